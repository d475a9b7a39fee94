"""Worker of test_deepspeed_native_keys.py: ``accelkit.get()`` with native DeepSpeed configs,
some misspelt; returns each one's error message (None: it built)."""

from __future__ import annotations

from typing import Any

#: name -> a native config (its keys as a user writes them)
CONFIGS: dict[str, dict[str, Any]] = {
    "top_level": {"zero_optimization": {"stage": 2}, "gradient_cliping": 0.5},
    "nested": {"zero_optimization": {"stgae": 3}},
    "deeper": {"zero_optimization": {"stage": 3, "offload_optimizer": {"devcie": "cpu"}}},
    "plain_section": {
        "bf16": {"enabled": False},
        "activation_checkpointing": {"partition_activatons": True},
    },
    # the twin: every key right, HF-style "auto" values included
    "valid": {
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
        "gradient_clipping": 0.5,
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": {"partition_activations": False},
        "steps_per_print": 100,
        "sequence_parallel_size": 1,  # read by DeepSpeedConfig itself, not its parser
    },
}


def try_configs() -> dict[str, Any]:
    import accelkit

    out: dict[str, Any] = {}
    for name, config in CONFIGS.items():
        try:
            accel = accelkit.get("deepspeed", config)
        except accelkit.ConfigError as err:
            out[name] = str(err)
        else:
            out[name] = None
            out["valid_clipping"] = accel.max_grad_norm
    return out
