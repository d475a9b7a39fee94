"""Install hints for plugin distributions accelkit knows of.

This is data for error messages only: no code branches on these names.
"""

from __future__ import annotations

#: backend name -> (distribution, pip line)
KNOWN_PLUGIN_BACKENDS: dict[str, tuple[str, str]] = {}

_PLUGINS = {
    "accelkit-deepspeed": (
        "deepspeed",
        "deepspeed_stage_1",
        "deepspeed_stage_2",
        "deepspeed_stage_3",
        "deepspeed_stage_3_offload",
    ),
    "accelkit-apex": ("apex", "apex_distributed_adam"),
    "accelkit-fairscale": ("fairscale_fsdp", "fairscale_oss", "fairscale_sdp"),
    "accelkit-colossalai": (
        "colossalai_gemini",
        "colossalai_zero",
        "colossalai_ddp",
        "colossalai_hybrid",
    ),
}

for _dist, _names in _PLUGINS.items():
    for _name in _names:
        KNOWN_PLUGIN_BACKENDS[_name] = (_dist, f"pip install {_dist}")
