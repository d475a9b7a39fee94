"""The asynchronous save's staging memory, shared with a writer process that writes it out.

A writer thread inside the training process releases the GIL for each write and checksum, and
must take it back after each; a training step bound by its Python thread (one that launches
many small kernels) waits at every hand-off. So the snapshot's host buffer is an anonymous
shared-memory file (``memfd_create``, not bound by ``/dev/shm``'s size), pinned for the GPU
with ``cudaHostRegister``, and a small process of its own (``write_worker.py``: standard
library and ``xxhash``, started once per buffer) writes, checksums and fsyncs each rank file
from it. The training process writes only the file's header, and waits on a pipe.

``ACCELKIT_ASYNC_WRITER=threads`` keeps the writing in the training process. Where shared
memory or the process is not available (not Linux; the process cannot start), the save uses
the threads, and says so at debug level.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

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


class _Writer:
    """One writer process over one shared buffer; requests go one at a time (one save is in
    flight per process)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        env = dict(os.environ)
        found = importlib.util.find_spec("xxhash")
        if found is not None and found.origin:  # xxhash where this process found it, and no more
            site = str(Path(found.origin).parent.parent)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (site, env.get("PYTHONPATH"))))
        try:
            self.process = subprocess.Popen(
                [sys.executable, str(_WORKER), str(fd), str(nbytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(fd,),
                env=env,
                text=True,
                bufsize=1,
            )
        except OSError as err:
            raise WriterUnavailable(f"cannot start {_WORKER.name}: {err}") from err
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
        return self.process.poll() is None

    def _reply(self, doing: str) -> dict[str, Any]:
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line:
            code = self.process.wait()
            raise CheckpointError(
                f"the checkpoint writer process (pid {self.process.pid}) exited with status "
                f"{code} while {doing}; nothing was committed, earlier checkpoints are intact"
            )
        return json.loads(line)

    def write(
        self, path: Path, items: list[tuple[int, int, int, str]], checksum: str
    ) -> dict[str, Any]:
        request = {"path": str(path), "items": items, "algorithm": checksum}
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise CheckpointError(
                f"the checkpoint writer process (pid {self.process.pid}) is gone ({err}); "
                f"{path} was not written, earlier checkpoints are intact"
            ) from err
        reply = self._reply(f"writing {path}")
        if "error" in reply:
            raise CheckpointError(f"writing {path} in the writer process: {reply['error']}")
        return reply

    def close(self) -> None:
        _live.discard(self)
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()  # the worker's loop ends at end of input
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


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
    """Write a safetensors rank file whose tensors all lie in the shared buffer of ``writer``
    (at ``spans``): the header here, the data by the writer process. Returns key -> digest."""
    from accelkit.checkpoint.safetensors_io import layout
    from accelkit.checkpoint.write_worker import pwrite_all

    prefix, offsets = layout(to_write, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, memoryview(prefix), 0)
    finally:
        os.close(fd)
    items = [
        (len(prefix) + offsets[key], offset, nbytes, key)
        for (key, _), (offset, nbytes) in zip(to_write, spans, strict=True)
    ]
    reply = writer.write(path, items, checksum)
    if profile is not None:
        profile.writer = "process"
        profile.add_work("pwrite", reply["pwrite"])
        profile.add_work("checksum", reply["checksum"])
        profile.phases["fsync"] = profile.phases.get("fsync", 0.0) + reply["fsync"]
    return reply["digests"]


def close_all() -> None:
    """Stop every writer process (at exit, after the save in flight has committed: called by
    :mod:`accelkit.checkpoint.background`'s exit handler, so the order is fixed)."""
    for writer in list(_live):
        writer.close()
