"""A safetensors writer that writes and hashes tensors in parallel, without copying them.

``safetensors.torch.save_file`` first turns every tensor into ``bytes`` (a copy of the whole
state); this writer knows every size up front (fragments are views), writes the header, then
has a thread pool ``pwrite`` each tensor straight from its memory at its offset and hash it
(both release the GIL). Extra host memory is zero for CPU tensors and a few fragments in flight
for device tensors. The output is a plain safetensors file: any safetensors reader opens it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from accelkit.checkpoint.format import pinned as staging
from accelkit.checkpoint.format.digest import digest as digest_of
from accelkit.checkpoint.format.digest import hasher as new_hasher
from accelkit.checkpoint.format.fileio import pwrite_all
from accelkit.checkpoint.format.pinned import start_writeback

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _code

#: the names the manifest uses ("float32", "bfloat16", ...)
DTYPE_NAMES: dict[torch.dtype, str] = {d: str(d).removeprefix("torch.") for d in DTYPE_TO_ST}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}

_HEADER_ALIGN = 8
_MAX_IN_FLIGHT = 4


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def sha256_of(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


class Sink(Protocol):
    """Where :func:`write_file` puts the file's bytes: a local file, or an object that is
    uploaded part by part while the rest is still being written. ``write`` is called from
    several threads at once, each with its own range."""

    #: the name its writes are profiled under ("pwrite", "assemble")
    work: str

    def open(self, total_bytes: int) -> None: ...

    def write(self, view: memoryview, offset: int) -> None: ...

    def finish(self, profile: Any) -> None:
        """Every byte is written: make them durable (fsync, or complete the upload)."""

    def close(self) -> None:
        """Release what ``open`` took; after an error, too (a sink may not be finished)."""


class FileSink:
    """A local file, written by ``pwrite``; each range is handed to the kernel's writeback at
    once, and ``finish`` is the ``fsync`` (``fsync=False``: none, for a scratch file)."""

    work = "pwrite"

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True) -> None:
        self.path, self.fsync, self.fd = path, fsync, -1

    def open(self, total_bytes: int) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, view: memoryview, offset: int) -> None:
        if view.nbytes:
            pwrite_all(self.fd, view, offset)
            start_writeback(self.fd, offset, view.nbytes)

    def finish(self, profile: Any) -> None:
        if self.fsync:
            started = time.perf_counter()
            os.fsync(self.fd)
            if profile is not None:
                spent = time.perf_counter() - started
                profile.phases["fsync"] = profile.phases.get("fsync", 0.0) + spent

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class LazyTensor:
    """A tensor to write that is produced only when its turn comes (a conversion reads its
    source one tensor at a time). ``shape`` and ``dtype`` must be what ``fetch()`` returns."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)


def write_file(
    path: str | os.PathLike | Sink,
    tensors: Sequence[tuple[str, torch.Tensor | LazyTensor]],
    metadata: dict[str, str] | None = None,
    *,
    pool: ThreadPoolExecutor | None = None,
    fsync: bool = True,
    progress: Any = None,
    flat: bool = True,
    checksum: str = "sha256",
    profile: Any = None,
) -> dict[str, str]:
    """Write ``(key, tensor)`` pairs into a safetensors file; return key -> digest (``checksum``
    names the algorithm, see :mod:`accelkit.checkpoint.format.digest`).

    With ``flat`` each tensor is stored 1-D (shape ``[numel]``; the manifest keeps the real
    shapes), else with its own shape. Every tensor's offset is known from the header, so the
    pool's threads write (``pwrite``) and hash the tensors in parallel. A device tensor streams
    through pinned staging slots (:mod:`accelkit.checkpoint.format.pinned`, reused across saves) in
    pieces, each piece's copy overlapping the previous piece's write; a :class:`LazyTensor` is
    fetched one at a time, with at most a few in flight. Each written range is handed to the
    kernel's writeback at once, so the disk works while the rest is produced and the final
    ``fsync`` waits for the tail only. ``path`` may be a :class:`Sink` instead of a file name
    (an object upload: ``fsync`` is then the sink's business). ``progress`` (a tqdm bar) is
    advanced by the bytes written; ``profile`` (a :class:`~accelkit.checkpoint.profile.SaveProfile`) gets the time
    spent per kind of work.
    """
    prefix, offsets = layout(tensors, metadata, flat=flat)
    data_start = len(prefix)
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=2)
    jobs: list[tuple[str, Future, int]] = []
    lazy_in_flight: deque[Future] = deque()
    slots = None
    followed: set[torch.device] = set()
    sink = FileSink(path, fsync=fsync) if isinstance(path, (str, os.PathLike)) else path
    sink.open(data_start + sum(t.numel() * t.dtype.itemsize for _, t in tensors))
    try:
        sink.write(memoryview(prefix), 0)
        for key, item in tensors:
            begin = data_start + offsets[key]
            if isinstance(item, LazyTensor):
                tensor = item.fetch()
                if tuple(tensor.shape) != tuple(item.shape) or tensor.dtype != item.dtype:
                    raise ValueError(
                        f"{key}: fetched {tensor.dtype} {list(tensor.shape)}, "
                        f"announced {item.dtype} {list(item.shape)}"
                    )
            else:
                tensor = item
            tensor = tensor.detach()
            if tensor.device.type == "cuda" and tensor.numel():
                if slots is None:
                    slots = staging.device_slots(pool._max_workers)
                if tensor.device not in followed:  # copies start after the work queued so far
                    slots.follow_current_stream(tensor.device)
                    followed.add(tensor.device)
                future = pool.submit(
                    _stream_device_tensor, sink, tensor, begin, slots, checksum, profile
                )
            else:
                host = _to_host(tensor)
                view = tensor_bytes(host)
                future = pool.submit(_write_and_hash, sink, view, begin, host, checksum, profile)
            nbytes = tensor.numel() * tensor.element_size()
            jobs.append((key, future, nbytes))
            if isinstance(item, LazyTensor):
                lazy_in_flight.append(future)
                while len(lazy_in_flight) > _MAX_IN_FLIGHT:  # bound fetched copies
                    lazy_in_flight.popleft().result()
        digests = {}
        for key, future, nbytes in jobs:
            digests[key] = future.result()
            if progress is not None:
                progress.update(nbytes)
        sink.finish(profile)
        return digests
    finally:
        sink.close()
        if own_pool:
            pool.shutdown(wait=True)


