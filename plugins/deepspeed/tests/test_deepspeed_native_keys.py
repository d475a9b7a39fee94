"""A native DeepSpeed config with an unknown key, at any depth, fails at ``accelkit.get()``
with "did you mean" (DeepSpeed itself ignores a top-level one and fails on a nested one only
when the engine is built). The keys are checked with DeepSpeed's own parser and pydantic
models (accelkit_deepspeed.native_check), in a launched process: DeepSpeed is never imported
into pytest's own."""

from __future__ import annotations

import pytest
from test_deepspeed_training import CPU_ENV

from accelkit.testing import run_ranks


@pytest.fixture(scope="module")
def messages() -> dict:
    return run_ranks("dsk_native_keys:try_configs", nproc=1, env=CPU_ENV)[0]


@pytest.mark.parametrize(
    ("name", "path", "hint"),
    [
        ("top_level", "gradient_cliping", "gradient_clipping"),
        ("nested", "zero_optimization.stgae", "stage"),
        ("deeper", "zero_optimization.offload_optimizer.devcie", "device"),
        ("plain_section", "activation_checkpointing.partition_activatons", "partition_activations"),
    ],
)
def test_an_unknown_key_fails_at_get_with_did_you_mean(messages, name, path, hint):
    message = messages[name]
    assert message is not None, f"{name}: the misspelt config was accepted"
    assert f"{path!r} (did you mean {hint!r}?)" in message
    assert "pydantic" not in message.lower()


def test_a_config_with_every_key_right_builds(messages):
    """The twin: "auto" values and plain sections pass; the clipping is the config's."""
    assert messages["valid"] is None
    assert messages["valid_clipping"] == 0.5
