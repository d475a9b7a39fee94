"""``accelkit plan``'s estimates for the ColossalAI backends (the ``accelkit_estimate_memory`` hook).

Checked three ways:

- hand computations written here, bytes per parameter of a bias-free ``Linear(1000, 1000)``
  (exactly 1,000,000 parameters) read off ColossalAI 0.5.0's source, as numbers, not through the
  estimator's helpers;
- the state LowLevelZero really holds, measured by ``cai_memory_reference.py`` (raw ColossalAI on
  2 gloo processes, no accelkit) on odd-sized layers that LowLevelZero pads: params, gradients
  after backward, fp32 master shards and AdamW state agree to the byte (measured difference 0 in
  all four stage x precision runs, so the test asserts equality);
- the hook answers without importing ColossalAI (a child interpreter's ``sys.modules``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from accelkit.benchmark.hook_testing import (
    ONE_LINEAR,
    ONE_LINEAR_PARAMS,
    estimate_through_hooks,
    peaks_in_fresh_interpreter,
)
from accelkit.benchmark.memory import model_stats
from accelkit.benchmark.workloads import Workload
from accelkit.cli import main as cli_main
from accelkit.errors import ConfigError

P = ONE_LINEAR_PARAMS


@pytest.fixture(scope="module")
def stats() -> dict[str, dict[str, Any]]:
    return {p: model_stats(ONE_LINEAR, 4, p) for p in ("32-true", "bf16-true", "bf16-mixed")}


estimate = estimate_through_hooks


def terms(e: dict[str, Any]) -> tuple[int, int, int, int, int]:
    return e["params"], e["grads"], e["optimizer"], e["master"], e["host"]


# ---- colossalai_ddp ---------------------------------------------------------------------------
def test_ddp_keeps_buckets_beside_the_gradients(stats):
    # fp32: weights 4 B; TorchDDPPlugin's gradient_as_bucket_view=False: DDP buckets 4 B + .grad
    # 4 B; AdamW exp_avg + exp_avg_sq 8 B
    e = estimate("colossalai_ddp", stats["32-true"], world_size=4)
    assert terms(e) == (4 * P, 8 * P, 8 * P, 0, 0)
    assert e["world_size"] == 4 and e["relative_step_time"] == 1.0
    view = estimate(
        "colossalai_ddp",
        stats["32-true"],
        world_size=4,
        backend_options={"gradient_as_bucket_view": True},
    )
    assert view["grads"] == 4 * P  # the gradients are the buckets
    assert view["peak"] <= e["peak"]
    assert [v["options"] for v in e["variants"]] == [{"gradient_as_bucket_view": True}]
    # bf16-true: everything bf16, AdamW's states too
    e = estimate("colossalai_ddp", stats["bf16-true"], world_size=4)
    assert terms(e) == (2 * P, 4 * P, 4 * P, 0, 0)


# ---- colossalai_zero ----------------------------------------------------------------------------
def test_zero_stage_1_and_2_terms(stats):
    # 4 ranks: shard S = 250,000 elements. fp32 params whole 4 MB; fp32 master shard 4S = 1 MB
    # (a copy even of fp32 parameters); AdamW on it 8S = 2 MB; stage 1 keeps all four ranks'
    # gradient pieces (4 MB), stage 2 its own (1 MB)
    one = estimate("colossalai_zero", stats["32-true"], world_size=4)
    assert terms(one) == (4_000_000, 4_000_000, 2_000_000, 1_000_000, 0)
    two = estimate("colossalai_zero", stats["32-true"], world_size=4, backend_options={"stage": 2})
    assert terms(two) == (4_000_000, 1_000_000, 2_000_000, 1_000_000, 0)
    assert (one["relative_step_time"], two["relative_step_time"]) == (1.05, 1.1)
    # bf16-true: bf16 params 2 MB and gradient shard 0.5 MB; the master and AdamW stay fp32
    low = estimate(
        "colossalai_zero", stats["bf16-true"], world_size=4, backend_options={"stage": 2}
    )
    assert terms(low) == (2_000_000, 500_000, 2_000_000, 1_000_000, 0)
    labels = [v["label"] for v in one["variants"]]
    assert labels == ["stage=2", "stage=2 cpu_offload"]


def test_zero_pads_each_parameter_to_the_world_size(stats):
    # 1,000,000 / 3 ranks: ceil -> 333,334 elements per shard
    e = estimate("colossalai_zero", stats["32-true"], world_size=3)
    assert (e["master"], e["optimizer"]) == (1_333_336, 2_666_672)
    assert e["grads"] == 3 * 333_334 * 4  # stage 1: every rank's padded piece


def test_zero_cpu_offload_moves_master_state_and_fp32_grads_to_the_host(stats):
    e = estimate(
        "colossalai_zero",
        stats["bf16-true"],
        world_size=4,
        backend_options={"stage": 2, "cpu_offload": True},
    )
    # host: master 1 MB + AdamW 2 MB + the fp32 gradient copy the step makes there 1 MB
    assert terms(e) == (2_000_000, 500_000, 0, 0, 4_000_000)
    assert e["relative_step_time"] == 3.0
    on_gpu = estimate(
        "colossalai_zero", stats["bf16-true"], world_size=4, backend_options={"stage": 2}
    )
    assert e["peak"] < on_gpu["peak"]


def test_zero_bucket_is_part_of_backward(stats):
    # the bucket LowLevelZero flattens in backward once gradients exist: 12 Mi elements by
    # default, capped at the model (1M x 4 B here); stage 2 holds a bucket and its flat copy
    trace = stats["32-true"]["step_peak"]
    default = estimate("colossalai_zero", stats["32-true"], world_size=4)
    assert default["activations"] == trace("fp32", 1.0, 1.0, after_first_grad=4 * P)
    none = estimate(
        "colossalai_zero",
        stats["32-true"],
        world_size=4,
        backend_options={"reduce_bucket_size_in_m": 0},
    )
    assert none["activations"] == trace("fp32", 1.0, 1.0)
    two = estimate("colossalai_zero", stats["32-true"], world_size=4, backend_options={"stage": 2})
    assert two["activations"] == trace("fp32", 0.25, 1.0, after_first_grad=8 * P)


def test_zero_has_no_16_mixed_and_says_what_it_estimated(stats):
    e = estimate("colossalai_zero", stats["bf16-true"], precision="16-mixed", world_size=2)
    assert e["precision"] == "16-true"
    assert "estimated at 16-true: colossalai_zero does not run 16-mixed" in e["note"]
    assert estimate("colossalai_zero", stats["32-true"], world_size=2).get("precision") is None


# ---- colossalai_gemini ---------------------------------------------------------------------------
def test_gemini_below_one_chunk_is_kept_gathered(stats):
    # 1M elements < min_chunk_size_m=32 Mi: one chunk, kept gathered on every GPU: bf16 params
    # 2 MB, fp32 master 4 MB and HybridAdam's 8 MB whole; offload fractions have no effect
    e = estimate("colossalai_gemini", stats["bf16-true"], world_size=4)
    assert terms(e) == (2 * P, 0, 8 * P, 4 * P, 0)
    assert "kept gathered" in e["note"] and "variants" not in e
    off = estimate(
        "colossalai_gemini",
        stats["bf16-true"],
        world_size=4,
        backend_options={"offload_optim_frac": 1.0},
    )
    assert terms(off) == terms(e)


def test_gemini_shards_chunks_and_offloads_fractions(stats):
    chunked = {"min_chunk_size_m": 0.5}  # 524,288 elements: the model is chunked
    e = estimate("colossalai_gemini", stats["bf16-true"], world_size=4, backend_options=chunked)
    # bf16 chunks 2 MB / 4; fp32 master 4 MB / 4; HybridAdam 8 MB / 4; gradients in the chunks
    assert terms(e) == (500_000, 0, 2_000_000, 1_000_000, 0)
    # two chunks gathered at a time: the 1M-element parameter's own chunk and the next, capped
    # at the model: 1M x 2 B on top of the traced bf16 step
    assert e["activations"] - stats["bf16-true"]["step_peak"]("low", 0.0, 0.0) == 2 * P
    half = estimate(
        "colossalai_gemini",
        stats["bf16-true"],
        world_size=4,
        backend_options={**chunked, "offload_optim_frac": 0.5},
    )
    # half of master and state on the CPU, with their gradient shards (bf16, 0.5 MB / 2)
    assert terms(half) == (500_000, 0, 1_000_000, 500_000, 1_750_000)
    full = estimate(
        "colossalai_gemini",
        stats["bf16-true"],
        world_size=4,
        backend_options={**chunked, "offload_optim_frac": 1.0, "offload_param_frac": 1.0},
    )
    assert terms(full) == (0, 0, 0, 0, 3_500_000)
    assert full["peak"] < half["peak"] < e["peak"]
    labels = [v["label"] for v in e["variants"]]
    assert labels == ["offload_optim_frac=1.0", "placement_policy=auto"]


def test_gemini_ignores_offload_param_frac_as_colossalai_does(stats):
    e = estimate(
        "colossalai_gemini",
        stats["bf16-true"],
        world_size=4,
        backend_options={
            "min_chunk_size_m": 0.5,
            "offload_optim_frac": 0.5,
            "offload_param_frac": 1.0,
        },
    )
    assert e["params"] == 500_000  # not offloaded: offload_optim_frac is not 1.0
    assert "offload_param_frac ignored" in e["note"]


def test_gemini_auto_placement_is_the_least_it_needs(stats):
    e = estimate(
        "colossalai_gemini",
        stats["bf16-true"],
        world_size=4,
        backend_options={"min_chunk_size_m": 0.5, "placement_policy": "auto"},
    )
    # master 1 MB + HybridAdam 2 MB + bf16 chunk shards 0.5 MB on the CPU; nothing kept on GPU
    assert terms(e) == (0, 0, 0, 0, 3_500_000)
    assert "auto" in e["formula"] and e["relative_step_time"] == 2.0


def test_gemini_tensor_parallel_and_extra_dp_shrink_the_zero_group(stats):
    # 8 GPUs, tp 2, extra_dp 2: ZeRO group of 2 over the 500,000 elements a tp rank holds
    e = estimate(
        "colossalai_gemini",
        stats["bf16-true"],
        world_size=8,
        backend_options={"min_chunk_size_m": 0.25, "tp_size": 2, "extra_dp_size": 2},
    )
    assert terms(e) == (500_000, 0, 2_000_000, 1_000_000, 0)


def test_gemini_precisions_and_optimizers(stats):
    e = estimate("colossalai_gemini", stats["bf16-mixed"], world_size=4)
    assert e["precision"] == "bf16-true" and "does not run bf16-mixed" in e["note"]
    assert estimate("colossalai_gemini", stats["32-true"], world_size=4) is None
    assert estimate("colossalai_gemini", stats["bf16-true"], optimizer="sgd-momentum") is None
    assert estimate("colossalai_gemini", stats["bf16-true"], device_type="cpu") is None


# ---- colossalai_hybrid ------------------------------------------------------------------------------
def test_hybrid_divides_by_tp_and_pp(stats):
    # 4 GPUs, tp 2 -> dp 2; zero_stage 0 bf16-true: params 1 MB, gradients 1 MB + DDP buckets
    # 1 MB, fp32 master of the tp shard 2 MB, AdamW on it 4 MB
    e = estimate(
        "colossalai_hybrid", stats["bf16-true"], world_size=4, backend_options={"tp_size": 2}
    )
    assert terms(e) == (1_000_000, 2_000_000, 4_000_000, 2_000_000, 0)
    assert "activations approximate" in e["note"]
    # zero_stage 1 over dp 2: shard 250,000; stage 1 keeps both pieces in bf16
    z = estimate(
        "colossalai_hybrid",
        stats["bf16-true"],
        world_size=4,
        backend_options={"tp_size": 2, "zero_stage": 1},
    )
    assert terms(z) == (1_000_000, 1_000_000, 2_000_000, 1_000_000, 0)
    # pp_size is refused as accelkit.get refuses it (pipeline stages are accelkit's pp), not estimated
    with pytest.raises(
        ConfigError, match=r"pp_size=2: pipeline stages are accelkit.s own option, pp"
    ):
        estimate(
            "colossalai_hybrid",
            stats["bf16-true"],
            world_size=4,
            backend_options={"tp_size": 2, "pp_size": 2, "zero_stage": 1},
        )
    with pytest.raises(ValueError, match="not divisible"):
        estimate(
            "colossalai_hybrid", stats["bf16-true"], world_size=3, backend_options={"tp_size": 2}
        )


def test_hybrid_tp_activation_factor(stats):
    # Megatron's split: 10 of 34 bytes replicated, 24 divided by tp (2): 22/34 of the trace
    base = estimate("colossalai_hybrid", stats["32-true"], world_size=2)
    tp = estimate(
        "colossalai_hybrid", stats["32-true"], world_size=2, backend_options={"tp_size": 2}
    )
    assert tp["activations"] == pytest.approx(base["activations"] * 22 / 34, abs=1)
    assert "activation factor 0.647" in tp["formula"]


def test_hybrid_zero_needs_a_true_precision(stats):
    assert (
        estimate("colossalai_hybrid", stats["32-true"], backend_options={"zero_stage": 1}) is None
    )
    e = estimate("colossalai_hybrid", stats["bf16-mixed"], backend_options={"zero_stage": 1})
    assert e["precision"] == "bf16-true"


def test_unknown_option_names_fail_like_get(stats):
    with pytest.raises(ValueError, match=r"unknown option 'offload_optim'.*offload_optim_frac"):
        estimate("colossalai_gemini", stats["bf16-true"], backend_options={"offload_optim": 1})


def test_other_backends_get_no_answer_from_this_plugin(stats):
    from accelkit_colossalai.plugin import accelkit_estimate_memory

    options = {"world_size": 1, "precision": "32-true", "backend_options": {}}
    assert accelkit_estimate_memory("ddp", stats["32-true"], options) is None


# ---- against what LowLevelZero holds -----------------------------------------------------------
@pytest.mark.slow
def test_zero_estimate_matches_raw_low_level_zero():
    pytest.importorskip("colossalai")
    from cai_memory_reference import build_model

    from accelkit.testing import run_ranks

    cfgs = [
        {"name": f"stage{s}-{p}", "stage": s, "precision": p}
        for s in (1, 2)
        for p in ("fp32", "bf16")
    ]
    measured = run_ranks("cai_memory_reference:measure_all", {"cfgs": cfgs})
    workload = Workload("odd", build_model, lambda b, g: (torch.randn(b, 37, generator=g),))
    for cfg in cfgs:
        precision = "32-true" if cfg["precision"] == "fp32" else "bf16-true"
        e = estimate(
            "colossalai_zero",
            model_stats(workload, 4, precision),
            world_size=2,
            backend_options={"stage": cfg["stage"]},
        )
        for rank in measured:
            got = rank[cfg["name"]]
            assert {k: e[k] for k in got} == got, cfg["name"]


# ---- accelkit plan -------------------------------------------------------------------------------
def test_plan_lists_colossalai_rows_and_never_recommends_another_precision(capsys):
    assert cli_main(["plan", "mlp", "--gpus", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {c["label"]: c for c in plan["candidates"]}
    assert {
        "colossalai_ddp",
        "colossalai_zero",
        "colossalai_zero stage=2",
        "colossalai_gemini",
        "colossalai_hybrid",
    } <= set(rows)
    gemini = rows["colossalai_gemini"]
    assert gemini["fits"] and "estimated at bf16-true" in gemini["note"]
    assert not any(name.startswith("colossalai") for name in plan["no_estimate"])
    assert plan["recommendation"] == "ddp"  # not colossalai_ddp: same figures, fewer libraries
    # only Gemini fits here; it ran at another precision, so nothing is recommended
    budget = str(int(gemini["estimate"]["peak"] / 0.9) + 1)
    assert (
        cli_main(
            [
                "plan",
                "mlp",
                "--gpus",
                "2",
                "--gpu-memory",
                budget,
                "--backends",
                "colossalai_gemini",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["candidates"][0]["fits"] and plan["recommendation"] is None
    assert "none of them runs bf16-mixed" in plan["reason"]


def test_the_hook_imports_no_colossalai():
    names = ["colossalai_ddp", "colossalai_zero", "colossalai_gemini", "colossalai_hybrid"]
    peaks, imported = peaks_in_fresh_interpreter(names, ["colossalai"], precision="bf16-true")
    assert all(isinstance(v, int) and v > 0 for v in peaks.values()), peaks
    assert imported == []
