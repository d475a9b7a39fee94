"""Where a checkpoint directory's neighbours are concerned: which checkpoint is newest, what
``latest`` may point at, what a killed save leaves behind.

Ordering follows the recorded step, never a clock; ``latest`` and the files a checkpoint names
stay inside its directory; leftovers of killed saves go at the next save, unless a save of this
process still uses them. Each positive test has a negative twin next to it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from accelkit.checkpoint import load, save
from accelkit.checkpoint.store import posix as storage
from accelkit.checkpoint.write import writer as writer_module
from accelkit.errors import CheckpointError
from accelkit.preemption import latest_checkpoint

DAY_NS = 24 * 3600 * 10**9


def _save(path: Path, step: int | None = None, **options) -> Path:
    state = {"model": torch.nn.Linear(2, 2)}
    if step is not None:
        state["step"] = step
    return save(None, path, state, **options)


def _manifest(path: Path) -> dict:
    return json.loads((path / "accelkit.json").read_text())


def _children(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---- ordering: the recorded step, never the clock -----------------------------------------------
def test_a_save_with_the_clock_a_day_ahead_neither_survives_rotation_nor_wins_latest(
    tmp_path, monkeypatch
):
    real_time_ns = writer_module.time.time_ns
    monkeypatch.setattr(writer_module.time, "time_ns", lambda: real_time_ns() + DAY_NS)
    _save(tmp_path / "step-1", step=1, keep_last=2)
    monkeypatch.undo()
    skewed = _manifest(tmp_path / "step-1")["created_unix_ns"]
    for step in (2, 3):
        _save(tmp_path / f"step-{step}", step=step, keep_last=2)
        # the clock says step-1 is the newest: ordering by it would have kept it
        assert _manifest(tmp_path / f"step-{step}")["created_unix_ns"] < skewed
    _save(tmp_path / "step-4", step=4, keep_last=2)
    assert _children(tmp_path) == ["latest", "step-3", "step-4"]
    assert not (tmp_path / "step-1").exists()  # the skewed one did not outlive newer steps

    (tmp_path / "latest").unlink()  # a save killed between its rename and the pointer update
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4"


def test_the_recorded_step_outranks_the_name(tmp_path):
    _save(tmp_path / "ckpt-1", step=20)
    _save(tmp_path / "ckpt-2", step=10)
    (tmp_path / "latest").unlink()
    # the name alone would pick ckpt-2; its step is the lower one
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-1"


def test_without_a_recorded_step_names_sort_naturally(tmp_path):
    for name in ("step-8", "step-10", "step-9"):  # nothing records a step: the names decide
        _save(tmp_path / name, keep_last=2)
        assert _manifest(tmp_path / name)["step"] is None
    # a plain string sort would put step-10 first and delete it
    assert _children(tmp_path) == ["latest", "step-10", "step-9"]
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"


def test_checkpoint_order_ranks_a_recorded_step_above_none(tmp_path):
    _save(tmp_path / "step-99")  # no step recorded
    _save(tmp_path / "step-3", step=3)
    assert storage.recorded_step(tmp_path / "step-99") is None
    assert storage.recorded_step(tmp_path / "step-3") == 3
    assert storage.checkpoint_order(tmp_path / "step-3") > storage.checkpoint_order(
        tmp_path / "step-99"
    )
    assert storage.natural_key("step-9") < storage.natural_key("step-10")
    assert not "step-9" < "step-10"  # what the natural key is there for


# ---- containment: latest and the files a checkpoint names stay inside ---------------------------
@pytest.fixture
def run_dir(tmp_path):
    """``runs/`` with one checkpoint, and a complete checkpoint outside it (a tempting target)."""
    runs = tmp_path / "runs"
    _save(runs / "step-1", step=1)
    _save(tmp_path / "elsewhere" / "step-7", step=7)
    return runs


def test_latest_naming_a_checkpoint_inside_loads(run_dir):
    """Positive twin of the refusals below: a plain name, or a link that stays inside."""
    assert storage.resolve(run_dir) == run_dir / "step-1"
    (run_dir / "alias").symlink_to(run_dir / "step-1")
    (run_dir / "latest").write_text("alias\n")
    assert storage.resolve(run_dir) == run_dir / "alias"
    load(None, run_dir, {"model": torch.nn.Linear(2, 2)})


@pytest.mark.parametrize("pointer", ["../elsewhere/step-7", "ABSOLUTE", "..", "."])
def test_latest_with_a_path_is_refused(run_dir, pointer):
    if pointer == "ABSOLUTE":
        pointer = str(run_dir.parent / "elsewhere" / "step-7")
    (run_dir / "latest").write_text(pointer + "\n")
    with pytest.raises(CheckpointError) as caught:
        storage.resolve(run_dir)
    message = str(caught.value)
    assert str(run_dir / "latest") in message and repr(pointer) in message
    assert "delete it" in message and "one name" in message
    with pytest.raises(CheckpointError, match="not the name of a checkpoint directory"):
        load(None, run_dir, {"model": torch.nn.Linear(2, 2)})


def test_latest_naming_a_link_that_leaves_is_refused(run_dir):
    (run_dir / "step-7").symlink_to(run_dir.parent / "elsewhere" / "step-7")
    (run_dir / "latest").write_text("step-7\n")
    with pytest.raises(CheckpointError, match=r"link that leads outside .*delete it"):
        storage.resolve(run_dir)


def test_latest_that_is_itself_a_link_leaving_is_refused(run_dir):
    outside = run_dir.parent / "pointer"
    outside.write_text("step-1\n")
    (run_dir / "latest").unlink()
    (run_dir / "latest").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"runs/latest is a link that leads outside"):
        storage.resolve(run_dir)


def test_latest_checkpoint_falls_back_inside_when_latest_leads_out(run_dir, caplog):
    (run_dir / "step-7").symlink_to(run_dir.parent / "elsewhere" / "step-7")  # higher step
    (run_dir / "latest").write_text("../elsewhere/step-7\n")
    with caplog.at_level(logging.WARNING, logger="accelkit"):
        found = latest_checkpoint(run_dir)
    assert found == run_dir / "step-1"  # neither the pointer nor the link is followed out
    assert "not the name of a checkpoint directory" in caplog.text
    assert "not a candidate to resume from" in caplog.text


def test_inside_resolves_files_of_the_directory(run_dir):
    checkpoint = run_dir / "step-1"
    rank_file = checkpoint / "rank-00000.safetensors"
    assert storage.inside(checkpoint, "rank-00000.safetensors") == rank_file.resolve()
    assert storage.inside(checkpoint, rank_file) == rank_file.resolve()
    (checkpoint / "rank-00001.safetensors").symlink_to(rank_file)  # a link that stays inside
    assert storage.inside(checkpoint, "rank-00001.safetensors") == rank_file.resolve()


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_inside_refuses_what_leaves_the_directory(run_dir, how):
    checkpoint = run_dir / "step-1"
    outside_file = run_dir.parent / "elsewhere" / "step-7" / "rank-00000.safetensors"
    if how == "dotdot":
        name = "../../elsewhere/step-7/rank-00000.safetensors"
    elif how == "absolute":
        name = str(outside_file)
    else:
        name = "rank-00003.safetensors"
        (checkpoint / name).symlink_to(outside_file)
    with pytest.raises(CheckpointError) as caught:
        storage.inside(checkpoint, name)
    message = str(caught.value)
    assert "leads outside the checkpoint directory" in message
    assert str(outside_file.resolve()) in message and "Put the file itself there" in message


def test_rotation_never_deletes_through_a_link(tmp_path):
    outside = _save(tmp_path / "elsewhere" / "step-0", step=0)
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "step-0").symlink_to(outside)  # same series by name, lowest step
    _save(runs / "step-1", step=1, keep_last=1)
    _save(runs / "step-2", step=2, keep_last=1)
    assert _children(runs) == ["latest", "step-0", "step-2"]  # step-1 rotated, the link not
    assert storage.is_checkpoint(outside) and (outside / "rank-00000.safetensors").is_file()


# ---- leftovers of killed saves ------------------------------------------------------------------
def test_the_next_save_sweeps_what_killed_saves_left(tmp_path):
    _save(tmp_path / "step-1", step=1)
    stale_pointer = tmp_path / ".latest.accelkit-tmp-0badc0de"
    stale_pointer.write_text("step-2\n")  # killed before its rename over latest
    stale_save = tmp_path / ".step-2.accelkit-tmp"
    stale_save.mkdir()
    (stale_save / "rank-00000.safetensors").write_bytes(b"half")
    other_series = tmp_path / ".best.accelkit-tmp"
    other_series.mkdir()
    # without keep_last: the sweep is part of every save
    _save(tmp_path / "step-3", step=3)
    assert not stale_pointer.exists() and not stale_save.exists()
    assert other_series.exists()  # another series' leftovers wait for a save of that series
    _save(tmp_path / "best", step=3)
    assert _children(tmp_path) == ["best", "latest", "step-1", "step-3"]


class _Gate:
    """A stateful object whose ``state_dict`` waits: holds a save open mid-way."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def state_dict(self) -> dict:
        self.entered.set()
        assert self.release.wait(60), "the test never released the save"
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_save_in_progress_in_another_thread_keeps_its_temporary(tmp_path):
    """Negative twin of the sweep: the same kind of directory, still in use, is left alone."""
    gate = _Gate()
    errors: list[BaseException] = []

    def save_step_5() -> None:
        try:
            save(None, tmp_path / "step-5", {"model": torch.nn.Linear(2, 2), "gate": gate})
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    worker = threading.Thread(target=save_step_5)
    worker.start()
    try:
        assert gate.entered.wait(60)
        (temporary,) = tmp_path.glob(".step-5.*.accelkit-tmp")  # the save's own sibling
        assert temporary.is_dir()
        _save(tmp_path / "step-6", step=6, keep_last=3)  # sweeps: must spare step-5's temporary
        assert temporary.is_dir()
    finally:
        gate.release.set()
        worker.join(60)
    assert not errors, errors
    assert storage.is_checkpoint(tmp_path / "step-5")
    assert _children(tmp_path) == ["latest", "step-5", "step-6"]


