"""``find_executable_batch_size``: after an out-of-memory error the function runs again with a
smaller batch, the failed attempt's objects freed (a DeepSpeed engine destroyed, not leaked);
other errors pass through at once; a batch that never fits ends with a clear error. The OOM is
simulated on the CPU (``torch.OutOfMemoryError``, what the allocator raises)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.memory import is_out_of_memory
from accelkit.testing import run_ranks

HERE = Path(__file__).parent


def test_retries_with_half_the_batch_until_it_fits_and_frees_each_attempt():
    accel = accelkit.get("cpu", seed=0)
    tried, models = [], []

    @accelkit.find_executable_batch_size(starting_batch_size=128, accel=accel)
    def train(batch_size: int, steps: int) -> int:
        tried.append(batch_size)
        net = torch.nn.Linear(4, 4)
        model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        models.append(weakref.ref(net))
        activations = torch.empty(batch_size, 4)  # what a real batch would allocate
        if batch_size > 16:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} MiB")
        for _ in range(steps):
            accel.backward(model(activations.normal_()).square().mean())
            opt.step()
        return batch_size

    assert train(2) == 16
    assert tried == [128, 64, 32, 16]
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

    with pytest.raises(RuntimeError, match="out of memory down to batch size 2"):
        train()


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
    assert result["dead_engines"] == [True, True] and result["last_alive"]
    assert result["loss_finite"]
