"""Processes for tests/test_checkpoint_faults.py: a trainer the test kills, ranks that die or
stop, scripts that end with a save in flight.

Run as ``python checkpoint_fault_workers.py MODE ROOT`` (a single trainer), or named to
:func:`accelkit.testing.spawn_ranks` (``checkpoint_fault_workers:<function>``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

import accelkit


def _model(value: float) -> torch.nn.Module:
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def trainer_killed_mid_save(root: Path) -> None:
    """Save step-2, print the writer process's pid, wait for the test's go (it stops that
    writer), then start saving step-4 into it and wait to be killed."""
    from accelkit.checkpoint.write import write_process

    accel = accelkit.get("cpu", seed=0)
    model = _model(2.0)
    accel.save(root / "step-2", {"model": model, "step": 2}, asynchronous=True)
    accel.wait_for_save()
    (writer,) = write_process._live
    print(writer.process.pid, flush=True)
    sys.stdin.readline()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-4.0)  # what the dead run meant to save at step 4
    accel.save(root / "step-4", {"model": model, "step": 4}, asynchronous=True)
    print("sent", flush=True)
    time.sleep(600)


def trainer_restarted(root: Path) -> None:
    """The restarted run saves step 4 again, with its own values."""
    accel = accelkit.get("cpu", seed=0)
    accel.save(root / "step-4", {"model": _model(4.0), "step": 4}, asynchronous=True)
    accel.end_training()


def interrupted(root: Path) -> None:
    """Save once (the writer process starts), print its pid, wait for Ctrl-C."""
    import signal

    from accelkit.checkpoint.write import write_process

    # Ctrl-C as a trainer in a terminal gets it: a suite started in the background by a script
    # (`cmd &` with no job control) hands its children SIGINT ignored, which Python keeps
    signal.signal(signal.SIGINT, signal.default_int_handler)

    accel = accelkit.get("cpu", seed=0)
    accel.save(root / "step-1", {"model": _model(1.0), "step": 1}, asynchronous=True)
    accel.wait_for_save()
    (writer,) = write_process._live
    print(writer.process.pid, flush=True)
    time.sleep(600)


def ends_with_a_save_in_flight(root: Path, fails: bool) -> None:
    """The script's last call is an asynchronous save; ``fails``: its write fails (a full
    disk). The interpreter exits while it runs."""
    from accelkit.checkpoint.write import writer

    accel = accelkit.get("cpu", seed=0)
    if fails:

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        writer._write_planned = disk_full
    accel.save(root / "step-9", {"model": _model(9.0), "step": 9}, asynchronous=True)
    print("the script ends", flush=True)


# ---- ranks (spawn_ranks) ---------------------------------------------------------------------------
def rank_dies_before_save(ckpt: str, how: str) -> str:
    """Rank 1 is killed before it calls save(); rank 0 saves, through ``accel.save`` or the
    checkpoint package's ``save`` directly. The training group's timeout is 10 minutes."""
    accel = accelkit.get("ddp", timeout=600.0)
    net = _model(1.0)
    model, _ = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accel.barrier()
    if accel.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "accel":
        accel.save(ckpt, {"model": model, "step": 1})
    else:
        from accelkit.checkpoint import save

        save(accel, ckpt, {"model": model, "step": 1})
    return "saved"


def every_rank_saves(ckpt: str, how: str) -> str:
    """The twin: both ranks save, with the same short commit timeout."""
    accel = accelkit.get("ddp", timeout=600.0)
    net = _model(1.0)
    model, _ = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    if how == "accel":
        accel.save(ckpt, {"model": model, "step": 1}, asynchronous=True)
        accel.end_training()
    else:
        from accelkit.checkpoint import save

        save(accel, ckpt, {"model": model, "step": 1})
    return "saved"


def rank_stops_in_a_collective(ready: str) -> str:
    """Rank 1 stops (SIGSTOP) after the barrier; rank 0 installs the stop handlers and enters
    an all-reduce that cannot complete. The test sends rank 0 SIGTERM."""
    accel = accelkit.get("ddp", timeout=600.0)
    accel.stop_on_signals()
    accel.barrier()
    if accel.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return "resumed"
    Path(ready).write_text("in the all-reduce")
    accel.all_reduce(torch.ones(1))
    return "the all-reduce completed"


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    if mode == "killed":
        trainer_killed_mid_save(where)
    elif mode == "restarted":
        trainer_restarted(where)
    elif mode == "interrupted":
        interrupted(where)
    else:
        ends_with_a_save_in_flight(where, fails=mode == "exit-fails")