class _OsHoldingOneThread:
    """``os`` for storage.py, except that ``fsync`` on one thread waits: holds a ``latest``
    update after its temporary file is written and before it is renamed over ``latest``."""

    def __init__(self, held: threading.Thread) -> None:
        self.held = held
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str):
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        if threading.current_thread() is self.held:
            self.entered.set()
            assert self.release.wait(60), "the test never released the pointer update"
        os.fsync(fd)


def test_a_latest_update_in_progress_keeps_its_temporary(tmp_path, monkeypatch):
    _save(tmp_path / "step-1", step=1)
    updater = threading.Thread(target=storage.write_latest, args=(tmp_path / "step-1",))
    held_os = _OsHoldingOneThread(updater)
    monkeypatch.setattr(storage, "os", held_os)
    updater.start()
    try:
        assert held_os.entered.wait(60)
        assert len(list(tmp_path.glob(".latest.accelkit-tmp-*"))) == 1
        _save(tmp_path / "step-2", step=2)
        assert len(list(tmp_path.glob(".latest.accelkit-tmp-*"))) == 1  # spared: in use
    finally:
        held_os.release.set()
        updater.join(60)
    assert list(tmp_path.glob(".latest.accelkit-tmp-*")) == []  # renamed over latest
    assert (tmp_path / "latest").read_text() == "step-1\n"
