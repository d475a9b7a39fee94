"""Training equivalence of the ColossalAI backends on 2 gloo processes (real ColossalAI 0.5.0).

One torchrun launch runs the raw references (cai_reference.py: ColossalAI's Booster as its docs
show it, and plain torch DDP; no accelkit imported), another runs the same runs through accelkit
(cai_workers.py). Every run is one epoch of 7 micro-batches per rank; with accumulation 3 the
last window holds one micro-batch (7 % 3 == 1), which accelkit still scales by 1/3 and steps at
the loader's end. Clipping uses max_norm 0.5, below every measured pre-clip norm of this
workload (0.51 ... 1.08), so every step clips.

Tolerances (measured on this CPU, 2 processes, fp32 and bf16-true):
- accelkit vs raw ColossalAI with the same plugin settings (no_sync used the same way): the same
  operations in the same order. Measured difference 0 for every loss, norm and weight (the norm
  compared after rounding ColossalAI's Python float to accel.grad_norm's float32) -> EXACT.
- accelkit colossalai_zero / colossalai_ddp vs raw torch DDP + clip_grad_norm_: measured 0 for
  losses and norms; weights up to 5.96e-8 absolute (one float32 ulp: ZeRO sums the norm in float64
  per gradient, so the clip coefficient can differ in its last bit). Bounds: TORCH_ATOL ten ulps,
  TORCH_RTOL for losses and norms.
"""

from __future__ import annotations

import math
import struct

import pytest

pytest.importorskip("colossalai")

from accelkit.testing import run_ranks

pytestmark = pytest.mark.slow

EXACT = 0.0
#: vs raw torch DDP: measured 0 (losses, norms) and 5.96e-8 absolute (weights); see module doc
TORCH_RTOL = 1e-6
TORCH_ATOL = 6e-7

REFERENCE_RUNS = [
    dict(name="zero2", kind="booster_zero", stage=2, accumulation=3, max_norm=0.5),
    dict(name="zero1", kind="booster_zero", stage=1, accumulation=3, max_norm=0.5),
    dict(
        name="zero2_bf16",
        kind="booster_zero",
        stage=2,
        precision="bf16",
        accumulation=2,
        track_grad_norm=True,
    ),
    dict(name="cddp", kind="booster_ddp", accumulation=3, max_norm=0.5),
    dict(name="torch", kind="torch_ddp", accumulation=3, max_norm=0.5),
]
ACCELKIT_RUNS = [
    dict(
        name="zero2",
        backend="colossalai_zero",
        options={"stage": 2},
        accumulation=3,
        max_norm=0.5,
    ),
    dict(
        name="zero1",
        backend="colossalai_zero",
        options={"stage": 1},
        accumulation=3,
        max_norm=0.5,
    ),
    dict(
        name="zero2_bf16",
        backend="colossalai_zero",
        options={"stage": 2},
        precision="bf16-true",
        accumulation=2,
        track_grad_norm=True,
    ),
    dict(name="cddp", backend="colossalai_ddp", accumulation=3, max_norm=0.5),
]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    reference = run_ranks("cai_reference:runs", {"cfgs": REFERENCE_RUNS})[0]
    ours = run_ranks("cai_workers:trains", {"jobs": ACCELKIT_RUNS})
    return {"reference": reference, "accelkit": ours[0], "accelkit_rank1": ours[1]}


def as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    worst = 0.0
    for u, v in zip(a, b):
        scale = max(abs(u), abs(v), 1e-3)
        worst = max(worst, abs(u - v) / scale if math.isfinite(u - v) else math.inf)
    return worst


def params_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    """Largest absolute element difference (weights are O(0.1-1) here)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(u - v) for k in a for u, v in zip(a[k], b[k], strict=True))


@pytest.mark.parametrize("name", ["zero2", "zero1", "zero2_bf16", "cddp"])
def test_matches_raw_colossalai(results, name):
    ref, ours = results["reference"][name], results["accelkit"][name]
    assert len(ours["losses"]) == 7
    assert rel_diff(ours["losses"], ref["losses"]) <= EXACT
    assert params_diff(ours["params"], ref["params"]) <= EXACT
    # every run reports a norm per applied step (clipped, or tracked for zero2_bf16): an empty
    # reference list would compare nothing
    assert len(ref["norms"]) == ours["applied"] and ref["norms"]
    # accel.grad_norm is a float32 tensor; ColossalAI's norm a Python float
    assert rel_diff(ours["norms"], [as_float32(n) for n in ref["norms"]]) <= EXACT


@pytest.mark.parametrize("name", ["zero2", "zero1", "cddp"])
def test_matches_raw_torch_ddp(results, name):
    ref, ours = results["reference"]["torch"], results["accelkit"][name]
    assert rel_diff(ours["losses"], ref["losses"]) <= TORCH_RTOL
    assert rel_diff(ours["norms"], ref["norms"]) <= TORCH_RTOL
    assert params_diff(ours["params"], ref["params"]) <= TORCH_ATOL


def test_short_last_window_steps_at_the_loader_end(results):
    # 7 micro-batches, accumulation 3: windows of 3, 3 and 1 -> 3 applied steps
    for name in ("zero2", "zero1", "cddp"):
        assert results["accelkit"][name]["applied"] == 3
        assert len(results["accelkit"][name]["norms"]) == 3
    assert results["accelkit"]["zero2_bf16"]["applied"] == 4  # windows 2, 2, 2, 1


def test_clipping_engaged_and_reports_the_pre_clip_norm(results):
    norms = results["reference"]["torch"]["norms"]
    assert min(norms) > 0.5, "max_norm must be below every norm, or clipping is not tested"
    for name in ("zero2", "zero1", "cddp"):
        assert all(n > 0.5 for n in results["accelkit"][name]["norms"])


def test_bf16_true_reports_a_norm_without_clipping(results):
    norms = results["accelkit"]["zero2_bf16"]["norms"]
    assert len(norms) == 4 and all(math.isfinite(n) and n > 0 for n in norms)


def test_no_sync_capability_follows_the_plugin(results):
    assert results["accelkit"]["zero1"]["no_sync"] is True  # LowLevelZero stage 1
    assert results["accelkit"]["zero2"]["no_sync"] is False
    assert results["accelkit"]["cddp"]["no_sync"] is True


def test_ranks_agree_on_the_weights(results):
    for name in ("zero2", "zero1", "cddp"):
        a, b = results["accelkit"][name]["params"], results["accelkit_rank1"][name]["params"]
        assert params_diff(a, b) == 0.0


def test_accumulate_without_no_sync_warns_once(results):
    # ZeRO-2 has no no_sync: 2 windows of 3 with 2 non-closing micro-batches each, one warning
    assert results["accelkit"]["zero2"]["sync_warnings"] == 1
    assert results["accelkit"]["zero1"]["sync_warnings"] == 0
    assert results["accelkit"]["cddp"]["sync_warnings"] == 0
