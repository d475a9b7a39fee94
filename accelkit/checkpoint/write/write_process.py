"""The asynchronous save's staging memory, shared with a writer process that writes it out.

A writer thread inside the training process releases the GIL for each write and checksum, and
must take it back after each; a training step bound by its Python thread (one that launches
many small kernels) waits at every hand-off. So the snapshot's host buffer is an anonymous
shared-memory file (``memfd_create``, not bound by ``/dev/shm``'s size), pinned for the GPU
with ``cudaHostRegister``, and a small process of its own (``write_worker.py``: standard
library and ``xxhash``, started once per buffer) writes, checksums and fsyncs each rank file
from it. The training process creates the file, writes its header, hands the open file to the
process, and waits for its answer, never longer than the stall limits (:func:`stall_limits`)
without a sign of progress. The process dies with the training process, and writes only into
the file handed to it (``write_worker.py`` says why).

``ACCELKIT_ASYNC_WRITER=threads`` keeps the writing in the training process. Where shared
memory or the process is not available (not Linux; the process cannot start), the save uses
the threads, and says so at debug level.
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from accelkit.checkpoint.format.fileio import pwrite_all
from accelkit.checkpoint.write.write_worker import recv_frame, send_frame
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

_WORKER = Path(__file__).with_name("write_worker.py")


def enabled() -> bool:
    """Whether asynchronous saves stage into shared memory for a writer process."""
    wanted = os.environ.get("ACCELKIT_ASYNC_WRITER", "process").strip().lower()
    if wanted not in ("process", "threads"):
        raise CheckpointError(
            f"ACCELKIT_ASYNC_WRITER={wanted!r}: choose 'process' (the default) or 'threads'"
        )
    return wanted == "process" and hasattr(os, "memfd_create") and sys.platform == "linux"


class WriterUnavailable(RuntimeError):
    """The writer process could not start: the save falls back to threads."""


class SharedStaging:
    """``nbytes`` of host memory another process can map (a memfd), page-locked for the GPU
    ``pin_for`` when given."""

    def __init__(self, nbytes: int, pin_for: torch.device | None = None) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create("accelkit-staging")
        self.pinned = False
        try:
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            if pin_for is not None:
                self._register(pin_for)
        except BaseException:
            self.release()
            raise
        self._writer: _Writer | None = None

    def _register(self, device: torch.device) -> None:
        """Page-lock the buffer (as a pinned allocation is), so device-to-host copies into it
        run at full speed and asynchronously. Registered under ``device``'s context, so a
        background thread (whose current device is 0) makes no context on another rank's GPU;
        portable, so every context sees it pinned."""
        portable = 1  # cudaHostRegisterPortable
        with torch.cuda.device(device):
            code = int(
                torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, portable)
            )
        if code != 0:
            raise RuntimeError(f"cudaHostRegister failed with CUDA error {code}")
        self.pinned, self._device = True, device

    def writer(self) -> _Writer:
        """This buffer's writer process, started now if it is not running (raises
        :class:`WriterUnavailable` if it cannot start)."""
        if self._writer is None or not self._writer.alive():
            self._writer = None
            self._writer = _Writer(self.fd, self.nbytes)
        return self._writer

    def release(self) -> None:
        """Stop the writer, unpin and free the memory (views still held keep it mapped)."""
        writer, self._writer = getattr(self, "_writer", None), None
        if writer is not None:
            writer.close()
        if self.pinned:
            with torch.cuda.device(self._device):
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        mapping = getattr(self, "_map", None)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # a snapshot view is still alive: the mapping goes with the last one
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def spans(self, to_write: list[tuple[str, torch.Tensor]]) -> list[tuple[int, int]] | None:
        """Each tensor's ``(offset in this buffer, nbytes)``, or None if one lies elsewhere."""
        if self.tensor is None:
            return None
        base = self.tensor.data_ptr()
        out = []
        for _, tensor in to_write:
            nbytes = tensor.numel() * tensor.element_size()
            offset = tensor.data_ptr() - base
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                return None
            if nbytes and (offset < 0 or offset + nbytes > self.nbytes):
                return None
            out.append((max(offset, 0), nbytes))
        return out


