"""Checkpoints in S3-compatible object storage: the same portable format, committed without a rename.

An S3 checkpoint ``s3://bucket/run/step-6`` holds the same objects a checkpoint directory holds
files (``accelkit.json``, ``rank-NNNNN.safetensors``, ``extra.json``), so a checkpoint copied
between a disk and a bucket loads either way. A store has no rename, so the commit is the order
of the writes:

1. rank 0 checks the location holds no committed checkpoint (accelkit never overwrites one in
   object storage: it could not do so atomically) and removes what a killed save left there
   (objects, unfinished multipart uploads);
2. every rank writes its rank file locally (the disk writer: checksums, the asynchronous
   writer process), uploads it in parallel parts, and reports its record;
3. rank 0 checks every rank file is there with its size, writes ``extra.json``, then the
   manifest, last and conditionally (``If-None-Match: *``: of two jobs saving to one location,
   one commits); then ``latest``, then rotation, which deletes an old checkpoint's manifest
   first, so it is never seen half deleted, then what killed saves of the series left under
   earlier names.

Each step closes as a disk save's does (:mod:`accelkit.checkpoint.write.agreement`): every wait for
another rank is bounded, and every rank raises the same error.

A location without a manifest is not a checkpoint: ``load``, ``latest`` and ``auto_resume`` never
see an interrupted save. A load (:func:`accelkit.checkpoint.read.s3_copy.opened`) reads with the disk reader over a partial local
copy: each rank downloads the rank files' headers and its share of the checksums (parallel
ranged GETs, each group of fragments hashed as soon as it has landed), and any other range its
fill reads when it reads it; with one rank, that is every byte, fetched up front. Every checksum
is still checked, by some rank, before any live tensor is written. The tools (``inspect``,
``convert``) download whole checkpoints (:func:`fetched`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accelkit.checkpoint.format.manifest import EXTRA_NAME, MANIFEST_NAME
from accelkit.checkpoint.store import posix as storage
from accelkit.checkpoint.store import s3_client as objectstore
from accelkit.checkpoint.store.s3_client import S3Location
from accelkit.checkpoint.store.scratch import LOAD_PREFIX, staging
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=objectstore.CONCURRENCY)


def _manifest_step(raw: bytes) -> int | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    for field in ("step", "applied_steps"):
        value = data.get(field) if isinstance(data, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


# ---- finding a checkpoint ---------------------------------------------------------------------
def _pointer_target(
    where: S3Location, store: objectstore.ObjectStore
) -> tuple[S3Location | None, str]:
    """Where ``where/latest`` points (None: no pointer) and the reason it is refused, if it is."""
    pointer = where.child(storage.LATEST_NAME)
    try:
        named = store.get(pointer.key).decode(errors="replace").strip()
    except objectstore.BucketMissing:
        raise
    except objectstore.ObjectMissing:
        return None, ""
    if not named or named in (".", "..") or "/" in named:
        return None, (
            f"{pointer} holds {named!r}, which is not the name of a checkpoint next to it: "
            f"'{storage.LATEST_NAME}' holds one name, with no '/' or '..'. Write the name of a "
            f"checkpoint of {where} into it, or delete it."
        )
    target = where.child(named)
    if store.head(target.child(MANIFEST_NAME).key) is None:
        return None, (
            f"{pointer} points at {named}, which is not a committed checkpoint (no "
            f"{MANIFEST_NAME}). Write the name of a checkpoint of {where} into it, or delete it."
        )
    return target, ""


def resolve(where: S3Location, storage_options: dict[str, Any] | None = None) -> S3Location:
    """The checkpoint ``where`` names: itself, or where its ``latest`` points."""
    store = objectstore.store_for(where, storage_options)
    if store.head(where.child(MANIFEST_NAME).key) is not None:
        return where
    target, refused = _pointer_target(where, store)
    if target is not None:
        return target
    if refused:
        raise CheckpointError(refused)
    if next(store.list(where.key + "/"), None) is None:
        store.check_bucket()
        raise CheckpointError(f"{where}: no such checkpoint (nothing is stored there)")
    raise CheckpointError(
        f"{where}: neither a checkpoint (no {MANIFEST_NAME}: a save that did not complete leaves "
        f"none) nor a prefix with a '{storage.LATEST_NAME}' pointer"
    )


def _committed(
    parent: S3Location, store: objectstore.ObjectStore, pattern: str | None = None
) -> list[tuple[tuple, S3Location]]:
    """The committed checkpoints right below ``parent`` (of one name ``pattern``), each with its
    order key (the recorded step, then the name; never a clock)."""
    found = []
    prefix = f"{parent.key}/" if parent.key else ""
    for name in store.list_dirs(prefix):
        if name.startswith(".") or (pattern and storage.rotation_pattern(name) != pattern):
            continue
        child = parent.child(name)
        try:
            raw = store.get(child.child(MANIFEST_NAME).key)
        except objectstore.ObjectMissing:
            continue  # no manifest: a save that did not complete, or a stray prefix
        step = _manifest_step(raw)
        found.append(((step is not None, step or 0, storage.natural_key(name)), child))
    return found


def latest_checkpoint(
    where: S3Location, storage_options: dict[str, Any] | None = None
) -> S3Location | None:
    """The newest committed checkpoint under ``where`` (or ``where`` itself), or None: what
    ``latest`` names when valid, else the one with the highest recorded step."""
    store = objectstore.store_for(where, storage_options)
    if store.head(where.child(MANIFEST_NAME).key) is not None:
        return where
    target, refused = _pointer_target(where, store)
    if target is not None:
        return target
    if refused:
        log.warning("%s; looking for the newest complete checkpoint instead", refused)
    candidates = _committed(where, store)
    return max(candidates, key=lambda c: c[0])[1] if candidates else None


# ---- reading ------------------------------------------------------------------------------------
def _safe_name(name: str, where: S3Location) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise CheckpointError(
            f"{where}/{MANIFEST_NAME} lists the file {name!r}, which is not a name inside the "
            "checkpoint; accelkit reads a checkpoint only from its own prefix"
        )
    return name


def download(
    where: S3Location,
    dest: Path,
    names: list[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Copy the objects ``names`` of ``where`` (default: every object right below it) into the
    local directory ``dest``, by parallel ranged GETs; a missing one raises, naming it."""
    store = objectstore.store_for(where, storage_options)
    prefix = f"{where.key}/"
    sizes = {
        key[len(prefix) :]: size
        for key, size in store.list(prefix)
        if "/" not in key[len(prefix) :]
    }
    if names is None:
        names = sorted(sizes)
    dest.mkdir(parents=True, exist_ok=True)
    with _pool() as pool:
        for name in names:
            _safe_name(name, where)
            if name not in sizes:
                raise CheckpointError(f"{where.child(name)}: object missing")
            store.download(where.child(name).key, dest / name, sizes[name], pool)


