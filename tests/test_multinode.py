"""Past one machine: accelkit run's store choice and signal exit, accelkit's store keys per
attempt, every rank reading the same checkpoint, a lost peer named at a save's roll call.

The whole jobs (several ``accelkit run`` agents on loopback, elastic, a node killed and
restarted) are in tests/test_multinode_jobs.py (slow tier).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.cli import run as run_command
from accelkit.testing import run_ranks, spawn_ranks, worker_env


# ---- accelkit run ---------------------------------------------------------------------------
def test_run_gives_each_attempt_its_own_store_unless_the_user_chose():
    env: dict[str, str] = {}
    run_command.choose_store_sharing(False, True, env)
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env = {}
    run_command.choose_store_sharing(False, False, env)  # one attempt: torch's default
    assert env == {}
    env = {}
    run_command.choose_store_sharing(True, True, env)  # --share-rdzv-store: torch's default
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    for chosen in ("0", "1"):  # exported by the user: left as it is, flag or not
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": chosen}
        run_command.choose_store_sharing(True, True, env)
        run_command.choose_store_sharing(False, True, env)
        assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": chosen}


@pytest.mark.parametrize(
    ("flags", "restarts"),
    [
        ([], False),
        (["--max-restarts", "0"], False),
        (["--max-restarts", "3"], True),
        (["--nnodes", "2"], False),
        (["--nnodes", "2:2"], False),
        (["--nnodes", "1:4"], True),
    ],
)
def test_run_knows_a_job_that_can_restart(flags, restarts):
    import argparse

    parser = argparse.ArgumentParser()
    run_command.add_parser(parser)
    assert run_command.can_restart(parser.parse_args([*flags, "train.py"])) is restarts


def test_run_help_says_why_and_names_the_rendezvous_host():
    out = subprocess.run(
        [*ACCELKIT_RUN, "--help"],
        capture_output=True,
        text=True,
        env=worker_env(),
        check=True,
    ).stdout
    flat = " ".join(out.split())
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in flat
    assert "#135712" in flat and "#167288" in flat
    assert "--share-rdzv-store" in flat
    assert "hosts the rendezvous: if it goes, the job goes" in flat
    assert "SIGTERM: 143" in flat


ACCELKIT_RUN = [sys.executable, "-m", "accelkit.cli", "run"]
SLEEPER = """\
import os, pathlib, signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))  # the worker's own Ctrl-C: no traceback
pathlib.Path(sys.argv[1], "ready-" + os.environ["RANK"]).write_text(os.environ.get(
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "unset"))
time.sleep(120)
"""


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_run_ends_on_a_signal_with_one_line_and_the_shells_status(tmp_path, sig, status):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(
        [*ACCELKIT_RUN, "--nproc-per-node", "1", "--max-restarts", "1", str(script), "."],
        cwd=tmp_path,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120  # a safety net under load, not a timed assertion
        while not (tmp_path / "ready-0").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, stderr
    assert f"accelkit run: stopped by {sig.name}; exit status {status}" in stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr
    assert (tmp_path / "ready-0").read_text() == "1"  # the default reached the worker


# ---- two ranks: one launch for the checks below ------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Two ranks, each in a folder of its own for the checkpoint checks: ``different`` holds
    another checkpoint on each "node", ``same`` a copy of one, ``missing`` exists on node 0
    only (a relative path names another folder on each rank: node-private disks)."""
    import shutil

    root = tmp_path_factory.mktemp("nodes")
    accel = accelkit.get("cpu")
    for rank in (0, 1):
        (root / f"node{rank}").mkdir()
        torch.manual_seed(rank)
        model = accel.setup(torch.nn.Linear(3, 2))
        accel.save(root / f"node{rank}" / "different", {"model": model, "step": 7})
    torch.manual_seed(5)
    model = accel.setup(torch.nn.Linear(3, 2))
    accel.save(root / "node0" / "same", {"model": model, "step": 3})
    accel.save(root / "node0" / "missing", {"model": model, "step": 3})
    shutil.copytree(root / "node0" / "same", root / "node1" / "same")
    results = run_ranks("multinode_workers:default_checks", {"root": str(root)})
    return {"results": results, "root": root}


