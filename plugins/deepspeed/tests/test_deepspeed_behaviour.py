"""Behaviour of the DeepSpeed backend beyond the numbers: ZeRO-3 init_module() and its guard,
the loader's batch size, native configs and DeepSpeed's own optimizer, schedulers, errors.

All checks run in one launched process (dsk_checks.all_checks); each test asserts on its part.
"""

from __future__ import annotations

import json

import pytest
from test_deepspeed_training import CPU_ENV

from accelkit.testing import run_ranks


@pytest.fixture(scope="module")
def checks() -> dict:
    return run_ranks("dsk_checks:all_checks", nproc=1, env=CPU_ENV)[0]


@pytest.fixture
def guard(checks) -> dict:
    return checks["guard"]


def test_zero3_init_module_partitions_while_building(guard):
    assert guard["init_context"] == "zero.Init"
    assert guard["partitioned"]
    # the model's own __init__ ran self.apply(init): DeepSpeed gathered, the values stuck
    assert guard["apply_in_init"] == [0.125, 0.125]
    assert guard["fc1_after_setup"] == [0.125, 0.125]


@pytest.mark.parametrize("write", ["nn_init", "data_write", "inplace_method", "load_state_dict"])
def test_writes_to_partitioned_weights_are_refused_with_the_fix(guard, write):
    error = guard[write]
    assert error is not None and error.startswith("PartitionedParameterError")
    assert "partitioned" in error
    assert "GatheredParameters" in error and "accel.load" in error


def test_the_documented_fix_works_and_setup_lifts_the_guard(guard):
    assert guard["requires_grad_"] is None  # changes no values: allowed
    assert guard["gathered_write"] == [0.5]  # written under GatheredParameters(modifier_rank=0)
    assert guard["class_after_setup"] == ["Parameter"]
    assert guard["wrapped_after_setup"] == 0 and guard["all_gather_is_deepspeeds"]
    assert guard["stepped"] is True


@pytest.fixture
def behaviour(checks) -> dict:
    return checks["behaviour"]


def test_micro_batch_comes_from_a_loader_set_up_first(behaviour):
    assert behaviour["micro_from_loader"] == 3
    assert behaviour["micro_default"] == 1 and behaviour["default_logged"]


def test_returned_optimizer_drives_deepspeeds_learning_rate(behaviour):
    assert behaviour["is_optimizer"]
    assert behaviour["engine_scheduler"] == "None"  # never handed to DeepSpeed
    # StepLR(gamma=0.5) built on the returned optimizer, stepped once by accelkit
    assert behaviour["sched_last_lr"] == behaviour["engine_lr_after_one_step"] == 0.05


def test_errors_and_plain_answers(behaviour):
    assert behaviour["clip_by_hand"].startswith("UnsupportedError")
    assert "max_grad_norm" in behaviour["clip_by_hand"]
    assert behaviour["foreign_optimizer"].startswith("ConfigError")
    assert "not this model's" in behaviour["foreign_optimizer"]
    assert behaviour["unwrap"] == "Net"
    assert behaviour["autocast_is_noop"] == "nullcontext"


def test_native_json_config_is_used_as_is_with_its_own_optimizer(behaviour):
    assert behaviour["native_settings"] == ["bf16-true", 2, 1.0]
    assert behaviour["native_engine"] == {
        "bf16": True,
        "gas": 2,
        "clip": 1.0,
        "micro": 4,
        "bucket": 1000,
        "inner": "AdamW",  # DeepSpeed built it ("torch_adam": true)
        "lr": 0.01,
    }
    assert behaviour["out_dtype"] == "torch.float32"  # fp32 in, bf16 engine, fp32 out
    assert behaviour["both_optimizers"].startswith("ConfigError")
    assert "names an optimizer" in behaviour["both_optimizers"]


def test_activation_checkpointing_under_zero3_changes_no_numbers(checks):
    result = checks["checkpointing"]
    assert result["blocks_True"] > 0 and result["blocks_False"] == 0
    assert result["True"] == result["False"]


def test_fp16_is_refused_at_get_where_the_device_lacks_it(checks):
    result = checks["fp16"]
    assert result["16-true"].startswith("ConfigError")
    assert "16-mixed" in result["16-true"] and "a GPU" in result["16-true"]
    assert result["16-mixed"] is None  # torch autocast fp16 does not need DeepSpeed's fp16


DEPRECATED_COLLECTIVES_SCRIPT = """
import json
import warnings
import torch
import torch.distributed as dist
import accelkit

accel = accelkit.get("deepspeed_stage_3")  # imports DeepSpeed; one process joins a gloo group
assert dist.is_initialized() and dist.get_world_size() == 1
with warnings.catch_warnings(record=True) as seen:
    for _ in range(3):  # what ZeRO-3 calls on every step
        dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2))
        dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))
    warnings.warn("a FutureWarning of the user's own", FutureWarning)
print("SEEN", json.dumps([str(w.message) for w in seen]))
"""


def test_torch_deprecation_of_deepspeeds_collectives_is_silenced_and_nothing_else():
    """torch deprecates all_gather_into_tensor and reduce_scatter_tensor, which DeepSpeed's ZeRO
    calls every step: the FutureWarning came about once per step per rank. In a subprocess, so
    pytest's own process keeps DeepSpeed unimported."""
    import os
    import subprocess
    import sys

    launch_vars = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {k: v for k, v in os.environ.items() if k not in launch_vars}
    done = subprocess.run(
        [sys.executable, "-c", DEPRECATED_COLLECTIVES_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.split("SEEN ", 1)[1])
    assert seen == ["a FutureWarning of the user's own"], seen
