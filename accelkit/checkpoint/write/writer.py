"""Saving: every rank writes its own fragments in parallel; rank 0 writes the manifest and commits.

Sequence (each step is agreed by all ranks, so a failure on one rank fails them all with the
same message instead of hanging the others):

1. rank 0 creates the temporary sibling ``.<name>.accelkit-tmp`` with a marker file; every rank
   checks it sees the marker (ranks that do not share the directory fail here, clearly);
2. every rank writes ``rank-NNNNN.safetensors`` (its fragments, its RNG state) and fsyncs it;
   the fragment records (names, ranges, checksums: a few bytes each) are gathered to rank 0;
3. rank 0 writes ``extra.json`` and ``accelkit.json``, fsyncs, renames the directory into place,
   moves the ``latest`` pointer, and rotates old checkpoints (``keep_last``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from accelkit import distributed
from accelkit.checkpoint import profile as profiling
from accelkit.checkpoint import progress
from accelkit.checkpoint.format import rng as rng_io
from accelkit.checkpoint.format.codec import drop_callables, encode
from accelkit.checkpoint.format.digest import DEFAULT as DEFAULT_CHECKSUM
from accelkit.checkpoint.format.digest import check_algorithm
from accelkit.checkpoint.format.manifest import (
    BACKEND_OBJECT,
    EXTRA_OBJECT,
    FORMAT,
    FORMAT_VERSION,
    RNG_OBJECT,
    FragmentRecord,
    Manifest,
    TensorEntry,
    rank_file_name,
)
from accelkit.checkpoint.format.safetensors_io import DTYPE_NAMES, layout, write_file
from accelkit.checkpoint.shards.fragments import Fragment, ObjectInfo, StateObjects, classify_state
from accelkit.checkpoint.write import agreement as commit
from accelkit.checkpoint.write import background
from accelkit.checkpoint.write.agreement import agree, was_agreed  # noqa: F401  (callers import them here)
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

#: the fix when the ranks name different directories
_SAME_PATH = (
    "save() is collective: every rank writes its part into one directory, so every rank must "
    "pass the same path. A path made per process differs on each (tempfile.mkdtemp(), a "
    "timestamp, a PID): make it on rank 0 and share it, `path = accel.broadcast(path)`, or use "
    "a fixed path."
)

#: writer threads of an asynchronous save (a synchronous one uses up to 8)
ASYNC_WRITERS = 2


def backend_of(accel: Any) -> Any:
    """The backend behind an Accelerator (or a Backend itself; None: a plain single process)."""
    from accelkit.backend import Backend, NoOptions, Settings

    if accel is None:
        return Backend("cpu", NoOptions(), Settings(precision="32-true"))
    if isinstance(accel, Backend):
        return accel
    return accel.backend


def _gather_to_rank0(record: dict[str, Any], group: Any = None) -> list[dict[str, Any]]:
    """Every rank's fragment records on rank 0 (others get an empty list): O(world) there only."""
    if not distributed.is_initialized():
        return [record]
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return [record]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(record, out, dst=0, group=group)
    return out or []


class _Collector:
    """Turns the tensors met while encoding JSON state into fragments of this rank's file."""

    def __init__(self) -> None:
        self.fragments: list[Fragment] = []

    def sink(self, obj: str, kind: str):
        def put(path: str, tensor: torch.Tensor) -> str:
            flat = tensor.detach().reshape(-1)
            self.fragments.append(Fragment(obj, path, kind, tuple(tensor.shape), 0, flat))
            return path

        return put


