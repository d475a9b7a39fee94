"""Workers of tests/test_batch_size_finder.py: DeepSpeed's engine from a failed attempt is
destroyed and collected, not leaked, when find_executable_batch_size retries; on the GPU, the
same against a real CUDA out-of-memory error, with the memory each attempt starts from."""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import torch


def deepspeed_retry(limit: int) -> dict[str, Any]:
    import accelkit

    accel = accelkit.get("deepspeed_stage_2", seed=0)
    engines: list[weakref.ref] = []
    tried: list[int] = []
    dead_at_start: list[list[bool]] = []

    @accelkit.find_executable_batch_size(starting_batch_size=32, accel=accel)
    def train(batch_size: int) -> float:
        tried.append(batch_size)
        # the failed attempts' engines are gone before this one starts (no gc.collect here)
        dead_at_start.append([ref() is None for ref in engines])
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
        "dead_at_start": dead_at_start,
        "dead_engines": [ref() is None for ref in engines[:-1]],
        "last_alive": engines[-1]() is not None,
        "loss_finite": loss == loss,
    }
    accel.end_training()
    return out


# ---- a real CUDA out-of-memory error (the GPU tests) ----------------------------------------------
def _linear_stack(width: int, layers: int) -> torch.nn.Module:
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    return torch.nn.Sequential(*blocks)


def _allocated() -> int:
    return torch.cuda.memory_allocated()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _live_engines() -> int:
    """DeepSpeed engines still in memory, reachable or not yet collected (0 without DeepSpeed)."""
    import sys

    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is None:
        return 0
    return sum(isinstance(o, engine_module.DeepSpeedEngine) for o in gc.get_objects())


def _train(accel: Any, batch_size: int, width: int, layers: int, steps: int) -> float:
    """Steps of AdamW on a Linear/ReLU stack; the batch is made on the device, as a loader's
    pinned copy would be. Every activation is ``batch_size x width`` fp32."""
    net = _linear_stack(width, layers)
    model, opt = accel.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    gen = torch.Generator(accel.device).manual_seed(batch_size)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch_size, width, device=accel.device, generator=gen)
        loss = model(x).square().mean()
        accel.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del x, loss
    return losses[-1]


def real_oom(
    backend: str, starting_batch_size: int, width: int, layers: int, steps: int
) -> dict[str, Any]:
    """``find_executable_batch_size`` against the CUDA allocator itself: the starting batch
    does not fit, the finder halves it until it does. Records per attempt the memory allocated
    at its start (above the baseline), the live DeepSpeed engines then, its seconds, and the first
    line of the error it died of; and the memory after the call and after ``free_memory``.

    The baseline is taken after one small attempt and ``free_memory``: what the first matmuls
    and the first engine allocate for the whole process (cuBLAS workspaces) is in it."""
    import accelkit

    accel = accelkit.get(backend, seed=0)
    torch.cuda.reset_peak_memory_stats()
    before_warm_up = _allocated()
    _train(accel, 8, width, layers, steps=1)  # warm-up, the same code path
    # what does not depend on the batch: weights, gradients, optimizer state, an engine's buffers
    fixed_peak = torch.cuda.max_memory_allocated() - before_warm_up
    accel.free_memory()
    baseline = _allocated()
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    attempts: list[dict[str, Any]] = []
    engines: list[weakref.ref] = []

    @accelkit.find_executable_batch_size(starting_batch_size=starting_batch_size, accel=accel)
    def train(batch_size: int) -> float:
        attempt: dict[str, Any] = {
            "batch_size": batch_size,
            "allocated_at_start": _allocated() - baseline,
            "live_engines_at_start": _live_engines(),
            "dead_engines_at_start": [ref() is None for ref in engines],
        }
        attempts.append(attempt)
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            loss = _train(accel, batch_size, width, layers, steps)
            torch.cuda.synchronize()
        except Exception as err:  # recorded, then left to the finder
            attempt.update(error_type=type(err).__name__, error=_first_line(err))
            raise
        finally:
            attempt["seconds"] = round(time.perf_counter() - start, 3)
            attempt["peak_allocated"] = torch.cuda.max_memory_allocated() - baseline
            engine = getattr(accel.backend, "engine", None)
            if engine is not None:
                engines.append(weakref.ref(engine))
            del engine
        return loss

    start = time.perf_counter()
    loss = train()
    seconds = time.perf_counter() - start
    after_call = _allocated() - baseline
    live_after_call = _live_engines()
    accel.free_memory()
    out = {
        "backend": backend,
        "width": width,
        "layers": layers,
        "param_bytes": sum(p.numel() * 4 for p in _linear_stack(width, layers).parameters()),
        "baseline": baseline,
        "fixed_peak": fixed_peak,
        "free_at_baseline": free_bytes,
        "total": total_bytes,
        "attempts": attempts,
        "loss": loss,
        "seconds": round(seconds, 3),
        "allocated_after_call": after_call,
        "live_engines_after_call": live_after_call,
        "allocated_after_free_memory": _allocated() - baseline,
        "live_engines_after_free_memory": _live_engines(),
        "dead_engines_after_free_memory": [ref() is None for ref in engines],
    }
    accel.end_training()
    return out
