"""DeepSpeed's own checkpoint format, when asked: ``accel.save(path, state, format="native")``.

The engine (model, fp32 masters, optimizer state) goes through ``engine.save_checkpoint`` /
``engine.load_checkpoint``; the rest of ``state`` (schedulers, the dataloader, other stateful
objects, plain values) rides in DeepSpeed's ``client_state``. It is pickled, as DeepSpeed's
files are, so loading it needs ``trust_pickle=True``, and even then every file DeepSpeed's
``load_checkpoint`` reads goes through accelkit's restricted unpickler with the classes
DeepSpeed's checkpoints hold (:mod:`accelkit_deepspeed.pickles`), never through DeepSpeed's
``torch.load(weights_only=False)``. ``accelkit convert --trust-pickle`` turns such a directory
into a portable checkpoint (:mod:`accelkit_deepspeed.importer`).

A native checkpoint holds one engine: with several models set up, ``state`` names the model (and
optimizer) of one of them, and only that engine's loss scale and counters go in.

Before ``load_checkpoint`` each rank reads the files it will load (:func:`read_ahead`: its zip
checksums, then the restricted unpickler), and the ranks agree on the outcome
(:func:`agree_readable`, one small all-gather): a missing, damaged or refused file on one rank
fails every rank at once with the same error, naming the rank and the file, instead of leaving
the other ranks waiting in DeepSpeed's collectives until the process group's timeout.
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accelkit.sdk import (
    CheckpointError,
    PickleRefused,
    UnsupportedError,
    check_same_files,
    classify_state,
    drop_callables,
    user_module,
)

CLIENT_KEY = "accelkit"


def _engine_parts(backend: Any, state: dict[str, Any]) -> tuple[Any, Any, list[str], list[str]]:
    """The engine whose model ``state`` holds, the state's objects, and that engine's names."""
    engines = list(backend.engines)
    if not engines:
        raise UnsupportedError(f"{backend.name}: call accel.setup() before a native save or load")
    objects = classify_state(state)
    inner = [user_module(m, backend) for m in objects.modules.values()]
    holding = [e for e in engines if any(m is e.module for m in inner)]
    if len(holding) > 1:
        raise UnsupportedError(
            f"{backend.name}: a native DeepSpeed checkpoint holds one engine, and state has the "
            f"models of {len(holding)}; save them with the portable format (the default), or "
            "one native checkpoint per model"
        )
    engine = holding[0] if holding else engines[0]
    modules = [n for n, m in objects.modules.items() if user_module(m, backend) is engine.module]
    optimizer = getattr(engine.optimizer, "optimizer", None)
    optimizers = [
        n for n, o in objects.optimizers.items() if o is engine.optimizer or o is optimizer
    ]
    strangers = [
        n for n in (*objects.modules, *objects.optimizers) if n not in (*modules, *optimizers)
    ]
    if strangers or len(modules) != 1:
        raise UnsupportedError(
            f"{backend.name}: a native DeepSpeed checkpoint holds the engine's model and "
            f"optimizer only (state has {strangers or 'no model'} besides); save the others "
            "with the portable format (the default)"
        )
    return engine, objects, modules, optimizers


@contextlib.contextmanager
def restricted_reads(
    engine: Any, path: str | os.PathLike, read: dict[str, Any] | None = None
) -> Iterator[None]:
    """For the duration, the files DeepSpeed's ``load_checkpoint`` reads go through accelkit's
    restricted unpickler: all of them go through ``engine.checkpoint_engine.load``, whose own
    reading is ``torch.load(weights_only=False)``. A universal checkpoint, which DeepSpeed
    reads with ``torch.load`` directly, is refused. ``read``: files already read (by
    :func:`read_ahead`), each handed over once instead of read again (and dropped from
    ``read``, so DeepSpeed alone holds it)."""
    from accelkit_deepspeed import pickles

    check_restrictable(engine, path)
    checkpoint_engine = engine.checkpoint_engine
    allowlist = pickles.native_allowlist()
    ready = read if read is not None else {}

    def load(path: str, map_location: Any = None) -> Any:
        key = os.path.abspath(path)
        if key in ready:
            return ready.pop(key)
        return pickles.load(path, allowlist, map_location=map_location)

    checkpoint_engine.load = load  # the instance's, over its class's method
    try:
        yield
    finally:
        del checkpoint_engine.load


def check_restrictable(engine: Any, path: str | os.PathLike, with_optimizer: bool = True) -> None:
    """Refuse a load in which DeepSpeed reads files outside its checkpoint engine, with
    ``torch.load(weights_only=False)``: a universal checkpoint, and ZeRO-3 without the optimizer
    (``zero_to_fp32`` then reads every rank's files)."""
    outside = (
        getattr(engine, "checkpoint_engine", None) is None or engine.load_universal_checkpoint()
    )
    if outside or (not with_optimizer and engine.zero_optimization_partition_weights()):
        raise UnsupportedError(
            f"{path}: this load makes DeepSpeed read files outside its checkpoint engine (a "
            "universal checkpoint, an engine without an optimizer, or ZeRO-3 without the "
            "optimizer in state), which accelkit cannot restrict; put the optimizer in state, "
            "or load a portable checkpoint instead (accelkit convert --trust-pickle)"
        )


def _resolved_tag(path: str | os.PathLike, tag: str | None) -> str | None:
    """The tag DeepSpeed's ``load_checkpoint`` will read: ``tag``, else the ``latest`` file's."""
    if tag is not None:
        return str(tag)
    latest = Path(path) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def files_to_read(
    engine: Any, path: str | os.PathLike, tag: str | None, with_optimizer: bool
) -> list[str]:
    """The files this rank's ``engine.load_checkpoint(path, tag)`` reads through the checkpoint
    engine, by DeepSpeed's own names for them: the model states (ZeRO-3: this rank's), and with
    the optimizer this rank's ZeRO optimizer states (an elastic checkpoint: every rank's, added
    by :func:`read_ahead` once the model file told how many). Missing ones are listed too."""
    resolved = _resolved_tag(path, tag)
    if resolved is None:  # no `latest`: DeepSpeed finds nothing, on every rank alike
        return []
    models = engine._get_all_ckpt_names(str(path), resolved)
    if len(models) == engine.mp_world_size:
        models = [models[engine.checkpoint_mp_rank]]
    elif not models:
        models = [engine._get_ckpt_name(str(path), resolved)]
    files = list(models)
    if _reads_optimizer_files(engine, with_optimizer) and not engine.zero_elastic_checkpoint():
        import torch.distributed as dist

        dp_rank = dist.get_rank(group=engine.optimizer.dp_process_group)
        files.append(_optimizer_file(engine, path, resolved, dp_rank))
    return [os.path.abspath(f) for f in files]


def _reads_optimizer_files(engine: Any, with_optimizer: bool) -> bool:
    return bool(
        with_optimizer and engine.zero_optimization() and not engine.zero_nvme_offload_optimizer()
    )


def _optimizer_file(engine: Any, path: str | os.PathLike, tag: str, dp_rank: int) -> str:
    """DeepSpeed's name for one rank's ZeRO optimizer states, or its older name where only that
    one exists (as ``_get_all_zero_checkpoint_names`` picks)."""
    name = engine._get_rank_zero_ckpt_name(
        str(path), tag, engine.checkpoint_mp_rank, dp_rank, engine.bfloat16_enabled()
    )
    older = name.replace("_optim_states.pt", "optim_states.pt")
    return older if not os.path.exists(name) and os.path.exists(older) else name


def _check_zip_checksums(file: str) -> None:
    """Every member of a ``torch.save`` zip file against the CRC-32 torch recorded for it: a
    flipped byte in a tensor's data otherwise loads silently (torch does not check them)."""
    with open(file, "rb") as raw:
        if raw.read(4) != b"PK\x03\x04":  # torch's legacy format: no checksums to check
            return
    try:
        with zipfile.ZipFile(file) as archive:
            for member in archive.infolist():
                if member.CRC == 0 and member.file_size:  # written without checksums
                    continue
                with archive.open(member) as data:
                    while data.read(1 << 24):
                        pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as err:
        raise CheckpointError(
            f"{file}: damaged ({err}); the file's bytes are not the ones DeepSpeed wrote. Load "
            "an earlier checkpoint, or copy this one again from where it was saved"
        ) from None


def read_ahead(
    engine: Any, path: str | os.PathLike, tag: str | None, with_optimizer: bool
) -> dict[str, Any]:
    """Each file :func:`files_to_read` names, checked (present, its zip checksums) and read
    through the restricted unpickler, by absolute path; raises on the first bad one."""
    from accelkit_deepspeed import pickles

    allowlist = pickles.native_allowlist()
    read: dict[str, Any] = {}

    def take(file: str) -> Any:
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{file}: missing from the native checkpoint; DeepSpeed needs it on this rank. "
                "Load a complete checkpoint (the same world size and ZeRO stage it was saved with)"
            )
        _check_zip_checksums(file)
        read[file] = pickles.load(file, allowlist, map_location="cpu")
        return read[file]

    for file in files_to_read(engine, path, tag, with_optimizer):
        take(file)
    if _reads_optimizer_files(engine, with_optimizer) and engine.zero_elastic_checkpoint():
        resolved = _resolved_tag(path, tag)
        saved = next(iter(read.values()), None) if resolved is not None else None
        world = saved.get("dp_world_size") if isinstance(saved, dict) else None
        for dp_rank in range(world if isinstance(world, int) else 0):
            take(os.path.abspath(_optimizer_file(engine, path, resolved, dp_rank)))
    return read


