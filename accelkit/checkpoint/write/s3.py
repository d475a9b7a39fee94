"""Saving to S3-compatible object storage: every rank uploads its rank file, rank 0 commits
(:mod:`accelkit.checkpoint.store.s3` says in which order)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from types import SimpleNamespace
from typing import Any

from accelkit import distributed
from accelkit.checkpoint import profile as profiling
from accelkit.checkpoint.format.digest import DEFAULT as DEFAULT_CHECKSUM
from accelkit.checkpoint.format.digest import check_algorithm
from accelkit.checkpoint.format.manifest import EXTRA_NAME
from accelkit.checkpoint.store import posix as storage
from accelkit.checkpoint.store import s3_client as objectstore
from accelkit.checkpoint.store.s3 import _pool, commit_checkpoint, prepare
from accelkit.checkpoint.store.s3_client import S3Location
from accelkit.checkpoint.store.scratch import SAVE_PREFIX, staging
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")


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
    from accelkit.checkpoint.write import writer

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
    from accelkit.checkpoint.shards.fragments import classify_state
    from accelkit.checkpoint.write import agreement as steps
    from accelkit.checkpoint.write import background, writer

    background.wait()  # the save in flight commits (or raises) before this one starts
    what = f"saving {where}"
    steps.roll_call("started", what)  # a rank that never comes is named, in time
    check_algorithm(checksum)
    if asynchronous:
        from accelkit.checkpoint.write import write_process

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
    from accelkit.checkpoint.write import writer

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
    from accelkit.checkpoint.write import agreement as steps
    from accelkit.checkpoint.write import background, writer

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
