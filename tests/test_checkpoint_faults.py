"""Saves under faults: a dead run's writer never touches a new run's files, every wait of a save
is bounded, a save that fails at exit fails the exit status, the reader keeps no descriptor.

Processes here are stopped (SIGSTOP) and killed on purpose. ``LIVENESS_S`` only keeps a broken
build from hanging the suite; no assertion is about time.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.checkpoint import CheckpointReader
from accelkit.checkpoint.write import write_process
from accelkit.testing import spawn_ranks

HERE = Path(__file__).parent
WORKERS = HERE / "checkpoint_fault_workers.py"
LIVENESS_S = 240


def _run_trainer(mode: str, root: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKERS), mode, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _gone(pid: int) -> bool:
    """The process ended (reaped, or a zombie that nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_for(condition, what: str) -> None:
    import time

    deadline = time.monotonic() + LIVENESS_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: still not so after {LIVENESS_S} s")
        time.sleep(0.05)


def _params_equal(path: Path, value: float) -> bool:
    from accelkit.checkpoint import load

    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    load(None, path, {"model": model}, rng=False)
    return all(torch.all(p == value) for p in model.parameters())


# ---- 1. a dead run's writer never writes into a restarted run's checkpoint -------------------------
@pytest.mark.slow
def test_a_stopped_writer_of_a_killed_run_never_touches_the_restarted_runs_checkpoint(tmp_path):
    """The old writer is stopped with a request in hand, its trainer is killed, the run
    restarts and saves the same step, the old writer is continued: the new checkpoint verifies
    and holds the restarted run's values; the old writer died with its trainer."""
    old = _run_trainer("killed", tmp_path)
    writer_pid = None
    try:
        writer_pid = int(old.stdout.readline())
        os.kill(writer_pid, signal.SIGSTOP)
        old.stdin.write("go\n")
        old.stdin.flush()
        assert old.stdout.readline().strip() == "sent"
        _wait_for(
            lambda: any(tmp_path.glob(".step-4.*.accelkit-tmp/.rank-00000.safetensors.*.part")),
            "request sent",
        )
        old.kill()
        old.wait()
        _wait_for(lambda: _gone(writer_pid), "the old writer died with its trainer")
        restarted = _run_trainer("restarted", tmp_path)
        _, err = restarted.communicate(timeout=LIVENESS_S)
        assert restarted.returncode == 0, err
    finally:
        if writer_pid is not None and not _gone(writer_pid):
            os.kill(writer_pid, signal.SIGCONT)
        if old.poll() is None:
            old.kill()
        _, old_err = old.communicate(timeout=LIVENESS_S)
    assert "Traceback" not in old_err  # the writer left quietly
    with CheckpointReader(tmp_path / "step-4") as reader:
        assert reader.verify_all() == []
    assert _params_equal(tmp_path / "step-4", 4.0)
    assert (tmp_path / "latest").read_text().strip() == "step-4"


def test_ctrl_c_ends_the_trainer_and_its_writer_without_a_word_from_the_writer(tmp_path):
    """Ctrl-C reaches the whole process group: the trainer stops with its KeyboardInterrupt,
    the writer process ends with it and prints nothing."""
    trainer = _run_trainer("interrupted", tmp_path, start_new_session=True)
    try:
        writer_pid = int(trainer.stdout.readline())
        os.killpg(trainer.pid, signal.SIGINT)
        _, err = trainer.communicate(timeout=LIVENESS_S)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert "KeyboardInterrupt" in err  # the trainer's own
    assert "write_worker" not in err, err[-3000:]
    _wait_for(lambda: _gone(writer_pid), "the writer ended")


def test_the_writer_process_writes_only_into_the_file_handed_to_it(tmp_path):
    """A request's file is replaced by another of the same name (a restarted run's) while the
    writer is stopped: once continued, it writes into the file it was handed, and the new one
    keeps its bytes."""
    staging = write_process.SharedStaging(1 << 16)
    try:
        staging.tensor.fill_(7)
        writer = staging.writer()
        to_write = [("x", staging.tensor[: 1 << 16])]
        target = tmp_path / "rank-00000.safetensors"
        os.kill(writer.process.pid, signal.SIGSTOP)
        result: dict = {}

        def write() -> None:
            try:
                result["digests"] = write_process.write_file(
                    target, to_write, staging.spans(to_write), writer, {}, "sha256"
                )
            except BaseException as err:
                result["error"] = err

        thread = threading.Thread(target=write)
        thread.start()
        _wait_for(lambda: target.exists() and target.stat().st_size > 0, "header written")
        target.unlink()
        target.write_bytes(b"the restarted run's file")
        os.kill(writer.process.pid, signal.SIGCONT)
        thread.join(LIVENESS_S)
        assert "error" not in result, result
        assert target.read_bytes() == b"the restarted run's file"
        import hashlib

        assert result["digests"]["x"] == hashlib.sha256(bytes([7]) * (1 << 16)).hexdigest()
    finally:
        staging.release()


# ---- 2. a writer that makes no progress fails the save ---------------------------------------------
def _setup_cpu():
    accel = accelkit.get("cpu", seed=0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model, opt = accel.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    return accel, {"model": model, "optimizer": opt, "step": 1}


def test_a_stopped_writer_fails_the_save_and_commits_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ACCELKIT_WRITER_STALL_WARN_S", "0.5")
    monkeypatch.setenv("ACCELKIT_WRITER_STALL_S", "2")
    accel, state = _setup_cpu()
    logger = logging.getLogger("accelkit")  # it may not propagate to caplog's root handler
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, caplog.handler])
    accel.save(tmp_path / "step-1", state, asynchronous=True)
    accel.wait_for_save()
    (writer,) = write_process._live
    os.kill(writer.process.pid, signal.SIGSTOP)
    try:
        accel.save(tmp_path / "step-2", state, asynchronous=True)
        with pytest.raises(accelkit.CheckpointError, match=r"made no progress .*step-2"):
            accel.wait_for_save()
    finally:
        if not _gone(writer.process.pid):
            os.kill(writer.process.pid, signal.SIGCONT)
    assert "has made no progress" in caplog.text  # the warning came first
    assert _gone(writer.process.pid)  # killed, not left behind
    assert not (tmp_path / "step-2").exists()
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    accel.save(tmp_path / "step-3", state, asynchronous=True)  # a new writer
    accel.wait_for_save()
    assert (tmp_path / "latest").read_text().strip() == "step-3"