def stall_limits() -> tuple[float, float]:
    """Seconds without progress from the writer process before a warning, and before the save
    fails: ``ACCELKIT_WRITER_STALL_WARN_S`` (default 30) and ``ACCELKIT_WRITER_STALL_S``
    (default 300)."""
    warn = _seconds("ACCELKIT_WRITER_STALL_WARN_S", 30.0)
    fail = _seconds("ACCELKIT_WRITER_STALL_S", 300.0)
    return min(warn, fail), fail


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise CheckpointError(f"{name}={raw!r}: give a number of seconds > 0 (default {default:g})")
    return value


_spawner: tuple[threading.Thread, queue.SimpleQueue] | None = None
_spawner_lock = threading.Lock()


def _in_lasting_thread(start: Callable[[], Any]) -> Any:
    """Run ``start`` on a thread that lives as long as the process. The kernel's parent-death
    signal follows the *thread* that started a process (prctl(2)), and a save's own thread
    ends with the save: a writer started there would be killed after its first save."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner[0].is_alive():  # none yet, or this is a fork
            requests: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(
                target=_serve_starts, args=(requests,), name="accelkit-writer-start", daemon=True
            )
            thread.start()
            _spawner = (thread, requests)
        requests = _spawner[1]
    answer: queue.SimpleQueue = queue.SimpleQueue()
    requests.put((start, answer))
    ok, value = answer.get()
    if not ok:
        raise value
    return value


def _serve_starts(requests: queue.SimpleQueue) -> None:
    while True:
        start, answer = requests.get()
        try:
            answer.put((True, start()))
        except BaseException as err:  # handed to the caller
            answer.put((False, err))


class _Writer:
    """One writer process over one shared buffer; requests go one at a time (one save is in
    flight per process). Every wait on it is bounded by :func:`stall_limits`."""

    def __init__(self, fd: int, nbytes: int) -> None:
        env = dict(os.environ)
        found = importlib.util.find_spec("xxhash")
        if found is not None and found.origin:  # xxhash where this process found it, and no more
            site = str(Path(found.origin).parent.parent)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (site, env.get("PYTHONPATH"))))
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [sys.executable, str(_WORKER), str(fd), str(nbytes), str(theirs.fileno())]
        command.append(str(os.getpid()))
        try:
            self.process = _in_lasting_thread(
                lambda: subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, pass_fds=(fd, theirs.fileno()), env=env
                )
            )
        except OSError as err:
            self.channel.close()
            raise WriterUnavailable(f"cannot start {_WORKER.name}: {err}") from err
        finally:
            theirs.close()
        try:
            hello = self._reply("starting")
        except (CheckpointError, ValueError) as err:
            self.close()
            raise WriterUnavailable(str(err)) from err
        if "ready" not in hello:
            self.close()
            raise WriterUnavailable(f"{_WORKER.name} did not start: {hello}")
        _live.add(self)

    def alive(self) -> bool:
        return self.channel.fileno() >= 0 and self.process.poll() is None

    def _reply(self, doing: str) -> dict[str, Any]:
        """The next answer that is not a progress report, waiting at most the stall limit
        since the last sign of progress (a warning at the first limit)."""
        warn_after, fail_after = stall_limits()
        last = time.monotonic()
        warned = False
        while True:
            quiet = time.monotonic() - last
            limit = fail_after if warned else warn_after
            ready, _, _ = select.select([self.channel], [], [], max(0.0, limit - quiet))
            if not ready:
                quiet = time.monotonic() - last
                if quiet >= fail_after:
                    self._stalled(doing, quiet)
                if not warned and quiet >= warn_after:
                    warned = True
                    log.warning(
                        "the checkpoint writer process (pid %d) has made no progress %s for "
                        "%.0f s (a stalled disk?); the save fails if it makes none for %.0f s "
                        "(ACCELKIT_WRITER_STALL_S)",
                        self.process.pid,
                        doing,
                        quiet,
                        fail_after,
                    )
                continue
            try:
                message, _ = recv_frame(self.channel)
            except TimeoutError:  # stopped half-way through a frame
                self._stalled(doing, time.monotonic() - last)
            except (EOFError, OSError) as err:
                try:
                    code: Any = self.process.wait(timeout=fail_after)
                except subprocess.TimeoutExpired:
                    code = "unknown (it closed its end and is still running)"
                raise CheckpointError(
                    f"the checkpoint writer process (pid {self.process.pid}) exited with status "
                    f"{code} while {doing}; nothing was committed, earlier checkpoints are intact"
                ) from err
            if "progress" in message:
                last, warned = time.monotonic(), False
                continue
            return message

    def _stalled(self, doing: str, quiet: float) -> NoReturn:
        """Kill a writer that stopped making progress and fail the save it was writing."""
        pid = self.process.pid
        self.close(kill=True)
        raise CheckpointError(
            f"the checkpoint writer process (pid {pid}) made no progress {doing} for "
            f"{quiet:.0f} s (ACCELKIT_WRITER_STALL_S); it was killed, and nothing was "
            "committed: earlier checkpoints are intact, and the next save starts a new writer"
        )

    def write(
        self, fd: int, name: Path, items: list[tuple[int, int, int, str]], checksum: str
    ) -> dict[str, Any]:
        """Have the process write ``items`` into the open file ``fd`` (``name`` is for the
        messages: the process never opens a path)."""
        request = {"name": str(name), "items": items, "algorithm": checksum}
        self.channel.settimeout(stall_limits()[1])  # a stopped process reads nothing
        try:
            send_frame(self.channel, request, fds=(fd,))
        except TimeoutError:
            self._stalled(f"reading the request for {name}", stall_limits()[1])
        except OSError as err:
            raise CheckpointError(
                f"the checkpoint writer process (pid {self.process.pid}) is gone ({err}); "
                f"{name} was not written, earlier checkpoints are intact"
            ) from err
        reply = self._reply(f"writing {name}")
        if "error" in reply:
            raise CheckpointError(f"writing {name} in the writer process: {reply['error']}")
        return reply

    def close(self, kill: bool = False) -> None:
        """Stop the process: the end of the channel ends its loop (``kill``: at once)."""
        _live.discard(self)
        self.channel.close()
        if kill:
            self.process.kill()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # in the kernel on a dead disk: it dies with us
            self.process.kill()


_live: set[_Writer] = set()


def write_file(
    path: Path,
    to_write: list[tuple[str, torch.Tensor]],
    spans: list[tuple[int, int]],
    writer: _Writer,
    metadata: dict[str, str],
    checksum: str,
    profile: Any = None,
) -> dict[str, str]:
    """Write a new safetensors rank file ``path`` whose tensors all lie in the shared buffer of
    ``writer`` (at ``spans``): this process creates the file and writes the header, and hands
    the open file to the writer process for the data. Returns key -> digest."""
    from accelkit.checkpoint.format.safetensors_io import layout

    prefix, offsets = layout(to_write, metadata)
    items = [
        (len(prefix) + offsets[key], offset, nbytes, key)
        for (key, _), (offset, nbytes) in zip(to_write, spans, strict=True)
    ]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pwrite_all(fd, memoryview(prefix), 0)
        reply = writer.write(fd, path, items, checksum)
    finally:
        os.close(fd)
    if profile is not None:
        profile.writer = "process"
        profile.add_work("pwrite", reply["pwrite"])
        profile.add_work("checksum", reply["checksum"])
        profile.phases["fsync"] = profile.phases.get("fsync", 0.0) + reply["fsync"]
    return reply["digests"]


def close_all() -> None:
    """Stop every writer process (at exit, after the save in flight has committed: called by
    :mod:`accelkit.checkpoint.write.background`'s exit handler, so the order is fixed)."""
    for writer in list(_live):
        writer.close()
