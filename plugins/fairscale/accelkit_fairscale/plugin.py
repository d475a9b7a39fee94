"""The ``accelkit`` entry point of accelkit-fairscale: names and factories, nothing imported."""

from __future__ import annotations

from typing import Any

import accelkit
from accelkit.sdk import installed_versions, pip_install

#: the plugin is installed (this module runs), so only its library can be missing
_INSTALL = pip_install("fairscale==0.4.13")


@accelkit.hookimpl
def accelkit_register_backends(registry: Any) -> None:
    registry.add(
        "fairscale_fsdp",
        "accelkit_fairscale.fsdp:FairScaleFSDPBackend",
        requires=("fairscale",),
        install=_INSTALL,
        description="FairScale FullyShardedDataParallel (flat parameters sharded; needs CUDA)",
        devices=("cuda",),
        devices_reason="FairScale 0.4.13's FullyShardedDataParallel drives CUDA streams "
        "unconditionally, whatever its options; on the CPU use fsdp, fairscale_oss or fairscale_sdp",
    )
    registry.add(
        "fairscale_oss",
        "accelkit_fairscale.oss:OSSBackend",
        requires=("fairscale",),
        install=_INSTALL,
        description="FairScale OSS (optimizer state sharded) under torch DDP",
    )
    registry.add(
        "fairscale_sdp",
        "accelkit_fairscale.oss:ShardedDDPBackend",
        requires=("fairscale",),
        install=_INSTALL,
        description="FairScale ShardedDataParallel + OSS (optimizer state and gradients sharded)",
    )


@accelkit.hookimpl
def accelkit_env_report() -> dict[str, Any]:
    return installed_versions("fairscale", "accelkit-fairscale")


@accelkit.hookimpl
def accelkit_estimate_memory(backend: str, model_stats: dict[str, Any], options: dict[str, Any]):
    from accelkit_fairscale.memory import estimate

    return estimate(backend, model_stats, options)