def _json_states(
    objects: StateObjects, backend: Any, collector: _Collector
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Rank 0's non-tensor state: scheduler and stateful objects, extras, the backend's state."""
    infos: dict[str, Any] = {}
    for kind, group in (("scheduler", objects.schedulers), ("stateful", objects.statefuls)):
        for name, obj in group.items():
            state = drop_callables(obj.state_dict(), name)
            infos[name] = {
                "type": kind,
                "class": f"{type(obj).__module__}.{type(obj).__qualname__}",
                "state": encode(state, name, collector.sink(name, "state")),
            }
    extras = {
        name: encode(value, name, collector.sink(EXTRA_OBJECT, "extra"))
        for name, value in objects.extras.items()
    }
    for name in objects.extras:
        infos[name] = {"type": "extra"}
    backend_state = encode(backend.state_dict(), "backend", collector.sink(BACKEND_OBJECT, "state"))
    return infos, extras, backend_state


def _fragment_key(frag: Fragment) -> str:
    return f"{frag.object}/{frag.kind}/{frag.fqn}@{frag.flat_offset}"


def _plan_rank(
    backend: Any,
    state: dict[str, Any],
    objects: StateObjects,
    save_rng: bool,
    exclude_frozen: bool = False,
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """This rank's record (names, ranges, JSON state) and the tensors its file will hold."""
    rank = backend.rank
    collector = _Collector()
    infos: dict[str, Any] = {}
    fragments: list[Fragment] = []
    for item in backend.local_fragments(state):
        if isinstance(item, ObjectInfo):
            infos[item.object] = item.info
        elif isinstance(item, Fragment):
            if exclude_frozen and item.meta.get("trainable") is False:
                continue  # frozen weights the user rebuilds from elsewhere (a PEFT base)
            fragments.append(item)
        else:
            raise CheckpointError(
                f"backend {backend.name!r}: local_fragments yielded a {type(item).__name__}; "
                "expected Fragment or ObjectInfo"
            )
    record: dict[str, Any] = {"rank": rank}
    # an optimizer's non-tensor per-parameter state is written by the rank that holds it (a
    # ZeRO-1 owner), so every rank reports its own and the manifest merges them
    scalars = {
        obj: info["scalar_state"]
        for obj, info in infos.items()
        if info.get("type") == "optimizer" and info.get("scalar_state")
    }
    if scalars and rank != 0:
        record["scalar_state"] = scalars
    if rank == 0:
        json_infos, extras, backend_state = _json_states(objects, backend, collector)
        infos.update(json_infos)
        record.update(infos=infos, extras=extras, backend_state=backend_state)
    elif getattr(backend.settings, "pipeline", None) is not None:
        # each stage's optimizer lists its own parameters: rank 0's groups hold the first's
        record["infos"] = {k: v for k, v in infos.items() if v.get("type") == "optimizer"}
    rank_state = backend.rank_state_dict()
    if rank_state:  # what differs per rank is saved by every rank (Backend.rank_state_dict)
        sink = collector.sink(f"{BACKEND_OBJECT}.{rank}", "state")
        record["rank_state"] = encode(rank_state, "rank state", sink)
    if save_rng:
        rng_tensors, rng_scalars = rng_io.capture()
        for name, tensor in rng_tensors.items():
            collector.fragments.append(
                Fragment(
                    f"{RNG_OBJECT}.{rank}", name, "rng", tuple(tensor.shape), 0, tensor.reshape(-1)
                )
            )
        record["rng"] = {"tensors": sorted(rng_tensors), "scalars": encode(rng_scalars, "rng")}
    fragments.extend(collector.fragments)

    to_write: list[tuple[str, torch.Tensor]] = []
    keys: set[str] = set()
    out = []
    for frag in fragments:
        if frag.data.dim() != 1:
            raise CheckpointError(f"fragment {frag.object}:{frag.kind}:{frag.fqn} must be 1-D")
        if frag.data.dtype not in DTYPE_NAMES:
            raise CheckpointError(
                f"fragment {frag.object}:{frag.kind}:{frag.fqn}: dtype {frag.data.dtype} cannot be stored"
            )
        numel = frag.data.numel()
        total = 1
        for s in frag.shape:
            total *= s
        if frag.flat_offset < 0 or frag.flat_offset + numel > total:
            raise CheckpointError(
                f"fragment {frag.object}:{frag.kind}:{frag.fqn}: range [{frag.flat_offset}, "
                f"{frag.flat_offset + numel}) is outside shape {list(frag.shape)}"
            )
        key = _fragment_key(frag) if numel else ""
        if numel:
            if key in keys:
                raise CheckpointError(f"rank {rank} yields fragment {key} twice")
            keys.add(key)
            to_write.append((key, frag.data))
        out.append(
            {
                "object": frag.object,
                "fqn": frag.fqn,
                "kind": frag.kind,
                "shape": list(frag.shape),
                "dtype": DTYPE_NAMES[frag.data.dtype],
                "flat_offset": frag.flat_offset,
                "numel": numel,
                "key": key,
                "meta": frag.meta,
            }
        )
    record["fragments"] = out
    record["file"] = {"name": rank_file_name(rank)}
    return record, to_write


def _write_planned(
    file_path: Path,
    record: dict[str, Any],
    to_write: list[tuple[str, Any]],
    checksum: str,
    profile: profiling.SaveProfile | None = None,
    label: str = "",
) -> dict[str, Any]:
    """Write a planned rank file (the tensors of ``to_write``) at ``file_path`` and complete
    its record (``label`` names the checkpoint on the progress bar)."""
    rank = record["rank"]
    written = _unique_sibling(file_path)
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "rank": str(rank)}
    shared = None
    if profile is not None and profile.asynchronous:
        shared = background.shared_staging(to_write)
    if shared is not None:  # the snapshot is in shared memory: the writer process writes it
        from accelkit.checkpoint.write import write_process

        shared_buffer, spans = shared
        try:
            process = shared_buffer.writer()
        except write_process.WriterUnavailable as err:
            log.warning("the checkpoint writer process is unavailable (%s); threads write", err)
            process = None
        if process is not None:
            digests = write_process.write_file(
                written, to_write, spans, process, metadata, checksum, profile
            )
            return _complete(record, digests, checksum, written, file_path)
    digests = _write_in_threads(
        written, label or file_path.name, rank, to_write, metadata, checksum, profile
    )
    return _complete(record, digests, checksum, written, file_path)


