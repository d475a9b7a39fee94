"""A job under ``accelkit run`` that fails prints one traceback, not one per rank, and a save
whose ranks name different directories says so (docs/getting-started.md, "Many processes").

Each test launches a script with ``accelkit run --nproc-per-node 2``, as a user does, and reads
what the job printed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SAVE = """
import sys, tempfile, torch, accelkit
accel = accelkit.get("ddp")
model = accel.setup(torch.nn.Linear(2, 2))
where = sys.argv[1]
path = tempfile.mkdtemp(dir=where) if sys.argv[2] == "per-rank" else where + "/shared"
accel.save(path + "/ck", {"model": model})
accel.print("saved", path)
"""

RAISE = """
import sys, accelkit
accel = accelkit.get("ddp")
if sys.argv[1] == "rank-1" and accel.rank == 1:
    raise ValueError("only rank 1 fails")
if sys.argv[1] == "every-rank":
    raise RuntimeError("every rank fails the same way")
accel.barrier()
"""


def _run(tmp_path: Path, source: str, *args: str, env: dict | None = None):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    command = [sys.executable, "-m", "accelkit.cli", "run", "--nproc-per-node", "2", str(script)]
    environ = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environ.pop(key, None)
    environ.pop("ACCELKIT_EVERY_TRACEBACK", None)
    environ.update(env or {})
    return subprocess.run(
        [*command, *args], env=environ, capture_output=True, text=True, timeout=240, check=False
    )


def test_ranks_saving_to_different_paths_fail_naming_the_paths_once(tmp_path):
    result = _run(tmp_path, SAVE, str(tmp_path), "per-rank")
    assert result.returncode == 1
    err = result.stderr
    assert err.count("Traceback") == 1, err[-4000:]
    assert "the ranks passed different checkpoint paths to save(): rank 0: " in err
    assert "rank 1: " in err and "accel.broadcast(path)" in err
    assert "cannot see" not in err  # not blamed on the filesystem
    made = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(made) == 2 and all(not any(p.iterdir()) for p in made)  # nothing written


def test_ranks_saving_to_one_path_save(tmp_path):
    result = _run(tmp_path, SAVE, str(tmp_path), "shared")
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "shared" / "ck" / "accelkit.json").is_file()


def test_an_error_on_one_rank_prints_that_ranks_traceback_once(tmp_path):
    result = _run(tmp_path, RAISE, "rank-1")
    assert result.returncode == 1
    err = result.stderr
    assert err.count("Traceback") == 1, err[-4000:]
    assert "[rank1]: ValueError: only rank 1 fails" in err


def test_an_error_of_every_rank_prints_one_traceback(tmp_path):
    result = _run(tmp_path, RAISE, "every-rank")
    assert result.returncode == 1
    err = result.stderr
    assert err.count("Traceback") == 1, err[-4000:]
    assert err.count("RuntimeError: every rank fails the same way") == 1


@pytest.mark.slow
@pytest.mark.parametrize("source,args", [(RAISE, ("every-rank",)), (SAVE, ("per-rank",))])
def test_every_traceback_on_request(tmp_path, source, args):
    """The negative twin: with ACCELKIT_EVERY_TRACEBACK=1 each rank prints its own."""
    args = (str(tmp_path), *args) if source is SAVE else args
    result = _run(tmp_path, source, *args, env={"ACCELKIT_EVERY_TRACEBACK": "1"})
    assert result.returncode == 1
    assert result.stderr.count("Traceback") == 2, result.stderr[-4000:]