def holds_checkpoint(where: S3Location, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``where`` is a checkpoint or holds a ``latest`` pointer."""
    store = objectstore.store_for(where, storage_options)
    return any(store.head(where.child(name).key) is not None for name in (MANIFEST_NAME, "latest"))


@contextmanager
def fetched(
    where: S3Location,
    storage_options: dict[str, Any] | None = None,
    *,
    manifest_only: bool = False,
) -> Iterator[Path]:
    """The checkpoint ``where`` names (after ``latest``), downloaded into a local temporary
    directory for the disk reader; errors name the S3 objects, not the temporary files."""
    target = resolve(where, storage_options)
    store = objectstore.store_for(target, storage_options)
    with staging(LOAD_PREFIX) as folder:
        local = folder / target.name
        local.mkdir()
        raw = store.get(target.child(MANIFEST_NAME).key)
        (local / MANIFEST_NAME).write_bytes(raw)
        if manifest_only:
            yield local
            return
        present = _listed_files(target, store, raw)
        with _pool() as pool:
            for name, size in present.items():
                store.download(target.child(name).key, local / name, size, pool)
        try:
            yield local
        except CheckpointError as err:
            raise _renamed(err, local, target) from err


def _listed_files(target: S3Location, store: objectstore.ObjectStore, raw: bytes) -> dict[str, int]:
    """The files the manifest ``raw`` lists, each with its object's size; a missing one
    raises, naming them all."""
    try:
        files = json.loads(raw).get("files", {})
        names = [_safe_name(str(n), target) for n in files]
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{target}/{MANIFEST_NAME}: not a valid manifest ({err})") from err
    prefix = f"{target.key}/"
    present = {key[len(prefix) :]: size for key, size in store.list(prefix)}
    missing = [n for n in names if n not in present]
    if missing:
        raise CheckpointError(
            f"{target}: object(s) {', '.join(str(target.child(n)) for n in missing)} "
            f"missing from the checkpoint (its {MANIFEST_NAME} lists them). The checkpoint "
            "is incomplete: copy the objects back, or load another checkpoint."
        )
    return {name: present[name] for name in names}


def _cited(err: CheckpointError, pairs: list[tuple[Path, Any]]) -> CheckpointError:
    """``err`` with each local path of ``pairs`` replaced by its S3 location."""
    message = str(err)
    for local, where in pairs:
        message = message.replace(str(local), str(where))
    cited = type(err)(message)
    for attr, value in vars(err).items():
        setattr(cited, attr, value)
    return cited


def _renamed(err: CheckpointError, local: Path, target: S3Location) -> CheckpointError:
    """``err`` with the temporary directories' paths (this rank's, and the others' an agreed
    error quotes) replaced by the S3 location."""
    pattern = rf"/\S*?/{LOAD_PREFIX}[^/\s]+/{re.escape(target.name)}"
    message = re.sub(pattern, lambda _: str(target), str(err))
    renamed = type(err)(message)
    for attr, value in vars(err).items():
        setattr(renamed, attr, value)
    return renamed


def upload_tree(
    local: Path, where: S3Location, storage_options: dict[str, Any] | None = None
) -> None:
    """A local file, or the files of a local directory, to ``where``; a checkpoint's manifest
    and a safetensors index go last, so a reader never sees them before what they list."""
    store = objectstore.store_for(where, storage_options)
    store.check_bucket()
    if local.is_file():
        with _pool() as pool:
            store.upload(where.key, local, pool)
        return
    last = (MANIFEST_NAME, "model.safetensors.index.json", storage.LATEST_NAME)
    files = sorted(
        (p for p in local.rglob("*") if p.is_file()), key=lambda p: (p.name in last, str(p))
    )
    if (local / MANIFEST_NAME).is_file():
        prepare(where, storage_options)
    with _pool() as pool:
        for path in files:
            key = where.child(path.relative_to(local).as_posix()).key
            if path.name == MANIFEST_NAME:
                store.put(key, path.read_bytes(), if_absent=True)
            else:
                store.upload(key, path, pool)


# ---- writing ------------------------------------------------------------------------------------
def prepare(where: S3Location, storage_options: dict[str, Any] | None = None) -> None:
    """Rank 0, before a save: refuse a committed checkpoint at ``where``; remove what a killed
    save left there."""
    if not where.key:
        raise CheckpointError(
            f"{where}: a checkpoint needs a name below the bucket (s3://bucket/run/step-6)"
        )
    store = objectstore.store_for(where, storage_options)
    store.check_bucket()
    if store.head(where.child(MANIFEST_NAME).key) is not None:
        raise CheckpointError(
            f"{where} is a committed checkpoint already. accelkit never overwrites a checkpoint "
            "in object storage (a store without rename cannot replace it all at once): save "
            "under a new name (step-N), or delete the old one first."
        )
    leftovers = [key for key, _ in store.list(where.key + "/")]
    aborted = store.abort_uploads(where.key + "/")
    if leftovers:
        store.delete(leftovers)
    if leftovers or aborted:
        log.info(
            "removed %d object(s) and %d unfinished upload(s) under %s, left by a save that did "
            "not complete",
            len(leftovers),
            aborted,
            where,
        )


def commit_checkpoint(
    where: S3Location,
    manifest_text: str,
    files: dict[str, Any],
    extras_raw: bytes | None,
    *,
    latest: bool,
    keep_last: int | None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Rank 0's last step: every listed file is there with its size, then ``extra.json``, the
    manifest (conditionally: the commit), ``latest``, and rotation."""
    store = objectstore.store_for(where, storage_options)
    if extras_raw is not None:
        store.put(where.child(EXTRA_NAME).key, extras_raw)
    prefix = f"{where.key}/"
    present = {key[len(prefix) :]: size for key, size in store.list(prefix)}
    for name, info in files.items():
        if present.get(name) != info.get("bytes"):
            raise CheckpointError(
                f"{where.child(name)}: expected {info.get('bytes')} bytes, the store has "
                f"{present.get(name, 'none')}; another job may be writing to {where}. Nothing "
                "was committed."
            )
    try:
        store.put(where.child(MANIFEST_NAME).key, manifest_text.encode(), if_absent=True)
    except objectstore.ObjectExists as err:
        raise CheckpointError(
            f"{where}: another save committed this checkpoint first (its {MANIFEST_NAME} "
            "appeared during this save); this save was not committed. Two jobs are writing to "
            "one location: give each its own."
        ) from err
    if latest:
        store.put(where.parent.child(storage.LATEST_NAME).key, (where.name + "\n").encode())
    if keep_last is not None:
        rotate(where, keep_last, store)
    sweep(where, store)


