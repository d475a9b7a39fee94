"""Asynchronous saves: the state is snapshotted to host memory, then written and committed by a
background thread while training goes on.

One save is in flight per process. The next save, a load, ``accel.end_training()``, a
preemption stop and interpreter exit wait for it; an error in the background is raised by the
next of those calls (logged at exit), never lost. The commit's collectives (gathering the
ranks' records, agreeing on errors) run on a gloo group of their own, so they never interleave
with the training loop's collectives on the default group.

The snapshot buffer is kept and reused: one per process, as large as the largest rank file
saved so far (pinned when the state is on a GPU, so the device-to-host copies run at full speed).
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

_lock = threading.Lock()
_pending: _Save | None = None
_group: Any = None
_buffer: torch.Tensor | None = None


class _Save:
    def __init__(self, path: Path, work: Callable[[], Any]) -> None:
        self.path = path
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), name="accelkit-save")
        self.thread.daemon = False  # interpreter exit waits for it (and atexit reports it)
        self.thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            work()
        except BaseException as err:  # kept for the next call to raise
            self.error = err


def start(path: Path, work: Callable[[], Any]) -> None:
    """Run ``work`` (write and commit ``path``) in the background."""
    global _pending
    wait()
    with _lock:
        _pending = _Save(path, work)


def pending() -> Path | None:
    """The checkpoint being written in the background, or None."""
    save = _pending
    return save.path if save is not None and save.thread.is_alive() else None


def wait() -> None:
    """Wait for the save in flight; raise its error if it failed."""
    global _pending
    with _lock:
        save, _pending = _pending, None
    if save is None:
        return
    save.thread.join()
    if save.error is not None:
        raise CheckpointError(
            f"the asynchronous save of {save.path} failed "
            f"({type(save.error).__name__}: {save.error}); that checkpoint was not committed, "
            "earlier ones are intact"
        ) from save.error


def commit_group() -> Any:
    """A gloo group over every rank for the background commit (made once; collective)."""
    global _group
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if _group is None:
        _group = dist.new_group(backend="gloo")
    return _group


def snapshot(tensors: list[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Copies of ``tensors`` in one reused host buffer (pinned for device tensors)."""
    global _buffer
    from accelkit.checkpoint.safetensors_io import LazyTensor

    items = [(k, t.fetch() if isinstance(t, LazyTensor) else t) for k, t in tensors]
    sizes = [t.numel() * t.element_size() for _, t in items]
    total = sum(-(-n // 64) * 64 for n in sizes)  # each copy 64-byte aligned
    on_device = any(t.device.type == "cuda" for _, t in items)
    if _buffer is None or _buffer.numel() < total or (on_device and not _buffer.is_pinned()):
        _buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=on_device)
    out, offset = [], 0
    for (key, tensor), nbytes in zip(items, sizes):
        host = _buffer[offset : offset + nbytes].view(tensor.dtype)
        host.copy_(tensor.detach().reshape(-1), non_blocking=tensor.device.type == "cuda")
        out.append((key, host))
        offset += -(-nbytes // 64) * 64
    if on_device:
        torch.cuda.synchronize()
    return out


def _at_exit() -> None:
    try:
        wait()
    except CheckpointError as err:
        log.error("%s", err)


atexit.register(_at_exit)
