"""Reading a portable checkpoint: ranges of any tensor, checked against their checksums.

A rank reads only the ranges it needs, whatever world size or backend wrote them. The rank
files are plain safetensors (any ``safe_open(...).get_slice`` reads them); this reader parses
their headers itself and reads each range with one positional read straight into the
destination tensor, so a load costs no extra host memory where the destination is a CPU
tensor of the stored dtype, and one bounded staging chunk otherwise (a device tensor, a cast,
or a part of a fragment). No ``mmap``: page-cache pages are not pinned into the process.

Checksums: a fragment is verified (SHA-256 of its bytes) the first time any part of it is
read. Read in part, the whole fragment streams through the hash in chunks, checked at once.
Read whole into its destination with ``defer_verify=True`` (what the default loader does), it
is hashed there in a background thread while the next one is read;
:meth:`CheckpointReader.finish` waits for those and raises on a mismatch (``load`` calls it
before returning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accelkit.checkpoint.format import pinned as staging
from accelkit.checkpoint.format.codec import decode
from accelkit.checkpoint.format.digest import digest as digest_of
from accelkit.checkpoint.format.digest import hasher as new_hasher
from accelkit.checkpoint.format.manifest import (
    EXTRA_OBJECT,
    MANIFEST_NAME,
    RNG_OBJECT,
    FragmentRecord,
    Manifest,
    TensorEntry,
    extras_file,
)
from accelkit.checkpoint.format.safetensors_io import (
    DTYPE_TO_ST,
    DTYPES_BY_NAME,
    ST_TO_DTYPE,
    read_header,
    tensor_bytes,
)
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

#: bytes per staged read (device destinations, casts, partial fragments)
CHUNK_BYTES = 64 << 20
#: bytes per read of a checksum-only pass: small enough that the hash finds them in the CPU's
#: cache (64 MB reads ran at a third of the speed of 4 MB reads on a 2-core machine)
VERIFY_CHUNK_BYTES = 4 << 20
#: the GIL's switch interval (s) inside :meth:`CheckpointReader.parallel_reads`
SWITCH_INTERVAL = float(os.environ.get("ACCELKIT_READ_SWITCH_INTERVAL", "0.0002"))
#: reads to a GPU up to this size are batched with their neighbours in the file
SMALL_READ_BYTES = 1 << 20


@dataclass
class _RankFile:
    fd: int
    header: dict[str, Any]
    data_start: int
    size: int


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (positional: threads may share the fd)."""
    done = 0
    total = view.nbytes
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


def _all_there(name: str, offset: int, nbytes: int) -> None:
    """A checkpoint on disk: every byte is there to read."""


def _digest(algorithm: str, view: memoryview) -> str:
    return digest_of(algorithm, view)


