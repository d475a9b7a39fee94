"""Rank workers of tests/test_multinode.py (run by accelkit.testing's run_ranks/spawn_ranks)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import accelkit
from accelkit import distributed, sdk
from accelkit.errors import CheckpointError


def default_checks(root: str) -> dict:
    """The default tier's two-rank checks, in one launch (a launch costs seconds here)."""
    return {"attempts": attempts(), "node_private": node_private(root)}


def attempts() -> dict:
    """Two attempts on one store (as under torchrun's shared store): the second sees none of
    the first's keys, and every rank holds the same id."""
    accel = accelkit.get("ddp", timeout=60.0)
    first = distributed.attempt_prefix()
    distributed.post_abort("the first attempt gave up")
    reporter_first = distributed._reporter(accel.rank, ValueError("boom"))
    distributed.rendezvous("probe")
    stale_abort_before = distributed._posted_abort()
    distributed.barrier()
    second = distributed.begin_attempt(accel.device)
    stale_abort_after = distributed._posted_abort()
    reporter_second = distributed._reporter(accel.rank, ValueError("boom"))
    distributed.barrier()
    return {
        "first": first,
        "second": distributed.attempt_prefix(),
        "second_id": second,
        "stale_abort_before": stale_abort_before,
        "stale_abort_after": stale_abort_after,
        "reporter_first": reporter_first,
        "reporter_second": reporter_second,
        "all_prefixes": distributed.all_gather_object(distributed.attempt_prefix()),
    }


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(3, 2), "step": 0}


def node_private(root: str) -> dict:
    """Each rank works in its own folder (``root/node<rank>``), so a relative path names a
    different directory on each rank: the node-private disks of a real cluster."""
    accel = accelkit.get("ddp", timeout=60.0)
    os.chdir(Path(root, f"node{accel.rank}"))
    out: dict = {}
    for case in ("different", "same", "missing"):
        state = _state(100 + accel.rank)
        model = accel.setup(state["model"])
        state["model"] = model
        try:
            accel.load(case, state)
            out[case] = "loaded"
        except CheckpointError as err:
            out[case] = str(err)
        try:  # a library's own checkpoint (format="native") is checked by its files
            sdk.check_same_files(case, case)
            out[f"files:{case}"] = "same"
        except CheckpointError as err:
            out[f"files:{case}"] = str(err)
    state = _state(0)
    state["model"] = accel.setup(state["model"])
    try:
        accel.auto_resume("runs", state)
        out["auto_resume"] = "fresh"
    except CheckpointError as err:
        out["auto_resume"] = str(err)
    os.chdir(root)  # now every rank sees one folder: the check passes
    out["auto_resume_shared"] = str(accel.auto_resume("shared-runs", state))
    return out


def heartbeat(lost_after: float, slow_s: float) -> dict:
    """Rank 1 works at the 'written' step of a save, beating; rank 0 waits at its roll call.
    ``slow_s`` < 0: rank 1 dies (no exit handlers) after a few beats; else it arrives after
    ``slow_s`` seconds of beating (a slow disk)."""
    from accelkit.checkpoint.write import agreement as commit

    accel = accelkit.get("ddp", timeout=120.0)
    if accel.rank == 1:
        with commit.working("written"):
            time.sleep(abs(slow_s))
            if slow_s < 0:
                os._exit(0)
        commit.roll_call("written", "saving probe")
        return {"arrived": True}
    started = time.monotonic()
    try:
        commit.roll_call("written", "saving probe")
        outcome = "passed"
    except CheckpointError as err:
        outcome = str(err)
    return {"outcome": outcome, "waited": time.monotonic() - started}
