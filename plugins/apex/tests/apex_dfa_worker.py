"""One rank of the 2-process ``apex_distributed_adam`` test (fake apex, gloo)::

    python -m torch.distributed.run --nproc-per-node 2 apex_dfa_worker.py OUTDIR

Trains, saves a portable checkpoint to OUTDIR/ck, records each parameter's whole optimizer state
gathered by the fake's own path (``full_state``), loads the checkpoint back into a fresh
accelerator at the same world size, and writes OUTDIR/rank-<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from apex_reference import batches, make_net, param_groups

import accelkit

FAKE = Path(__file__).resolve().parent / "fake_apex"

OPTIONS = dict(bucket_cap_mb=200 / 2**20, max_grad_norm=0.5, accumulation_steps=2)
MICRO = 6


def per_rank_data(world: int):
    data = batches(MICRO * world, seed=3)
    return [data[r::world] for r in range(world)]


def build():
    accel = accelkit.get("apex_distributed_adam", **OPTIONS)
    model = make_net()
    model, opt = accel.setup(model, torch.optim.AdamW(param_groups(model), lr=1e-2))
    return accel, model, opt


def full(model, opt):
    return {
        n: {k: v.reshape(-1).tolist() for k, v in opt.optimizer.full_state(p).items()}
        for n, p in model.named_parameters()
    }


def main() -> None:
    outdir = Path(sys.argv[1])
    sys.path.insert(0, str(FAKE))  # the fake apex, in this worker process only
    from accelkit_apex.distributed_adam import DistributedAdamBackend

    DistributedAdamBackend._pick_device = lambda self: torch.device("cpu")
    accel, model, opt = build()
    rank, world = accel.rank, accel.world_size
    losses, norms = [], []
    for x, y in per_rank_data(world)[rank]:
        with accel.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accel.backward(loss)
            if accel.step():
                norms.append(float(accel.grad_norm))
        losses.append(loss.item())
    state = full(model, opt)
    weights = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    accel.save(outdir / "ck", {"model": model, "optimizer": opt})
    fragments = [
        [list(f.shard_param_range), list(f.shard_range)]
        for p in model.parameters()
        for f in opt.optimizer.state[p]["fragments"]
        if f.in_local_shard
    ]
    events = list(opt.optimizer.events)

    again, model2, opt2 = build()
    again.load(outdir / "ck", {"model": model2, "optimizer": opt2})
    reloaded = full(model2, opt2)
    result = {
        "losses": losses,
        "norms": norms,
        "state": state,
        "weights": weights,
        "reloaded_equal": reloaded == state,
        "fragments": fragments,
        "events": events,
    }
    (outdir / f"rank-{rank}.json").write_text(json.dumps(result))
    time.sleep(
        0.1
    )  # let gloo's threads finish before the interpreter does (see accelkit/testing/_rank.py)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
