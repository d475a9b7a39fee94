"""Checkpoints in object storage: the same portable format, committed without a rename.

A checkpoint ``s3://bucket/run/step-6`` holds the objects a checkpoint directory holds files
(``accelkit.json``, the rank files, ``extra.json``), so a checkpoint copied between a disk and a
bucket loads either way. :class:`BucketStore` implements every verb of the
:class:`~accelkit.checkpoint.store.base.Store` protocol once, over any
:class:`~accelkit.checkpoint.store.base.Bucket` (S3's, a plugin's GCS). A bucket has no rename,
so the commit is the order of the writes:

1. rank 0 refuses a location that holds a committed checkpoint (it could not be replaced all at
   once) and deletes nothing: what another job writes there is not its to remove;
2. every rank writes its rank file under a name unique to this save (``rank-00000.<save>.
   safetensors``, recorded in the manifest), so the files of two saves of one location never
   replace each other;
3. rank 0 checks every rank file is there with its size, writes ``extra.json``, then the
   manifest, last and conditionally (``If-None-Match: *``): of two jobs saving to one location,
   one commits and the other is told that another job writes there. A retried PUT that finds its
   own manifest is success. The checkpoint is committed once its manifest is there: ``latest``,
   rotation and the sweep that follow may fail (a warning), and ``latest`` is then followed past
   (:meth:`BucketStore.resolve`), never a wedge.

A location without a manifest is not a checkpoint: ``load``, ``latest`` and ``auto_resume``
never see an interrupted save. After a commit, the sweep removes, from one listing of the series,
the objects of its location that the manifest does not list (a losing or killed save's), and the
prefixes of earlier names without a manifest.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelkit.checkpoint.format.manifest import EXTRA_NAME, MANIFEST_NAME
from accelkit.checkpoint.store import names
from accelkit.checkpoint.store.base import Bucket, ObjectExists, ObjectMissing, StoredObject
from accelkit.checkpoint.store.scratch import SAVE_PREFIX, staging
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

#: parallel requests of one transfer
CONCURRENCY = 8


@dataclass(frozen=True)
class ObjectLocation:
    """``scheme://bucket/key``: ``key`` is a prefix without a trailing slash (a "directory")."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        base = f"{self.scheme}://{self.bucket}"
        return f"{base}/{self.key}" if self.key else base

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectLocation:
        key = self.key.rsplit("/", 1)[0] if "/" in self.key else ""
        return ObjectLocation(self.scheme, self.bucket, key)

    def child(self, name: str) -> ObjectLocation:
        return ObjectLocation(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def prefix(self) -> str:
        """The prefix of the objects below it (``key/``; empty for the bucket)."""
        return f"{self.key}/" if self.key else ""


def parse(scheme: str, url: str) -> ObjectLocation:
    """``url`` (``scheme://bucket/prefix``) as a location; a malformed one is refused."""
    rest = url[len(scheme) + 3 :] if url.lower().startswith(f"{scheme}://") else ""
    bucket, _, key = rest.partition("/")
    key = key.strip("/")
    if not bucket or "//" in key or any(part in (".", "..") for part in key.split("/")):
        raise CheckpointError(
            f"{url}: not a valid {scheme.upper()} location; write it as "
            f"{scheme}://bucket/prefix/name"
        )
    return ObjectLocation(scheme, bucket, key)


def _safe_name(name: str, where: ObjectLocation) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise CheckpointError(
            f"{where}/{MANIFEST_NAME} lists the file {name!r}, which is not a name inside the "
            "checkpoint; accelkit reads a checkpoint only from its own prefix"
        )
    return name


@dataclass
class _RankFileTarget:
    sink: Any | None = None
    path: Path | None = None


@dataclass
class RangedObject:
    """A rank file of a committed checkpoint, read in ranges pinned to one version."""

    bucket: Bucket
    key: str
    name: str
    size: int
    version: str

    def read_into(self, view: memoryview, offset: int) -> None:
        self.bucket.read_into(self.key, view, offset, self.version or None)


class BucketStore:
    """A :class:`~accelkit.checkpoint.store.base.Store` over the buckets of one service:
    ``bucket_for(name)`` gives the :class:`~accelkit.checkpoint.store.base.Bucket` of a bucket's
    name (the module's docstring says how a save commits)."""

    def __init__(self, scheme: str, bucket_for: Callable[[str], Bucket]) -> None:
        self.scheme = scheme
        self._bucket_for = bucket_for

    # ---- names ----------------------------------------------------------------------------------
    def where(self, where: Any) -> ObjectLocation:
        return where if isinstance(where, ObjectLocation) else parse(self.scheme, str(where))

    def bucket(self, where: Any) -> Bucket:
        return self._bucket_for(self.where(where).bucket)

    def child(self, where: str, name: str) -> str:
        return str(self.where(where).child(name))

    def display(self, where: str) -> str:
        return str(self.where(where))

    @staticmethod
    def pool() -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=CONCURRENCY)

    # ---- finding --------------------------------------------------------------------------------
    def _has_manifest(self, bucket: Bucket, where: ObjectLocation) -> bool:
        return bucket.head(where.child(MANIFEST_NAME).key) is not None

    def _step(self, bucket: Bucket, where: ObjectLocation) -> int | None:
        try:
            raw, _ = bucket.get(where.child(MANIFEST_NAME).key)
        except ObjectMissing:
            return None
        return names.manifest_step(raw)

    def _pointer_target(
        self, bucket: Bucket, where: ObjectLocation
    ) -> tuple[ObjectLocation | None, str]:
        """Where ``where/latest`` points (None: no pointer) and why it is refused, if it is."""
        pointer = where.child(names.LATEST_NAME)
        try:
            raw, _ = bucket.get(pointer.key)
        except ObjectMissing:
            return None, ""
        named = raw.decode(errors="replace").strip()
        if not named or named in (".", "..") or "/" in named:
            return None, (
                f"{pointer} holds {named!r}, which is not the name of a checkpoint next to it: "
                f"'{names.LATEST_NAME}' holds one name, with no '/' or '..'. Write the name of a "
                f"checkpoint of {where} into it, or delete it."
            )
        target = where.child(named)
        if not self._has_manifest(bucket, target):
            return None, (
                f"{pointer} points at {named}, which is not a committed checkpoint (no "
                f"{MANIFEST_NAME}). Write the name of a checkpoint of {where} into it, or delete "
                "it."
            )
        return self._past(bucket, target), ""

    def _past(self, bucket: Bucket, target: ObjectLocation) -> ObjectLocation:
        """``target``, or a committed sibling of its name pattern and a higher step: a save
        that committed and died before it moved ``latest`` (only later names are asked)."""
        pattern, order = names.rotation_pattern(target.name), names.natural_key(target.name)
        later = [
            n
            for n in self._dirs(bucket, target.parent)
            if names.rotation_pattern(n) == pattern and names.natural_key(n) > order
        ]
        if not later:
            return target
        best, best_step = target, self._step(bucket, target)
        for name in later:
            step = self._step(bucket, target.parent.child(name))
            if step is not None and (best_step is None or step > best_step):
                best, best_step = target.parent.child(name), step
        if best != target:
            log.warning(
                "%s names %s, but %s is committed with a higher step (a save that died before it "
                "moved '%s'): loading %s",
                target.parent.child(names.LATEST_NAME),
                target.name,
                best.name,
                names.LATEST_NAME,
                best,
            )
        return best

    @staticmethod
    def _dirs(bucket: Bucket, parent: ObjectLocation) -> list[str]:
        """The names that hold objects right below ``parent``."""
        lister = getattr(bucket, "list_dirs", None)
        if lister is not None:
            return list(lister(parent.prefix))
        found = {o.key[len(parent.prefix) :].split("/", 1)[0] for o in bucket.list(parent.prefix)}
        return sorted(n for n in found if n)

    def _named(self, where: str) -> tuple[Bucket, ObjectLocation, ObjectLocation | None, str]:
        """``where``'s bucket and location, the checkpoint it names (itself, else ``latest``'s,
        followed past) or None, and why ``latest`` was refused, if it was."""
        loc = self.where(where)
        bucket = self.bucket(loc)
        if self._has_manifest(bucket, loc):
            return bucket, loc, loc, ""
        return bucket, loc, *self._pointer_target(bucket, loc)

    def resolve(self, where: str) -> str:
        bucket, loc, target, refused = self._named(where)
        if target is not None:
            return str(target)
        if refused:
            raise CheckpointError(refused)
        if next(iter(bucket.list(loc.prefix)), None) is None:
            bucket.check()
            raise CheckpointError(f"{loc}: no such checkpoint (nothing is stored there)")
        raise CheckpointError(
            f"{loc}: neither a checkpoint (no {MANIFEST_NAME}: a save that did not complete "
            f"leaves none) nor a prefix with a '{names.LATEST_NAME}' pointer"
        )

    def _committed(
        self, bucket: Bucket, parent: ObjectLocation, pattern: str | None = None
    ) -> list[tuple[tuple, ObjectLocation]]:
        """The committed checkpoints right below ``parent`` (of one name ``pattern``), each with
        its order key (the recorded step, then the name; never a clock)."""
        found = []
        committed = {  # one listing: no request per name a rotation emptied
            o.key[len(parent.prefix) : -len(MANIFEST_NAME) - 1]
            for o in bucket.list(parent.prefix)
            if o.key.endswith(f"/{MANIFEST_NAME}")
            and o.key.count("/") == parent.prefix.count("/") + 1
        }
        for name in sorted(committed):
            if name.startswith(".") or (pattern and names.rotation_pattern(name) != pattern):
                continue
            child = parent.child(name)
            try:
                raw, _ = bucket.get(child.child(MANIFEST_NAME).key)
            except ObjectMissing:
                continue  # no manifest: a save that did not complete, or a stray prefix
            step = names.manifest_step(raw)
            found.append(((step is not None, step or 0, names.natural_key(name)), child))
        return found

    def newest(self, where: str) -> str | None:
        bucket, loc, target, refused = self._named(where)
        if target is not None:
            return str(target)
        if refused:
            log.warning("%s; looking for the newest complete checkpoint instead", refused)
        candidates = self._committed(bucket, loc)
        return str(max(candidates, key=lambda c: c[0])[1]) if candidates else None

    def recorded_step(self, where: str) -> int | None:
        loc = self.where(where)
        return self._step(self.bucket(loc), loc)

    def read_manifest(self, where: str) -> bytes:
        loc = self.where(where)
        raw, _ = self.bucket(loc).get(loc.child(MANIFEST_NAME).key)
        return raw

    def is_checkpoint(self, where: str) -> bool:
        loc = self.where(where)
        bucket = self.bucket(loc)
        return any(
            bucket.head(loc.child(name).key) is not None
            for name in (MANIFEST_NAME, names.LATEST_NAME)
        )

    # ---- saving ---------------------------------------------------------------------------------
    def prepare(self, where: str, save_id: str) -> None:
        loc = self.where(where)
        if not loc.key:
            raise CheckpointError(
                f"{loc}: a checkpoint needs a name below the bucket ({self.scheme}://bucket/run/"
                "step-6)"
            )
        bucket = self.bucket(loc)
        bucket.check()
        if self._has_manifest(bucket, loc):
            raise CheckpointError(
                f"{loc} is a committed checkpoint already. accelkit never overwrites a "
                "checkpoint in object storage (a store without rename cannot replace it all at "
                "once): save under a new name (step-N), or delete the old one first."
            )

    def check_prepared(self, where: str, save_id: str) -> str | None:
        return None  # every rank reaches the same bucket

    def rank_file_name(self, rank: int, save_id: str) -> str:
        return f"rank-{rank:05d}.{save_id}.safetensors"

    def extras_name(self, save_id: str) -> str:
        return f"extra.{save_id}.json" if save_id else EXTRA_NAME

    @contextmanager
    def open_rank_file(
        self, where: str, save_id: str, name: str, *, asynchronous: bool, profile: Any
    ) -> Iterator[_RankFileTarget]:
        """A synchronous save streams into a multipart upload: each part is sent as soon as its
        bytes are written and hashed, with no local copy. An asynchronous one, beside a training
        loop, has the writer process write a local file first, away from the loop's GIL, and
        uploads it after: its save takes longer, but the loop beside it runs faster
        (docs/checkpoint.md, "Object storage", gives both figures)."""
        loc = self.where(where)
        bucket = self.bucket(loc)
        key = loc.child(name).key
        if not asynchronous:
            with profile.phase("upload"), self.pool() as pool:
                yield _RankFileTarget(sink=bucket.sink(key, pool))
            return
        with staging(SAVE_PREFIX) as folder:
            path = folder / name
            with profile.phase("write"):
                yield _RankFileTarget(path=path)
            with profile.phase("upload"), self.pool() as pool:
                bucket.upload(key, path, pool)

    def commit(
        self,
        where: str,
        save_id: str,
        manifest: bytes,
        files: dict[str, int],
        extras: bytes | None,
    ) -> None:
        loc = self.where(where)
        bucket = self.bucket(loc)
        if extras is not None:
            bucket.put(loc.child(self.extras_name(save_id)).key, extras)
        present = {o.key[len(loc.prefix) :]: o.size for o in bucket.list(loc.prefix)}
        for name, size in files.items():
            if present.get(name) != size:
                raise CheckpointError(
                    f"{loc.child(name)}: expected {size} bytes, the store has "
                    f"{present.get(name, 'none')}: another job writes here ({loc}) and removed "
                    "this save's files, or they were deleted; nothing was committed. Give each "
                    "job its own location."
                )
        key = loc.child(MANIFEST_NAME).key
        try:
            bucket.put(key, manifest, if_absent=True)
        except ObjectExists as err:
            try:
                theirs, _ = bucket.get(key)
            except ObjectMissing:
                theirs = b""
            if theirs == manifest:  # a retry found its own write: the answer was lost
                return
            try:  # the loser's files (named for this save alone) go; the winner's stay
                own = [*files, *([self.extras_name(save_id)] if extras is not None else [])]
                bucket.delete([loc.child(n).key for n in own])
            except CheckpointError as cleanup:
                log.warning("could not remove this save's files under %s: %s", loc, cleanup)
            raise CheckpointError(
                f"{loc}: another job writes here, and committed this checkpoint first (its "
                f"{MANIFEST_NAME} appeared during this save); this save was not committed. Give "
                "each job its own location."
            ) from err

    def point_latest(self, where: str) -> None:
        loc = self.where(where)
        self.bucket(loc).put(loc.parent.child(names.LATEST_NAME).key, (loc.name + "\n").encode())

    def rotate(self, where: str, keep_last: int) -> list[str]:
        loc = self.where(where)
        bucket = self.bucket(loc)
        siblings = self._committed(bucket, loc.parent, names.rotation_pattern(loc.name))
        siblings.sort(key=lambda c: c[0], reverse=True)
        keep = {c.name for _, c in siblings[:keep_last]} | {loc.name}
        deleted = []
        for _, old in siblings:
            if old.name in keep:
                continue
            bucket.delete([old.child(MANIFEST_NAME).key])  # uncommitted first: never half gone
            bucket.delete([o.key for o in bucket.list(old.prefix)])
            deleted.append(str(old))
            log.info("removed old checkpoint %s (keep_last=%d)", old, keep_last)
        return deleted

    def sweep(self, where: str) -> list[str]:
        """After a commit, from one listing of the series: the objects of ``where`` its manifest
        does not list, and the prefixes of earlier names of its pattern without a manifest (a
        later name may be another job's save in flight: it is left), with their unfinished
        uploads."""
        loc = self.where(where)
        bucket = self.bucket(loc)
        parent, pattern = loc.parent, names.rotation_pattern(loc.name)
        order = names.natural_key(loc.name)
        by_name: dict[str, list[StoredObject]] = {}
        for obj in bucket.list(parent.prefix):
            head, _, rest = obj.key[len(parent.prefix) :].partition("/")
            if rest:
                by_name.setdefault(head, []).append(obj)
        raw, _ = bucket.get(loc.child(MANIFEST_NAME).key)
        listed = {MANIFEST_NAME, *json.loads(raw).get("files", {})}
        removed: list[str] = []
        stray = [o.key for o in by_name.get(loc.name, []) if o.key[len(loc.prefix) :] not in listed]
        if stray:
            bucket.delete(stray)
            removed.extend(f"{self.scheme}://{bucket.name}/{k}" for k in stray)
            log.info("removed %d object(s) of %s that its manifest does not list", len(stray), loc)

        def earlier(name: str) -> bool:
            return names.rotation_pattern(name) == pattern and names.natural_key(name) < order

        for name, objects in by_name.items():
            keys = [o.key for o in objects]
            if earlier(name) and parent.child(name).child(MANIFEST_NAME).key not in keys:
                bucket.delete(keys)
                removed.append(str(parent.child(name)))
                log.info("removed %s, left by a save that did not complete", parent.child(name))
        ours = re.escape(loc.prefix)
        bucket.abort_uploads(
            parent.prefix,
            lambda key: (
                bool(re.match(ours, key))
                or (
                    "/" in key[len(parent.prefix) :]
                    and earlier(key[len(parent.prefix) :].split("/")[0])
                )
            ),
        )
        return removed

    # ---- loading --------------------------------------------------------------------------------
    def local_directory(self, where: str) -> Path | None:
        return None

    def open_ranged(self, where: str, name: str) -> RangedObject:
        loc = self.where(where)
        bucket = self.bucket(loc)
        key = loc.child(_safe_name(name, loc)).key
        found = bucket.head(key)
        if found is None:
            raise CheckpointError(
                f"{loc.child(name)}: object missing from the checkpoint (its {MANIFEST_NAME} "
                "lists it). The checkpoint is incomplete: copy the object back, or load another "
                "checkpoint."
            )
        return RangedObject(bucket, key, name, found.size, found.version)

    def listed_files(self, where: str, manifest: bytes) -> dict[str, RangedObject]:
        """Every file the manifest lists, opened for ranged reads from one listing; a missing
        one raises, naming them all."""
        loc = self.where(where)
        bucket = self.bucket(loc)
        try:
            wanted = [_safe_name(str(n), loc) for n in json.loads(manifest).get("files", {})]
        except (ValueError, AttributeError) as err:
            raise CheckpointError(f"{loc}/{MANIFEST_NAME}: not a valid manifest ({err})") from err
        present = {o.key[len(loc.prefix) :]: o for o in bucket.list(loc.prefix)}
        missing = [n for n in wanted if n not in present]
        if missing:
            raise CheckpointError(
                f"{loc}: object(s) {', '.join(str(loc.child(n)) for n in missing)} missing from "
                f"the checkpoint (its {MANIFEST_NAME} lists them). The checkpoint is incomplete: "
                "copy the objects back, or load another checkpoint."
            )
        return {
            n: RangedObject(bucket, present[n].key, n, present[n].size, present[n].version)
            for n in wanted
        }

    def download(self, where: str, dest: Path, wanted: list[str] | None = None) -> None:
        loc = self.where(where)
        bucket = self.bucket(loc)
        sizes = {
            o.key[len(loc.prefix) :]: o
            for o in bucket.list(loc.prefix)
            if "/" not in o.key[len(loc.prefix) :]
        }
        dest.mkdir(parents=True, exist_ok=True)
        for name in wanted if wanted is not None else sorted(sizes):
            _safe_name(name, loc)
            if name not in sizes:
                raise CheckpointError(f"{loc.child(name)}: object missing")
            _download(RangedObject(bucket, sizes[name].key, name, sizes[name].size, ""), dest)

    def upload(self, local: Path, where: str) -> None:
        loc = self.where(where)
        bucket = self.bucket(loc)
        bucket.check()
        if local.is_file():
            with self.pool() as pool:
                bucket.upload(loc.key, local, pool)
            return
        last = (MANIFEST_NAME, "model.safetensors.index.json", names.LATEST_NAME)
        files = sorted(
            (p for p in local.rglob("*") if p.is_file()), key=lambda p: (p.name in last, str(p))
        )
        if (local / MANIFEST_NAME).is_file():
            self.prepare(str(loc), "")
        with self.pool() as pool:
            for path in files:
                key = loc.child(path.relative_to(local).as_posix()).key
                if path.name == MANIFEST_NAME:
                    bucket.put(key, path.read_bytes(), if_absent=True)
                else:
                    bucket.upload(key, path, pool)


def _download(source: RangedObject, dest: Path) -> None:
    """One object into ``dest/<its name>``, in parallel ranged reads of its parts."""
    import os

    path = dest / source.name
    step = getattr(source.bucket, "part_bytes", 8 << 20)
    with open(path, "wb") as f:
        f.truncate(source.size)
    fd = os.open(path, os.O_WRONLY)
    try:

        def part(start: int) -> None:
            buffer = bytearray(min(step, source.size - start))
            source.read_into(memoryview(buffer), start)
            os.pwrite(fd, buffer, start)

        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            for future in [pool.submit(part, s) for s in range(0, source.size, step)]:
                future.result()
    finally:
        os.close(fd)
