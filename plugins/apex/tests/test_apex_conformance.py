"""The Apex backends pass accelkit's conformance suite on a CUDA GPU with the real Apex.

The CPU fake (fake_apex/) checks only accelkit's own logic elsewhere; it is no stand-in for
Apex's fused kernels, so the contract runs on the GPU machine only.
"""

from __future__ import annotations

from accelkit.testing.conformance import backend_contract

TestApexContract = backend_contract(
    "apex", world_sizes=(1,), resume_world_sizes=(1,), resume_with=("cpu", 1), gpu=True
)
TestDistributedAdamContract = backend_contract(
    "apex_distributed_adam", world_sizes=(1,), resume_world_sizes=(1,), gpu=True
)
