"""The ``accelkit`` entry point of accelkit-fairscale: names and factories, nothing imported."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import accelkit

_INSTALL = "pip install accelkit-fairscale  (it pulls fairscale==0.4.13)"


@accelkit.hookimpl
def accelkit_register_backends(registry: Any) -> None:
    registry.add(
        "fairscale_fsdp",
        "accelkit_fairscale.fsdp:FairScaleFSDPBackend",
        requires=("fairscale",),
        install=_INSTALL,
        description="FairScale FullyShardedDataParallel (flat parameters sharded; needs CUDA)",
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
    versions: dict[str, Any] = {}
    for dist_name in ("fairscale", "accelkit-fairscale"):
        try:
            versions[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            versions[dist_name] = None
    return versions


@accelkit.hookimpl
def accelkit_estimate_memory(backend: str, model_stats: dict[str, Any], options: dict[str, Any]):
    from accelkit_fairscale.memory import estimate

    return estimate(backend, model_stats, options)