def sweep(where: S3Location, store: objectstore.ObjectStore) -> list[S3Location]:
    """After a commit: remove what killed saves of this series left below ``where``'s name
    (``step-7`` when ``step-8`` commits): prefixes of its name pattern without a manifest, and
    their unfinished multipart uploads. A later name (another job's save in flight) is left."""
    pattern = storage.rotation_pattern(where.name)
    order = storage.natural_key(where.name)
    prefix = f"{where.parent.key}/" if where.parent.key else ""
    removed = []

    def earlier(name: str) -> bool:
        return (
            storage.rotation_pattern(name) == pattern
            and storage.natural_key(name) < order
            and store.head(where.parent.child(name).child(MANIFEST_NAME).key) is None
        )

    for name in store.list_dirs(prefix):
        if earlier(name):
            orphan = where.parent.child(name)
            store.delete([key for key, _ in store.list(orphan.key + "/")])
            removed.append(orphan)
            log.info("removed %s, left by a save that did not complete", orphan)
    # parts of uploads never completed (a prefix holding only those lists no objects)
    store.abort_uploads(
        prefix, lambda key: "/" in key[len(prefix) :] and earlier(key[len(prefix) :].split("/")[0])
    )
    return removed


def rotate(where: S3Location, keep_last: int, store: objectstore.ObjectStore) -> list[S3Location]:
    """Delete the committed siblings of ``where`` of its name pattern beyond the ``keep_last``
    with the highest steps (``where`` is always kept): the manifest first, then the rest."""
    siblings = _committed(where.parent, store, storage.rotation_pattern(where.name))
    siblings.sort(key=lambda c: c[0], reverse=True)
    keep = {c.name for _, c in siblings[:keep_last]} | {where.name}
    deleted = []
    for _, old in siblings:
        if old.name in keep:
            continue
        store.delete([old.child(MANIFEST_NAME).key])  # uncommitted first: never seen half gone
        store.delete([key for key, _ in store.list(old.key + "/")])
        deleted.append(old)
        log.info("removed old checkpoint %s (keep_last=%d)", old, keep_last)
    return deleted