def _stream_planned(
    sink: Any,
    label: str,
    record: dict[str, Any],
    to_write: list[tuple[str, Any]],
    checksum: str,
    profile: profiling.SaveProfile | None = None,
) -> dict[str, Any]:
    """Write a planned rank file into ``sink`` (an object upload, part by part as it is
    written) instead of a local file; complete its record."""
    rank = record["rank"]
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "rank": str(rank)}
    prefix, _ = layout(to_write, metadata)
    total = len(prefix) + sum(t.numel() * t.dtype.itemsize for _, t in to_write)
    digests = _write_in_threads(sink, label, rank, to_write, metadata, checksum, profile)
    return _with_digests(record, digests, checksum, total)


def _write_in_threads(
    destination: Any,
    label: str,
    rank: int,
    to_write: list[tuple[str, Any]],
    metadata: dict[str, str],
    checksum: str,
    profile: profiling.SaveProfile | None,
) -> dict[str, str]:
    workers = max(1, min(8, (os.cpu_count() or 2)))
    initializer = None
    if profile is not None and profile.asynchronous:
        # beside a training loop: two threads at a lower priority keep up with the disk, and
        # leave the loop its CPU and its GIL (eight made a launch-bound step 10% slower)
        workers, initializer = min(workers, ASYNC_WRITERS), _lower_priority
    bar = progress.rank_zero_bar(
        sum(t.numel() * t.element_size() for _, t in to_write), rank, f"saving {label}"
    )
    with ThreadPoolExecutor(max_workers=workers, initializer=initializer) as pool:
        digests = write_file(
            destination,
            to_write,
            metadata,
            pool=pool,
            checksum=checksum,
            profile=profile,
            progress=bar,
        )
    progress.close(bar)
    return digests


def _unique_sibling(file_path: Path) -> Path:
    """A name next to ``file_path`` that no other save and no other process uses: a rank file
    is written under it and renamed once complete, so bytes a dead run's writer sends late
    never land in a file of the same name that a restarted run writes."""
    return file_path.with_name(f".{file_path.name}.{os.getpid()}-{secrets.token_hex(6)}.part")


def _complete(
    record: dict[str, Any], digests: dict[str, str], checksum: str, written: Path, file_path: Path
) -> dict[str, Any]:
    """Give the finished file ``written`` its name ``file_path``; the rank's record with each
    fragment's checksum and the file's size."""
    try:
        os.rename(written, file_path)  # the directory's fsync at the commit makes it durable
    except FileNotFoundError as err:
        raise CheckpointError(
            f"{file_path.parent} was removed while this save wrote {file_path.name}: another "
            "job writes here (its save of the same name swept this one's files), or something "
            "else removed them; nothing was committed. Give each job its own location."
        ) from err
    return _with_digests(record, digests, checksum, file_path.stat().st_size)


def _with_digests(
    record: dict[str, Any], digests: dict[str, str], checksum: str, nbytes: int
) -> dict[str, Any]:
    for rec in record["fragments"]:
        rec["digest"] = digests.get(rec["key"], "")
        rec["algorithm"] = checksum
    record["file"] = {"name": record["file"]["name"], "bytes": nbytes}
    return record


