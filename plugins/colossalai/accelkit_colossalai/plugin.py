"""The ``accelkit`` entry point of accelkit-colossalai: names and factories, nothing imported."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import accelkit

#: colossalai pins torch<=2.5.1, so it is installed without its dependency resolution
INSTALL = (
    "pip install accelkit-colossalai 'accelkit-colossalai[booster]' && "
    "pip install --no-deps colossalai==0.5.0  (see docs/backends/colossalai.md)"
)

BACKENDS: dict[str, tuple[str, str]] = {
    "colossalai_ddp": (
        "accelkit_colossalai.backend:ColossalDDPBackend",
        "ColossalAI TorchDDPPlugin (torch DDP through the Booster)",
    ),
    "colossalai_zero": (
        "accelkit_colossalai.backend:ColossalZeroBackend",
        "ColossalAI LowLevelZeroPlugin: ZeRO stage 1/2, optional CPU offload",
    ),
    "colossalai_gemini": (
        "accelkit_colossalai.backend:ColossalGeminiBackend",
        "ColossalAI GeminiPlugin: chunked ZeRO-3 with placement policy and offload (CUDA only)",
    ),
    "colossalai_hybrid": (
        "accelkit_colossalai.backend:ColossalHybridBackend",
        "ColossalAI HybridParallelPlugin: tensor parallel + ZeRO (Shardformer models)",
    ),
}


@accelkit.hookimpl
def accelkit_register_backends(registry: Any) -> None:
    for name, (factory, description) in BACKENDS.items():
        registry.add(
            name,
            factory,
            requires=("colossalai",),
            install=INSTALL,
            description=description,
        )


@accelkit.hookimpl
def accelkit_checkpoint_importers() -> dict[str, Any]:
    from accelkit_colossalai.importer import ColossalAIImporter  # no colossalai import

    return {"colossalai": ColossalAIImporter()}


@accelkit.hookimpl
def accelkit_env_report() -> dict[str, Any]:
    versions: dict[str, Any] = {}
    for dist_name in ("colossalai", "accelkit-colossalai", "transformers", "peft"):
        try:
            versions[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            versions[dist_name] = None
    return versions


@accelkit.hookimpl
def accelkit_estimate_memory(backend: str, model_stats: dict[str, Any], options: dict[str, Any]):
    if backend not in BACKENDS:
        return None
    from accelkit_colossalai.memory import estimate  # no colossalai import

    return estimate(backend, model_stats, options)
