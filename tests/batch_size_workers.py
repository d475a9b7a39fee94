"""Worker of tests/test_batch_size_finder.py: DeepSpeed's engine from a failed attempt is
destroyed and collected, not leaked, when find_executable_batch_size retries."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch


def deepspeed_retry(limit: int) -> dict[str, Any]:
    import accelkit

    accel = accelkit.get("deepspeed_stage_2", seed=0)
    engines: list[weakref.ref] = []
    tried: list[int] = []

    @accelkit.find_executable_batch_size(starting_batch_size=32, accel=accel)
    def train(batch_size: int) -> float:
        tried.append(batch_size)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        engines.append(weakref.ref(accel.backend.engine))
        if batch_size > limit:  # what the allocator raises when the batch does not fit
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated at batch {batch_size})")
        loss = model(torch.randn(batch_size, 8)).square().mean()
        accel.backward(loss)
        opt.step()
        return float(loss)

    loss = train()
    gc.collect()
    out = {
        "tried": tried,
        "dead_engines": [ref() is None for ref in engines[:-1]],
        "last_alive": engines[-1]() is not None,
        "loss_finite": loss == loss,
    }
    accel.end_training()
    return out
