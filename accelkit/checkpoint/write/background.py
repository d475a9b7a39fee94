"""Asynchronous saves: the state is snapshotted to host memory, then written and committed by a
background thread while training goes on.

One save is in flight per process. The next save, a load, ``accel.end_training()``, a
preemption stop and interpreter exit wait for it; an error in the background is raised by the
next of those calls (logged at exit), never lost. The commit's collectives (gathering the
ranks' records, agreeing on errors) run on a gloo group of their own, so they never interleave
with the training loop's collectives on the default group.

The snapshot buffer is kept and reused: one per process, as large as the largest rank file
saved so far (pinned when the state is on a GPU, so the device-to-host copies run at full
speed). Pinning takes far longer than copying, so the first save of a GPU state snapshots into
spare device memory instead, where there is room, and the buffer is pinned in the background
after that save is written (:func:`snapshot`). The buffer is shared memory, written out by a
process of its own (:mod:`accelkit.checkpoint.write.write_process`), so the writing never contends
with training for the GIL.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

_lock = threading.Lock()
_pending: _Save | None = None
_buffer: torch.Tensor | None = None
_pinned = False  # whether _buffer is page-locked for the GPU
_shared: Any = None  # the SharedStaging behind _buffer, when a writer process can read it
_grow_to = 0  # bytes of pinned staging the next save wants (set by a device-side snapshot)
_grow_device: torch.device | None = None  # the GPU that snapshot came from


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
    """A gloo group over every rank for the background commit (made once; collective):
    :func:`accelkit.checkpoint.write.agreement.commit_group`."""
    from accelkit.checkpoint.write import agreement as commit

    return commit.commit_group()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _device_has_room(items: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether every GPU holding part of the state has twice that part free (driver-free plus
    the caching allocator's unused blocks): a device-side copy then cannot starve training."""
    need: dict[torch.device, int] = {}
    for _, tensor in items:
        if tensor.device.type == "cuda":
            need[tensor.device] = need.get(tensor.device, 0) + _nbytes(tensor)
    for device, nbytes in need.items():
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if free + cached < 2 * nbytes:
            return False
    return True


def snapshot(tensors: list[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Copies of ``tensors`` that training cannot change, made as fast as the hardware allows:

    - into the process's pinned host buffer, when it is large enough (every save after the
      first): the stall is the device-to-host copy alone;
    - else, for a state on a GPU with room to spare, into device memory (a copy at the
      device's bandwidth); the background thread writes from there, frees it, and then pins
      the host buffer for the next save, so the first save does not stall on pinning;
    - else into the host buffer, (re)allocated now (pinned for device tensors).
    """
    global _grow_to, _grow_device
    from accelkit.checkpoint.format.safetensors_io import LazyTensor

    items = [(k, t.fetch() if isinstance(t, LazyTensor) else t.detach()) for k, t in tensors]
    total = sum(-(-_nbytes(t) // 64) * 64 for _, t in items)  # each copy 64-byte aligned
    device = next((t.device for _, t in items if t.device.type == "cuda"), None)
    on_device = device is not None
    ready = _buffer is not None and _buffer.numel() >= total
    ready = ready and (not on_device or _pinned)
    if on_device and not ready and _device_has_room(items):
        out = [(k, t.clone(memory_format=torch.contiguous_format).reshape(-1)) for k, t in items]
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        _grow_to, _grow_device = max(_grow_to, total), device
        return out
    if not ready:
        _allocate(max(total, 1), pin=device)
    assert _buffer is not None
    out, offset = [], 0
    for key, tensor in items:
        nbytes = _nbytes(tensor)
        host = _buffer[offset : offset + nbytes].view(tensor.dtype)
        host.copy_(tensor.reshape(-1), non_blocking=tensor.device.type == "cuda")
        out.append((key, host))
        offset += -(-nbytes // 64) * 64
    if on_device:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    return out


def _allocate(nbytes: int, pin: torch.device | None) -> None:
    """(Re)allocate the snapshot buffer: shared memory for a writer process where it can be
    had, else process memory; page-locked for the GPU ``pin`` (the state's device, so the
    calling thread touches no other GPU)."""
    global _buffer, _pinned, _shared
    from accelkit.checkpoint.write import write_process

    _buffer, _pinned = None, False  # release the old one before pinning a larger one
    if _shared is not None:
        _shared.release()
        _shared = None
    if write_process.enabled():
        try:
            _shared = write_process.SharedStaging(nbytes, pin_for=pin)
            _buffer, _pinned = _shared.tensor, _shared.pinned
            return
        except Exception as err:  # no shared memory here: the threads write instead
            log.debug("asynchronous saves write from threads (no shared staging: %s)", err)
    if pin is None:
        _buffer = torch.empty(nbytes, dtype=torch.uint8)
    else:
        with torch.cuda.device(pin):
            _buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    _pinned = pin is not None


def shared_staging(to_write: list[tuple[str, Any]]) -> tuple[Any, list[tuple[int, int]]] | None:
    """The shared buffer and each tensor's span in it, when every tensor of ``to_write`` lies
    in the process's shared snapshot buffer (so a writer process can write them); else None."""
    from accelkit.checkpoint.write import write_process

    if _shared is None or not to_write or not write_process.enabled():
        return None
    spans = _shared.spans(to_write)
    return None if spans is None else (_shared, spans)


def grow_staging() -> None:
    """Pin the host buffer a device-side snapshot asked for (in the background thread, after
    that snapshot is written), so the next save copies straight into pinned memory."""
    global _grow_to, _grow_device
    if _grow_to and (_buffer is None or _buffer.numel() < _grow_to or not _pinned):
        _allocate(_grow_to, pin=_grow_device)
    _grow_to, _grow_device = 0, None


def _at_exit() -> None:
    """At interpreter exit (after the save's thread ended): stop the writer process; if the
    last save failed, say which checkpoint was not written and exit with status 1, so a
    scheduler never records a job whose final checkpoint does not exist as a success.

    Python ignores what an exit handler raises, so the status is set by ``os._exit`` after the
    log handlers are flushed; exit handlers registered before this module was imported (it is
    imported with :mod:`accelkit.checkpoint`, at ``accelkit.get``) do not run then."""
    failed = None
    with _lock:
        save = _pending
    try:
        wait()
    except CheckpointError as err:
        failed = err
    if _shared is not None:  # the writer process ends once the last save is written
        from accelkit.checkpoint.write import write_process

        write_process.close_all()
    if failed is None:
        return
    path = save.path if save is not None else "?"
    reason = failed.__cause__ or failed
    cause = f"{type(reason).__name__}: {reason}".splitlines()[0]
    sys.stderr.write(
        f"accelkit: the checkpoint {path} was not written: its asynchronous save failed "
        f"({cause}); exiting with status 1\n"
    )
    logging.shutdown()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


atexit.register(_at_exit)