# ---- the store: one namespace per attempt ----------------------------------------------------
def test_accelkit_keys_of_one_attempt_are_invisible_to_the_next(two_ranks):
    results = [r["attempts"] for r in two_ranks["results"]]
    first, second = results
    for result in results:
        assert result["first"] != result["second"]
        assert result["second"] == f"accelkit/{result['second_id']}/"
        assert len(set(result["all_prefixes"])) == 1  # rank 0's id, on every rank
        assert result["stale_abort_before"].endswith("the first attempt gave up")
        assert result["stale_abort_after"] is None  # the new attempt quotes no old reason
    assert first["first"] == second["first"]
    # exactly one rank was the first to fail in each attempt: the counter started over
    assert sorted([first["reporter_first"], second["reporter_first"]]) == [False, True]
    assert sorted([first["reporter_second"], second["reporter_second"]]) == [False, True]


# ---- every rank reads the same checkpoint ------------------------------------------------------
@pytest.fixture(scope="module")
def node_private(two_ranks) -> dict:
    return {"results": [r["node_private"] for r in two_ranks["results"]], "root": two_ranks["root"]}


def test_a_load_refuses_ranks_that_read_different_checkpoints(node_private):
    for result in node_private["results"]:
        message = result["different"]
        assert "rank 1 reads a different checkpoint at this path than rank 0" in message
        assert "node-local disks?" in message and "s3://" in message
    # the negative twin: a copy of one checkpoint on each node loads
    assert [r["same"] for r in node_private["results"]] == ["loaded", "loaded"]


def test_a_native_load_refuses_ranks_that_see_different_files(node_private):
    """``format="native"`` checkpoints have no manifest: the files' names, sizes and times."""
    for result in node_private["results"]:
        message = result["files:different"]
        assert "rank(s) [1] see other files in different than rank 0" in message
        assert "node-local disks?" in message and "Nothing was loaded" in message
        assert "rank(s) [1] see other files" in result["files:missing"]  # none there at all
    # the negative twin: a copy (times kept, as a shared filesystem shows one file) passes
    assert [r["files:same"] for r in node_private["results"]] == ["same", "same"]


def test_a_rank_that_cannot_read_the_checkpoint_is_told_why(node_private):
    rank0, rank1 = (r["missing"] for r in node_private["results"])
    assert "rank 1 cannot read the checkpoint rank 0 reads at this path" in rank0
    assert "node-local disks?" in rank0
    assert "this rank cannot read the checkpoint that rank(s) [0] read" in rank1
    assert "node-local disks?" in rank1


def test_auto_resume_checks_up_front_that_its_directory_is_shared(node_private):
    for result in node_private["results"]:
        assert "rank(s) [1] cannot see the marker rank 0 wrote" in result["auto_resume"]
        assert "Nothing was loaded and nothing trained" in result["auto_resume"]
        assert result["auto_resume_shared"] == "None"  # one shared folder: starts fresh
    root = node_private["root"]
    assert not list(root.glob("**/.accelkit-shared-*"))  # the markers are gone


# ---- a lost peer at a save's roll call ------------------------------------------------------
def _heartbeat_run(tmp_path: Path, slow_s: float) -> dict:
    env = {"ACCELKIT_HEARTBEAT_LOST_S": "3", "ACCELKIT_COMMIT_TIMEOUT_S": "600"}
    procs = spawn_ranks(
        "multinode_workers:heartbeat", {"lost_after": 3, "slow_s": slow_s}, tmp_path, env=env
    )
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 0, outputs[0][1]
    return json.loads((tmp_path / "rank-0.json").read_text())


@pytest.mark.slow
def test_a_peer_whose_heartbeats_stop_fails_the_save_long_before_the_commit_timeout(tmp_path):
    result = _heartbeat_run(tmp_path, slow_s=-2.0)
    assert "rank(s) [1] stopped sending heartbeats at the 'written' step" in result["outcome"]
    assert "ACCELKIT_HEARTBEAT_LOST_S" in result["outcome"]
    assert result["waited"] < 600  # named by its silence, not by ACCELKIT_COMMIT_TIMEOUT_S


@pytest.mark.slow
def test_a_slow_peer_that_keeps_beating_is_waited_for(tmp_path):
    result = _heartbeat_run(tmp_path, slow_s=7.0)  # more than twice the 3 s without beats
    assert result["outcome"] == "passed"