def layout(
    tensors: Sequence[tuple[str, torch.Tensor | LazyTensor]],
    metadata: dict[str, str] | None = None,
    *,
    flat: bool = True,
) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (the header's length, then the header) and each tensor's offset
    from the end of them: the tensors follow one another in the order given."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets: dict[str, int] = {}
    offset = 0
    for key, tensor in tensors:
        if tensor.dtype not in DTYPE_TO_ST:
            raise TypeError(f"{key}: dtype {tensor.dtype} has no safetensors code")
        nbytes = tensor.numel() * torch.empty((), dtype=tensor.dtype).element_size()
        header[key] = {
            "dtype": DTYPE_TO_ST[tensor.dtype],
            "shape": [tensor.numel()] if flat else list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offsets[key] = offset
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-(len(raw) + 8)) % _HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw, offsets


def _write_and_hash(
    sink: Sink,
    view: memoryview,
    offset: int,
    keepalive: torch.Tensor,
    checksum: str,
    profile: Any = None,
) -> str:
    """Runs in a pool thread: both calls release the GIL."""
    started = time.perf_counter()
    sink.write(view, offset)
    written = time.perf_counter()
    digest = digest_of(checksum, view)
    if profile is not None:
        profile.add_work(sink.work, written - started)
        profile.add_work("checksum", time.perf_counter() - written)
    del keepalive  # the host copy lives until its bytes are written and hashed
    return digest


def _stream_device_tensor(
    sink: Sink, tensor: torch.Tensor, offset: int, slots: Any, checksum: str, profile: Any
) -> str:
    """Runs in a pool thread: ``tensor`` (on a GPU) goes to the file piece by piece through two
    pinned slots, the next piece's copy running while this one is written and hashed."""
    hasher = new_hasher(checksum)
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    total = flat.numel()
    step = slots.slot_bytes
    pieces = [(lo, min(total, lo + step)) for lo in range(0, total, step)]
    held: deque[tuple[Any, Any, int, int]] = deque()

    def issue(lo: int, hi: int) -> None:
        started = time.perf_counter()
        slot = slots.acquire()
        event = slots.copy(flat[lo:hi], slot)
        held.append((slot, event, lo, hi))
        if profile is not None:
            profile.add_work("copy", time.perf_counter() - started)

    def drain_one() -> None:
        slot, event, lo, hi = held.popleft()
        started = time.perf_counter()
        event.synchronize()
        copied = time.perf_counter()
        view = tensor_bytes(slot[: hi - lo])
        sink.write(view, offset + lo)
        written = time.perf_counter()
        hasher.update(view)
        slots.release(slot)
        if profile is not None:
            profile.add_work("copy", copied - started)
            profile.add_work(sink.work, written - copied)
            profile.add_work("checksum", time.perf_counter() - written)

    try:
        for lo, hi in pieces:
            issue(lo, hi)
            if len(held) > 1:
                drain_one()
        while held:
            drain_one()
    finally:
        while held:  # an error: give the slots back once their copies are done
            slot, event, _, _ = held.popleft()
            event.synchronize()
            slots.release(slot)
    return hasher.hexdigest()


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the byte offset where the data starts."""
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        if len(size_bytes) != 8:
            raise ValueError("file is shorter than a safetensors header")
        (size,) = struct.unpack("<Q", size_bytes)
        if size > 100_000_000:
            raise ValueError(f"header size {size} is implausible")
        raw = f.read(size)
        if len(raw) != size:
            raise ValueError("header is truncated")
    return json.loads(raw), 8 + size
