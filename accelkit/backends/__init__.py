"""The torch-native backends, registered through the same hook as third-party plugins
(as pytest registers its own plugins)."""

from __future__ import annotations

from typing import Any

from accelkit.checkpoint.formats.convert import accelkit_checkpoint_importers  # noqa: F401 (native importers)
from accelkit.hookspecs import hookimpl


@hookimpl
def accelkit_register_backends(registry: Any) -> None:
    registry.add(
        "cpu", "accelkit.backends.single:SingleDeviceBackend", description="one process on the CPU"
    )
    registry.add(
        "cuda",
        "accelkit.backends.single:SingleDeviceBackend",
        aliases=("gpu",),
        description="one CUDA device",
        devices=("cuda",),
    )
    registry.add(
        "mps",
        "accelkit.backends.single:SingleDeviceBackend",
        description="Apple MPS device",
        devices=("mps",),
    )
    registry.add(
        "ddp",
        "accelkit.backends.ddp:DDPBackend",
        description="torch DistributedDataParallel (gloo on CPU, nccl on CUDA)",
    )
    registry.add(
        "fsdp", "accelkit.backends.fsdp:FSDPBackend", description="torch FSDP2 (fully_shard)"
    )
    registry.add(
        "auto",
        "accelkit.backends.single:AutoBackend",
        description="ddp when launched on several processes, else the best single device",
    )


@hookimpl
def accelkit_env_report() -> dict[str, Any]:
    import torch

    return {"torch": torch.__version__, "cuda (torch build)": torch.version.cuda or "none"}


@hookimpl
def accelkit_estimate_memory(backend: str, model_stats: dict[str, Any], options: dict[str, Any]):
    from accelkit.benchmark.memory import estimate_native

    return estimate_native(backend, model_stats, options)
