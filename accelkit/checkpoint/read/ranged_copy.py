"""Loading a checkpoint from a store that is not a local directory: the disk reader over a
partial local copy of the rank files, fetched through the store's ranged reads
(:meth:`~accelkit.checkpoint.store.base.Store.open_ranged`, each pinned to the version seen when
the load began).

Each rank fetches the rank files' headers and its share of the checksums (parallel ranged reads,
each group of fragments hashed as soon as it has landed), and any other range its fill reads
when it reads it; with one rank, that is every byte, fetched up front. Every fragment a rank
fetches after the ranks agreed (a range of another rank's share) is hashed in the copy before
the fill reads it: no byte reaches a live tensor unverified. The copy lives in memory
(:data:`MEMORY_STAGING`) when it fits, and is removed when the load ends, or by the next load
if this one was killed; closing it never raises over the load's own error. After a load that
succeeded, only the copy's names go at once: its memory is given back by a thread of its own
(freeing a state's worth of pages takes a fifth of a load's time), which the next load, or
:func:`wait_for_release`, waits for, so two loads never hold two copies.
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


#: the threads giving back the memory of finished loads' copies (:func:`wait_for_release`)
_releasing: list[threading.Thread] = []
_releasing_lock = threading.Lock()


def wait_for_release() -> None:
    """Wait until the copies of the loads that returned have given back their memory (their
    descriptors closed and mappings gone). Each load waits for it before it fetches."""
    with _releasing_lock:
        threads = list(_releasing)
    for thread in threads:
        thread.join()
    with _releasing_lock:
        _releasing[:] = [t for t in _releasing if t.is_alive()]


def _release_later(copies: list[_PartialCopy]) -> None:
    """Close ``copies`` (their pages freed when the last mapping and descriptor go) on a
    thread, after the load returned; an interpreter waits for it before it exits."""

    def release() -> None:
        for copy in copies:
            _close_quietly(str(copy.path), copy.close)

    thread = threading.Thread(target=release, name="accelkit-load-release")
    with _releasing_lock:
        _releasing.append(thread)
    thread.start()


class _PartialCopy:
    """A local sparse copy of one object and the record of the byte ranges it holds; what is
    not there yet is fetched by ranged GETs (parallel parts) before it is read."""

    def __init__(self, source: Any, where: str, path: Path, pool: Any) -> None:
        self.source, self.where, self.path, self.pool = source, where, path, pool
        self.size = size = source.size
        self.step = getattr(getattr(source, "bucket", None), "part_bytes", 8 << 20)
        #: fragments checked in this copy: ``(offset, nbytes)`` of each, sorted
        self.spans: list[tuple[int, int, Any, int]] = []
        self.checked: set[int] = set()  # offsets of the spans hashed here, or by the share
        self.check: Any = None  # (entry, index, view) -> None, raising on a mismatch
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
        """Release the mapping and the descriptor; never raises (a view still exported, kept
        by an error's traceback, leaves the mapping to the garbage collector, not the fd)."""
        try:
            self.view.release()
            if self._mapped is not None:
                self._mapped.close()
        except BufferError as err:
            log.debug(
                "%s: the copy's mapping is still in use (%s); left to be collected", self.path, err
            )
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
        step, out = self.step, []
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
        with self.view[start:end] as part:
            self.source.read_into(part, start)
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
        """Bytes ``[offset, offset + nbytes)`` are in the copy when this returns: fetched from
        the version every rank verified its share of, and each whole fragment among them that
        this rank did not check itself hashed here first (a range of a fragment, a resharding
        fill's, rests on that version: its hash covers the whole fragment)."""
        end = min(self.size, offset + nbytes)
        parts = self.parts(self.missing(offset, end))
        if parts:  # on the pool's threads, whose part buffers go when the load ends
            _wait([self.pool.submit(self.get, *p) for p in parts])
        for start, length, entry, index in self._inside(offset, end):
            with self.view[start : start + length] as view:
                self.check(entry, index, view)
            with self._lock:
                self.checked.add(start)

    def _inside(self, start: int, end: int) -> list[tuple[int, int, Any, int]]:
        """The fragments wholly inside ``[start, end)`` not checked yet."""
        if self.check is None:
            return []
        spans = self.spans
        i = bisect.bisect_left(spans, start, key=lambda s: s[0])
        out = []
        for span in spans[i:]:
            if span[0] + span[1] > end:
                break
            if span[0] not in self.checked:
                out.append(span)
        return out

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
            with view[offset : offset + nbytes] as part:
                digest.update(part)
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


def _checker(reader: Any) -> Any:
    """``check(entry, index, view)``: hash fragment ``index`` of ``entry`` in ``view``."""
    from accelkit.checkpoint.format.digest import hasher

    def check(entry: Any, index: int, view: memoryview) -> None:
        frag = entry.fragments[index]
        digest = hasher(frag.algorithm)
        digest.update(view)
        got = digest.hexdigest()
        if got != frag.digest:
            raise reader._checksum_error(entry, frag, got)

    return check


def _close_quietly(what: str, close: Any) -> None:
    """Cleanup never replaces the load's own error, nor fails a load that succeeded."""
    try:
        close()
    except Exception as err:
        log.debug("closing %s: %s", what, err)


@contextmanager
def opened(
    store: Any,
    target: str,
    manifest: bytes,
    *,
    rank: int = 0,
    world: int = 1,
    strict: bool = True,
    verify: bool = True,
    profile: Any = None,
) -> Iterator[Any]:
    """A :class:`~accelkit.checkpoint.read.reader.CheckpointReader` of the committed checkpoint
    ``target`` of ``store`` (resolved already; ``manifest``: its bytes, read once), for rank
    ``rank`` of ``world``, over a partial local copy. Before it yields: ``extra.json`` and each
    rank file's header, then this rank's verify share
    (:func:`~accelkit.checkpoint.read.verify.share_spans`; everything with one rank), each group
    of fragments hashed as soon as it has landed. Any other range is fetched, and its fragments
    hashed, when the load reads it. Errors name the store's locations, never the temporary
    files, which are gone when it exits."""
    from accelkit.checkpoint.format.manifest import Manifest
    from accelkit.checkpoint.read.reader import CheckpointReader
    from accelkit.checkpoint.read.verify import share_spans

    profile = profile or profiling.SaveProfile()
    wait_for_release()  # the last load's copy is gone before this one takes room
    cleanup = ExitStack()
    succeeded = False
    with profile.phase("download"):
        lister = getattr(store, "listed_files", None)
        if lister is not None:
            files = lister(target, manifest)
        else:
            names = Manifest.parse(manifest, store.display(target)).files
            files = {name: store.open_ranged(target, name) for name in names}
        total = sum(f.size for f in files.values())
        folder = cleanup.enter_context(staging(PARTIAL_PREFIX, _load_root(total)))
        local = folder / (target.rstrip("/").rsplit("/", 1)[-1] or "checkpoint")
    copies: dict[str, _PartialCopy] = {}
    pool = ThreadPoolExecutor(max_workers=8)
    reader = prechecks = None
    try:
        try:
            with profile.phase("download"):
                local.mkdir()
                (local / MANIFEST_NAME).write_bytes(manifest)
                for name, source in files.items():
                    copies[name] = _PartialCopy(
                        source, store.child(target, name), local / name, pool
                    )
                    if not name.endswith(".safetensors"):  # extra.json: small, read whole
                        copies[name].ensure(0, source.size)
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

                rank_files = {n: c for n, c in copies.items() if n.endswith(".safetensors")}
                if world == 1:  # every byte, requested at once; the headers come first
                    futures = fetch({name: [(0, c.size)] for name, c in rank_files.items()})
                    _wait([parts[0] for parts in futures.values() if parts])
                    for copy in rank_files.values():
                        copy.fetch_header(on_pool=False)  # a header longer than that part
                else:
                    _wait([pool.submit(copy.fetch_header) for copy in rank_files.values()])

                def ensure(name: str, offset: int, nbytes: int) -> None:
                    copy = copies.get(name)
                    if copy is not None:
                        copy.ensure(offset, nbytes)

                reader = CheckpointReader(
                    local,
                    strict=strict,
                    verify=verify,
                    ensure=ensure,
                    manifest=Manifest.parse(manifest, str(local / MANIFEST_NAME), local),
                )
                spans = share_spans(reader, rank, world) if verify else []
                prechecks.share(reader, spans)
                if world > 1:
                    futures = fetch(_share_ranges(spans))
                _wait([future for parts in futures.values() for future in parts])
                reader.prechecked = prechecks.result
                #: the versions read, compared across the ranks before any fill
                #: (:func:`~accelkit.checkpoint.read.same_source.check_same_checkpoint`)
                reader.versions = {n: str(getattr(f, "version", "")) for n, f in files.items()}
                if verify:  # what the fill reads beyond this rank's share is hashed first
                    check = _checker(reader)
                    mine = {(s[0], s[1]) for s in spans}
                    for entry in reader.manifest.tensors:
                        for i in range(len(entry.fragments)):
                            name, offset, nbytes = reader.fragment_span(entry, i)
                            copy = copies.get(name)
                            if copy is None:
                                continue
                            copy.spans.append((offset, nbytes, entry, i))
                            if (name, offset) in mine:
                                copy.checked.add(offset)
                    for copy in copies.values():
                        copy.spans.sort(key=lambda s: s[0])
                        copy.check = check
            yield reader
            succeeded = True
        except CheckpointError as err:
            raise _renamed(err, local, store.display(target)) from err
    finally:
        _close_quietly("the download pool", lambda: pool.shutdown(wait=True, cancel_futures=True))
        if prechecks is not None:
            _close_quietly("the checks", prechecks.close)
        if reader is not None:
            _close_quietly("the reader", reader.close)
        if copies:
            log.debug(
                "rank %d fetched %d of the %d bytes of %s's rank files",
                rank,
                sum(c.fetched for c in copies.values()),
                sum(c.size for c in copies.values()),
                store.display(target),
            )
        if succeeded:  # the names now (a folder unlocked and empty), the memory on a thread
            _close_quietly("the staging folder", cleanup.close)
            _release_later(list(copies.values()))
        else:  # after an error, everything before it propagates
            for copy in copies.values():
                _close_quietly(str(copy.path), copy.close)
            _close_quietly("the staging folder", cleanup.close)


def _renamed(err: CheckpointError, local: Path, target: str) -> CheckpointError:
    """``err`` with the temporary copies' paths (this rank's, and the others' an agreed error
    quotes) replaced by the store's location."""
    import re

    name = re.escape(local.name)
    pattern = rf"/\S*?/{LOAD_PREFIX}[^/\s]+/{name}"
    message = re.sub(pattern, lambda _: target, str(err))
    renamed = type(err)(message)
    for attr, value in vars(err).items():
        setattr(renamed, attr, value)
    return renamed
