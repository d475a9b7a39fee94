"""``fairscale_fsdp`` on 2 gloo CPU processes -- under a TEST-ONLY shim.

FairScale 0.4.13's FSDP cannot run without CUDA (it drives CUDA streams unconditionally), and
the plugin ships no patch for that (``test_fairscale_fsdp.py`` checks the refusal). To still
test the backend's wiring on CPU, these workers apply ``fairscale_cpu_shim`` (no-op streams in
FairScale's FSDP module, ``record_stream`` a no-op for CPU tensors) to BOTH sides: accelkit and
the raw FairScale reference. So these tests (all named ``*_shim``) do not count as coverage of
FairScale FSDP itself; each has a GPU twin in ``test_fairscale_fsdp.py`` marked ``gpu``.

Workload and rule as in ``test_fairscale_oss_sdp.py``: 7 micro-batches per rank and epoch,
2 epochs, accumulation 3 (windows 3, 3, 1), clipping at 0.5, AdamW.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_fairscale_oss_sdp import DDP_RTOL, SAME_RTOL, compare

from accelkit.testing import run_ranks

pytestmark = pytest.mark.slow

ACC, CLIP, EPOCHS = 3, 0.5, 2
COMMON = dict(accumulation=ACC, max_norm=CLIP, epochs=EPOCHS)
SHIM = {"shim": True}

RAW_RUNS: dict[str, dict[str, Any]] = {
    "ddp": dict(mode="ddp", **COMMON),
    "fsdp_sync": dict(mode="fsdp", cfg={**SHIM, "no_sync": False}, **COMMON),
    "fsdp_no_sync": dict(mode="fsdp", cfg=SHIM, **COMMON),
    "fsdp_fp16_sync": dict(
        mode="fsdp",
        precision="16-mixed",
        cfg={**SHIM, "no_sync": False, "fsdp_mixed": True},
        **COMMON,
    ),
    "fsdp_bf16_sync": dict(
        mode="fsdp", precision="bf16-mixed", cfg={**SHIM, "no_sync": False}, **COMMON
    ),
}

ACCEL_RUNS: dict[str, dict[str, Any]] = {
    "fsdp": dict(backend="fairscale_fsdp", shim=True, **COMMON),
    "fsdp_skip_sync": dict(
        backend="fairscale_fsdp",
        shim=True,
        options={"skip_sync_in_accumulation": True},
        **COMMON,
    ),
    "fsdp_fp16": dict(backend="fairscale_fsdp", shim=True, precision="16-mixed", **COMMON),
    "fsdp_bf16": dict(backend="fairscale_fsdp", shim=True, precision="bf16-mixed", **COMMON),
    "fsdp_root_only": dict(
        backend="fairscale_fsdp", shim=True, options={"wrap_policy": False}, **COMMON
    ),
    "fsdp_not_flat": dict(
        backend="fairscale_fsdp", shim=True, options={"flatten_parameters": False}, **COMMON
    ),
}


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return run_ranks("fairscale_reference:suite", {"runs": RAW_RUNS})[0]


@pytest.fixture(scope="module")
def accel() -> list[dict[str, Any]]:
    return run_ranks("fs_workers:suite", {"runs": ACCEL_RUNS})


def test_ranks_agree_shim(accel):
    for name in ACCEL_RUNS:
        assert "error" not in accel[0][name], (name, accel[0][name].get("error"))
        assert accel[0][name]["losses"] == accel[1][name]["losses"], name
        assert accel[0][name]["params"] == accel[1][name]["params"], name


@pytest.mark.parametrize(
    ("name", "ref"),
    [
        ("fsdp", "fsdp_sync"),  # default: reduce-scatter every micro-batch
        ("fsdp_skip_sync", "fsdp_no_sync"),  # opt-in: FSDP's no_sync inside the window
        ("fsdp_fp16", "fsdp_fp16_sync"),  # FairScale mixed_precision=True + ShardedGradScaler
        ("fsdp_bf16", "fsdp_bf16_sync"),  # fp32 FSDP + torch.autocast(bf16)
    ],
)
def test_matches_raw_fairscale_fsdp_shim(raw, accel, name, ref):
    """Measured: bit-identical (0) for all four."""
    diffs = compare(accel[0][name], raw[ref])
    print(name, "vs", ref, diffs)
    assert max(diffs.values()) <= SAME_RTOL, diffs


@pytest.mark.parametrize("name", ["fsdp", "fsdp_skip_sync", "fsdp_root_only", "fsdp_not_flat"])
def test_matches_raw_ddp_shim(raw, accel, name):
    """Measured floor vs DDP: losses <= 2.3e-7, norms <= 1.4e-7, parameters <= 8.3e-7."""
    diffs = compare(accel[0][name], raw["ddp"])
    print(name, "vs ddp", diffs)
    assert max(diffs.values()) <= DDP_RTOL, diffs


def test_wrap_policy_nests_units_shim(accel):
    """Default policy: one unit per block of the ``blocks`` stack, plus the root; each rank
    holds half of the (padded) flat parameters."""
    full = sum(len(v) for v in accel[0]["fsdp"]["params"].values())
    assert accel[0]["fsdp"]["units"] == 4
    assert accel[0]["fsdp_root_only"]["units"] == 1
    for name in ("fsdp", "fsdp_root_only"):
        local = accel[0][name]["local_numel"]
        assert full / 2 <= local <= full / 2 + accel[0][name]["units"], (name, local, full)


def test_fp16_skips_the_overflowing_first_step_shim(raw, accel):
    """The initial loss scale (2**16) overflows fp16 gradients at step 1: the step is skipped,
    grad_norm reads inf (raw FairScale's clip returns nan there), and the scaler backs off."""
    norms = accel[0]["fsdp_fp16"]["norms"]
    assert norms[0] == float("inf")
    assert all(n != n or n == float("inf") for n in raw["fsdp_fp16_sync"]["norms"][:1])
    assert accel[0]["fsdp_fp16"]["applied_steps"] == 3 * EPOCHS


def test_accumulation_counts_and_clipping_shim(raw, accel):
    run = accel[0]["fsdp"]
    assert run["applied_steps"] == 3 * EPOCHS
    assert min(run["norms"]) > CLIP  # every step was clipped
    assert max(compare(run, raw["ddp"]).values()) <= DDP_RTOL
    # the opt-in no_sync path is a different computation order, not a different result
    assert max(compare(run, raw["fsdp_no_sync"]).values()) <= DDP_RTOL


# ---- world size 1 with FairScale's own fp16 mixed precision ------------------------------------
W1_FP16 = dict(mode="fsdp", precision="16-mixed", **COMMON)
W1_FP16_CFG = {**SHIM, "no_sync": False, "fsdp_mixed": True}


@pytest.fixture(scope="module")
def world1() -> dict[str, Any]:
    raw = run_ranks(
        "fairscale_reference:suite",
        {
            "runs": {
                "fp16": dict(cfg=W1_FP16_CFG, **W1_FP16),
                # FairScale as it is: no cast of the gradients before the optimizer step
                "fp16_uncast": dict(cfg={**W1_FP16_CFG, "grad_cast": False}, **W1_FP16),
            },
            "catch": True,
        },
        nproc=1,
    )[0]
    accel = run_ranks(
        "fs_workers:suite",
        {
            "runs": {
                "fp16": dict(backend="fairscale_fsdp", shim=True, precision="16-mixed", **COMMON),
                "fp16_skip_sync": dict(
                    backend="fairscale_fsdp",
                    shim=True,
                    precision="16-mixed",
                    options={"skip_sync_in_accumulation": True},
                    **COMMON,
                ),
            }
        },
        nproc=1,
    )[0]
    return {"raw": raw, "accel": accel}


def test_fairscale_leaves_fp16_grads_at_world_size_1_shim(world1):
    """The premise (negative twin): FairScale 0.4.13's FSDP at world size 1 leaves the
    mixed-precision gradients in fp16, and AdamW refuses them. Seen the same way on the H200
    (bench/results/2026-12-02-h200-call2/gpu-tests.log)."""
    error = world1["raw"]["fp16_uncast"].get("error", "")
    assert "expected dtype float for `end` but got dtype c10::Half" in error, error


@pytest.mark.parametrize("name", ["fp16", "fp16_skip_sync"])
def test_world_size_1_fp16_trains_like_raw_fairscale_shim(world1, name):
    """accelkit casts the gradients to the flat parameters' fp32 before unscaling (as FairScale
    does at world size > 1); the raw reference does the same by hand. With no_sync the window's
    gradients accumulate in fp16 before the cast: measured equal to the synced run too."""
    run = world1["accel"][name]
    assert "error" not in run, run.get("error")
    assert run["applied_steps"] == 5 * EPOCHS  # 14 micro-batches per epoch: 3, 3, 3, 3, 2
    assert run["norms"][0] == float("inf")  # the first step overflows (scale 2**16)
    diffs = compare(run, world1["raw"]["fp16"])
    print(name, "world 1 vs raw", diffs)
    assert max(diffs.values()) <= SAME_RTOL, diffs
