"""The DeepSpeed backend on CUDA (issue 5's GPU part): fp16 and bf16 on ZeRO-2 and ZeRO-3 with
offload, against raw DeepSpeed in the same processes. Run on the GPU machine::

    ACCELKIT_GPU_REPORT=/some/dir python3 -m pytest -q -m gpu -o addopts="" plugins/deepspeed/tests

Every test runs at world size 1 and 2 (one rank per GPU, nccl); on a machine with fewer GPUs
the 2-rank case is skipped with the reason, never run on one rank instead. The scenarios, references and checks are the
CPU tests' (dsk_worker / dsk_reference / dsk_accel), with ``device="cuda"``.

A GPU run is scarce, so these tests do not stop at the first difference: every scenario runs
(one that raises is reported, the next still runs), every check is evaluated, and what was
*measured* (max loss / grad-norm / weight differences against raw DeepSpeed and raw PyTorch, next
to the tolerance) goes into a per-test summary: printed at the end of the pytest run, and written
as JSON lines to ``$ACCELKIT_GPU_REPORT/deepspeed-gpu.jsonl`` when that variable names a folder.

The number of applied windows depends on the number of ranks (28 samples, batch 2: 7
micro-batches per rank and epoch on 2 ranks -> 3 windows; 14 on 1 rank -> 5 windows), so the
expected skip pattern is computed from the rule, not written out for 2 ranks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_deepspeed_training import (
    COMMON,
    CUDA_ENV,
    TOLERANCES,
    differences,
    expected_skipped,
    within,
)

from accelkit.testing import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}rank")
def nproc(request: pytest.FixtureRequest) -> int:
    """Ranks of this run, one GPU each: the 2-rank case skips, visibly, on a one-GPU machine."""
    have = torch.cuda.device_count()
    if have < request.param:
        pytest.skip(f"{request.param} ranks need {request.param} GPUs; this machine has {have}")
    return request.param


def run(scenarios: list[dict[str, Any]], nproc: int) -> list[list[dict[str, Any]]]:
    return run_ranks(
        "dsk_worker:compare",
        {"scenarios": [dict(s, device="cuda") for s in scenarios], "keep_going": True},
        nproc=nproc,
        env=CUDA_ENV,
        timeout=900,
    )


def _label(s: dict[str, Any]) -> str:
    parts = [f"zero{s['stage']}", s["precision"]]
    parts += [k for k in ("offload_optimizer", "offload_param", "zero_init") if s.get(k)]
    return "+".join(parts)


def _equal_to_raw_deepspeed(
    accel: dict[str, Any], raw: dict[str, Any], *, norms: bool = True
) -> list[str]:
    """assert_equal_to_raw_deepspeed as a list of what differs (empty when equal)."""
    problems = []
    if accel["losses"] != raw["losses"]:
        problems.append("losses differ from raw DeepSpeed")
    if accel["params"] != raw["params"]:
        problems.append("final weights differ from raw DeepSpeed")
    if accel["lrs"] != raw["lrs"]:
        problems.append(f"lrs differ from raw DeepSpeed: {accel['lrs']} vs {raw['lrs']}")
    for i, (ours, theirs) in enumerate(zip(accel["norms"], raw["norms"])):
        if norms and theirs is not None and ours != pytest.approx(theirs, rel=1e-6):
            problems.append(f"grad norm {i}: {ours} vs raw DeepSpeed {theirs}")
    if len(accel["norms"]) != len(raw["norms"]):
        problems.append(f"{len(accel['norms'])} windows vs raw DeepSpeed's {len(raw['norms'])}")
    return problems


def check_all(
    gpu_report: Any,
    scenarios: list[dict[str, Any]],
    checks: Any,
    nproc: int,
    *,
    norms_vs_deepspeed: bool = True,
) -> None:
    """Run the scenarios, evaluate every check on every rank, record what was measured, and
    fail once at the end with everything that differed."""
    all_problems: list[str] = []
    try:
        ranks = run(scenarios, nproc)
    except AssertionError as err:  # the launch itself failed: its output is the report
        gpu_report(scenario="launch", problems=[str(err)[-6000:]])
        raise
    for rank, results in enumerate(ranks):
        for s, result in zip(scenarios, results, strict=True):
            where = f"rank {rank}/{nproc} {_label(s)}"
            if "error" in result:
                problems = [f"raised: {result['error']}"]
                gpu_report(scenario=where, problems=problems)
                all_problems += [f"{where}: {p}" for p in problems]
                continue
            accel = result["accel"]
            measured: dict[str, Any] = {
                "seconds": result.get("seconds"),
                "skipped": accel["skipped"],
                "param_dtype": accel["param_dtype"],
                "scale": accel["scale"],
                "vs_deepspeed": differences(accel, result["deepspeed"]),
            }
            problems = _equal_to_raw_deepspeed(accel, result["deepspeed"], norms=norms_vs_deepspeed)
            problems += checks(s, accel, result)
            precision = s["precision"]
            if "torch" in result:
                measured["vs_torch"] = differences(accel, result["torch"])
                measured["torch_tolerance"] = dict(
                    zip(("loss_rtol", "weight_atol", "norm_rtol"), TOLERANCES[precision])
                )
                beyond = within(accel, result["torch"], precision)
                if beyond:
                    problems.append(f"beyond raw PyTorch's tolerance: {beyond[:6]}")
                # raw DeepSpeed against raw PyTorch: the floor on this GPU
                measured["floor_deepspeed_vs_torch"] = differences(
                    result["deepspeed"], result["torch"]
                )
            gpu_report(scenario=where, measured=measured, problems=problems)
            all_problems += [f"{where}: {p}" for p in problems]
    assert not all_problems, "\n".join(all_problems)


def _skips_an_overflow(s: dict[str, Any], accel: dict[str, Any], nproc: int) -> list[str]:
    problems = []
    want = expected_skipped(nproc, s["overflow_at"], s["accumulation"])
    if accel["skipped"] != want:
        problems.append(f"skipped {accel['skipped']}, expected {want}")
    first = want.index(True)
    if accel["norms"][first] != math.inf:
        problems.append(f"grad norm of the skipped window {accel['norms'][first]}, expected inf")
    if accel["lrs"][first - 1] != accel["lrs"][first]:
        problems.append(f"the scheduler stepped on the skipped window: {accel['lrs']}")
    return problems


def test_fp16_zero2_and_zero3_offload_skip_an_overflow_like_raw_deepspeed(gpu_report, nproc):
    base = dict(COMMON, precision="16-true", overflow_at=4)
    scenarios = [
        dict(base, stage=2),
        dict(base, stage=2, offload_optimizer=True),
        dict(base, stage=3, offload_optimizer=True, offload_param=True, zero_init=True),
    ]

    def checks(s, accel, result):
        problems = _skips_an_overflow(s, accel, nproc)
        if accel["param_dtype"] != str(torch.float16):
            problems.append(f"param dtype {accel['param_dtype']}")
        return problems

    check_all(gpu_report, scenarios, checks, nproc)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_bf16_zero2_and_zero3_offload_match_raw_deepspeed_and_pytorch(gpu_report, precision, nproc):
    base = dict(COMMON, precision=precision)
    scenarios = [
        dict(base, stage=2),
        dict(base, stage=2, offload_optimizer=True),
        dict(base, stage=3, offload_optimizer=True, offload_param=True, zero_init=True),
    ]
    check_all(gpu_report, scenarios, lambda s, accel, result: [], nproc)


def test_16_mixed_zero2_overflow_backs_the_scale_off_like_torch(gpu_report, nproc):
    scenarios = [dict(COMMON, precision="16-mixed", overflow_at=4, stage=2, clip=None)]

    def checks(s, accel, result):
        problems = _skips_an_overflow(s, accel, nproc)
        scales = result["torch"]["scales"]
        if not accel["scale"] == scales[-1] == 32768.0:
            problems.append(f"scale {accel['scale']}, raw PyTorch {scales[-1]}, expected 32768")
        return problems

    # under ZeRO raw DeepSpeed (0.19.8) reports the loss-scaled grad norm (accelkit divides it)
    check_all(gpu_report, scenarios, checks, nproc, norms_vs_deepspeed=False)


# ---- the portable checkpoint on CUDA (issue 6) ------------------------------------------------------
def test_zero3_bf16_checkpoint_round_trip_on_cuda(gpu_report, tmp_path, nproc):
    """ZeRO-3 bf16 on CUDA writes its ranges; ZeRO-3 resumes bit-exactly, and ZeRO-2, ZeRO-3
    with CPU offload and the cpu backend receive fp32 masters and Adam state bit for bit
    (dsk_ckpt's workload, the checks of test_deepspeed_checkpoint.py)."""
    from test_deepspeed_checkpoint import differing

    path = str(tmp_path / "z3")
    bf16, cuda = "bf16-true", {"device": "cuda"}
    offload = {"device": "cuda", "offload_optimizer": "cpu", "offload_param": "cpu"}
    jobs = [
        dict(name="z3", stage=3, precision=bf16, options=cuda, save_at=3, save_to=path),
        dict(name="z3<-z3", stage=3, precision=bf16, options=cuda, load_from=path),
        dict(name="z2<-z3", stage=2, precision=bf16, options=cuda, load_from=path),
        dict(name="z3off<-z3", stage=3, precision=bf16, options=offload, load_from=path),
    ]
    if nproc == 1:  # the cpu backend is one process
        jobs.append(dict(name="cpu<-z3", backend="cpu", load_from=path))
    results = run_ranks("dsk_ckpt:jobs", {"jobs": jobs}, nproc=nproc, env=CUDA_ENV, timeout=600)
    runs = results[0]
    all_problems = []
    source = runs["z3"]
    for name in [job["name"] for job in jobs[1:]]:
        result, problems, measured = runs[name], [], {}
        if "error" in result or "crash" in result or "error" in source or "crash" in source:
            problems.append(str(result.get("error") or result.get("crash") or source)[-2000:])
        else:
            keys = (
                ("weights", "lp", "exp_avg", "exp_avg_sq")
                if name != "cpu<-z3"
                else ("weights", "exp_avg", "exp_avg_sq")
            )
            bad = differing(result["loaded"], source["saved"], keys)
            if bad:
                problems.append(f"not bit for bit after the load: {bad[:6]}")
            diffs = [abs(a - b) / abs(b) for a, b in zip(result["losses"], source["losses"][3:])]
            measured = {"loss_max_rel_vs_uninterrupted": max(diffs), "losses": result["losses"]}
            if name == "z3<-z3" and result["losses"] != source["losses"][3:]:
                problems.append("the same-stage resume does not reproduce the losses exactly")
        gpu_report(scenario=f"{name} x{nproc}", measured=measured, problems=problems)
        all_problems += [f"{name}: {p}" for p in problems]
    assert not all_problems, "\n".join(all_problems)
