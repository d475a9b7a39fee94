"""Loading a checkpoint from object storage: the disk reader over a partial local copy.

Each rank downloads the rank files' headers and its share of the checksums (parallel ranged GETs,
each group of fragments hashed as soon as it has landed), and any other range its fill reads
when it reads it; with one rank, that is every byte, fetched up front. Every checksum is still
checked, by some rank, before any live tensor is written. The copy lives in memory
(:data:`MEMORY_STAGING`) when it fits, and is removed when the load ends, or by the next load
if this one was killed.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from accelkit.checkpoint import profile as profiling
from accelkit.checkpoint.format.manifest import MANIFEST_NAME
from accelkit.checkpoint.store import s3_client as objectstore
from accelkit.checkpoint.store.s3 import _listed_files, _pool, _renamed, resolve
from accelkit.checkpoint.store.s3_client import S3Location
from accelkit.checkpoint.store.scratch import LOAD_PREFIX, STAGING_ENV, staging
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

#: a load's partial copy (locked while the load runs, as every transfer's folder is)
PARTIAL_PREFIX = f"{LOAD_PREFIX}partial-"
#: a load's copy goes here (memory) when it fits and STAGING_ENV is not set
MEMORY_STAGING = "/dev/shm"


def _load_root(nbytes: int) -> str | None:
    """Where a load's local copy goes: :data:`STAGING_ENV` if set; else in memory
    (:data:`MEMORY_STAGING`, a tmpfs: the copy lives only while the load runs, and a disk would
    write it out for nothing) when the ``nbytes`` each rank of this node may fetch fit there and
    in a quarter of the available memory; else (None) the temp dir."""
    if os.environ.get(STAGING_ENV):
        return os.environ[STAGING_ENV]
    return MEMORY_STAGING if _fits_in_memory(nbytes) else None


def _fits_in_memory(nbytes: int) -> bool:
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
        room = os.statvfs(MEMORY_STAGING)
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, ValueError, KeyError):
        return False
    need = nbytes * ranks
    writable = os.access(MEMORY_STAGING, os.W_OK)
    return writable and need <= room.f_bavail * room.f_frsize // 2 and need <= available // 4


# ---- loading: a partial local copy, fetched as the load reads ------------------------------------
#: bytes of each rank file's start fetched first, for its safetensors header (more if it is longer)
HEADER_BYTES = 64 << 10
#: threads hashing this rank's verify share while the rest of it downloads
HASH_WORKERS = 2


def _wait(futures: list[Any]) -> None:
    """Wait for every future; on the first error, cancel those not started and raise it."""
    failed = None
    for future in futures:
        try:
            future.result()
        except BaseException as err:
            if failed is None:
                failed = err
                for other in futures:
                    other.cancel()
    if failed is not None:
        raise failed


class _PartialCopy:
    """A local sparse copy of one object and the record of the byte ranges it holds; what is
    not there yet is fetched by ranged GETs (parallel parts) before it is read."""

    def __init__(
        self, store: objectstore.ObjectStore, where: S3Location, path: Path, size: int, pool: Any
    ) -> None:
        self.store, self.where, self.path, self.size, self.pool = store, where, path, size, pool
        self.fetched = 0  # bytes downloaded
        self._present: list[tuple[int, int]] = []  # sorted, disjoint, merged [start, end)
        self._lock = threading.Lock()
        self._mapped: mmap.mmap | None = None
        self.view = memoryview(b"")
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self.fd, size)
            # bytes are received straight into the copy's pages: no buffer, no second copy
            if size:
                self._mapped = mmap.mmap(self.fd, size)
                self.view = memoryview(self._mapped)
        except OSError as err:
            self.close()
            raise self._no_room(err) from err

    def close(self) -> None:
        self.view.release()
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The ranges of ``[start, end)`` the copy does not hold yet."""
        out, position = [], start
        with self._lock:
            first = max(0, bisect.bisect_right(self._present, start, key=lambda r: r[0]) - 1)
            for lo, hi in self._present[first:]:
                if lo >= end:
                    break
                if lo > position:
                    out.append((position, lo))
                position = max(position, hi)
                if position >= end:
                    break
        if position < end:
            out.append((position, end))
        return out

    def parts(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` cut into requests at the multiples of the part size: the parts the object
        was uploaded in (a store keeps each as a piece; a request across two reads both)."""
        step, out = objectstore.part_bytes(self.size), []
        for start, end in ranges:
            while start < end:
                stop = min(end, (start // step + 1) * step)
                out.append((start, stop))
                start = stop
        return out

    def get(self, start: int, end: int) -> None:
        """Fetch ``[start, end)`` by one ranged GET into the copy, then record it."""
        try:  # the range's room, taken now: a full tmpfs is an error here, not a SIGBUS later
            os.posix_fallocate(self.fd, start, end - start)
        except OSError as err:
            raise self._no_room(err) from err
        self.store.read_into(self.where.key, self.view[start:end], start)
        with self._lock:
            present = self._present
            i = bisect.bisect_left(present, start, key=lambda r: r[1])
            j, lo, hi = i, start, end
            while j < len(present) and present[j][0] <= hi:
                lo, hi = min(lo, present[j][0]), max(hi, present[j][1])
                j += 1
            present[i:j] = [(lo, hi)]
            self.fetched += end - start

    def _no_room(self, err: BaseException) -> CheckpointError:
        return CheckpointError(
            f"{self.where}: cannot keep the downloaded bytes in the local staging folder "
            f"({err}); point {STAGING_ENV} at a folder with room"
        )

    def ensure(self, offset: int, nbytes: int) -> None:
        """Bytes ``[offset, offset + nbytes)`` are in the copy when this returns."""
        parts = self.parts(self.missing(offset, min(self.size, offset + nbytes)))
        if parts:  # on the pool's threads, whose part buffers go when the load ends
            _wait([self.pool.submit(self.get, *p) for p in parts])

    def fetch_header(self, *, on_pool: bool = True) -> None:
        """The safetensors header: the first :data:`HEADER_BYTES`, and the rest of a longer
        one (a malformed length is left for the reader to report). Called on a thread of the
        pool, or (``on_pool=False``) from another, through it."""
        fetch = self._fetch_here if on_pool else self.ensure
        fetch(0, HEADER_BYTES)
        if self.size >= 8:
            (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            fetch(0, 8 + min(length, 10**8))

    def _fetch_here(self, offset: int, nbytes: int) -> None:
        for part in self.parts(self.missing(offset, min(self.size, offset + nbytes))):
            self.get(*part)


class _Prechecks:
    """Hashes this rank's verify share while it downloads: each group of fragments
    (:func:`~accelkit.checkpoint.read.verify.check_batches`) is checked on a worker as soon as all
    its bytes have landed. :meth:`result` is what the reader's ``prechecked`` returns."""

    def __init__(self, copies: dict[str, _PartialCopy]) -> None:
        self.copies = copies
        self.reader: Any = None
        self.pool = ThreadPoolExecutor(max_workers=HASH_WORKERS)
        self._lock = threading.Lock()
        self._futures: list[Any] = []
        self._failed: list[tuple[tuple[str, int], CheckpointError]] = []
        self._checked: set[tuple[str, str]] = set()
        # per file, in file order: [first byte, end, group, submitted]
        self._groups: dict[str, list[list[Any]]] = {}

    def share(self, reader: Any, spans: list[Any]) -> None:
        """Check ``spans`` (this rank's share) with ``reader``: those already in at once, the
        others as they land (bytes may land before: the headers come first)."""
        from accelkit.checkpoint.read.verify import check_batches

        groups: dict[str, list[list[Any]]] = {}
        for group in check_batches(spans):
            lo, hi = group[0][1], group[-1][1] + group[-1][2]
            groups.setdefault(group[0][0], []).append([lo, hi, group, False])
        with self._lock:
            self.reader, self._groups = reader, groups
        for name, copy in self.copies.items():
            self.landed(name, 0, copy.size)

    def landed(self, name: str, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of ``name`` are in: submit the groups now complete."""
        with self._lock:
            groups = self._groups.get(name, [])
        for item in groups[bisect.bisect_right(groups, start, key=lambda g: g[1]) :]:
            lo, hi, group, submitted = item
            if lo >= end:
                break
            if submitted or self.copies[name].missing(lo, hi):
                continue
            with self._lock:
                if not item[3]:
                    item[3] = True
                    self._futures.append(self.pool.submit(self._check, group))

    def _check(self, group: list[Any]) -> None:
        """Hash each fragment of ``group`` where it lies in the copy's mapping (no copy)."""
        from accelkit.checkpoint.format.digest import hasher

        view = self.copies[group[0][0]].view
        failed = None
        for _, offset, nbytes, entry, i in group:
            frag = entry.fragments[i]
            digest = hasher(frag.algorithm)
            digest.update(view[offset : offset + nbytes])
            got = digest.hexdigest()
            if got != frag.digest and failed is None:
                failed = self.reader._checksum_error(entry, frag, got)
        with self._lock:
            if failed is not None:
                self._failed.append(((group[0][0], group[0][1]), failed))
            self._checked.update((s[0], s[3].fragments[s[4]].key) for s in group)

    def result(self) -> tuple[set[tuple[str, str]], list[CheckpointError]]:
        """The fragments checked and the errors of those that failed, in file order (after the
        checks in flight)."""
        for future in list(self._futures):
            future.exception()
        with self._lock:
            failed = [err for _, err in sorted(self._failed, key=lambda f: f[0])]
            return set(self._checked), failed

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _share_ranges(spans: list[Any]) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of ``spans`` (in file order), per file, back-to-back ones merged."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, offset, nbytes, _, _ in spans:
        mine = ranges.setdefault(name, [])
        if mine and mine[-1][1] == offset:
            mine[-1] = (mine[-1][0], offset + nbytes)
        elif nbytes:
            mine.append((offset, offset + nbytes))
    return ranges


@contextmanager
def opened(
    where: S3Location,
    storage_options: dict[str, Any] | None = None,
    *,
    rank: int = 0,
    world: int = 1,
    strict: bool = True,
    verify: bool = True,
    profile: Any = None,
) -> Iterator[Any]:
    """A :class:`~accelkit.checkpoint.read.reader.CheckpointReader` of the checkpoint ``where``
    names (after ``latest``), for rank ``rank`` of ``world``, over a partial local copy. Before
    it yields: the manifest, ``extra.json`` and each rank file's header, then this rank's
    verify share (:func:`~accelkit.checkpoint.read.verify.share_spans`; everything with one rank),
    each group of fragments hashed as soon as it has landed. Any other range is fetched when
    the load reads it. Errors name the S3 objects, never the temporary files, which are gone
    when it exits."""
    from accelkit.checkpoint.read.reader import CheckpointReader
    from accelkit.checkpoint.read.verify import share_spans

    profile = profile or profiling.SaveProfile()
    cleanup = ExitStack()
    with profile.phase("download"):
        target = resolve(where, storage_options)
        store = objectstore.store_for(target, storage_options)
        raw = store.get(target.child(MANIFEST_NAME).key)
        files = _listed_files(target, store, raw)
        folder = cleanup.enter_context(staging(PARTIAL_PREFIX, _load_root(sum(files.values()))))
        local = folder / target.name
    copies: dict[str, _PartialCopy] = {}
    pool = _pool()
    reader = prechecks = None
    try:
        try:
            with profile.phase("download"):
                local.mkdir()
                (local / MANIFEST_NAME).write_bytes(raw)
                for name, size in files.items():
                    if name.endswith(".safetensors"):
                        path = local / name
                        copies[name] = _PartialCopy(store, target.child(name), path, size, pool)
                    else:  # extra.json: small, read whole
                        store.download(target.child(name).key, local / name, size, pool)
                prechecks = _Prechecks(copies)

                def part(name: str, start: int, end: int) -> None:
                    copies[name].get(start, end)
                    prechecks.landed(name, start, end)

                def fetch(wanted: dict[str, list[tuple[int, int]]]) -> dict[str, list[Any]]:
                    """Each file's parts of ``wanted`` not there yet, requested in order."""
                    futures: dict[str, list[Any]] = {}
                    for name, ranges in wanted.items():
                        missing = [m for lo, hi in ranges for m in copies[name].missing(lo, hi)]
                        futures[name] = [
                            pool.submit(part, name, *p) for p in copies[name].parts(missing)
                        ]
                    return futures

                if world == 1:  # every byte, requested at once; the headers come first
                    futures = fetch({name: [(0, c.size)] for name, c in copies.items()})
                    _wait([parts[0] for parts in futures.values() if parts])
                    for copy in copies.values():
                        copy.fetch_header(on_pool=False)  # a header longer than that part
                else:
                    _wait([pool.submit(copy.fetch_header) for copy in copies.values()])

                def ensure(name: str, offset: int, nbytes: int) -> None:
                    copy = copies.get(name)
                    if copy is not None:
                        copy.ensure(offset, nbytes)

                reader = CheckpointReader(local, strict=strict, verify=verify, ensure=ensure)
                spans = share_spans(reader, rank, world) if verify else []
                prechecks.share(reader, spans)
                if world > 1:
                    futures = fetch(_share_ranges(spans))
                _wait([future for parts in futures.values() for future in parts])
                reader.prechecked = prechecks.result
            yield reader
        except CheckpointError as err:
            raise _renamed(err, local, target) from err
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if prechecks is not None:
            prechecks.close()
        if reader is not None:
            reader.close()
        if copies:
            log.debug(
                "rank %d fetched %d of the %d bytes of %s's rank files",
                rank,
                sum(c.fetched for c in copies.values()),
                sum(c.size for c in copies.values()),
                target,
            )
        for copy in copies.values():
            copy.close()
        cleanup.close()