def agree_readable(path: str | os.PathLike, error: BaseException | None) -> None:
    """Every rank learns whether any rank's :func:`read_ahead` failed, and every rank then raises
    the same error, naming each failed rank and its message (one small all-gather on the default
    group, bounded by its timeout; the ranks arrive there as soon as their reads end)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    failed = [(rank, message) for rank, message in enumerate(messages) if message]
    if not failed:
        return
    detail = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
    text = (
        f"{path}: native DeepSpeed load stopped on every rank before DeepSpeed read anything, "
        f"as {len(failed)} of {len(messages)} ranks cannot read their files: {detail}"
    )
    refused = all(m.startswith(f"{PickleRefused.__name__}: ") for _, m in failed)
    agreed = PickleRefused(text) if refused else CheckpointError(text)
    raise agreed from error


def save(
    backend: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    from accelkit_deepspeed.checkpoint import engine_state_of

    engine, objects, _, _ = _engine_parts(backend, state)
    client: dict[str, Any] = {
        "schedulers": {n: drop_callables(s.state_dict(), n) for n, s in objects.schedulers.items()},
        "statefuls": {n: s.state_dict() for n, s in objects.statefuls.items()},
        "extras": dict(objects.extras),
        "backend": engine_state_of(backend, engine),
    }
    engine.save_checkpoint(
        str(path),
        tag=tag,
        client_state={CLIENT_KEY: client},
        exclude_frozen_parameters=exclude_frozen_parameters,
    )
    return Path(path)


def load(
    backend: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
    trust_pickle: bool = False,
    tag: str | None = None,
) -> dict[str, Any]:
    if not trust_pickle:
        raise CheckpointError(
            f"{path}: a native DeepSpeed checkpoint is pickled. Pass trust_pickle=True to read "
            "it with accelkit's restricted unpickler (tensors, plain containers, numpy values and "
            "the classes DeepSpeed's checkpoints hold, and no other global), or convert it "
            "once with `accelkit convert --trust-pickle` and load the portable copy."
        )
    from accelkit_deepspeed.checkpoint import load_engine_state_of

    engine, objects, _, optimizers = _engine_parts(backend, state)
    check_restrictable(engine, path, with_optimizer=bool(optimizers))
    read: dict[str, Any] = {}
    failure: BaseException | None = None
    try:
        read = read_ahead(engine, path, tag, with_optimizer=bool(optimizers))
    except Exception as err:  # any failure on one rank must reach the others, not strand them
        failure = err
    agree_readable(path, failure)
    resolved = _resolved_tag(path, tag)  # every rank's files of it, as rank 0 sees them
    check_same_files(Path(path) / resolved if resolved else path, path)
    with restricted_reads(engine, path, read):
        load_path, client = engine.load_checkpoint(
            str(path),
            tag=tag,
            load_module_strict=strict,
            load_optimizer_states=bool(optimizers),
            load_lr_scheduler_states=False,
        )
    if load_path is None:
        raise CheckpointError(f"{path}: DeepSpeed found no checkpoint to load there")
    saved = (client or {}).get(CLIENT_KEY, {})
    for group in ("schedulers", "statefuls"):
        mine = getattr(objects, group)
        for name, value in saved.get(group, {}).items():
            if name in mine:
                mine[name].load_state_dict(value)
            elif strict and name not in state:
                continue
    missing = [
        n
        for n in (*objects.schedulers, *objects.statefuls, *objects.extras)
        if n not in saved.get("schedulers", {})
        and n not in saved.get("statefuls", {})
        and n not in saved.get("extras", {})
    ]
    if missing and strict:
        raise CheckpointError(
            f"{path}: {missing} are not in this native checkpoint (pass strict=False to load "
            "what is there)"
        )
    for name in objects.extras:
        if name in saved.get("extras", {}):
            state[name] = saved["extras"][name]
    load_engine_state_of(backend, engine, saved.get("backend", {}))
    unconsumed: dict[str, Any] = {}
    for group in ("schedulers", "statefuls", "extras"):
        for name, value in saved.get(group, {}).items():
            if name not in state:
                unconsumed[name] = value
    return unconsumed
