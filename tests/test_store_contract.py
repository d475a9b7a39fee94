"""The store conformance suite (accelkit.testing.store_contract) on the stores of the core: a
folder on disk, and S3 (SeaweedFS on loopback, behind the fault proxy). The gs:// store runs it
in plugins/gcs/tests.

A store's known defect would run as a strict xfail naming what happens (a strict xfail that
passes fails the run); none is left on these two."""

from __future__ import annotations

from accelkit.testing.store_contract import store_contract

TestDiskStore = store_contract("disk")
TestS3Store = store_contract("s3")
