"""The ``Store`` protocol: where checkpoints live, and how a save is committed there.

One save orchestration (:mod:`accelkit.checkpoint.write.writer`) and one load orchestration
(:mod:`accelkit.checkpoint`) run on every store; a store supplies the verbs below and nothing of
the format (which files a checkpoint holds, their bytes, their checksums). A location is a string
the store understands: a path for :class:`~accelkit.checkpoint.store.posix.PosixStore`, a URL
(``s3://bucket/run/step-6``) for a store of objects.

A store of objects without an atomic rename need not write these verbs itself:
:class:`~accelkit.checkpoint.store.bucket.BucketStore` implements them once, committing by the
order of the writes (the manifest last, conditionally), over a :class:`Bucket`, the few object
operations a service offers (S3, GCS, Azure Blob). A third-party store is a ``Bucket`` (or a
whole ``Store``) registered by scheme through the ``accelkit_checkpoint_stores`` hook
(docs/plugins.md, "Checkpoint stores"); :func:`accelkit.checkpoint.store.store_for` picks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from accelkit.errors import CheckpointError

__all__ = [
    "Bucket",
    "BucketMissing",
    "ObjectExists",
    "ObjectMissing",
    "RankFileTarget",
    "RangedFile",
    "Store",
    "StoredObject",
    "VersionChanged",
]


class ObjectMissing(CheckpointError):
    """The object (or the bucket) does not exist."""


class BucketMissing(ObjectMissing):
    """The bucket does not exist."""


class ObjectExists(CheckpointError):
    """A conditional create found the object already there."""


class VersionChanged(CheckpointError):
    """A read pinned to one version of an object found another: it was replaced meanwhile."""


def read_timeout_option(value: Any, default: float) -> float:
    """``storage_options["read_timeout"]``: seconds a request may wait for the server's next
    bytes before it is retried (a stalled connection); a positive number."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(
            f"storage_options: read_timeout must be a positive number of seconds, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class StoredObject:
    """One object of a bucket: its key, size and version (S3's ETag, GCS's generation: what
    a pinned read names)."""

    key: str
    size: int
    version: str


class RankFileTarget(Protocol):
    """Where one rank writes its rank file, as its store chose (:meth:`Store.open_rank_file`):
    a :class:`~accelkit.checkpoint.format.safetensors_io.Sink` to stream the bytes into
    (``sink``), or a local file to write (``path``) that the store publishes when the context
    exits without an error."""

    sink: Any | None
    path: Path | None