class CheckpointReader:
    """Random access to the tensors of one checkpoint (a directory, or one with ``latest``).

    Backends use :meth:`entry` / :meth:`read_flat` in ``load_fragments``; the rest serves the
    default loader and the tools. Call :meth:`finish` (``load`` does) before trusting what was
    read, and :meth:`close` (or use it as a context manager) to release the files.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        strict: bool = True,
        verify: bool = True,
        manifest: Manifest | None = None,
        described_by: str | os.PathLike | None = None,
        ensure: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """``manifest``: read these files as it describes them (pretrained safetensors, which
        have no ``accelkit.json``; ``described_by`` names what the messages cite instead).
        ``ensure(file, offset, nbytes)``: called before each read of a rank file's bytes, to bring
        in those not there yet (:mod:`accelkit.checkpoint.read.ranged_copy`), or raise CheckpointError."""
        from accelkit.checkpoint.store.posix import resolve

        self.directory = resolve(directory) if manifest is None else Path(directory)
        self.strict = strict
        self.verify = verify
        self.ensure = ensure or _all_there
        #: fragments hashed before the validate phase (an object-storage load, as they arrived):
        #: ``() -> (checked (file, key)s, errors)``; ``verify_share`` reads only the others
        self.prechecked: Callable[[], tuple[set[tuple[str, str]], list[CheckpointError]]] | None
        self.prechecked = None
        self.manifest = Manifest.read(self.directory) if manifest is None else manifest
        self.manifest_path = (
            self.directory / MANIFEST_NAME if described_by is None else Path(described_by)
        )
        self._index: dict[tuple[str, str, str], TensorEntry] = {
            (t.object, t.kind, t.fqn): t for t in self.manifest.tensors
        }
        self._by_file: dict[str, list[str]] = {}
        for t in self.manifest.tensors:
            for f in t.fragments:
                self._by_file.setdefault(f.file, []).append(t.label)
        self._files: dict[str, _RankFile] = {}
        self._verified: set[tuple[str, str]] = set()
        self._pending: list[tuple[Future, TensorEntry, FragmentRecord]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._stages: list[torch.Tensor | None] = [None, None]
        self._lane: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._reads: list[Future] | None = None  # inside parallel_reads(): reads in flight
        self._local = threading.local()  # each thread's reusable verification buffer
        self.check_files()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for pool in (self._pool, self._lane):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._lane = None
        self._close_files()

    def __del__(self) -> None:
        try:
            self._close_files()
        except Exception:
            pass

    # ---- integrity ----------------------------------------------------------------------------
    def _holds(self, name: str) -> str:
        tensors = self._by_file.get(name, [])
        if not tensors:
            return ""
        shown = ", ".join(tensors[:3]) + (
            f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
        )
        return f"; it holds tensors {shown}"

    def check_files(self) -> None:
        """Every file the manifest lists exists inside the checkpoint directory with the
        recorded size (a truncated, missing or redirected rank file fails here, before any
        tensor is touched)."""
        root = self.directory.resolve()
        for name, info in self.manifest.files.items():
            path = self.directory / name
            if not path.is_file():
                raise CheckpointError(
                    f"{path}: file missing from the checkpoint{self._holds(name)}"
                )
            if not path.resolve().is_relative_to(root):
                raise CheckpointError(
                    f"{path}: a link to {path.resolve()}, outside the checkpoint directory; "
                    "refusing to read it (copy the file into the checkpoint instead)"
                )
            size = path.stat().st_size
            if "bytes" in info and size != int(info["bytes"]):
                raise CheckpointError(
                    f"{path}: {size} bytes, the manifest says {info['bytes']} (truncated or "
                    f"replaced){self._holds(name)}"
                )

    def check_headers(self) -> None:
        """Every fragment's key, dtype, shape and byte range agree with its file's header."""
        for entry in self.manifest.tensors:
            for frag in entry.fragments:
                self._locate(entry, frag)

    def trust_verified(self) -> None:
        """Read on without hashing: every fragment was verified already (the load's validate
        phase split that over the ranks), or the caller passed ``verify=False``."""
        self.verify = False

    def _file(self, name: str) -> _RankFile:
        rank_file = self._files.get(name)
        if rank_file is not None:
            return rank_file
        with self._open_lock:  # threads verifying one file open it once (no descriptor lost)
            rank_file = self._files.get(name)
            if rank_file is not None:
                return rank_file
            path = self.directory / name
            try:
                header, data_start = read_header(path)
                size = path.stat().st_size
                fd = os.open(path, os.O_RDONLY)
            except (OSError, ValueError, UnicodeDecodeError, TypeError) as err:
                raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from err
            rank_file = _RankFile(fd, header, data_start, size)
            self._files[name] = rank_file
            return rank_file

    def _close_files(self, keep: Collection[str] = ()) -> None:
        """Close the rank files open now, but those named in ``keep`` (they reopen on demand)."""
        with self._open_lock:
            for name in [n for n in self._files if n not in keep]:
                os.close(self._files.pop(name).fd)

    def _locate(
        self, entry: TensorEntry, frag: FragmentRecord
    ) -> tuple[_RankFile, int, torch.dtype]:
        """The file, the byte offset of the fragment's first element, and its stored dtype,
        after checking the file's header agrees with the manifest."""
        path = self.directory / frag.file
        rank_file = self._file(frag.file)
        info = rank_file.header.get(frag.key)
        if not isinstance(info, dict):
            raise CheckpointError(
                f"{path}: key {frag.key} of tensor {entry.label} is not in the file"
            )
        stored = DTYPES_BY_NAME.get(entry.dtype)
        code = info.get("dtype")
        if stored is None or code != DTYPE_TO_ST.get(stored):
            raise CheckpointError(
                f"{path}: key {frag.key} of tensor {entry.label} is {code}, the manifest says "
                f"{entry.dtype}"
            )
        shape = info.get("shape")
        if not isinstance(shape, list) or math.prod(shape) != frag.numel:
            raise CheckpointError(
                f"{path}: key {frag.key} of tensor {entry.label} has shape {info.get('shape')}, "
                f"the manifest says [{frag.numel}]"
            )
        begin, end = info.get("data_offsets", [None, None])
        element = torch.empty((), dtype=ST_TO_DTYPE[code]).element_size()
        if (
            not isinstance(begin, int)
            or end != begin + frag.numel * element
            or rank_file.data_start + end > rank_file.size
        ):
            raise CheckpointError(
                f"{path}: key {frag.key} of tensor {entry.label} has data offsets "
                f"{info.get('data_offsets')} that do not fit {frag.numel} elements in the file"
            )
        return rank_file, rank_file.data_start + begin, stored

    def _checksum_error(
        self, entry: TensorEntry, frag: FragmentRecord, digest: str
    ) -> CheckpointError:
        return CheckpointError(
            f"{self.directory / frag.file}: fragment {frag.key} of tensor {entry.label} "
            f"(flat_offset {frag.flat_offset}, numel {frag.numel}) failed its checksum: "
            f"expected {frag.algorithm} {frag.digest}, got {digest}"
        )

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 2)))
        return self._pool

    @contextmanager
    def parallel_reads(self) -> Iterator[None]:
        """Inside this scope, whole-fragment reads into contiguous destinations that need no
        checksum (the load's validate phase checked them all) run on the reader's threads,
        several at once, and return at once; the scope's end waits for them all and raises the
        first error. Destinations must not be read or written inside the scope (the default
        dense loader only fills them)."""
        outer, self._reads = self._reads, []
        self._followed: set[torch.device] = set()
        self._batch: list[tuple[int, int, torch.Tensor, Path, TensorEntry]] = []
        failed: BaseException | None = None
        # the loop submitting reads holds the GIL most of the time; a reader thread back from a
        # read waits for it up to the switch interval (5 ms) each time, so the reads would drain
        # at the pace of those hand-offs: shorten it while the reads run
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
        try:
            yield
        except BaseException as err:
            failed = err
            raise
        finally:
            self._flush_batch()
            reads, self._reads = self._reads, outer
            sys.setswitchinterval(interval)
            for future in reads:
                try:
                    future.result()
                except BaseException as err:
                    failed = failed or err
            if failed is not None and not isinstance(failed, Exception):
                raise failed
        if failed is not None:
            raise failed

    def finish(self) -> None:
        """Wait for background checksums; raise on the first fragment that failed."""
        pending, self._pending = self._pending, []
        failed = None
        for future, entry, frag in pending:
            digest = future.result()
            if digest != frag.digest and failed is None:
                failed = self._checksum_error(entry, frag, digest)
        if failed is not None:
            raise failed

    def verify_fragment(self, entry: TensorEntry, index: int) -> None:
        """Stream one whole fragment through its checksum (chunked) and check it."""
        frag = entry.fragments[index]
        rank_file, offset, stored = self._locate(entry, frag)
        element = torch.empty((), dtype=stored).element_size()
        hasher = new_hasher(frag.algorithm)
        view = self._thread_buffer(min(VERIFY_CHUNK_BYTES, max(1, frag.numel * element)))
        buffer = view
        remaining, position = frag.numel * element, offset
        try:
            self.ensure(frag.file, offset, remaining)
            while remaining:
                n = min(remaining, len(buffer))
                _pread_into(rank_file.fd, view[:n], position)
                hasher.update(view[:n])
                remaining -= n
                position += n
        except OSError as err:
            raise CheckpointError(
                f"{self.directory / frag.file}: {err} (tensor {entry.label})"
            ) from err
        digest = hasher.hexdigest()
        if digest != frag.digest:
            raise self._checksum_error(entry, frag, digest)
        with self._lock:
            self._verified.add((frag.file, frag.key))

    def fragment_span(self, entry: TensorEntry, index: int) -> tuple[str, int, int]:
        """Where fragment ``index`` of ``entry`` lies: its file, byte offset and length."""
        frag = entry.fragments[index]
        _, offset, stored = self._locate(entry, frag)
        return frag.file, offset, frag.numel * stored.itemsize

    def verify_run(self, run: list[tuple[str, int, int, TensorEntry, int]]) -> None:
        """Check fragments that lie back to back in one file with one read: small fragments
        cost a slice and a hash each, not a read and a buffer each. ``run`` holds
        :meth:`fragment_span`'s ``(file, offset, nbytes)`` with each ``(entry, index)``."""
        name, begin = run[0][0], run[0][1]
        end = run[-1][1] + run[-1][2]
        view = self._thread_buffer(end - begin)[: end - begin]
        path = self.directory / name
        try:
            self.ensure(name, begin, end - begin)
            _pread_into(self._file(name).fd, view, begin)
        except OSError as err:
            raise CheckpointError(f"{path}: {err} (fragments of {run[0][3].label})") from err
        failed = None
        for _, offset, nbytes, entry, i in run:
            frag = entry.fragments[i]
            digest = _digest(frag.algorithm, view[offset - begin : offset - begin + nbytes])
            if digest != frag.digest:
                failed = failed or self._checksum_error(entry, frag, digest)
                continue
            with self._lock:
                self._verified.add((frag.file, frag.key))
        if failed is not None:
            raise failed

    def _thread_buffer(self, nbytes: int) -> memoryview:
        """This thread's reusable read buffer, at least ``nbytes`` (a fresh zeroed buffer per
        fragment would cost more than the read)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._local.buffer = bytearray(max(nbytes, VERIFY_CHUNK_BYTES))
        return memoryview(buffer)

    # ---- lookup -------------------------------------------------------------------------------
    def entry(self, obj: str, kind: str, fqn: str) -> TensorEntry | None:
        return self._index.get((obj, kind, fqn))

    def entries(self, obj: str | None = None) -> list[TensorEntry]:
        return [t for t in self.manifest.tensors if obj is None or t.object == obj]

    def module_entries(self, obj: str) -> dict[str, TensorEntry]:
        """fqn -> entry of the parameters and buffers of module object ``obj``."""
        return {
            t.fqn: t
            for t in self.manifest.tensors
            if t.object == obj and t.kind in ("param", "buffer")
        }

    def optimizer_entries(self, obj: str) -> dict[str, dict[str, TensorEntry]]:
        """parameter name -> state key -> entry, for optimizer object ``obj``."""
        out: dict[str, dict[str, TensorEntry]] = {}
        for t in self.manifest.tensors:
            if t.object == obj and t.kind.startswith("optim:"):
                out.setdefault(t.fqn, {})[t.kind.removeprefix("optim:")] = t
        return out

    def object_info(self, obj: str, expected_type: str | None = None) -> dict[str, Any]:
        info = self.manifest.objects.get(obj)
        if info is None:
            raise CheckpointError(f"{self.manifest_path}: no object {obj!r} in this checkpoint")
        if expected_type is not None and info.get("type") != expected_type:
            raise CheckpointError(
                f"{self.manifest_path}: object {obj!r} is a {info.get('type')}, not a {expected_type}"
            )
        return info

    def check_keys(
        self, what: str, missing: list[str], unexpected: list[str], extra: str | None = None
    ) -> None:
        """Fail (strict) or warn about keys that do not match, listing them all."""
        if not missing and not unexpected and not extra:
            return
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the target: {', '.join(unexpected)}")
        if extra:
            parts.append(extra)
        message = f"{what} does not match {self.directory}: " + "; ".join(parts)
        if self.strict:
            raise CheckpointError(message + " (pass strict=False to load what matches)")
        log.warning(message)

    # ---- reading ------------------------------------------------------------------------------
    def read_flat(
        self,
        entry: TensorEntry,
        start: int = 0,
        numel: int | None = None,
        *,
        out: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        defer_verify: bool = False,
    ) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor, as a 1-D tensor.

        Written into ``out`` (1-D, any device and dtype: cast on copy) when given. Checksums
        are verified before this returns, unless ``defer_verify``: then a fragment read whole
        straight into ``out`` is hashed there in a background thread while the caller reads
        on, and :meth:`finish` (which ``load`` calls) raises if it failed; inside
        :meth:`parallel_reads`, a deferred read itself may land only when that scope ends.
        Do not read or modify ``out`` before then when deferring.
        """
        numel = entry.numel - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > entry.numel:
            raise CheckpointError(
                f"tensor {entry.label}: range [{start}, {start + numel}) is outside its "
                f"{entry.numel} elements"
            )
        stored = DTYPES_BY_NAME.get(entry.dtype)
        if stored is None:
            raise CheckpointError(f"tensor {entry.label}: unknown dtype {entry.dtype!r}")
        if out is None:
            out = torch.empty(numel, dtype=dtype or stored)
        elif out.numel() != numel or out.dim() != 1:
            raise ValueError(f"out must be 1-D with {numel} elements")
        end = start + numel
        for i, frag in enumerate(entry.fragments):
            lo, hi = max(start, frag.flat_offset), min(end, frag.flat_offset + frag.numel)
            if lo < hi:
                self._read_fragment(
                    entry,
                    i,
                    lo - frag.flat_offset,
                    hi - frag.flat_offset,
                    out[lo - start : hi - start],
                    deferred=defer_verify,
                )
        if not defer_verify:
            self.finish()
        return out

    def _read_fragment(
        self,
        entry: TensorEntry,
        index: int,
        a: int,
        b: int,
        dst: torch.Tensor,
        *,
        deferred: bool = False,
    ) -> None:
        """Elements ``[a, b)`` of fragment ``index`` into ``dst``; with ``deferred`` (the
        caller reads ``dst`` only after :meth:`parallel_reads` ends) the read may run on a
        reader thread."""
        frag = entry.fragments[index]
        rank_file, offset, stored = self._locate(entry, frag)
        element = torch.empty((), dtype=stored).element_size()
        verify = self.verify and (frag.file, frag.key) not in self._verified
        whole = a == 0 and b == frag.numel
        direct = dst.device.type == "cpu" and dst.dtype == stored and dst.is_contiguous()
        path = self.directory / frag.file
        if deferred and self._reads is not None and not verify and dst.is_contiguous():
            to_gpu = dst.device.type == "cuda" and dst.dtype == stored
            if direct or to_gpu:
                if to_gpu and dst.device not in self._followed:
                    # the copies start after the work already queued on this thread's stream
                    slots = staging.device_slots(self._workers()._max_workers)
                    slots.follow_current_stream(dst.device)
                    self._followed.add(dst.device)
                start = offset + a * element
                nbytes = dst.numel() * element
                if to_gpu and nbytes <= min(SMALL_READ_BYTES, staging.SLOT_BYTES):
                    self._batch_small(rank_file.fd, start, dst, path, entry)
                    return
                self._reads.append(
                    self._workers().submit(self._read_task, path, rank_file.fd, start, dst, entry)
                )
                return
        try:
            lo, hi = (0, frag.numel) if verify and not (direct and whole) else (a, b)
            self.ensure(frag.file, offset + lo * element, (hi - lo) * element)
            if direct and (whole or not verify):
                view = tensor_bytes(dst)
                _pread_into(rank_file.fd, view, offset + a * element)
                if verify:
                    self._verified.add((frag.file, frag.key))
                    self._pending.append(
                        (self._workers().submit(_digest, frag.algorithm, view), entry, frag)
                    )
                return
            lo, hi = (0, frag.numel) if verify else (a, b)
            digest = self._staged(
                rank_file.fd, offset, element, stored, lo, hi, a, b, dst, verify and frag.algorithm
            )
        except OSError as err:
            raise CheckpointError(f"{path}: {err} (tensor {entry.label})") from err
        if digest is not None:
            if digest != frag.digest:
                raise self._checksum_error(entry, frag, digest)
            self._verified.add((frag.file, frag.key))

    def _batch_small(
        self, fd: int, offset: int, dst: torch.Tensor, path: Path, entry: TensorEntry
    ) -> None:
        """Collect small reads to a GPU that lie back to back in one file: one read and one
        slot for the lot, one copy each (a slot, a read and an event per fragment of a few
        bytes, such as an optimizer's step, would cost more than the bytes)."""
        batch = self._batch
        nbytes = dst.numel() * dst.element_size()
        if batch:
            last_fd, last_offset, last, _, _ = batch[-1]
            end = last_offset + last.numel() * last.element_size()
            size = end - batch[0][1] + nbytes
            if (
                last_fd != fd
                or end != offset
                or size > staging.SLOT_BYTES
                or last.device != dst.device
            ):
                self._flush_batch()
        self._batch.append((fd, offset, dst, path, entry))

    def _flush_batch(self) -> None:
        batch, self._batch = getattr(self, "_batch", []), []
        if batch and self._reads is not None:
            self._reads.append(self._workers().submit(self._read_batch_task, batch))

    def _read_batch_task(
        self, batch: list[tuple[int, int, torch.Tensor, Path, TensorEntry]]
    ) -> None:
        fd, begin = batch[0][0], batch[0][1]
        last = batch[-1]
        end = last[1] + last[2].numel() * last[2].element_size()
        slots = staging.device_slots(self._workers()._max_workers)
        slot = slots.acquire()
        try:
            try:
                self.ensure(last[3].name, begin, end - begin)
                _pread_into(fd, tensor_bytes(slot[: end - begin]), begin)
            except OSError as err:
                raise CheckpointError(f"{last[3]}: {err} (tensor {batch[0][4].label})") from err
            pieces = []
            for _, offset, dst, _, _ in batch:
                n = dst.numel() * dst.element_size()
                pieces.append(
                    (slot[offset - begin : offset - begin + n], dst.view(-1).view(torch.uint8))
                )
            slots.copy_many(pieces).synchronize()
        finally:
            slots.release(slot)

    def _read_task(
        self, path: Path, fd: int, offset: int, dst: torch.Tensor, entry: TensorEntry
    ) -> None:
        """One read of :meth:`parallel_reads`, on a reader thread: straight into a CPU
        destination, or through pinned slots into a GPU one (each slot's copy overlapping the
        next slot's read)."""
        try:
            self.ensure(path.name, offset, dst.numel() * dst.element_size())
            if dst.device.type == "cpu":
                _pread_into(fd, tensor_bytes(dst), offset)
                return
            slots = staging.device_slots(self._workers()._max_workers)
            flat = dst.view(-1).view(torch.uint8)
            step = slots.slot_bytes
            held: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
            try:
                for lo in range(0, flat.numel(), step):
                    hi = min(flat.numel(), lo + step)
                    if len(held) > 1:
                        slot, event = held.popleft()
                        event.synchronize()
                        slots.release(slot)
                    slot = slots.acquire()
                    _pread_into(fd, tensor_bytes(slot[: hi - lo]), offset + lo)
                    held.append((slot, slots.copy_to(slot[: hi - lo], flat[lo:hi])))
            finally:
                while held:
                    slot, event = held.popleft()
                    event.synchronize()
                    slots.release(slot)
        except OSError as err:
            raise CheckpointError(f"{path}: {err} (tensor {entry.label})") from err

    def _staged(
        self,
        fd: int,
        offset: int,
        element: int,
        stored: torch.dtype,
        lo: int,
        hi: int,
        a: int,
        b: int,
        dst: torch.Tensor,
        verify: str | bool,
    ) -> str | None:
        """Stream elements ``[lo, hi)`` through two alternating host buffers: while one is
        copied to ``dst`` (asynchronously, for a GPU) and hashed (in order, on one thread),
        the next chunk is read into the other. Elements ``[a, b)`` land in ``dst``."""
        hasher = new_hasher(verify) if verify else None
        on_gpu = dst.device.type == "cuda"
        step = max(1, CHUNK_BYTES // element)
        copies: list[Any] = [None, None]
        hashes: list[Future | None] = [None, None]
        position, turn = lo, 0
        while position < hi:
            stop = min(hi, position + step)
            if copies[turn] is not None:
                copies[turn].synchronize()
            if hashes[turn] is not None:
                hashes[turn].result()
            buffer = self._staging(turn, stop - position, stored, pinned=on_gpu)
            _pread_into(fd, tensor_bytes(buffer), offset + position * element)
            if hasher is not None:
                hashes[turn] = self._hash_lane().submit(hasher.update, tensor_bytes(buffer))
            s, e = max(position, a), min(stop, b)
            if s < e:
                dst[s - a : e - a].copy_(buffer[s - position : e - position], non_blocking=on_gpu)
                if on_gpu:
                    copies[turn] = torch.cuda.Event()
                    copies[turn].record()
            position, turn = stop, 1 - turn
        for pending in (*copies, *hashes):
            if isinstance(pending, Future):
                pending.result()
            elif pending is not None:
                pending.synchronize()
        return hasher.hexdigest() if hasher is not None else None

    def _hash_lane(self) -> ThreadPoolExecutor:
        """One thread: the chunks of a fragment are hashed in the order they were read."""
        if self._lane is None:
            self._lane = ThreadPoolExecutor(max_workers=1)
        return self._lane

    def _staging(self, turn: int, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """Host buffer ``turn`` (of two), at least ``numel`` elements (pinned to feed a GPU)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        stage = self._stages[turn]
        if stage is None or stage.numel() < nbytes or (pinned and not stage.is_pinned()):
            size = max(nbytes, min(CHUNK_BYTES, 1 << 20))
            stage = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self._stages[turn] = stage
        return stage[:nbytes].view(dtype)

    def read(self, entry: TensorEntry, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor in its global shape, its checksums verified before it returns."""
        return self.read_flat(entry, dtype=dtype).view(entry.shape)

    def read_named(self, obj: str, kind: str, fqn: str) -> torch.Tensor:
        entry = self.entry(obj, kind, fqn)
        if entry is None:
            raise CheckpointError(f"{self.manifest_path}: no tensor {obj}:{kind}:{fqn}")
        return self.read(entry)

    def tensor_source(self, obj: str, kind: str):
        """A decoder callback for tensors referenced from JSON state (extras, statefuls)."""
        return lambda path: self.read_named(obj, kind, path)

    def extras(self) -> dict[str, Any]:
        """The user's extras from ``extra.json`` (tensors read from the rank files)."""
        name = extras_file(self.manifest.files)
        if name is None:
            return {}
        path, info = self.directory / name, self.manifest.files[name]
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise CheckpointError(f"{path}: {err}") from err
        digest = hashlib.sha256(raw).hexdigest()
        if digest != info.get("sha256"):
            raise CheckpointError(
                f"{path}: checksum mismatch (expected {info.get('sha256')}, got {digest})"
            )
        try:
            data = json.loads(raw)
            source = self.tensor_source(EXTRA_OBJECT, "extra")
            return {k: decode(v, source) for k, v in data["extras"].items()}
        except CheckpointError:
            raise
        except Exception as err:  # checksummed, yet malformed: a crafted file
            raise CheckpointError(
                f"{path}: malformed extras ({type(err).__name__}: {err})"
            ) from err

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The RNG state rank ``rank`` saved, or None."""
        record = self.manifest.data.get("rng", {}).get(str(rank))
        if record is None:
            return None
        where = f"{self.manifest_path}: field 'rng.{rank}'"
        if not isinstance(record, dict) or not isinstance(record.get("tensors", []), list):
            raise CheckpointError(f"{where} is malformed")
        tensors = {}
        for name in record.get("tensors", []):
            tensors[name] = self.read_named(f"{RNG_OBJECT}.{rank}", "rng", str(name))
        try:
            scalars = decode(record.get("scalars", {}))
        except Exception as err:
            raise CheckpointError(f"{where} cannot be decoded ({err})") from err
        if not isinstance(scalars, dict):
            raise CheckpointError(f"{where}: 'scalars' is not an object")
        return tensors, scalars

    def verify_all(self, progress: Any = None) -> list[str]:
        """Check every fragment's checksum (in parallel); return the problems (empty: intact).
        The rank files it opens are closed when it returns (a checkpoint deleted after a
        check gives its disk space back)."""
        problems: list[str] = []
        jobs = []
        already_open = set(self._files)
        try:
            for entry in self.manifest.tensors:
                for i, frag in enumerate(entry.fragments):
                    job = self._workers().submit(self.verify_fragment, entry, i)
                    jobs.append((job, entry, frag))
            for future, entry, frag in jobs:
                try:
                    future.result()
                except CheckpointError as err:
                    problems.append(str(err))
                if progress is not None:
                    size = torch.empty((), dtype=DTYPES_BY_NAME.get(entry.dtype, torch.uint8))
                    progress.update(frag.numel * size.element_size())
        finally:
            for future, _, _ in jobs:  # none still reading when the files close
                if not future.cancel():
                    future.exception()
            self._close_files(keep=already_open)
        if extras_file(self.manifest.files) is not None:
            try:
                self.extras()
            except CheckpointError as err:
                problems.append(str(err))
        return problems
