"""``find_executable_batch_size``: retry a training function with a smaller batch after an
out-of-memory error, freeing what the failed attempt built (as Accelerate's helper does).

The function takes the batch size as its first argument and builds what depends on it (the
loader, and usually the model and optimizer through ``accel.setup``) inside. After an OOM the
Accelerator forgets what it set up and the backend releases what it built for it
(:meth:`~accelkit.accelerator.Accelerator.free_memory`: a DeepSpeed engine is destroyed, not
leaked), then cached memory is freed and the next size is tried.

With several processes, every rank must run out of memory at the same batch size (the usual
case: the same shapes on the same GPUs); a rank that fails alone leaves the others waiting in a
collective until the process group's timeout.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from accelkit.errors import ConfigError

log = logging.getLogger("accelkit")
T = TypeVar("T")

#: what torch's allocators say when they run out (CUDA, the CPU allocator, cuDNN, cuBLAS)
_OOM_MESSAGES = (
    "out of memory",
    "can't allocate memory",
    "cudnn_status_not_supported",  # what cuDNN says when its workspace does not fit
    "cublas_status_alloc_failed",
    "not enough memory",
)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocator running out of memory (not any RuntimeError)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if isinstance(err, RuntimeError) and len(err.args) == 1 and isinstance(err.args[0], str):
        message = err.args[0].lower()
        return any(m in message for m in _OOM_MESSAGES)
    return False


def _first_line(err: BaseException) -> str:
    """The allocator's message without its advice paragraph, for one log line."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def release_memory(accel: Any = None) -> None:
    """Free what an attempt built: the Accelerator's objects (if given), then cached memory."""
    if accel is not None:
        accel.free_memory()
        return
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(
    function: Callable[..., T] | None = None,
    *,
    starting_batch_size: int = 128,
    accel: Any = None,
    min_batch_size: int = 1,
    reduce: Callable[[int], int] = lambda size: size // 2,
) -> Any:
    """Decorate ``function(batch_size, *args, **kwargs)``: call it with ``starting_batch_size``
    and, after each out-of-memory error, free memory and call it again with ``reduce(size)``
    (halving by default) until it returns; below ``min_batch_size`` the last error is raised.
    Pass ``accel`` so each retry starts from a clean Accelerator (``accel.free_memory()``)."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            accel=accel,
            min_batch_size=min_batch_size,
            reduce=reduce,
        )
    if starting_batch_size < min_batch_size or min_batch_size < 1:
        raise ConfigError(
            f"find_executable_batch_size: starting_batch_size={starting_batch_size} must be >= "
            f"min_batch_size={min_batch_size} >= 1"
        )

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> T:
        size = starting_batch_size
        while True:
            try:
                return function(size, *args, **kwargs)
            except Exception as err:
                if not is_out_of_memory(err):
                    raise
                reason = _first_line(err)
            # freed here, not in the except block: while an exception is being handled its
            # traceback keeps the failed attempt's frames (tensors, an engine) alive
            release_memory(accel)
            smaller = reduce(size)
            if smaller < min_batch_size or smaller >= size:
                raise RuntimeError(
                    f"find_executable_batch_size: out of memory down to batch size {size} "
                    f"(min_batch_size={min_batch_size}); the model itself may not fit, or "
                    f"memory is held outside the function. Last error: {reason}"
                )
            log.warning(
                "out of memory at batch size %d (%s); retrying with %d", size, reason, smaller
            )
            size = smaller

    return run
