"""The training script of tests/test_multinode_jobs.py, launched by ``accelkit run`` as a user's
would be: one agent per "node", on loopback.

Rank 0 appends one JSON line per step to ``LOG/steps.jsonl`` (the attempt, the world size, the
mean loss and the samples of the step) and one ``start`` line per attempt (the step it resumed
from). A checkpoint is saved after every step, so a node lost at any moment costs one step.
With ``--hold-after N``, an attempt that has made N steps waits while ``LOG/hold-<world size>``
exists (the test paces the run with it); the ranks decide together, each poll an all-reduce,
and a stop signal ends the wait with the stop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import accelkit
from accelkit import distributed

SEED = 11
SAMPLES = 48  # an epoch: 6 steps at 2 ranks x batch 4, 12 at one rank, 4 at three


def build(accel, seed: int = SEED):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = accel.setup(model, opt)
    sched = accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 6, generator=g),
        torch.randn(SAMPLES, 1, generator=g),
        torch.arange(SAMPLES),
    )
    loader = accel.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    return model, opt, sched, loader


def _append(log: Path, record: dict) -> None:
    with open(log / "steps.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _held(accel, log: Path) -> bool:
    """Wait while ``hold-<world>`` exists; True if a stop came meanwhile. Every poll is
    collective, so the ranks leave together (one must not step while another waits)."""
    hold = log / f"hold-{accel.world_size}"
    while True:
        if accel.should_stop:
            return True
        flag = torch.tensor([1.0 if hold.exists() else 0.0])
        if accel.all_reduce(flag, "max").item() == 0:
            return False
        time.sleep(0.05)


def _stop(accel, log: Path, attempt: str, step: int) -> int:
    if accel.rank == 0:
        _append(log, {"event": "stop", "attempt": attempt, "step": step})
    accel.end_training()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--stop-at", type=int, default=0, help="save there and end (a plain run)")
    parser.add_argument("--crash", default="", help="RANK:STEP: that rank dies once, there")
    parser.add_argument("--load", default="", help="only load this checkpoint, then end")
    parser.add_argument("--hold-after", type=int, default=0)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    log = Path(args.log)
    accel = accelkit.get("ddp", seed=args.seed, timeout=120.0)
    model, opt, sched, loader = build(accel, args.seed)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader, "step": 0}
    if args.load:
        accel.load(args.load, state)
        return 0
    resumed = accel.auto_resume(args.ckpt, state)
    step = state["step"]
    attempt = distributed.attempt_prefix()
    if accel.rank == 0:
        _append(
            log,
            {
                "event": "start",
                "attempt": attempt,
                "world": accel.world_size,
                "resumed": step if resumed else None,
            },
        )
    crash_rank, _, crash_step = args.crash.partition(":")
    made = 0
    while step < args.steps:
        for x, y, index in loader:
            if args.hold_after and made == args.hold_after and _held(accel, log):
                return _stop(accel, log, attempt, step)
            made += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            accel.backward(loss)
            accel.step()
            step += 1
            state["step"] = step
            mean = accel.all_reduce(loss.detach(), "mean").item()
            samples = accel.gather_for_metrics(index).tolist()
            if accel.rank == 0:
                _append(
                    log,
                    {
                        "event": "step",
                        "attempt": attempt,
                        "world": accel.world_size,
                        "step": step,
                        "loss": mean.hex(),
                        "samples": samples,
                    },
                )
            if (
                args.crash
                and accel.rank == int(crash_rank)
                and step == int(crash_step)
                and not (log / "crashed").exists()
            ):
                (log / "crashed").write_text(str(os.getpid()))
                os._exit(3)  # a worker crash: no save, no exit handlers
            accel.save(Path(args.ckpt, f"step-{step}"), state, keep_last=3)
            if accel.should_stop or step == args.stop_at:
                return _stop(accel, log, attempt, step)
            if step == args.steps:
                break
    if accel.rank == 0:
        _append(log, {"event": "done", "attempt": attempt, "step": step})
    accel.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
