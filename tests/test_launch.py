"""``accelkit.launch(fn)`` starts the ranks itself (notebooks, scripts without torchrun), and
``main_process_first`` lets the main rank go first without a collective, so a block that needs
every rank fails at once instead of hanging (accelerate #3709)."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.errors import ConfigError, DistributedError, UnsupportedError
from accelkit.launcher import RankFailedError

SEED = 5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)


def ddp_worker(steps: int) -> dict:
    """The user's function: joins the group launch() set up and trains DDP on its half."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    accel = accelkit.get("ddp", timeout=60.0)
    torch.manual_seed(SEED)
    model = torch.nn.Linear(3, 1)
    model, _ = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    mine = slice(accel.rank * 4, accel.rank * 4 + 4)
    for _ in range(steps):
        accel.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]))
        accel.step()
    total = accel.all_reduce(torch.tensor([float(accel.rank)]), "sum")
    return {
        "rank": accel.rank,
        "world": accel.world_size,
        "sum": total.item(),
        "weight": accel.unwrap(model).weight.detach().tolist(),
        "pid": os.getpid(),
    }


def raw_full_batch(steps: int) -> list:
    """The reference: one raw-PyTorch process on the whole batch (DDP averages gradients)."""
    torch.manual_seed(SEED)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.weight.detach().tolist()