class RangedFile(Protocol):
    """A rank file opened for ranged reading, pinned to the version it was opened at."""

    name: str
    size: int

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes from ``offset`` (retried; a replaced object raises
        :class:`VersionChanged`, a short one :class:`~accelkit.errors.CheckpointError`)."""
        ...


@runtime_checkable
class Store(Protocol):
    """Checkpoint-level verbs; the save and load orchestrations call nothing else of a store.

    Rank 0 alone calls ``prepare``, ``commit``, ``point_latest``, ``rotate`` and ``sweep``; every
    rank calls ``open_rank_file`` for its own file and the reading verbs."""

    #: the URL scheme it serves ("" for local paths)
    scheme: str

    # ---- names ----------------------------------------------------------------------------------
    def child(self, where: str, name: str) -> str:
        """The location ``name`` right below ``where``."""
        ...

    def display(self, where: str) -> str:
        """``where`` as the user wrote it (messages, ``accelkit inspect``)."""
        ...

    # ---- finding --------------------------------------------------------------------------------
    def resolve(self, where: str) -> str:
        """The committed checkpoint ``where`` names: itself, else the one its ``latest`` names,
        followed past to a committed sibling of a higher step (a save killed after its commit
        and before ``latest`` moved). Raises CheckpointError when there is none."""
        ...

    def newest(self, where: str) -> str | None:
        """The newest committed checkpoint under ``where`` (or ``where`` itself): ``latest``'s,
        or one of a higher step; None where there is none (``auto_resume`` starts fresh)."""
        ...

    def recorded_step(self, where: str) -> int | None:
        """The step the committed checkpoint ``where``'s manifest records."""
        ...

    def read_manifest(self, where: str) -> bytes:
        """The manifest's bytes of the committed checkpoint ``where`` (resolved already)."""
        ...

    # ---- saving ---------------------------------------------------------------------------------
    def prepare(self, where: str, save_id: str) -> None:
        """Rank 0, before a save: make room for a save of ``where``; refuse what must not be
        replaced. ``save_id`` is unique to this save."""
        ...

    def check_prepared(self, where: str, save_id: str) -> str | None:
        """Every rank but 0, after ``prepare``: None where this rank sees the prepared place;
        else what it cannot see and what to do, worded to follow "rank(s) [1] " (ranks that do
        not share a directory)."""
        ...

    def rank_file_name(self, rank: int, save_id: str) -> str:
        """The name of ``rank``'s file in the save ``save_id`` (the manifest records it)."""
        ...

    def extras_name(self, save_id: str) -> str:
        """The name of ``extra.json`` in the save ``save_id`` (the manifest records it)."""
        ...

    def open_rank_file(
        self, where: str, save_id: str, name: str, *, asynchronous: bool, profile: Any
    ) -> AbstractContextManager[RankFileTarget]:
        """Where this rank writes its file ``name`` of the save ``save_id`` of ``where``
        (``profile.phase(name)`` times the store's own work): streamed, or a
        local file published on exit (an asynchronous save beside a training loop), as the
        store chooses."""
        ...

    def commit(
        self,
        where: str,
        save_id: str,
        manifest: bytes,
        files: dict[str, int],
        extras: bytes | None,
    ) -> None:
        """Rank 0, for the save ``save_id``: every file of ``files`` (name -> bytes) is there, then ``extra.json``
        (``extras``), then the manifest: the commit. Of two saves of one location, one commits
        and the other raises CheckpointError saying another job writes there. A retried request
        that finds its own write is success."""
        ...

    def point_latest(self, where: str) -> None:
        """Point ``latest`` beside ``where`` at it. A failure after the commit is a warning:
        :meth:`resolve` and :meth:`newest` follow past a stale ``latest``."""
        ...

    def rotate(self, where: str, keep_last: int) -> list[str]:
        """Delete committed siblings of ``where``'s name pattern beyond the ``keep_last`` of the
        highest steps (``where`` is kept); what was deleted."""
        ...

    def sweep(self, where: str) -> list[str]:
        """Remove what killed saves of ``where``'s series left; what was removed."""
        ...

    # ---- loading --------------------------------------------------------------------------------
    def local_directory(self, where: str) -> Path | None:
        """The local directory the reader reads the checkpoint ``where`` in place from, or None:
        then the load reads its rank files through :meth:`open_ranged`."""
        ...

    def open_ranged(self, where: str, name: str) -> RangedFile:
        """The file ``name`` of the committed checkpoint ``where``, for ranged reads pinned to
        the version seen now."""
        ...

    def download(self, where: str, dest: Path) -> None:
        """Every object right below ``where`` into the local directory ``dest`` (the tools)."""
        ...

    def upload(self, local: Path, where: str) -> None:
        """A local file or directory to ``where``; a checkpoint's manifest goes last (the
        tools' output)."""
        ...

    def is_checkpoint(self, where: str) -> bool:
        """Whether ``where`` is a committed checkpoint or holds a ``latest`` pointer."""
        ...


@runtime_checkable
class Bucket(Protocol):
    """The object operations :class:`~accelkit.checkpoint.store.bucket.BucketStore` needs of a
    service: keys are ``/``-separated names inside one bucket. Every method retries what a flaky
    network breaks (a reset, a cut body, a 503) and maps the service's errors onto
    :class:`ObjectMissing`, :class:`BucketMissing`, :class:`ObjectExists` and
    :class:`VersionChanged`; any other failure is a CheckpointError that says what to do."""

    #: the URL scheme ("s3", "gs") and the bucket's name
    scheme: str
    name: str
    #: the size of the pieces a large object is read in (its upload's parts)
    part_bytes: int

    def check(self) -> None:
        """Raise BucketMissing, or a clear error, where the bucket cannot be used."""
        ...

    def head(self, key: str) -> StoredObject | None:
        """The object ``key``, or None where there is none."""
        ...

    def get(self, key: str) -> tuple[bytes, str]:
        """The whole object ``key`` and its version (ObjectMissing where there is none)."""
        ...

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Store ``data`` at ``key``; ``if_absent``: only where no object has the key, else
        ObjectExists (the caller tells its own retried write from another's)."""
        ...

    def read_into(self, key: str, view: memoryview, offset: int, version: str | None) -> None:
        """Fill ``view`` with ``key``'s bytes from ``offset``; with ``version``, only from that
        version (else VersionChanged)."""
        ...

    def list(self, prefix: str) -> Iterator[StoredObject]:
        """Every object whose key starts with ``prefix``."""
        ...

    def list_dirs(self, prefix: str) -> list[str]:
        """The names right below ``prefix`` (which ends with ``/``) that hold objects: the
        listing with a delimiter."""
        ...

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (absent ones are no error)."""
        ...

    def sink(self, key: str, pool: ThreadPoolExecutor) -> Any:
        """A :class:`~accelkit.checkpoint.format.safetensors_io.Sink` that uploads what is
        written to ``key`` as it comes, and stores nothing where it is closed unfinished."""
        ...

    def upload(self, key: str, source: Path, pool: ThreadPoolExecutor) -> None:
        """The local file ``source`` to ``key``."""
        ...

    def abort_uploads(self, prefix: str, only: Callable[[str], bool] | None = None) -> int:
        """Drop unfinished uploads under ``prefix`` (a killed save's parts) whose key ``only``
        accepts; how many. A service without resumable uploads returns 0."""
        ...
