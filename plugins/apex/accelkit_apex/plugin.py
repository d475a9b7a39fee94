"""The ``accelkit`` entry point of accelkit-apex: names and factories only, no apex import."""

from __future__ import annotations

from typing import Any

import accelkit
from accelkit.sdk import installed_versions
from accelkit_apex.probe import INSTALL

#: why both backends need a GPU (read by ``accelkit env`` and ``accelkit demo``)
_CUDA_ONLY = "Apex's fused optimizers and norms run only as its compiled CUDA kernels"


@accelkit.hookimpl
def accelkit_register_backends(registry: Any) -> None:
    registry.add(
        "apex",
        "accelkit_apex.backend:ApexBackend",
        requires=("apex",),
        install=INSTALL,
        devices=("cuda",),
        devices_reason=_CUDA_ONLY,
        description="one CUDA device; torch autocast precision, the optimizer swapped for Apex's "
        "fused twin (FusedAdam, FusedSGD), optional fused norms",
    )
    registry.add(
        "apex_distributed_adam",
        "accelkit_apex.distributed_adam:DistributedAdamBackend",
        requires=("apex",),
        install=INSTALL,
        devices=("cuda",),
        devices_reason=_CUDA_ONLY,
        description="Apex DistributedFusedAdam (ZeRO-2: optimizer state and gradients sharded, "
        "its own gradient sync; CUDA, NCCL)",
    )


@accelkit.hookimpl
def accelkit_env_report() -> dict[str, Any]:
    from accelkit_apex.probe import env_report

    return {**env_report(), **installed_versions("accelkit-apex")}


@accelkit.hookimpl
def accelkit_estimate_memory(backend: str, model_stats: dict[str, Any], options: dict[str, Any]):
    if backend not in ("apex", "apex_distributed_adam"):
        return None
    from accelkit_apex.memory import estimate  # no apex import

    return estimate(backend, model_stats, options)