def _lower_priority() -> None:
    """Lower the calling thread's scheduling priority (Linux: a thread is a task of its own)."""
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _merge_optimizer_groups(infos: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Under pipeline parallelism each stage's optimizer holds its own parameters: group ``g``
    of the saved optimizer lists every stage's names (in rank order, so stage order) and the
    per-parameter scalar state of all; the stages must agree on everything else."""
    for record in records[1:]:
        for name, info in (record.get("infos") or {}).items():
            mine = infos.get(name)
            if mine is None or mine.get("type") != "optimizer" or mine is info:
                continue
            groups, theirs = mine["param_groups"], info["param_groups"]
            if len(groups) != len(theirs):
                raise CheckpointError(
                    f"optimizer {name!r}: rank {record['rank']} has {len(theirs)} param groups, "
                    f"rank 0 {len(groups)}; every pipeline stage must build the optimizer with "
                    "the same groups"
                )
            for index, (group, other) in enumerate(zip(groups, theirs)):
                settings = {k: v for k, v in group.items() if k != "params"}
                if settings != {k: v for k, v in other.items() if k != "params"}:
                    raise CheckpointError(
                        f"optimizer {name!r}: param group {index} has other settings on rank "
                        f"{record['rank']} than on rank 0 ({settings}); pipeline stages must "
                        "share their hyperparameters (one optimizer over the whole model)"
                    )
                seen = set(group["params"])
                group["params"] += [p for p in other["params"] if p not in seen]
            for pname, value in (info.get("scalar_state") or {}).items():
                mine.setdefault("scalar_state", {}).setdefault(pname, value)


def _build_manifest(
    backend: Any,
    accel: Any,
    records: list[dict[str, Any]],
    state_keys: list[str],
    step: Any,
    created_unix_ns: int | None = None,
) -> tuple[Manifest, dict[str, Any]]:
    main = records[0]
    entries: dict[tuple[str, str, str], TensorEntry] = {}
    for record in records:
        for rec in record["fragments"]:
            label = (rec["object"], rec["kind"], rec["fqn"])
            entry = entries.get(label)
            if entry is None:
                entry = TensorEntry(
                    rec["object"], rec["fqn"], rec["kind"], tuple(rec["shape"]), rec["dtype"]
                )
                entries[label] = entry
            elif entry.shape != tuple(rec["shape"]) or entry.dtype != rec["dtype"]:
                raise CheckpointError(
                    f"tensor {entry.label}: rank {record['rank']} reports shape {rec['shape']} "
                    f"{rec['dtype']}, another rank {list(entry.shape)} {entry.dtype}"
                )
            for key, value in (rec.get("meta") or {}).items():
                entry.meta.setdefault(key, value)
            if rec["numel"]:
                entry.fragments.append(
                    FragmentRecord(
                        record["file"]["name"],
                        rec["key"],
                        rec["flat_offset"],
                        rec["numel"],
                        rec["digest"],
                        rec.get("algorithm", "sha256"),
                    )
                )
    tensors = sorted(
        entries.values(), key=lambda t: (t.object.startswith("__"), t.object, t.kind, t.fqn)
    )
    for t in tensors:
        t.fragments.sort(key=lambda f: f.flat_offset)
    _merge_optimizer_groups(main["infos"], records)
    objects = {}
    for name in [*state_keys, *(k for k in main["infos"] if k not in state_keys)]:
        info = main["infos"].get(name)
        if info is None:
            info = {"type": "module" if any(t.object == name for t in tensors) else "unknown"}
        objects[name] = info
    for record in records[1:]:  # rank 0's first: where two ranks hold a value, its is kept
        for name, per_param in record.get("scalar_state", {}).items():
            merged = objects.get(name, {}).setdefault("scalar_state", {})
            for pname, values in per_param.items():
                merged.setdefault(pname, values)
    try:
        import safetensors

        st_version = safetensors.__version__
    except (ImportError, AttributeError):  # pragma: no cover
        st_version = "?"
    from accelkit.version import __version__

    data: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_unix_ns": time.time_ns() if created_unix_ns is None else created_unix_ns,
        "writer": {
            "backend": backend.name,
            "accelkit": __version__,
            "torch": torch.__version__,
            "safetensors": st_version,
            "python": platform.python_version(),
        },
        "world_size": len(records),
        "precision": getattr(backend.settings, "precision", None),
        "step": step,
        # the Accelerator's optimizer-step count, which load() restores (absent before 0.1.1)
        "applied_steps": getattr(accel, "applied_steps", None),
        "files": {
            r["file"]["name"]: {"rank": r["rank"], "bytes": r["file"]["bytes"]} for r in records
        },
        "objects": objects,
        "backend_state": main.get("backend_state", {}),
        "rng": {str(r["rank"]): r["rng"] for r in records if "rng" in r},
    }
    pipeline = getattr(backend.settings, "pipeline", None)
    if pipeline is not None:  # informational: a load at any layout ignores it
        data["pipeline"] = pipeline.describe()
    rank_states = {str(r["rank"]): r["rank_state"] for r in records if "rank_state" in r}
    if rank_states:
        data["rank_state"] = rank_states
    return Manifest(data, tensors), main.get("extras", {})


def finalize(
    path: Any,
    manifest: Manifest,
    extras: dict[str, Any],
    *,
    latest: bool,
    keep_last: int | None,
    writer: str = "",
    store: Any = None,
    save_id: str = "",
) -> None:
    """Rank 0's last step: ``extra.json`` and the manifest, committed by the store (a rename,
    or the manifest written last and conditionally); then the ``latest`` pointer and rotation,
    whose failures are warnings: the checkpoint is committed once its manifest is there."""
    from accelkit.checkpoint.store import store_for

    store = store or store_for(path)
    where = str(path)
    raw = None
    if extras:
        raw = (json.dumps({"extras": extras}, indent=1, allow_nan=False) + "\n").encode()
        manifest.data["files"][store.extras_name(save_id)] = {
            "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
        }
    try:
        manifest.validate()
    except CheckpointError as err:
        who = writer or manifest.data.get("writer", {}).get("backend", "?")
        raise CheckpointError(f"backend {who!r} wrote an inconsistent checkpoint: {err}") from err
    extras_name = store.extras_name(save_id)
    files = {n: i["bytes"] for n, i in manifest.data["files"].items() if n != extras_name}
    store.commit(where, save_id, manifest.to_json_text().encode(), files, raw)
    after = []
    if latest:
        after.append(("point latest at it", lambda: store.point_latest(where)))
    if keep_last is not None:
        after.append((f"rotate (keep_last={keep_last})", lambda: store.rotate(where, keep_last)))
    after.append(("remove what earlier saves left", lambda: store.sweep(where)))
    for doing, step in after:
        try:
            step()
        except Exception as err:  # the checkpoint is committed: say so, and go on
            log.warning(
                "saved %s (committed), but could not %s: %s. 'latest' and auto_resume follow "
                "past a stale pointer to the checkpoint of the highest step; the next save "
                "retries the cleanup.",
                store.display(where),
                doing,
                err,
            )


def save(
    accel: Any,
    path: str | os.PathLike,
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
) -> Path | str:
    """Write a portable checkpoint of ``state`` to ``path`` (a directory, or a location its
    store serves); see :mod:`accelkit.checkpoint`.

    ``exclude_frozen`` leaves out parameters with ``requires_grad=False`` (the manifest says so,
    and loading does not count them missing). ``checksum``: each fragment's checksum,
    ``"xxh3_128"`` (fast, the default) or ``"sha256"`` (cryptographic). ``asynchronous``:
    return once the state is copied to host memory; writing and committing go on in the
    background (:mod:`accelkit.checkpoint.write.background`)."""
    from accelkit.checkpoint.store import store_for

    store = store_for(path, storage_options)
    background.wait()  # the save in flight commits (or raises) before this one starts
    where = store.display(path) if store.scheme else str(Path(path).absolute())
    what = f"saving {where}"
    commit.roll_call("started", what)  # a rank that never comes is named, in time
    started = time.perf_counter()
    profile = profiling.SaveProfile(asynchronous=asynchronous)
    check_algorithm(checksum)
    if asynchronous:
        from accelkit.checkpoint.write import write_process

        write_process.enabled()  # a misspelt ACCELKIT_ASYNC_WRITER is refused now, not later
        write_process.stall_limits()  # and so is a malformed stall limit
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
    backend = backend_of(accel)
    rank = backend.rank
    objects = classify_state(state)
    if step is None:
        explicit = state.get("step")
        if isinstance(explicit, int) and not isinstance(explicit, bool):
            step = explicit
        elif hasattr(accel, "applied_steps"):
            step = accel.applied_steps
    # what the manifest records of the Accelerator, as of now (the commit may run later)
    counters = SimpleNamespace(applied_steps=getattr(accel, "applied_steps", None))

    distributed.refuse_different(where, "checkpoint paths to save()", _SAME_PATH, CheckpointError)
    group = commit.commit_group()  # every collective of the save runs on it, bounded
    save_id, error = secrets.token_hex(6), None
    with profile.phase("prepare"):
        if rank == 0:
            try:
                with commit.working("prepared"):  # a long sweep is not a dead rank 0
                    store.prepare(where, save_id)
            except Exception as err:
                error = err
        commit.report("prepared", error, what, group)
        save_id = distributed.all_gather_object(save_id, group)[0]  # rank 0's names the save
        blind = distributed.all_gather_object(
            None if rank == 0 else store.check_prepared(where, save_id), group
        )
    if any(blind):
        ranks = [r for r, tail in enumerate(blind) if tail]
        raise CheckpointError(f"{what}: rank(s) {ranks} {next(t for t in blind if t)}")

    planned, error = None, None
    try:
        with commit.working("planned"):  # pinning a large first snapshot takes its time
            with profile.phase("plan"):
                record, to_write = _plan_rank(backend, state, objects, rng, exclude_frozen)
                record["file"] = {"name": store.rank_file_name(rank, save_id)}
            if asynchronous:
                with profile.phase("stage"):
                    to_write = background.snapshot(to_write)
        planned = (record, to_write)
    except Exception as err:
        error = err
    commit.report("planned", error, what, group)
    assert planned is not None
    job = (backend, counters, store, where, save_id, *planned, list(state), step)
    options = {"checksum": checksum, "exclude_frozen": exclude_frozen, "profile": profile}
    options.update(latest=latest, keep_last=keep_last, started=started)
    result: Path | str = where if store.scheme else Path(where)
    if asynchronous:
        background.start(result, lambda: _write_and_commit(*job, group=group, **options))
        if rank == 0:
            log.info(
                "saving %s in the background (training stalled %.2f s for the snapshot)",
                where,
                time.perf_counter() - started,
            )
        return result
    _write_and_commit(*job, group=group, **options)
    return result


def _write_rank_file(
    store: Any,
    where: str,
    save_id: str,
    record: dict[str, Any],
    to_write: list[tuple[str, Any]],
    checksum: str,
    profile: profiling.SaveProfile,
) -> dict[str, Any]:
    """This rank's file, where its store has it written: streamed into a sink, or a local file
    (the store publishes it when the context exits)."""
    name, label = record["file"]["name"], where.rstrip("/").rsplit("/", 1)[-1]
    with store.open_rank_file(
        where, save_id, name, asynchronous=profile.asynchronous, profile=profile
    ) as target:
        if target.sink is not None:
            return _stream_planned(target.sink, label, record, to_write, checksum, profile)
        record = _write_planned(target.path, record, to_write, checksum, profile, label)
        to_write.clear()  # a snapshot's copies are released as soon as they are written
        return record


def _write_and_commit(
    backend: Any,
    counters: Any,
    store: Any,
    where: str,
    save_id: str,
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
) -> None:
    """Every rank writes its shards (its rank file); every rank reports; rank 0 writes the
    manifest and commits; every rank learns the outcome (:mod:`accelkit.checkpoint.write.agreement`:
    collectives on ``group``, each wait bounded)."""
    rank = record["rank"]
    profile.tensors = len(to_write)
    profile.nbytes = sum(t.numel() * t.dtype.itemsize for _, t in to_write)
    error = None
    with profile.phase("write"):
        try:
            with commit.working("written"):  # a long upload is not a dead rank
                record = _write_rank_file(
                    store, where, save_id, record, to_write, checksum, profile
                )
        except Exception as err:
            error = err
    for nested in ("fsync", "upload"):  # timed inside the write: each is its own phase
        profile.phases["write"] -= profile.phases.get(nested, 0.0)
    to_write.clear()  # a snapshot's device copies are released as soon as they are written
    with profile.phase("gather"):
        commit.report("written", error, f"saving {where}", group)
        records = _gather_to_rank0(record, group)

    error = None
    with profile.phase("commit"):
        if rank == 0:
            try:
                with commit.working("committed"):  # a long rotation is not a dead rank 0
                    manifest, extras = _build_manifest(backend, counters, records, state_keys, step)
                    if exclude_frozen:
                        manifest.data["excluded_frozen"] = True
                    finalize(
                        where,
                        manifest,
                        extras,
                        latest=latest,
                        keep_last=keep_last,
                        store=store,
                        save_id=save_id,
                    )
            except Exception as err:
                error = err
        commit.report("committed", error, f"saving {where}", group)
    profiling.record(profile)
    if profile.asynchronous:  # pin the next save's staging now, off the training thread
        background.grow_staging()
    if rank == 0:
        size = sum(r["file"]["bytes"] for r in records)
        elapsed = time.perf_counter() - started
        log.info("saved %s: %.3f GB in %.2f s", where, size / 1e9, elapsed)
