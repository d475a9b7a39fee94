"""GPU runs of the ColossalAI backends (marked ``gpu``; skipped without CUDA). One process, one GPU.

- Gemini (bf16-true, 16-true; accelkit swaps the torch Adam for a HybridAdam) and LowLevelZero
  stage 1 and 2, each in bf16-true and 16-true, against ColossalAI's Booster used directly with
  the same settings: losses and weights expected equal, as measured on the CPU for the
  CPU-capable plugins.
- HybridParallelPlugin (tp_size=1) in bf16-true and 16-true, plain and with ZeRO 1/2, against
  the raw Booster, both sides clipping through the plugin's ``max_norm``: losses, working weights
  and fp32 masters equal, and (bf16) the reported gradient norms.
- The portable checkpoint from Gemini (gathered: the fp32 master chunks and the optimizer state,
  marked ``"gathered": true``) into ``ddp`` and back, and LowLevelZero bf16 into ``ddp``.

The wheels this needs on the GPU image (ColossalAI is not a pip dependency of the plugin):
colossalai 0.5.0, transformers 4.51.3, peft 0.13.2, tokenizers 0.21.4, huggingface_hub 0.36.2,
galore_torch 1.0, contexttimer 0.3.3, bitsandbytes 0.50.2. Gemini JIT-builds its CUDA kernels on
first use (~90 s).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("colossalai")

from accelkit.testing import run_ranks

pytestmark = pytest.mark.gpu

LR = 0.05  # the workers' learning rate

RUNS = [
    ("gemini_bf16", "colossalai_gemini", {}, "bf16-true", "booster_gemini", {"precision": "bf16"}),
    ("gemini_fp16", "colossalai_gemini", {}, "16-true", "booster_gemini", {"precision": "fp16"}),
    # Gemini without accumulation too: it separates the accumulation path from the rest
    (
        "gemini_bf16_acc1",
        "colossalai_gemini",
        {},
        "bf16-true",
        "booster_gemini",
        {"precision": "bf16"},
    ),
    (
        "zero1_bf16",
        "colossalai_zero",
        {"stage": 1},
        "bf16-true",
        "booster_zero",
        {"stage": 1, "precision": "bf16"},
    ),
    (
        "zero2_fp16",
        "colossalai_zero",
        {"stage": 2},
        "16-true",
        "booster_zero",
        {"stage": 2, "precision": "fp16"},
    ),
    # the other two of LowLevelZero's stage x precision matrix
    (
        "zero1_fp16",
        "colossalai_zero",
        {"stage": 1},
        "16-true",
        "booster_zero",
        {"stage": 1, "precision": "fp16"},
    ),
    (
        "zero2_bf16",
        "colossalai_zero",
        {"stage": 2},
        "bf16-true",
        "booster_zero",
        {"stage": 2, "precision": "bf16"},
    ),
]


def _accumulation(name: str) -> int:
    return 1 if name.endswith("_acc1") else 2


def _selected_runs(request: pytest.FixtureRequest) -> list[tuple]:
    """The RUNS whose test was selected (``-k``): a re-run of one case trains only that one."""
    names = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_matches_raw_booster_on_gpu"
    }
    return [run for run in RUNS if run[0] in names]


@pytest.fixture(scope="module")
def training(request):
    runs = _selected_runs(request)
    reference = run_ranks(
        "cai_reference:runs",
        {
            "cfgs": [
                dict(
                    name=name,
                    kind=kind,
                    device="cuda",  # the reference's default is the CPU (gloo + CPU accelerator)
                    accumulation=_accumulation(name),
                    max_norm=0.5,
                    catch=True,
                    **extra,
                )
                for name, _b, _o, _p, kind, extra in runs
            ]
        },
        nproc=1,
        timeout=900,
    )[0]
    ours = run_ranks(
        "cai_workers:trains",
        {
            "jobs": [
                dict(
                    name=name,
                    backend=backend,
                    options=options,
                    precision=precision,
                    accumulation=_accumulation(name),
                    max_norm=0.5,
                    catch=True,
                )
                for name, backend, options, precision, _k, _e in runs
            ]
        },
        nproc=1,
        timeout=900,
    )[0]
    return reference, ours


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_matches_raw_booster_on_gpu(training, name):
    reference, ours = training
    assert "error" not in reference[name], f"raw ColossalAI failed: {reference[name].get('error')}"
    assert "error" not in ours[name], f"accelkit failed: {ours[name].get('error')}"
    assert ours[name]["losses"] == reference[name]["losses"]
    assert ours[name]["params"] == reference[name]["params"]
    if "fp16" in name:
        # ColossalAI reports the norm of the loss-scaled gradients; accel.grad_norm divides by
        # the scale, so only the bf16 runs compare norms directly
        assert all(n > 0 for n in ours[name]["norms"])
        return
    ref_norms = [float(torch.tensor(n, dtype=torch.float32)) for n in reference[name]["norms"]]
    assert ref_norms, "the raw Booster reported no norm: nothing would be compared"
    assert ours[name]["norms"] == ref_norms


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("colossalai-gpu-ckpt")
    ck = {n: str(root / n) for n in ("gemini", "ddp", "zbf")}
    common, resume = dict(total=7, save_at=4), dict(total=7, start=4)
    gemini = dict(backend="colossalai_gemini", precision="bf16-true")
    out = run_ranks(
        "cai_workers:ckpt_jobs",
        {
            "jobs": [
                {**job, "catch": True}
                for job in [
                    dict(name="gemini", save_to=ck["gemini"], **gemini, **common),
                    dict(name="ddp", backend="ddp", save_to=ck["ddp"], **common),
                    dict(
                        name="zbf",
                        backend="colossalai_zero",
                        options={"stage": 2},
                        precision="bf16-true",
                        save_to=ck["zbf"],
                        **common,
                    ),
                    dict(name="gemini<-gemini", load_from=ck["gemini"], **gemini, **resume),
                    dict(name="ddp<-gemini", backend="ddp", load_from=ck["gemini"], **resume),
                    dict(name="gemini<-ddp", load_from=ck["ddp"], **gemini, **resume),
                    dict(name="ddp<-zbf", backend="ddp", load_from=ck["zbf"], **resume),
                ]
            ]
        },
        nproc=1,
        timeout=900,
    )[0]
    return out, root


def _ok(out: dict, *names: str) -> None:
    for name in names:
        assert "error" not in out[name], f"{name}: {out[name].get('error')}"


def test_gemini_checkpoint_is_marked_gathered(checkpoints):
    out, root = checkpoints
    _ok(out, "gemini")
    manifest = json.loads((Path(root) / "gemini" / "accelkit.json").read_text())
    params = [t for t in manifest["tensors"] if t["kind"] == "param"]
    assert params and all(t.get("gathered") for t in params)
    assert all(t["dtype"] == "float32" for t in params)  # the fp32 master chunks


def test_gemini_resumes_itself_exactly(checkpoints):
    out, _ = checkpoints
    _ok(out, "gemini", "gemini<-gemini")
    resumed, original = out["gemini<-gemini"], out["gemini"]
    assert resumed["after_load"] == original["at_save"]
    for step in ("5", "6", "7"):
        assert resumed["losses"][step] == original["losses"][step]


def test_gemini_state_reaches_ddp_and_back(checkpoints):
    out, _ = checkpoints
    _ok(out, "gemini", "ddp", "ddp<-gemini", "gemini<-ddp")
    into_ddp, gemini = out["ddp<-gemini"], out["gemini"]
    assert into_ddp["after_load"]["optim"] == gemini["at_save"]["optim"]
    # Gemini's own state_dict gathers its fp32 master chunks (measured on the H200: the values
    # are not bf16-representable), and the checkpoint carries the same masters: ddp gets them
    # bit for bit, and Gemini takes ddp's fp32 weights as its masters bit for bit
    assert into_ddp["after_load"]["params"] == gemini["at_save"]["params"]
    into_gemini, ddp = out["gemini<-ddp"], out["ddp"]
    assert into_gemini["after_load"]["optim"] == ddp["at_save"]["optim"]
    assert into_gemini["after_load"]["params"] == ddp["at_save"]["params"]


def test_zero_bf16_master_reaches_ddp(checkpoints):
    out, _ = checkpoints
    _ok(out, "zbf", "ddp<-zbf")
    into_ddp, zbf = out["ddp<-zbf"], out["zbf"]
    assert into_ddp["after_load"]["optim"] == zbf["at_save"]["optim"]
    masters = [v for shard in zbf["masters_at_save"] for v in shard]
    loaded = [v for values in into_ddp["after_load"]["params"].values() for v in values]
    assert loaded == masters  # one process: each master shard is the whole parameter


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    jobs = [
        dict(name="zero", backend="colossalai_zero", options={"stage": 2}),
        dict(name="gemini", backend="colossalai_gemini"),
    ]
    out = run_ranks("cai_workers:overflow_jobs", {"jobs": jobs}, nproc=1, timeout=900)[0]
    for name in ("zero", "gemini"):
        run = out[name]
        assert run["skipped"][0] is True, run  # loss x 1000 x 2**17 overflows fp16 at once
        assert run["norms"][0] == float("inf")
        assert run["lrs"][0] == LR  # the scheduler did not step on the skipped step
        assert run["scales"][1] < run["scales"][0]  # and the scale backed off
        assert False in run["skipped"], "the scale never came down far enough to step"
        first = run["skipped"].index(False)
        assert run["lrs"][first] == LR * 0.5  # one scheduler step for the first applied step
        assert math.isfinite(run["norms"][first])


#: both sides clip through the plugin's max_norm; the CPU twin measured pre-clip norms of 0.939 to
#: 0.956 for this tiny Llama (fp32 and bf16-true), so 0.5 clips every step
HYBRID_MAX_NORM = 0.5
HYBRID_RUNS = [
    dict(name="hybrid_bf16", tp_size=1, precision="bf16", max_norm=HYBRID_MAX_NORM),
    dict(name="hybrid_fp16", tp_size=1, precision="fp16", max_norm=HYBRID_MAX_NORM),
    dict(
        name="hybrid_zero1_bf16",
        tp_size=1,
        zero_stage=1,
        precision="bf16",
        max_norm=HYBRID_MAX_NORM,
    ),
    dict(
        name="hybrid_zero2_fp16",
        tp_size=1,
        zero_stage=2,
        precision="fp16",
        max_norm=HYBRID_MAX_NORM,
    ),
]
HYBRID_PRECISION = {"bf16": "bf16-true", "fp16": "16-true"}


def _selected_hybrid_runs(request: pytest.FixtureRequest) -> list[dict]:
    """The HYBRID_RUNS whose test was selected (``-k``)."""
    names = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_hybrid_matches_raw_booster_on_gpu"
    }
    return [run for run in HYBRID_RUNS if run["name"] in names]


@pytest.fixture(scope="module")
def hybrid_training(request):
    pytest.importorskip("transformers")
    runs = _selected_hybrid_runs(request)
    reference = run_ranks(
        "cai_reference:hybrid_runs",
        {"cfgs": [{**run, "device": "cuda", "catch": True} for run in runs]},
        nproc=1,
        timeout=600,
    )[0]
    jobs = [{**run, "precision": HYBRID_PRECISION[run["precision"]], "catch": True} for run in runs]
    ours = run_ranks("cai_workers:hybrid_jobs", {"jobs": jobs}, nproc=1, timeout=600)[0]
    return reference, ours


@pytest.mark.parametrize("name", [r["name"] for r in HYBRID_RUNS])
def test_hybrid_matches_raw_booster_on_gpu(hybrid_training, name):
    # HybridParallelPlugin (tp_size=1, Shardformer's Llama policy) on one GPU, accumulation 2,
    # both sides clipping at HYBRID_MAX_NORM through the plugin; the CPU twin
    # (test_colossalai_hybrid.py) measured losses, norms, weights and fp32 masters equal: equal
    reference, ours = hybrid_training
    raw, mine = reference[name], ours[name]
    assert "error" not in raw, f"raw ColossalAI failed: {raw.get('error')}"
    assert "error" not in mine, f"accelkit failed: {mine.get('error')}"
    assert len(mine["losses"]) == 16 // 2
    assert mine["losses"] == raw["losses"]
    assert mine["params"] == raw["params"]  # the bf16/fp16 working weights
    assert len(mine["masters"]) == 21, "no fp32 master read from the optimizer"
    assert mine["masters"] == raw["masters"]  # the fp32 masters the optimizer steps
    assert len(mine["norms"]) == mine["applied"] == 4
    if "fp16" in name:
        # ColossalAI reports the norm of the loss-scaled gradients; accel.grad_norm divides by
        # the scale, so only the bf16 runs compare norms directly
        return
    assert mine["norms"] == [float(torch.tensor(n, dtype=torch.float32)) for n in raw["norms"]]
    assert min(mine["norms"]) > HYBRID_MAX_NORM, "clipping never engaged"
