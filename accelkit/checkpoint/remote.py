"""Checkpoints in object storage: the same portable format, committed without a rename.

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

Each step closes as a disk save's does (:mod:`accelkit.checkpoint.commit`): every wait for
another rank is bounded, and every rank raises the same error.

A location without a manifest is not a checkpoint: ``load``, ``latest`` and ``auto_resume`` never
see an interrupted save. A load (:func:`accelkit.checkpoint.remote_load.opened`) reads with the disk reader over a partial local
copy: each rank downloads the rank files' headers and its share of the checksums (parallel
ranged GETs, each group of fragments hashed as soon as it has landed), and any other range its
fill reads when it reads it; with one rank, that is every byte, fetched up front. Every checksum
is still checked, by some rank, before any live tensor is written. The tools (``inspect``,
``convert``) download whole checkpoints (:func:`fetched`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from accelkit import distributed
from accelkit.checkpoint import objectstore, storage
from accelkit.checkpoint import profile as profiling
from accelkit.checkpoint.digest import DEFAULT as DEFAULT_CHECKSUM
from accelkit.checkpoint.digest import check_algorithm
from accelkit.checkpoint.manifest import EXTRA_NAME, MANIFEST_NAME
from accelkit.checkpoint.objectstore import S3Location
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

LOAD_PREFIX = "accelkit-s3-load-"
SAVE_PREFIX = "accelkit-s3-save-"
OUT_PREFIX = "accelkit-s3-out-"
#: where rank files are staged before their upload and after their download (default: TMPDIR)
STAGING_ENV = "ACCELKIT_S3_STAGING"
#: a folder younger than this is never taken for abandoned (it may not be locked yet)
_ABANDONED_AFTER_S = 60


@contextmanager
def staging(prefix: str, root: str | os.PathLike | None = None) -> Iterator[Path]:
    """A new local folder for a transfer (in ``root``, else :data:`STAGING_ENV`, else the temp
    dir), locked while it is in use and removed after. Folders of the same kind that killed
    processes left there (their lock died with them) are removed first."""
    base = Path(root or os.environ.get(STAGING_ENV) or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(f"{prefix}*"):
        _remove_if_abandoned(stale)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    lock = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)
        except OSError:  # a filesystem without locks: nothing will take the folder for abandoned
            pass
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)


def _remove_if_abandoned(folder: Path) -> None:
    """Remove a transfer's folder whose process is gone: no lock on it, and not just made."""
    try:
        if time.time() - folder.stat().st_mtime < _ABANDONED_AFTER_S:
            return
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # in use
    else:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)


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


