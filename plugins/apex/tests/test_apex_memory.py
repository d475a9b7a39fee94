"""``accelkit plan``'s estimates for the Apex backends (the ``accelkit_estimate_memory`` hook).

Hand computations written here, bytes of a bias-free ``Linear(1000, 1000)`` (exactly 1,000,000
parameters), from what Apex's optimizers allocate (FusedAdam: fp32 ``exp_avg``/``exp_avg_sq``
whatever the parameters' dtype; DistributedFusedAdam: buckets of ``bucket_cap_mb`` MiB of the
gradient-sync dtype, each with a shard of fp32 parameter copy and moments per rank). No real
Apex here, so nothing is measured: the hook only does arithmetic, and it must not import apex
(checked with the fake apex importable, in a child interpreter's ``sys.modules``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from apex_testlib import FAKE_ROOT

from accelkit.benchmark.hook_testing import (
    ONE_LINEAR,
    ONE_LINEAR_PARAMS,
    estimate_through_hooks,
    peaks_in_fresh_interpreter,
)
from accelkit.benchmark.memory import model_stats
from accelkit.cli import main as cli_main

P = ONE_LINEAR_PARAMS


@pytest.fixture(scope="module")
def stats() -> dict[str, dict[str, Any]]:
    return {p: model_stats(ONE_LINEAR, 4, p) for p in ("32-true", "bf16-true", "16-true")}


estimate = estimate_through_hooks


def terms(e: dict[str, Any]) -> tuple[int, int, int, int]:
    return e["params"], e["grads"], e["optimizer"], e["master"]


# ---- apex -----------------------------------------------------------------------------------------
def test_apex_fused_adam_keeps_fp32_moments(stats):
    # fp32: weights 4 MB, gradients 4 MB, FusedAdam exp_avg + exp_avg_sq 8 MB
    e = estimate("apex", stats["32-true"])
    assert terms(e) == (4 * P, 4 * P, 8 * P, 0)
    # bf16-true: bf16 weights and gradients, but FusedAdam's moments stay fp32: 8 MB, where
    # torch's AdamW (the cuda estimate) keeps them in bf16: 4 MB
    e = estimate("apex", stats["bf16-true"])
    assert terms(e) == (2 * P, 2 * P, 8 * P, 0)
    assert estimate("cuda", stats["bf16-true"])["optimizer"] == 4 * P


def test_apex_has_no_foreach_temporary(stats):
    # the fused kernel updates in place: the step needs the gradients (4 MB) and nothing more,
    # where torch's foreach AdamW adds a temporary of the parameters' size
    e = estimate("apex", stats["32-true"])
    trace = stats["32-true"]["step_peak"]("fp32", 1.0, 1.0)
    assert e["peak"] == 4 * P + 8 * P + max(trace, 4 * P)
    assert e["peak"] <= estimate("cuda", stats["32-true"])["peak"]


def test_apex_fused_sgd(stats):
    # FusedSGD's momentum follows the parameters: fp16 2 MB; it refuses bf16 parameters
    e = estimate("apex", stats["16-true"], optimizer="sgd-momentum")
    assert terms(e) == (2 * P, 2 * P, 2 * P, 0)
    assert estimate("apex", stats["bf16-true"], optimizer="sgd-momentum") is None


def test_apex_without_the_swap_is_the_cuda_estimate(stats):
    e = estimate("apex", stats["bf16-true"], backend_options={"fused_optimizer": False})
    cuda = estimate("cuda", stats["bf16-true"])
    assert terms(e) == terms(cuda) == (2 * P, 2 * P, 4 * P, 0)


def test_apex_uses_one_gpu_of_several(stats):
    e = estimate("apex", stats["32-true"], world_size=8)
    assert e["world_size"] == 1 and e["relative_step_time"] == 8.0
    assert estimate("apex", stats["32-true"], device_type="cpu") is None


# ---- apex_distributed_adam ----------------------------------------------------------------------
def test_distributed_adam_allocates_whole_buckets(stats):
    # 100 MiB buckets of fp32 gradients: 26,214,400 elements, 6,553,600 per rank of 4; the 1M
    # model fits one bucket, and each rank still holds a whole shard: fp32 parameter copy 25 MiB,
    # moments 50 MiB, reduced gradient shard 25 MiB
    e = estimate("apex_distributed_adam", stats["32-true"], world_size=4)
    assert terms(e) == (4 * P, 26_214_400, 52_428_800, 26_214_400)
    assert e["world_size"] == 4 and e["relative_step_time"] == 1.05


def test_distributed_adam_small_buckets_shard_the_model(stats):
    # 1 MiB buckets of fp32: 262,144 elements, 65,536 per rank of 4; 4 buckets hold the model
    # -> 262,144 elements per rank: copy 1 MiB, moments 2 MiB, gradient shard 1 MiB
    small = {"bucket_cap_mb": 1}
    e = estimate("apex_distributed_adam", stats["32-true"], world_size=4, backend_options=small)
    assert terms(e) == (4 * P, 1_048_576, 2_097_152, 1_048_576)
    # bf16-true syncs bf16 gradients: 524,288 elements a bucket, 2 buckets, the same 262,144
    # elements per rank; the gradient shard is bf16 (0.5 MiB)
    e = estimate("apex_distributed_adam", stats["bf16-true"], world_size=4, backend_options=small)
    assert terms(e) == (2 * P, 524_288, 2_097_152, 1_048_576)
    # fp32 gradient sync of bf16 parameters: fp32 buckets again
    e = estimate(
        "apex_distributed_adam",
        stats["bf16-true"],
        world_size=4,
        backend_options={**small, "grad_sync_dtype": "fp32"},
    )
    assert e["grads"] == 1_048_576
    # a persistent gradient buffer of the 4 fp32 buckets (4 x 262,144 x 4 B) on top
    e = estimate(
        "apex_distributed_adam",
        stats["32-true"],
        world_size=4,
        backend_options={**small, "contiguous_grad_buffer": True},
    )
    assert e["grads"] == 1_048_576 + 4_194_304


def test_distributed_adam_takes_adam_only(stats):
    assert estimate("apex_distributed_adam", stats["32-true"], optimizer="sgd-momentum") is None


def test_unknown_option_names_fail(stats):
    with pytest.raises(ValueError, match=r"unknown option 'bucket_mb'.*bucket_cap_mb"):
        estimate("apex_distributed_adam", stats["32-true"], backend_options={"bucket_mb": 1})


# ---- accelkit plan --------------------------------------------------------------------------------
def test_plan_lists_the_apex_rows(capsys):
    args = ["plan", "mlp", "--gpus", "2", "--backends", "cuda,ddp,apex,apex_distributed_adam"]
    assert cli_main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {c["label"]: c for c in plan["candidates"]}
    assert set(rows) == {"cuda", "ddp", "apex", "apex_distributed_adam"}
    assert rows["apex"]["estimate"]["world_size"] == 1
    assert rows["apex_distributed_adam"]["estimate"]["world_size"] == 2
    assert plan["no_estimate"] == []


def test_the_hook_imports_no_apex():
    """With the fake apex importable, the estimates leave it (and amp_C) unimported."""
    peaks, imported = peaks_in_fresh_interpreter(
        ["apex", "apex_distributed_adam"],
        ["apex", "amp_C"],
        precision="bf16-mixed",
        python_path=[str(FAKE_ROOT)],
    )
    assert all(isinstance(v, int) and v > 0 for v in peaks.values()), peaks
    assert imported == []
