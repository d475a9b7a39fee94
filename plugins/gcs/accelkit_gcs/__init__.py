"""accelkit-gcs: ``gs://`` checkpoints through Google Cloud Storage's own JSON API.

Installing the distribution registers the store (entry point ``accelkit``, hook
``accelkit_checkpoint_stores``); then ``accel.save("gs://bucket/run/step-6", state)`` and every
other checkpoint call take ``gs://`` URLs. docs/stores.md says how to set it up and test it.
"""

from __future__ import annotations

__all__ = ["gcs_store"]


def gcs_store(storage_options: dict | None = None):
    """The store of ``gs://`` locations: accelkit's one object-store orchestration
    (:class:`accelkit.sdk.BucketStore`) over :class:`~accelkit_gcs.bucket.GCSBucket`."""
    from accelkit.sdk import BucketStore
    from accelkit_gcs.bucket import GCSBucket

    return BucketStore("gs", lambda name: GCSBucket(name, storage_options))
