"""The FairScale backends pass accelkit's conformance suite: OSS and ShardedDDP on the CPU
(gloo), FullyShardedDataParallel on the GPU (FairScale's FSDP drives CUDA streams)."""

from __future__ import annotations

import pytest

pytest.importorskip("fairscale")

from accelkit.testing.conformance import backend_contract

TestOssContract = backend_contract("fairscale_oss", world_sizes=(1, 2))
TestSdpContract = backend_contract("fairscale_sdp", world_sizes=(1, 2), slow=True)
TestFsdpContract = backend_contract(
    "fairscale_fsdp",
    world_sizes=(1, 2),
    resume_world_sizes=(1,),
    gpu=True,
    # measured on one H200 (bench/results/2026-12-03-h200-callG/h): 9 syncs in the steps, not
    # yet traced to FairScale's FSDP or to accelkit's plugin
    known_host_syncs="fairscale_fsdp's step syncs the host (not yet traced; see the log of 2026-12-03)",
)