@contextmanager
def fetched_pretrained(
    where: S3Location, storage_options: dict[str, Any] | None = None
) -> Iterator[Path]:
    """Pretrained safetensors at ``where`` (one ``.safetensors`` object, or a prefix with
    ``model.safetensors`` or the shards of ``model.safetensors.index.json``) in a local
    temporary directory; what it yields is what :func:`load_pretrained` takes."""
    from accelkit.checkpoint.pretrained import INDEX_NAME, SINGLE_NAME

    store = objectstore.store_for(where, storage_options)
    single = bool(where.key) and store.head(where.key) is not None  # an object, not a prefix
    with staging(LOAD_PREFIX) as folder:
        local = folder / ("object" if single else (where.name or where.bucket))
        local.mkdir()
        if single:
            download(where.parent, local, [where.name], storage_options)
            yielded = local / where.name
        elif store.head(where.child(INDEX_NAME).key) is not None:
            raw = store.get(where.child(INDEX_NAME).key)
            (local / INDEX_NAME).write_bytes(raw)
            try:
                names = sorted(set(json.loads(raw)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise CheckpointError(
                    f"{where.child(INDEX_NAME)}: not a safetensors index ({err})"
                ) from err
            prefix = f"{where.key}/"
            present = {key[len(prefix) :] for key, _ in store.list(prefix)}
            missing = [str(where.child(n)) for n in names if n not in present]
            if missing:
                raise CheckpointError(
                    f"{where.child(INDEX_NAME)} names {', '.join(missing)}, which the store "
                    "does not hold; the upload or copy is incomplete"
                )
            download(where, local, names, storage_options)
            yielded = local
        elif store.head(where.child(SINGLE_NAME).key) is not None:
            download(where, local, [SINGLE_NAME], storage_options)
            yielded = local
        else:
            raise CheckpointError(
                f"{where}: no {SINGLE_NAME}, {INDEX_NAME} or {MANIFEST_NAME} there; pass a "
                "prefix holding Hugging Face-style safetensors, a .safetensors object or an "
                "accelkit checkpoint"
            )
        try:
            yield yielded
        except CheckpointError as err:
            pairs = [(yielded, where), (local, where.parent if single else where)]
            raise _cited(err, pairs) from err


@contextmanager
def local_paths(
    src: str | os.PathLike | None,
    dst: str | os.PathLike | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[tuple[Any, Any, Any]]:
    """For tools that work on local files (``accelkit convert`` / ``inspect``): an ``s3://``
    ``src`` downloaded (a checkpoint, after ``latest``; a single object; pretrained
    safetensors), and a local stand-in for an ``s3://`` ``dst``. Yields ``(src, dst,
    publish)``: ``publish(written)`` uploads what the tool wrote to ``dst`` (a checkpoint's
    manifest last) and returns where it now is. Local paths pass through unchanged."""
    from contextlib import ExitStack

    pairs: list[tuple[Path, Any]] = []
    with ExitStack() as stack:
        local_src: Any = src
        source = None if src is None else objectstore.location(src)
        if source is not None:
            if holds_checkpoint(source, storage_options):
                target = resolve(source, storage_options)
                local_src = stack.enter_context(fetched(target, storage_options))
            else:
                target = source
                local_src = stack.enter_context(fetched_pretrained(source, storage_options))
            pairs.append((Path(local_src), target))
        local_dst: Any = dst
        destination = objectstore.location(dst) if dst is not None else None
        if destination is not None:
            folder = stack.enter_context(staging(OUT_PREFIX))
            local_dst = folder / (destination.name or "out")
            pairs.append((local_dst, destination))

        def publish(written: Any) -> Any:
            if destination is None:
                return written
            upload_tree(Path(written), destination, storage_options)
            return str(destination)

        try:
            yield local_src, local_dst, publish
        except CheckpointError as err:
            raise _cited(err, pairs) from err


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


def _upload_rank_file(
    where: S3Location,
    record: dict[str, Any],
    to_write: list[tuple[str, Any]],
    checksum: str,
    profile: profiling.SaveProfile,
    storage_options: dict[str, Any] | None,
) -> dict[str, Any]:
    """This rank's file to ``where``; the record, completed.

    A synchronous save writes it straight into a multipart upload: each part is sent as soon as
    its bytes are written and hashed, with no local copy. An asynchronous one, beside a training
    loop, has the writer process write it to a local file first, away from the loop's GIL, and
    then uploads that: its save takes longer, but the loop beside it runs faster
    (docs/checkpoint.md, "Object storage", gives both figures)."""
    from accelkit.checkpoint import writer

    store = objectstore.store_for(where, storage_options)
    key = where.child(record["file"]["name"]).key
    if not profile.asynchronous:
        with profile.phase("upload"), _pool() as pool:
            sink = objectstore.UploadSink(store, key, pool)
            return writer._stream_planned(sink, where.name, record, to_write, checksum, profile)
    with staging(SAVE_PREFIX) as folder:
        local = folder / where.name
        storage.temp_dir(local).mkdir(parents=True)
        with profile.phase("write"):
            record = writer._write_planned(local, record, to_write, checksum, profile)
        to_write.clear()  # a snapshot's copies are released as soon as they are written
        with profile.phase("upload"), _pool() as pool:
            store.upload(key, storage.temp_dir(local) / record["file"]["name"], pool)
        return record


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


def save(
    accel: Any,
    where: S3Location,
    state: dict[str, Any],
    *,
    keep_last: int | None = None,
    latest: bool = True,
    step: int | None = None,
    rng: bool = True,
    exclude_frozen: bool = False,
    checksum: str = DEFAULT_CHECKSUM,
    asynchronous: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """:func:`accelkit.checkpoint.save` to object storage (the module's docstring says how)."""
    from accelkit.checkpoint import background, writer
    from accelkit.checkpoint import commit as steps
    from accelkit.checkpoint.fragments import classify_state

    background.wait()  # the save in flight commits (or raises) before this one starts
    what = f"saving {where}"
    steps.roll_call("started", what)  # a rank that never comes is named, in time
    check_algorithm(checksum)
    if asynchronous:
        from accelkit.checkpoint import write_process

        write_process.enabled()
        write_process.stall_limits()
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
    started = time.perf_counter()
    profile = profiling.SaveProfile(asynchronous=asynchronous)
    backend = writer.backend_of(accel)
    rank = backend.rank
    objects = classify_state(state)
    if step is None:  # as on disk: the state's own "step", else the Accelerator's count
        explicit = state.get("step")
        if isinstance(explicit, int) and not isinstance(explicit, bool):
            step = explicit
        elif hasattr(accel, "applied_steps"):
            step = accel.applied_steps
    counters = SimpleNamespace(applied_steps=getattr(accel, "applied_steps", None))
    distributed.refuse_different(
        str(where), "checkpoint paths to save()", writer._SAME_PATH, CheckpointError
    )
    group = steps.commit_group()  # every collective of the save runs on it, bounded

    error = None
    with profile.phase("prepare"):
        if rank == 0:
            try:
                with steps.working("prepared"):
                    prepare(where, storage_options)
            except Exception as err:
                error = err
        steps.report("prepared", error, what, group)

    planned, error = None, None
    try:
        with steps.working("planned"):
            with profile.phase("plan"):
                record, to_write = writer._plan_rank(backend, state, objects, rng, exclude_frozen)
            if asynchronous:
                with profile.phase("stage"):
                    to_write = background.snapshot(to_write)
        planned = (record, to_write)
    except Exception as err:
        error = err
    steps.report("planned", error, what, group)
    assert planned is not None
    job = (backend, counters, where, *planned, list(state), step)
    options: dict[str, Any] = {"checksum": checksum, "exclude_frozen": exclude_frozen}
    options.update(latest=latest, keep_last=keep_last, started=started, profile=profile)
    options.update(storage_options=storage_options)
    if asynchronous:
        background.start(where, lambda: _upload_and_commit(*job, group=group, **options))
        if rank == 0:
            log.info(
                "saving %s in the background (training stalled %.2f s for the snapshot)",
                where,
                time.perf_counter() - started,
            )
        return str(where)
    _upload_and_commit(*job, group=group, **options)
    return str(where)


def _extras_bytes(manifest: Any, extras: dict[str, Any]) -> bytes | None:
    """``extra.json``'s bytes (recorded in the manifest with their checksum), or None."""
    if not extras:
        return None
    raw = (json.dumps({"extras": extras}, indent=1, allow_nan=False) + "\n").encode()
    manifest.data["files"][EXTRA_NAME] = {
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    return raw


def _commit_records(
    backend: Any,
    counters: Any,
    where: S3Location,
    records: list[dict[str, Any]],
    state_keys: list[str],
    step: Any,
    *,
    exclude_frozen: bool,
    latest: bool,
    keep_last: int | None,
    storage_options: dict[str, Any] | None,
) -> None:
    """Rank 0: the manifest from every rank's record, then :func:`commit_checkpoint`."""
    from accelkit.checkpoint import writer

    manifest, extras = writer._build_manifest(backend, counters, records, state_keys, step)
    if exclude_frozen:
        manifest.data["excluded_frozen"] = True
    extras_raw = _extras_bytes(manifest, extras)
    try:
        manifest.validate()
    except CheckpointError as err:
        who = manifest.data.get("writer", {}).get("backend", "?")
        raise CheckpointError(f"backend {who!r} wrote an inconsistent checkpoint: {err}") from err
    commit_checkpoint(
        where,
        manifest.to_json_text(),
        {n: i for n, i in manifest.data["files"].items() if n != EXTRA_NAME},
        extras_raw,
        latest=latest,
        keep_last=keep_last,
        storage_options=storage_options,
    )


def _upload_and_commit(
    backend: Any,
    counters: Any,
    where: S3Location,
    record: dict[str, Any],
    to_write: list[tuple[str, Any]],
    state_keys: list[str],
    step: Any,
    *,
    group: Any,
    checksum: str,
    exclude_frozen: bool,
    latest: bool,
    keep_last: int | None,
    started: float,
    profile: profiling.SaveProfile,
    storage_options: dict[str, Any] | None,
) -> None:
    """Every rank writes its file locally and uploads it; rank 0 commits (collective on
    ``group``)."""
    from accelkit.checkpoint import background, writer
    from accelkit.checkpoint import commit as steps

    rank = record["rank"]
    profile.tensors = len(to_write)
    profile.nbytes = sum(t.numel() * t.dtype.itemsize for _, t in to_write)
    error = None
    try:
        with steps.working("written"):  # a long upload is not a dead rank
            record = _upload_rank_file(where, record, to_write, checksum, profile, storage_options)
            to_write.clear()  # a snapshot's copies are released once they are sent
    except Exception as err:
        error = err
    with profile.phase("gather"):
        steps.report("written", error, f"saving {where}", group)
        records = writer._gather_to_rank0(record, group)

    error = None
    with profile.phase("commit"):
        if rank == 0:
            try:
                with steps.working("committed"):  # a long rotation is not a dead rank 0
                    _commit_records(
                        backend,
                        counters,
                        where,
                        records,
                        state_keys,
                        step,
                        exclude_frozen=exclude_frozen,
                        latest=latest,
                        keep_last=keep_last,
                        storage_options=storage_options,
                    )
            except Exception as err:
                error = err
        steps.report("committed", error, f"saving {where}", group)
    profiling.record(profile)
    if profile.asynchronous:  # pin the next save's staging now, off the training thread
        background.grow_staging()
    if rank == 0:
        size = sum(r["file"]["bytes"] for r in records)
        log.info("saved %s: %.3f GB in %.2f s", where, size / 1e9, time.perf_counter() - started)
