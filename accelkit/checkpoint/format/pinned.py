"""Host staging for saves from a GPU, and early writeback.

Copies from a GPU to ordinary (pageable) host memory run at a fraction of the link's speed and
block the calling thread; copies into pinned memory run at full speed and asynchronously. But
pinning memory is slow (the kernel must fault in and lock every page), so pinned memory is
allocated once per process and reused by every later save:

- :func:`device_slots`: a few small pinned slots through which a synchronous save streams each
  GPU tensor to its file, piece by piece, the next piece's copy overlapping this one's write;
- the asynchronous save's snapshot buffer (:mod:`accelkit.checkpoint.write.background`), as large as
  the rank's state.

:func:`start_writeback` hands a written range to the kernel's writeback at once, so the disk
works while the rest of the file is produced, and the final ``fsync`` waits for the tail only
(left alone, Linux starts writing dirty pages only past ``dirty_background_ratio`` of memory,
or after 30 s).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from accelkit.checkpoint.format.fileio import SYNC_FILE_RANGE_WRITE, load_sync_file_range

#: bytes per pinned slot of a synchronous save (two slots per writer thread)
SLOT_BYTES = 8 << 20

_sync_file_range: Any = False  # False: not looked up yet; None: missing or turned off
_lock = threading.Lock()
_slots: _DeviceSlots | None = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the disk now,
    without waiting (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; a no-op where it is missing).
    Durability still comes from the ``fsync`` that follows."""
    global _sync_file_range
    if _sync_file_range is False:
        _sync_file_range = load_sync_file_range()
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


class _DeviceSlots:
    """Pinned host slots shared by a save's writer threads, and one copy stream per device."""

    def __init__(self, count: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.count = count
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True))
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def follow_current_stream(self, device: torch.device) -> None:
        """Copies from ``device`` start after the work queued so far on the calling thread's
        current stream (the optimizer step that produced the state)."""
        self._stream(device).wait_stream(torch.cuda.current_stream(device))

    def acquire(self) -> torch.Tensor:
        return self._free.get()

    def release(self, slot: torch.Tensor) -> None:
        self._free.put(slot)

    def copy(self, source: torch.Tensor, slot: torch.Tensor) -> torch.cuda.Event:
        """Start copying ``source`` (uint8, on a GPU) into ``slot``; the returned event fires
        when the bytes are there."""
        stream = self._stream(source.device)
        with torch.cuda.stream(stream):
            slot[: source.numel()].copy_(source, non_blocking=True)
            source.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def copy_to(self, slot: torch.Tensor, target: torch.Tensor) -> torch.cuda.Event:
        """Start copying ``slot`` (uint8, pinned) into ``target`` (uint8, on a GPU); the event
        fires when the slot may be reused and the bytes are in ``target``."""
        stream = self._stream(target.device)
        with torch.cuda.stream(stream):
            target.copy_(slot, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def copy_many(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        """Start copying each ``(slot part, target)`` pair (uint8; targets on one GPU); the
        event fires when all have landed."""
        stream = self._stream(pieces[0][1].device)
        with torch.cuda.stream(stream):
            for source, target in pieces:
                target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event


def device_slots(workers: int) -> _DeviceSlots:
    """The process's pinned slots, two per writer thread (made on first use, then reused)."""
    global _slots
    with _lock:
        if _slots is None or _slots.count < 2 * workers:
            _slots = _DeviceSlots(2 * workers, SLOT_BYTES)
        return _slots
