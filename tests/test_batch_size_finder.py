"""``find_executable_batch_size``: after an out-of-memory error the function runs again with a
smaller batch, the failed attempt's objects freed before the next one starts (a DeepSpeed engine
destroyed, not leaked); other errors pass through at once; a batch that never fits ends with a
clear error. On the CPU the OOM is simulated (``torch.OutOfMemoryError``, what the allocator
raises); the ``gpu`` tests run into the CUDA allocator's own, on ``cuda`` and DeepSpeed ZeRO-2::

    ACCELKIT_GPU_REPORT=/some/dir python3 -m pytest -q -m gpu -o addopts="" tests/test_batch_size_finder.py

They append what they measured (batch sizes tried, each OOM's first line, memory at each
attempt's start, seconds) to ``$ACCELKIT_GPU_REPORT/batch-size-finder-gpu.jsonl``."""

from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import accelkit
from accelkit.memory import is_out_of_memory
from accelkit.testing import run_ranks

HERE = Path(__file__).parent


class _Cycle:
    """An object only the cyclic garbage collector frees (as a DeepSpeed engine is)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.me = tensor, self


def test_retries_with_half_the_batch_until_it_fits_and_frees_each_attempt():
    accel = accelkit.get("cpu", seed=0)
    tried, models, cycles, freed_at_start = [], [], [], []

    @accelkit.find_executable_batch_size(starting_batch_size=128, accel=accel)
    def train(batch_size: int, steps: int) -> int:
        tried.append(batch_size)
        freed_at_start.append([ref() is None for ref in models + cycles])
        net = torch.nn.Linear(4, 4)
        model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        models.append(weakref.ref(net))
        activations = torch.empty(batch_size, 4)  # what a real batch would allocate
        cycles.append(weakref.ref(_Cycle(activations)))
        if batch_size > 16:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} MiB")
        for _ in range(steps):
            accel.backward(model(activations.normal_()).square().mean())
            opt.step()
        return batch_size

    assert train(2) == 16
    assert tried == [128, 64, 32, 16]
    # each attempt starts with the earlier ones freed, objects in reference cycles too: the
    # finder frees them after the error's traceback (which holds the attempt's frames) is gone
    assert freed_at_start == [[], [True, True], [True] * 4, [True] * 6]
    gc.collect()
    assert [ref() is None for ref in models] == [True, True, True, False]  # attempts freed
    assert accel.applied_steps == 2  # only the attempt that fit trained


def test_other_errors_pass_through_at_once():
    calls = []

    @accelkit.find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int) -> None:
        calls.append(batch_size)
        raise ValueError("a bug, not a batch size")

    with pytest.raises(ValueError, match="a bug"):
        train()
    assert calls == [8]


def test_a_batch_that_never_fits_ends_with_a_clear_error():
    @accelkit.find_executable_batch_size(starting_batch_size=4, min_batch_size=2)
    def train(batch_size: int) -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(RuntimeError, match="out of memory down to batch size 2") as raised:
        train()
    assert "Last error: CUDA out of memory. Tried to allocate 2.00 GiB" in str(raised.value)


def test_out_of_memory_is_recognised_by_its_message_only_where_it_is_one():
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(
        RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")
    )
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an allocator's error


@pytest.mark.slow
def test_a_deepspeed_engine_of_a_failed_attempt_is_destroyed():
    pytest.importorskip("deepspeed")
    (result,) = run_ranks(
        "batch_size_workers:deepspeed_retry",
        {"limit": 8},
        nproc=1,
        timeout=300,
        path=[HERE],
        env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
    )
    assert result["tried"] == [32, 16, 8]
    assert result["dead_at_start"] == [[], [True], [True, True]]  # destroyed before the retry
    assert result["dead_engines"] == [True, True] and result["last_alive"]
    assert result["loss_finite"]


# ---- a real CUDA out-of-memory error (GPU machine) -----------------------------------------------
#: a Linear(1024, 1024) + ReLU stack of 8 layers (33.6 MB of fp32 weights) trained with AdamW; at
#: the starting batch of 2**24 rows every activation is 64 GiB, so the first forward already runs
#: out of an H200's 140 GB, and the fitting batch (about 2**21) trains in seconds
OOM_WORKLOAD = dict(starting_batch_size=2**24, width=1024, layers=8, steps=2)
#: memory allocated at an attempt's start above the baseline. Not measured on the GPU yet; chosen
#: below what any leak holds: one attempt's weights alone are 33.6 MB, its activations GiBs
LEAK_TOLERANCE = 16 * 2**20
CUDA_ENV = {"DS_ACCELERATOR": "cuda", "PYTHONWARNINGS": "ignore"}


def predicted_batch_size(result: dict[str, Any]) -> int:
    """The largest ``start / 2**k`` whose peak fits in the memory free at the baseline. Per row of
    the batch, backward keeps ``layers + 1`` activations of ``width`` fp32 (the input and each
    ReLU's output) and about 4 more are in flight at the peak (the loss's gradients, a Linear's
    output before its ReLU): 13 for 8 layers, measured on the CPU by tracking every tensor's
    storage through one step. The warm-up's peak (weights, AdamW, an engine's buffers) is fixed."""
    per_row = (result["layers"] + 5) * result["width"] * 4
    fits = (result["free_at_baseline"] - result["fixed_peak"]) // per_row
    size = OOM_WORKLOAD["starting_batch_size"]
    while size > fits:
        size //= 2
    return size


def report(name: str, row: dict[str, Any]) -> None:
    """Append what a GPU test measured to $ACCELKIT_GPU_REPORT/batch-size-finder-gpu.jsonl."""
    folder = os.environ.get("ACCELKIT_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "batch-size-finder-gpu.jsonl", "a") as out:
            out.write(json.dumps({"test": name, **row}, default=str) + "\n")


def run_real_oom(backend: str) -> dict[str, Any]:
    (result,) = run_ranks(
        "batch_size_workers:real_oom",
        {"backend": backend, **OOM_WORKLOAD},
        nproc=1,
        timeout=150,  # about 20 s (cuda) and 35 s (DeepSpeed) expected on an H200
        path=[HERE],
        env=CUDA_ENV,
    )
    return result


def check_real_oom(result: dict[str, Any]) -> list[str]:
    """What every backend must show after a real OOM (a list, so one GPU run reports it all)."""
    problems = []
    attempts = result["attempts"]
    tried = [a["batch_size"] for a in attempts]
    found = tried[-1]
    start = OOM_WORKLOAD["starting_batch_size"]
    if tried != [start // 2**k for k in range(len(tried))] or found >= start:
        problems.append(f"tried {tried}: not halving from {start} down to a smaller size")
    predicted = predicted_batch_size(result)
    if found not in (predicted // 2, predicted, predicted * 2):
        problems.append(f"found batch size {found}, predicted {predicted} (within a factor 2)")
    for failed in attempts[:-1]:
        if not failed.get("error", "").startswith("CUDA out of memory"):
            problems.append(f"batch {failed['batch_size']} failed with {failed.get('error')!r}")
    if "error" in attempts[-1]:
        problems.append(f"the last attempt failed: {attempts[-1]['error']}")
    for attempt in attempts:
        if attempt["allocated_at_start"] > LEAK_TOLERANCE:
            problems.append(
                f"batch {attempt['batch_size']} started with {attempt['allocated_at_start']} bytes "
                "above the baseline: an earlier attempt leaked"
            )
    if result["allocated_after_free_memory"] > LEAK_TOLERANCE:
        problems.append(f"{result['allocated_after_free_memory']} bytes left after free_memory")
    if not result["loss"] < float("inf"):  # also false for nan
        problems.append(f"loss {result['loss']} is not finite")
    return problems


@pytest.mark.gpu
@pytest.mark.slow
def test_a_real_cuda_oom_halves_the_batch_until_it_fits_and_leaks_nothing():
    result = run_real_oom("cuda")
    problems = check_real_oom(result)
    # set up still: the weights and AdamW's two moments of the attempt that fit (no gradients)
    held = 3 * result["param_bytes"]
    if result["allocated_after_call"] > held + LEAK_TOLERANCE:
        problems.append(f"{result['allocated_after_call']} bytes after the call, {held} expected")
    report("cuda", {**result, "predicted": predicted_batch_size(result), "problems": problems})
    assert not problems, problems


@pytest.mark.gpu
@pytest.mark.slow
def test_deepspeed_engines_of_real_oom_attempts_are_destroyed_before_the_retry():
    pytest.importorskip("deepspeed")
    result = run_real_oom("deepspeed_stage_2")
    problems = check_real_oom(result)
    for i, attempt in enumerate(result["attempts"]):
        if attempt["live_engines_at_start"] or attempt["dead_engines_at_start"] != [True] * i:
            problems.append(
                f"batch {attempt['batch_size']} started with {attempt['live_engines_at_start']} "
                f"engines in memory (dead: {attempt['dead_engines_at_start']})"
            )
    if result["live_engines_after_call"] != 1:
        problems.append(f"{result['live_engines_after_call']} engines after the call, not 1")
    if result["live_engines_after_free_memory"] or not all(
        result["dead_engines_after_free_memory"]
    ):
        problems.append("an engine outlived free_memory")
    report(
        "deepspeed_stage_2",
        {**result, "predicted": predicted_batch_size(result), "problems": problems},
    )
    assert not problems, problems


@pytest.mark.gpu
def test_a_model_larger_than_the_gpu_ends_with_the_allocators_error():
    """The negative twin: no batch size helps when the weights alone do not fit."""
    accel = accelkit.get("cuda")
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(accel.device).total_memory
    tried = []

    @accelkit.find_executable_batch_size(starting_batch_size=4, accel=accel)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        rows = total // (4 * 1024) + 1024  # fp32 weights a little larger than the whole GPU
        net = torch.nn.Linear(rows, 1024, bias=False, device=accel.device)
        accel.setup(net, torch.optim.AdamW(net.parameters()))

    with pytest.raises(
        RuntimeError, match=r"down to batch size 1 .*Last error: CUDA out of memory"
    ):
        train()
    assert tried == [4, 2, 1]
    assert torch.cuda.memory_allocated() == before
