"""Pipeline parallelism on ``fsdp`` and ``ddp`` (gloo CPU processes) against raw PyTorch
(tests/pipeline_reference.py imports nothing from accelkit): every schedule at pp 2 and 4 against
one process running the same micro-batches; accumulation with a short last window; pp x FSDP2
and pp x TP against torch's own pipelining on the same mesh; the traps' negative twins; the same
initial weights at every stage count; refusals.

Tolerances, measured (torch 2.13 CPU, fp32): pure pipelines are bit-exact on the weights and
losses for every schedule but LoopedBFS; the clipping norm adds the stages' squared norms, one
rounding away from ``clip_grad_norm_`` over all tensors (1 ulp measured: 6e-8 on a norm of 0.56),
which can move a weight by an ulp: the comparisons allow ``EXACT_FLOOR = 1e-6``. With data
parallelism inside the stages, gradients are summed over ranks in another order: 1e-5 (FSDP2 x
pp, measured 6e-8 in the probe; AdamW's first steps magnify it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from accelkit.testing import run_ranks

HERE = Path(__file__).parent
EXACT_FLOOR = 1e-6
DP_FLOOR = 1e-5
RUN = {"timeout": 600, "path": [HERE]}


def _max_diff(ours: dict[str, list[float]], ref: dict[str, list[float]]) -> float:
    assert ours, "this rank holds no parameters"
    worst = 0.0
    for name, values in ours.items():
        assert name in ref, f"{name} is not a name of the unsplit model"
        worst = max(worst, max(abs(a - b) for a, b in zip(values, ref[name])))
    return worst


def _check_against_one_process(results, ref, floor, pp):
    held = set()
    for result in results:
        assert _max_diff(result["params"], ref["params"]) <= floor
        held |= set(result["params"])
        # the mean micro-batch loss, on every rank (not only the last stage's)
        assert max(abs(a - b) for a, b in zip(result["losses"], ref["losses"])) <= floor
        assert max(abs(a - b) for a, b in zip(result["norms"], ref["norms"])) <= floor
    assert held == set(ref["params"]), "together the stages hold the whole model"
    assert min(ref["norms"]) < 1.0 < max(ref["norms"]) or max(ref["norms"]) > 1.0, (
        "the reference never clipped: the norm check would be blind"
    )


def _case(backend, pp, schedule, microbatches, accumulation=1, n_batches=3, optimizer="sgd"):
    from pipeline_reference import one_process

    pipeline = {"schedule": schedule, "microbatches": microbatches}
    kwargs = dict(
        backend=backend,
        pp=pp,
        pipeline=pipeline,
        n_batches=n_batches,
        batch=8,
        accumulation=accumulation,
        optimizer=optimizer,
    )
    ours = run_ranks("pipeline_workers:train", kwargs, nproc=pp, **RUN)
    ref = one_process(
        n_batches=n_batches,
        batch=8,
        microbatches=microbatches,
        accumulation=accumulation,
        optimizer=optimizer,
    )
    _check_against_one_process(ours, ref, EXACT_FLOOR, pp)
    return ours, ref


# ---- the default tier: two small cases ---------------------------------------------------------
def test_fsdp_pp2_1f1b_matches_one_process():
    """Windows of 2 and a short last one of 1; model(x) refused naming forward_backward."""
    ours, _ = _case("fsdp", 2, "1F1B", 4, accumulation=2, n_batches=3)
    assert all("accel.forward_backward(model, x, target=y" in r["refused"] for r in ours)


# ---- the matrix ----------------------------------------------------------------------------
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_matches_one_process(backend, pp, schedule):
    if pp == 4 and schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                "ZBVZeroBubble", "DualPipeV") and backend == "ddp":  # fmt: skip
        pytest.skip("covered on fsdp: 8 stages of one block each, 4 processes on 2 cores")
    _case(backend, pp, schedule, 8 if pp == 4 else 4)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [2, 3])
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_accumulation_with_a_short_last_window(accumulation, schedule):
    _case("ddp", 2, schedule, 4, accumulation=accumulation, n_batches=accumulation + 1)