@pytest.mark.slow
def test_launch_spawns_two_gloo_ranks_and_returns_their_results_by_rank():
    results = accelkit.launch(ddp_worker, 3, nproc=2)  # a script: spawn, fn importable
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 1.0 for r in results)
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3
    expected = torch.tensor(raw_full_batch(3))
    for r in results:
        # DDP averages two half-batch gradients, the reference takes one full-batch gradient:
        # the same sum in another order: may differ by fp32 rounding (measured: equal here)
        torch.testing.assert_close(torch.tensor(r["weight"]), expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(expected, torch.tensor(raw_full_batch(0)))  # the weights moved
    assert not torch.distributed.is_initialized()  # the parent joined no group


@pytest.mark.slow
def test_launch_forks_a_function_defined_where_it_cannot_be_imported(tmp_path):
    """What a notebook does: the function lives in ``__main__`` of an interactive session."""
    marker = tmp_path / "ran"

    def local_fn(tag):  # a closure: spawn could not pickle it, fork needs not
        accel = accelkit.get("ddp", timeout=60.0)
        Path(marker.with_suffix(f".{accel.rank}")).write_text(tag)
        return accel.all_reduce(torch.ones(1), "sum").item()

    assert accelkit.launch(local_fn, "x", nproc=2, start_method="fork") == [2.0, 2.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran.0", "ran.1"]


def fails_on_rank_1() -> str:
    accel = accelkit.get("ddp", timeout=60.0)
    if accel.rank == 1:
        raise ValueError("bad shard on rank 1")
    accel.all_reduce(torch.ones(1))  # rank 1 never comes: this fails once rank 1 is gone
    return "unreachable"


@pytest.mark.slow
def test_a_rank_that_raises_is_named_with_its_traceback_and_the_others_end():
    with pytest.raises(RankFailedError) as info:
        accelkit.launch(fails_on_rank_1, nproc=2, grace_s=60)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed: ValueError: bad shard on rank 1")
    assert "fails_on_rank_1" in message  # its traceback
    assert "rank 0: " in message  # rank 0 ended too (its all_reduce lost its peer)


def test_launch_refuses_to_nest_under_a_launcher_and_bad_arguments(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="already one rank"):
        accelkit.launch(print, nproc=2)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match="nproc"):
        accelkit.launch(print, nproc=0)
    with pytest.raises(ConfigError, match="start_method"):
        accelkit.launch(print, nproc=1, start_method="teleport")


# ---- main_process_first --------------------------------------------------------------------------
def first_worker(log: str, local: bool) -> list:
    accel = accelkit.get("ddp", timeout=60.0)
    with accel.main_process_first(local=local):
        with open(log, "a") as f:
            f.write(f"enter {accel.rank}\n")
        if accel.rank == 0:
            time.sleep(1.0)  # gives a rank that did not wait the time to enter (it must not)
        with open(log, "a") as f:
            f.write(f"leave {accel.rank}\n")
    accel.barrier()  # collectives work again after the block
    return Path(log).read_text().split("\n")[:-1]


@pytest.mark.slow
@pytest.mark.parametrize("local", [False, True])
def test_main_process_first_runs_the_block_on_rank_0_before_the_others(tmp_path, local):
    log = str(tmp_path / f"order-{local}.txt")
    results = accelkit.launch(first_worker, log, local, nproc=2)
    assert results[0] == ["enter 0", "leave 0", "enter 1", "leave 1"]


def collective_inside_worker(what: str) -> dict:
    accel = accelkit.get("ddp", timeout=60.0)
    model = torch.nn.Linear(2, 2)
    try:
        with accel.main_process_first():
            if what == "setup":
                accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            else:
                accel.all_reduce(torch.ones(1))
    except (UnsupportedError, DistributedError) as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.parametrize("what", ["setup", "all_reduce"])
def test_a_collective_inside_main_process_first_fails_on_every_rank_at_once(what):
    """accelerate #3709: the main rank's collective inside the block waits for ranks that wait
    for the block. Here rank 0 is refused at once and rank 1 learns it instead of running it."""
    rank0, rank1 = accelkit.launch(collective_inside_worker, what, nproc=2)
    assert rank0["error"] == "UnsupportedError"
    assert "inside main_process_first()" in rank0["message"]
    assert rank1["error"] == "DistributedError"
    assert "rank 0 failed inside main_process_first()" in rank1["message"]
    assert "UnsupportedError" in rank1["message"]


def zero3_inside_worker() -> dict:
    """accelerate #3709 itself: a ZeRO-3 model built inside main_process_first."""
    accel = accelkit.get(
        "deepspeed_stage_3", timeout=60.0, reduce_bucket_size=4096, allgather_bucket_size=4096
    )
    try:
        with accel.main_process_first(), accel.init_module():
            torch.nn.Linear(4, 4)
    except (UnsupportedError, DistributedError) as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


@pytest.mark.slow
def test_a_zero3_model_built_inside_main_process_first_fails_at_once_on_every_rank():
    if not (
        importlib.util.find_spec("deepspeed") and importlib.util.find_spec("accelkit_deepspeed")
    ):
        pytest.skip("deepspeed or accelkit-deepspeed is not installed")
    rank0, rank1 = accelkit.launch(zero3_inside_worker, nproc=2)
    assert rank0["error"] == "UnsupportedError", rank0
    assert "deepspeed_stage_3: init_module() needs every rank" in rank0["message"]
    assert rank1["error"] == "DistributedError", rank1
    assert "rank 0 failed inside main_process_first()" in rank1["message"]


def cuda_worker() -> dict:
    accel = accelkit.get("ddp", timeout=120.0)
    total = accel.all_reduce(torch.ones(1, device=accel.device), "sum")
    return {"device": str(accel.device), "sum": total.item()}


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [1, 2])
def test_launch_on_cuda_gives_each_rank_its_own_gpu(nproc):
    if torch.cuda.device_count() < nproc:  # never a silent one-rank run of the two-rank case
        pytest.skip(
            f"{nproc} ranks need {nproc} GPUs; this machine has {torch.cuda.device_count()}"
        )
    results = accelkit.launch(cuda_worker, nproc=nproc)  # spawn: CUDA and fork do not mix
    assert [r["device"] for r in results] == [f"cuda:{r}" for r in range(nproc)]
    assert all(r["sum"] == nproc for r in results)


def test_main_process_first_on_one_process_runs_the_block_and_refuses_collectives():
    accel = accelkit.get("cpu")
    ran = []
    with accel.main_process_first():
        ran.append(True)
        with pytest.raises(UnsupportedError, match="main_process_first"):
            accel.barrier()
    assert ran == [True]
    accel.barrier()  # fine again outside