def test_a_writer_that_keeps_working_is_not_failed(tmp_path, monkeypatch):
    """The twin: the same short limits, a writer that is not stopped: the save commits."""
    monkeypatch.setenv("ACCELKIT_WRITER_STALL_WARN_S", "0.5")
    monkeypatch.setenv("ACCELKIT_WRITER_STALL_S", "2")
    accel, state = _setup_cpu()
    for step in (1, 2):
        accel.save(tmp_path / f"step-{step}", state, asynchronous=True)
        accel.wait_for_save()
    with CheckpointReader(tmp_path / "step-2") as reader:
        assert reader.verify_all() == []


@pytest.mark.parametrize("name", ["ACCELKIT_WRITER_STALL_S", "ACCELKIT_COMMIT_TIMEOUT_S"])
def test_a_bound_that_is_not_a_positive_number_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.setenv(name, "soon")
    accel, state = _setup_cpu()
    with pytest.raises(accelkit.CheckpointError, match=rf"{name}='soon': give a number"):
        accel.save(tmp_path / "a", state, asynchronous=True)
        accel.wait_for_save()
    assert not (tmp_path / "a").exists()


# ---- 3. a dead peer fails the save in the commit timeout; SIGTERM ends a stuck rank --------------
def _finish(procs: list[subprocess.Popen], first_only: bool = False) -> list[tuple[int, str]]:
    out = []
    try:
        for proc in procs[:1] if first_only else procs:
            try:
                _, stderr = proc.communicate(timeout=LIVENESS_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a rank was still running {LIVENESS_S} s later")
            out.append((proc.returncode, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["accel", "direct"])
def test_a_rank_killed_before_save_is_named_within_the_commit_timeout(tmp_path, how):
    """The training group waits 10 minutes, the commit 5 s: the survivor's save fails naming
    rank 1, long before the group's timeout (which would outlast ``LIVENESS_S``)."""
    env = {"ACCELKIT_COMMIT_TIMEOUT_S": "5"}
    procs = spawn_ranks(
        "checkpoint_fault_workers:rank_dies_before_save",
        {"ckpt": str(tmp_path / "ckpt"), "how": how},
        tmp_path,
        env=env,
        path=[HERE],
    )
    ((code, err),) = _finish(procs, first_only=True)
    assert code != 0
    assert "rank(s) [1] did not reach" in err, err[-3000:]
    assert "within 5 s" in err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["accel", "direct"])
def test_every_rank_saving_with_the_same_commit_timeout_commits(tmp_path, how):
    env = {"ACCELKIT_COMMIT_TIMEOUT_S": "5"}
    procs = spawn_ranks(
        "checkpoint_fault_workers:every_rank_saves",
        {"ckpt": str(tmp_path / "ckpt"), "how": how},
        tmp_path,
        env=env,
        path=[HERE],
    )
    for code, err in _finish(procs):
        assert code == 0, err[-3000:]
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert reader.verify_all() == []


@pytest.mark.slow
def test_sigterm_ends_a_rank_stuck_in_a_collective_within_the_grace_period(tmp_path):
    """Rank 1 is stopped; rank 0 waits in an all-reduce (10 minute group timeout), with the
    stop handlers installed, and gets SIGTERM: it exits with 143 and says why, well before
    the launcher would send SIGKILL."""
    ready = tmp_path / "ready"
    procs = spawn_ranks(
        "checkpoint_fault_workers:rank_stops_in_a_collective",
        {"ready": str(ready)},
        tmp_path,
        env={"ACCELKIT_SIGTERM_GRACE_S": "2"},
        path=[HERE],
    )
    try:
        _wait_for(ready.exists, "rank 0 in the all-reduce")
        procs[0].send_signal(signal.SIGTERM)
        ((code, err),) = _finish(procs, first_only=True)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM came 2 s ago" in err
    assert not (tmp_path / "rank-0.json").exists()  # the all-reduce never completed


# ---- 4. a save that fails at exit fails the exit status --------------------------------------------
@pytest.mark.parametrize("fails", [True, False], ids=["fails", "commits"])
def test_a_save_that_fails_at_exit_makes_the_exit_status_non_zero(tmp_path, fails):
    script = _run_trainer("exit-fails" if fails else "exit-commits", tmp_path)
    out, err = script.communicate(timeout=LIVENESS_S)
    assert "the script ends" in out
    assert "Traceback" not in err  # the writer process leaves quietly too
    if fails:
        assert script.returncode == 1
        lines = [line for line in err.splitlines() if "was not written" in line]
        assert len(lines) == 1, err
        assert f"the checkpoint {tmp_path / 'step-9'} was not written" in lines[0]
        assert "No space left on device" in lines[0]
        assert not (tmp_path / "step-9").exists()
    else:
        assert script.returncode == 0, err
        assert "was not written" not in err
        with CheckpointReader(tmp_path / "step-9") as reader:
            assert reader.verify_all() == []


# ---- 5. the reader closes every descriptor it opens ------------------------------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_verify_all_leaves_no_descriptor_open(tmp_path):
    accel, state = _setup_cpu()
    big = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(24)))  # many fragments
    accel.save(tmp_path / "a", {**state, "big": big})
    reader = CheckpointReader(tmp_path / "a")
    before = _open_fds()
    for _ in range(20):
        assert reader.verify_all() == []
    assert _open_fds() == before
    for _ in range(20):
        with CheckpointReader(tmp_path / "a") as fresh:
            assert fresh.verify_all() == []
    assert _open_fds() == before
    reader.close()


def test_verify_all_still_reports_a_flipped_byte_and_closes_its_files(tmp_path):
    accel, state = _setup_cpu()
    accel.save(tmp_path / "a", state)
    rank_file = tmp_path / "a" / "rank-00000.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-5] ^= 0x10
    rank_file.write_bytes(bytes(data))
    before = _open_fds()
    with CheckpointReader(tmp_path / "a") as reader:
        problems = reader.verify_all()
        assert len(problems) == 1 and "rank-00000.safetensors" in problems[0]
        assert "failed its checksum" in problems[0]
    assert _open_fds() == before
