"""``bench/peers.py``, the peer benchmark, in its CPU smoke mode.

Timing is never asserted (this 2-core machine is shared). What a reader of its log relies on is:
every installed side trains the same model from the same weights on the same batches for the
same number of steps (checked through the last loss: on the CPU in fp32 the sides ended
bit-identical in every run here, difference 0.0, so equality is asserted), the ratios are taken
per round against the raw row of the same process, MFU uses 6 x non-embedding parameters + 12 L
T d per token against the peak the log prints, and a side whose library is missing is listed as
not installed, not silently dropped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accelkit.testing import worker_env

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / "peers.py"
#: the side -> the module it needs; absent ones must be reported as not installed
LIBRARIES = {"fabric": "lightning", "accelerate": "accelerate"}
# tiny-gpt by hand: 2 blocks of 12 d^2 + 13 d (d = 64), final LayerNorm 2d, head d x 512
NON_EMBEDDING = 2 * (12 * 64**2 + 13 * 64) + 2 * 64 + 64 * 512
PER_TOKEN = 6 * NON_EMBEDDING + 12 * 2 * 64 * 64


def run_peers(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "peers.json"
    command = [sys.executable, str(PEERS), "--device", "cpu", "--out", str(out), *args]
    done = subprocess.run(
        command, env=worker_env(), capture_output=True, text=True, timeout=400, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.slow  # four libraries' loops: 7-11 s
def test_peers_cpu_smoke_same_work_on_every_side(tmp_path):
    doc, log = run_peers(
        tmp_path,
        "--workloads", "tiny-gpt,mlp", "--modes", "raw,fabric,accelerate,accelkit",
        "--steps", "2", "--warmup", "1", "--repeats", "2", "--peak-tflops", "0.01",
    )  # fmt: skip
    assert "peak MFU is taken against: 10.0 GFLOP/s (given with --peak-tflops)" in log
    assert list(doc["processes"]) == ["main"]  # the four sides share one process
    gpt = doc["workloads"]["tiny-gpt"]
    assert (gpt["non_embedding_params"], gpt["flops_per_token"]) == (NON_EMBEDDING, PER_TOKEN)
    for name, workload in doc["workloads"].items():
        rows = {r["mode"]: r for r in workload["rows"]}
        assert list(rows) == ["raw", "fabric", "accelerate", "accelkit"]
        ran = [m for m in rows if m not in LIBRARIES or installed(LIBRARIES[m])]
        for mode in set(rows) - set(ran):
            assert rows[mode]["status"] == "not installed", rows[mode]
            assert "pip install 'accelkit[bench]'" in rows[mode]["reason"]
        raw = rows["raw"]
        for mode in ran:
            row = rows[mode]
            assert row["status"] == "ok", row
            assert len(row["step_ms"]["rounds"]) == 2 and row["steps"] == 2
            # same weights, batches and step count: the same last loss (bit-identical here)
            assert row["loss"] == raw["loss"], (name, mode, row["loss"], raw["loss"])
            if mode != "raw":
                per_round = [
                    a / b
                    for a, b in zip(row["step_ms"]["rounds"], raw["step_ms"]["rounds"], strict=True)
                ]
                assert row["vs_raw"]["rounds"] == pytest.approx(per_round)
            if name == "tiny-gpt":
                assert row["mfu"] == pytest.approx(PER_TOKEN * row["tokens_per_s"] / 1e10)
            else:
                assert "mfu" not in row  # the MLP is overhead-bound: no MFU
        for mode in ran:
            assert f"| {rows[mode]['label']} | main |" in log


def load_peers(monkeypatch: pytest.MonkeyPatch) -> Any:
    spec = importlib.util.spec_from_file_location("peers_bench", PEERS)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "peers_bench", module)  # its dataclasses look it up
    monkeypatch.syspath_prepend(str(PEERS.parent))  # its sibling bench/reference_gpt.py
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_a_side_without_its_library_is_listed_as_not_installed(monkeypatch):
    import torch

    peers = load_peers(monkeypatch)
    monkeypatch.setattr(peers, "installed", lambda module: module != "accelerate")
    args = argparse.Namespace(
        modes=["raw", "accelerate"], batch=2, steps=1, warmup=0, repeats=1, seed=0
    )
    done = peers.run_workload("main", peers.WORKLOADS["mlp"](), torch.device("cpu"), args)
    sides = {s["mode"]: s for s in done["sides"]}
    assert sides["raw"]["status"] == "ok"
    assert sides["accelerate"]["status"] == "not installed"
    assert "pip install 'accelkit[bench]'" in sides["accelerate"]["reason"]


@pytest.mark.slow
@pytest.mark.skipif(not installed("deepspeed"), reason="deepspeed is not installed")
def test_peers_cpu_deepspeed_group(tmp_path):
    """Raw DeepSpeed ZeRO-2 and accelkit's deepspeed_stage_2 in a process of their own, with a
    raw-PyTorch row as that process's reference."""
    doc, _ = run_peers(
        tmp_path,
        "--workloads", "tiny-gpt", "--modes", "zero2",
        "--steps", "2", "--warmup", "1", "--repeats", "2", "--peak-tflops", "0.01",
    )  # fmt: skip
    rows = {r["mode"]: r for r in doc["workloads"]["tiny-gpt"]["rows"]}
    assert list(rows) == ["raw", "deepspeed_zero2", "accelkit_deepspeed_stage_2"]
    assert {r["process"] for r in rows.values()} == {"zero2"}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["loss"] == rows["raw"]["loss"]
    ours = rows["accelkit_deepspeed_stage_2"]
    per_round = [
        a / b
        for a, b in zip(
            ours["step_ms"]["rounds"], rows["deepspeed_zero2"]["step_ms"]["rounds"], strict=True
        )
    ]
    assert ours["vs_raw_deepspeed"]["rounds"] == pytest.approx(per_round)
