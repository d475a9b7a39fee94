"""``accel.save(..., asynchronous=True)``: the snapshot is what was saved while training goes
on; the next call waits; a background error is raised there, never lost; 2 ranks save
asynchronously and 1 rank loads. Rotation and ``latest`` of asynchronous saves are the store
suite's (tests/test_store_contract.py), on every store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.checkpoint.write import background, writer
from accelkit.testing import run_ranks

HERE = Path(__file__).parent


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _setup(accel, seed: int = 0):
    net = _net(seed)
    model, opt = accel.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    accel.backward(model(torch.randn(8, 16)).square().mean())
    opt.step()
    opt.zero_grad()
    return model, opt


def test_the_checkpoint_holds_the_state_of_the_save_call_not_later_steps(tmp_path):
    accel = accelkit.get("cpu", seed=0)
    model, opt = _setup(accel)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    accel.save(tmp_path / "a", {"model": model, "optimizer": opt, "step": 1}, asynchronous=True)
    for _ in range(3):  # training goes on while the background thread writes
        accel.backward(model(torch.randn(8, 16)).square().mean())
        opt.step()
        opt.zero_grad()
    accel.wait_for_save()
    fresh = accelkit.get("cpu", seed=0)
    other, other_opt = _setup(fresh, seed=5)
    state = {"model": other, "optimizer": other_opt, "step": 0}
    fresh.load(tmp_path / "a", state)
    assert state["step"] == 1
    for key, value in other.state_dict().items():
        assert torch.equal(value, expected[key]), key  # bit for bit the snapshot
    assert not torch.equal(other.state_dict()["0.weight"], model.state_dict()["0.weight"])


def test_a_background_failure_is_raised_by_the_next_call_and_commits_nothing(tmp_path, monkeypatch):
    accel = accelkit.get("cpu", seed=0)
    model, _ = _setup(accel)
    accel.save(tmp_path / "step-1", {"model": model, "step": 1})

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_write_planned", disk_full)
    accel.save(tmp_path / "step-2", {"model": model, "step": 2}, asynchronous=True)
    monkeypatch.undo()
    with pytest.raises(accelkit.CheckpointError, match=r"asynchronous save of .*step-2 failed"):
        accel.save(tmp_path / "step-3", {"model": model, "step": 3})
    assert not (tmp_path / "step-2").exists()  # never committed
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    background.wait()  # the error was raised once: nothing is pending now
    accel.save(tmp_path / "step-3", {"model": model, "step": 3})
    assert (tmp_path / "latest").read_text().strip() == "step-3"


def ranks_job(root: str) -> dict:
    accel = accelkit.get("ddp", seed=0)
    model, opt = _setup(accel)
    expected = {k: v.clone() for k, v in accel.unwrap(model).state_dict().items()}
    accel.save(Path(root) / "step-1", {"model": model, "optimizer": opt}, asynchronous=True)
    for _ in range(2):  # collectives of the loop while the commit gathers on its own group
        accel.backward(model(torch.randn(8, 16)).square().mean())
        opt.step()
        opt.zero_grad()
        accel.all_reduce(torch.ones(()))
    accel.end_training()
    torch.save(expected, Path(root) / f"expected-{accel.rank}.pt")
    return {"rank": accel.rank}


def test_two_ranks_save_asynchronously_and_one_rank_loads(tmp_path):
    run_ranks("test_checkpoint_async:ranks_job", {"root": str(tmp_path)}, nproc=2, path=[HERE])
    expected = torch.load(tmp_path / "expected-0.pt")
    accel = accelkit.get("cpu", seed=0)
    model, opt = _setup(accel, seed=9)
    accel.load(tmp_path / "step-1", {"model": model, "optimizer": opt})
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


# ---- the writer process ------------------------------------------------------------------------
def _state_and_values(accel):
    model, opt = _setup(accel)
    return {"model": model, "optimizer": opt, "step": 1}, {
        k: v.clone() for k, v in model.state_dict().items()
    }


def test_the_writer_process_writes_what_the_threads_write(tmp_path, monkeypatch):
    """The default writer (a process reading the shared snapshot) and the threads of the
    training process write the same bytes; the profile says which one wrote."""
    from accelkit.checkpoint.profile import last_save

    accel = accelkit.get("cpu", seed=0)
    state, expected = _state_and_values(accel)
    files = {}
    for writer_kind in ("process", "threads", "process"):
        monkeypatch.setenv("ACCELKIT_ASYNC_WRITER", writer_kind)
        path = tmp_path / f"{writer_kind}-{len(files)}"
        accel.save(path, state, asynchronous=True)
        accel.wait_for_save()
        assert last_save().writer == writer_kind
        files[path.name] = (path / "rank-00000.safetensors").read_bytes()
    assert len(set(files.values())) == 1
    fresh = accelkit.get("cpu", seed=0)
    other, other_opt = _setup(fresh, seed=5)
    fresh.load(tmp_path / "process-0", {"model": other, "optimizer": other_opt, "step": 0})
    assert all(torch.equal(v, expected[k]) for k, v in other.state_dict().items())


def test_a_flipped_byte_in_a_file_the_writer_process_wrote_fails_the_load(tmp_path):
    accel = accelkit.get("cpu", seed=0)
    state, _ = _state_and_values(accel)
    accel.save(tmp_path / "a", state, asynchronous=True)
    accel.wait_for_save()
    rank_file = tmp_path / "a" / "rank-00000.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-5] ^= 0x10
    rank_file.write_bytes(bytes(data))
    with pytest.raises(accelkit.CheckpointError, match=r"rank-00000\.safetensors"):
        accel.load(tmp_path / "a", state)


def test_a_writer_process_that_dies_fails_the_save_clearly_and_the_next_save_works(
    tmp_path, monkeypatch
):
    """The writer process exits in the middle of a save (a fake worker that reads the request
    and dies): the next call raises a CheckpointError naming it, nothing is committed, the
    earlier checkpoint stays ``latest``; the save after that starts a new writer and commits."""
    from accelkit.checkpoint.write import write_process

    accel = accelkit.get("cpu", seed=0)
    state, _ = _state_and_values(accel)
    accel.save(tmp_path / "step-1", state, asynchronous=True)
    accel.wait_for_save()
    dying = tmp_path / "dying_worker.py"
    dying.write_text(  # the worker's protocol: length-prefixed JSON frames on the channel
        "import json, os, socket, struct, sys\n"
        "channel = socket.socket(fileno=int(sys.argv[3]))\n"
        "hello = json.dumps({'ready': os.getpid()}).encode()\n"
        "channel.sendall(struct.pack('>I', len(hello)) + hello)\n"
        "channel.recv(1)\n"
        "os._exit(3)\n"
    )
    write_process.close_all()  # the next save starts a writer from the fake script
    monkeypatch.setattr(write_process, "_WORKER", dying)
    accel.save(tmp_path / "step-2", state, asynchronous=True)
    with pytest.raises(accelkit.CheckpointError, match=r"writer process .* exited with status 3"):
        accel.wait_for_save()
    assert not (tmp_path / "step-2").exists()
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    monkeypatch.undo()
    accel.save(tmp_path / "step-3", state, asynchronous=True)
    accel.wait_for_save()
    assert (tmp_path / "latest").read_text().strip() == "step-3"


def test_an_unknown_writer_choice_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    accel = accelkit.get("cpu", seed=0)
    state, _ = _state_and_values(accel)
    monkeypatch.setenv("ACCELKIT_ASYNC_WRITER", "proccess")
    with pytest.raises(accelkit.CheckpointError, match=r"'process' \(the default\) or 'threads'"):
        accel.save(tmp_path / "a", state, asynchronous=True)
    assert not (tmp_path / "a").exists()


def test_a_writer_process_that_cannot_start_leaves_the_writing_to_threads(
    tmp_path, monkeypatch, caplog
):
    from accelkit.checkpoint.profile import last_save
    from accelkit.checkpoint.write import write_process

    accel = accelkit.get("cpu", seed=0)
    state, expected = _state_and_values(accel)
    broken = tmp_path / "broken_worker.py"
    broken.write_text("import sys\nsys.exit('no xxhash here')\n")
    write_process.close_all()
    monkeypatch.setattr(write_process, "_WORKER", broken)
    accel.save(tmp_path / "a", state, asynchronous=True)
    accel.wait_for_save()
    assert last_save().writer == "threads"
    assert "writer process is unavailable" in caplog.text
    fresh = accelkit.get("cpu", seed=0)
    other, other_opt = _setup(fresh, seed=5)
    fresh.load(tmp_path / "a", {"model": other, "optimizer": other_opt, "step": 0})
    assert all(torch.equal(v, expected[k]) for k, v in other.state_dict().items())
