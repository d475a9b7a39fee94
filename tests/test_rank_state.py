"""Per-rank backend state (``Backend.rank_state_dict`` / ``load_rank_state_dict``): every rank
saves its own and gets it back at the same world size; at another world size the backend's
``rank_state_on_resize`` refuses (nothing loaded), drops, or hands over every rank's state.
A flipped byte in a rank's state fails the load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rank_state_workers as workers
import torch

import accelkit
from accelkit.testing import run_ranks

HERE = Path(__file__).parent
KW = {"timeout": 300, "path": [HERE]}


def _flip_in_tensor(checkpoint: Path, prefix: str) -> None:
    """Flip one byte inside the first tensor whose key starts with ``prefix``."""
    for shard in sorted(checkpoint.glob("rank-*.safetensors")):
        raw = bytearray(shard.read_bytes())
        size = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + size])
        for key, info in header.items():
            if key.startswith(prefix):
                lo, hi = info["data_offsets"]
                raw[8 + size + (lo + hi) // 2] ^= 0x01
                shard.write_bytes(bytes(raw))
                return
    raise AssertionError(f"no tensor {prefix}* in {checkpoint}")


def test_one_process_gets_back_its_own_state(tmp_path):
    workers.run("counting_cpu", save=str(tmp_path / "ck"))
    manifest = json.loads((tmp_path / "ck" / "accelkit.json").read_text())
    assert set(manifest["rank_state"]) == {"0"}
    out = workers.run("counting_cpu", load=str(tmp_path / "ck"))
    assert out["error"] is None
    assert out["restored"] == {
        "saved_world_size": 1,
        "states": {"0": {"samples": 10, "mark": [0.0, 0.0, 0.0]}},
    }


def test_a_flipped_byte_in_a_rank_state_fails_the_load(tmp_path):
    workers.run("counting_cpu", save=str(tmp_path / "ck"))
    _flip_in_tensor(tmp_path / "ck", "__backend__.0/state/")
    out = workers.run("counting_cpu", load=str(tmp_path / "ck"))
    assert out["error"] is not None and "checksum" in out["error"], out["error"]
    assert out["restored"] is None and out["weights_unchanged"]


def test_a_backend_without_rank_state_writes_no_field(tmp_path):
    accel = accelkit.get("cpu")
    accel.save(tmp_path / "ck", {"step": 1})
    assert "rank_state" not in json.loads((tmp_path / "ck" / "accelkit.json").read_text())


@pytest.fixture(scope="module")
def saved_at_two(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rank-state") / "ck"
    run_ranks("rank_state_workers:run", {"backend": "counting", "save": str(path)}, nproc=2, **KW)
    return path


@pytest.mark.slow
def test_each_of_two_ranks_gets_back_what_it_saved(saved_at_two):
    job = {"backend": "counting", "load": str(saved_at_two)}
    for rank, out in enumerate(run_ranks("rank_state_workers:run", job, nproc=2, **KW)):
        assert out["error"] is None, out["error"]
        mark = [float(rank)] * 3
        assert out["restored"] == {
            "saved_world_size": 2,
            "states": {str(rank): {"samples": 10 * (rank + 1), "mark": mark}},
        }


@pytest.mark.slow
def test_refuse_fails_a_load_at_another_world_size_and_nothing_loads(saved_at_two):
    (out,) = run_ranks(
        "rank_state_workers:run", {"backend": "counting", "load": str(saved_at_two)}, nproc=1, **KW
    )
    assert out["error"] is not None and "resume on 2 processes" in out["error"], out["error"]
    assert out["restored"] is None and out["weights_unchanged"]


@pytest.mark.slow
def test_drop_skips_the_rank_state_and_loads_the_rest(saved_at_two):
    job = {"backend": "counting_drop", "load": str(saved_at_two)}
    (out,) = run_ranks("rank_state_workers:run", job, nproc=1, **KW)
    assert out["error"] is None and out["restored"] is None
    assert not out["weights_unchanged"]  # the model came from the checkpoint


@pytest.mark.slow
def test_merge_hands_every_saved_rank_to_the_backend(saved_at_two):
    job = {"backend": "counting_merge", "load": str(saved_at_two)}
    (out,) = run_ranks("rank_state_workers:run", job, nproc=1, **KW)
    assert out["error"] is None, out["error"]
    assert out["restored"] == {
        "saved_world_size": 2,
        "states": {
            "0": {"samples": 10, "mark": [0.0, 0.0, 0.0]},
            "1": {"samples": 20, "mark": [1.0, 1.0, 1.0]},
        },
    }


def test_a_backend_that_keeps_no_rank_state_continues_the_run(tmp_path):
    workers.run("counting_cpu", save=str(tmp_path / "ck"))  # weights of torch.manual_seed(0)
    torch.manual_seed(0)
    saved = torch.nn.Linear(2, 1)
    accel = accelkit.get("cpu")
    net = torch.nn.Linear(2, 1)
    model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accel.load(tmp_path / "ck", {"model": model, "optimizer": opt})  # the rank state is not cpu's
    assert torch.equal(net.weight, saved.weight)
