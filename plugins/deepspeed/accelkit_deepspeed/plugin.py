"""The ``accelkit`` entry point of accelkit-deepspeed: names and factories only, no DeepSpeed import."""

from __future__ import annotations

from typing import Any

import accelkit
from accelkit.sdk import installed_versions, pip_install

FACTORY = "accelkit_deepspeed.backend:DeepSpeedBackend"
#: the plugin is installed (this module runs), so only its library can be missing; 0.19.8 is the
#: version it is tested with (it needs >= 0.17.2)
INSTALL = pip_install("deepspeed==0.19.8")

#: name -> (preset short options, description)
SHORTCUTS: dict[str, tuple[dict[str, Any], str]] = {
    "deepspeed": ({}, "DeepSpeed ZeRO (stage from the config; 2 by default)"),
    "deepspeed_stage_1": ({"zero_stage": 1}, "DeepSpeed ZeRO-1: optimizer state partitioned"),
    "deepspeed_stage_2": ({"zero_stage": 2}, "DeepSpeed ZeRO-2: optimizer state and gradients"),
    "deepspeed_stage_3": ({"zero_stage": 3}, "DeepSpeed ZeRO-3: parameters too"),
    "deepspeed_stage_3_offload": (
        {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
        "DeepSpeed ZeRO-3 with optimizer state and parameters in CPU memory",
    ),
}


@accelkit.hookimpl
def accelkit_register_backends(registry: Any) -> None:
    for name, (defaults, description) in SHORTCUTS.items():
        registry.add(
            name,
            FACTORY,
            defaults=defaults,
            requires=("deepspeed",),
            install=INSTALL,
            description=description,
        )


@accelkit.hookimpl
def accelkit_env_report() -> dict[str, Any]:
    return installed_versions("deepspeed", "accelkit-deepspeed")


@accelkit.hookimpl
def accelkit_estimate_memory(backend: str, model_stats: dict[str, Any], options: dict[str, Any]):
    if backend not in SHORTCUTS:
        return None
    from accelkit_deepspeed.memory import estimate

    return estimate(backend, model_stats, options)


@accelkit.hookimpl
def accelkit_checkpoint_importers() -> dict[str, Any]:
    """``accelkit convert --trust-pickle`` reads raw DeepSpeed checkpoint directories."""
    from accelkit_deepspeed.importer import DeepSpeedImporter

    return {"deepspeed": DeepSpeedImporter()}
