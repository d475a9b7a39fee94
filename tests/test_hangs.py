"""Hangs end in an error that names the cause, within the process group's timeout.

Three ways a distributed loop hangs: a ``save`` called on rank 0 only (on a sharded backend each
rank holds its own shard), a collective called on one rank only, and a rank that died. Each run
here uses a 10 s group timeout; ``LIVENESS_BOUND_S`` only keeps a broken build from hanging the
suite (without the timeout the survivors would wait 30 minutes), it is not a timing assertion.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

import accelkit
from accelkit.testing import spawn_ranks

TIMEOUT_S = 10.0
LIVENESS_BOUND_S = 240


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    try:
        for proc in procs:
            try:
                _, stderr = proc.communicate(timeout=LIVENESS_BOUND_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a rank was still running {LIVENESS_BOUND_S} s later")
            out.append((proc.returncode, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


def rank0_save_worker(ckpt: str, backend: str) -> str:
    options = {"device": "cpu"} if backend == "fsdp" else {}
    accel = accelkit.get(backend, timeout=TIMEOUT_S, **options)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    for _ in range(2):
        accel.backward(model(torch.randn(2, 4)).square().mean())
        accel.step()
        if accel.is_main:  # the bug: raw-PyTorch habit, fatal with shards
            accel.save(ckpt, {"model": model, "optimizer": opt})
    return "finished"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_a_save_on_rank_0_only_names_the_ranks_that_did_not_come(tmp_path, backend):
    procs = spawn_ranks(
        "test_hangs:rank0_save_worker",
        {"ckpt": str(tmp_path / "ckpt"), "backend": backend},
        tmp_path,
    )
    (code0, err0), (code1, _) = _finish(procs)
    assert code0 != 0 and code1 != 0
    assert "DistributedError" in err0
    assert "save() (call 1 on this rank) is collective, and rank(s) [1] did not reach it" in err0
    assert "not under `if accel.is_main:`" in err0
    assert not (tmp_path / "rank-0.json").exists() and not (tmp_path / "rank-1.json").exists()
    assert not (tmp_path / "ckpt").exists()  # nothing half-written under the checkpoint's name


def every_rank_saves_worker(ckpt: str) -> str:
    """The twin: the same loop, every rank saving: it completes."""
    accel = accelkit.get("fsdp", timeout=TIMEOUT_S, device="cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    for step in range(2):
        accel.backward(model(torch.randn(2, 4)).square().mean())
        accel.step()
        accel.save(f"{ckpt}/step-{step}", {"model": model, "optimizer": opt})
    return "finished"


@pytest.mark.slow
def test_the_same_save_on_every_rank_completes(tmp_path):
    procs = spawn_ranks(
        "test_hangs:every_rank_saves_worker", {"ckpt": str(tmp_path / "ckpt")}, tmp_path
    )
    for code, err in _finish(procs):
        assert code == 0, err[-3000:]
    assert (tmp_path / "ckpt" / "step-1" / "accelkit.json").is_file()


def lone_collective_worker(mode: str) -> str:
    accel = accelkit.get("ddp", timeout=TIMEOUT_S)
    accel.barrier()
    if accel.rank == 1:
        if mode == "dies":
            os._exit(3)
        time.sleep(TIMEOUT_S * 4)  # "skips": busy elsewhere, never calls the all_reduce
        return "rank 1 done"
    accel.all_reduce(torch.ones(1))  # called on rank 0 only
    return "rank 0 finished alone"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["skips", "dies"])
def test_a_collective_on_one_rank_or_a_dead_peer_names_the_collective(tmp_path, mode):
    procs = spawn_ranks("test_hangs:lone_collective_worker", {"mode": mode}, tmp_path)
    try:
        _, err0 = procs[0].communicate(timeout=LIVENESS_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank 0 still running {LIVENESS_BOUND_S} s after rank 1 {mode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert procs[0].returncode != 0
    assert "DistributedError: rank 0: all_reduce failed" in err0, err0[-3000:]
    assert "not every rank called it" in err0 and "died" in err0
    assert "process group timeout 10 s" in err0
