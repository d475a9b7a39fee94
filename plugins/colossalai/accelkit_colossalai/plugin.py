"""The ``accelkit`` entry point of accelkit-colossalai: names and factories, nothing imported."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import accelkit
from accelkit.sdk import installed_versions

#: colossalai pins torch<=2.5.1, so its script installs it without dependency resolution, next to
#: the interpreter that runs accelkit (the plugin is installed: this module runs)
_SCRIPT = Path(__file__).resolve().parents[1] / "install_colossalai.sh"
INSTALL = (
    f"bash {shlex.quote(str(_SCRIPT))} {shlex.quote(sys.executable)}"
    if _SCRIPT.is_file()
    else f"bash plugins/colossalai/install_colossalai.sh {shlex.quote(sys.executable)}  "
    "(from the root of an accelkit checkout)"
)

#: what colossalai_hybrid trains: HybridParallelPlugin shards every model through Shardformer
HYBRID_MODELS = (
    "a model ColossalAI's Shardformer has a policy for (most Hugging Face transformers models: "
    "Llama, GPT-2, BERT, ...); a plain torch.nn.Module fails with its 'Auto policy' error"
)

#: name -> (factory, description)
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


#: name -> what it needs beyond colossalai (read by ``accelkit env`` and ``accelkit demo``)
REQUIREMENTS: dict[str, dict[str, Any]] = {
    "colossalai_gemini": {
        "devices": ("cuda",),
        "devices_reason": "Gemini's optimizers are CUDA kernels and its chunks use CUDA streams; "
        "on the CPU use colossalai_zero or colossalai_ddp",
    },
    "colossalai_hybrid": {"models": HYBRID_MODELS},
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
            **REQUIREMENTS.get(name, {}),
        )


@accelkit.hookimpl
def accelkit_checkpoint_importers() -> dict[str, Any]:
    from accelkit_colossalai.importer import ColossalAIImporter  # no colossalai import

    return {"colossalai": ColossalAIImporter()}


@accelkit.hookimpl
def accelkit_env_report() -> dict[str, Any]:
    return installed_versions("colossalai", "accelkit-colossalai", "transformers", "peft")


@accelkit.hookimpl
def accelkit_estimate_memory(backend: str, model_stats: dict[str, Any], options: dict[str, Any]):
    if backend not in BACKENDS:
        return None
    from accelkit_colossalai.memory import estimate  # no colossalai import

    return estimate(backend, model_stats, options)
