"""The portable checkpoint: one format every backend writes and reads, at any world size.

A checkpoint is a directory::

    ckpt/
      accelkit.json            manifest: versions, world size, precision, step, objects, and
                               every tensor with its fragments and their SHA-256 checksums
      rank-00000.safetensors   rank 0's fragments (1-D ranges of flattened tensors) and RNG
      rank-00001.safetensors   ...written in parallel, no gather
      extra.json               the user's numbers and strings

``save`` and ``load`` are what :meth:`Accelerator.save` and :meth:`Accelerator.load` call.
The format is specified in docs/checkpoint.md. Nothing is unpickled on load.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from accelkit.backend import set_checkpoint_defaults
from accelkit.checkpoint import profile as profiling
from accelkit.checkpoint import progress
from accelkit.checkpoint.format import rng as rng_io
from accelkit.checkpoint.format.fqn import canonical_fqn
from accelkit.checkpoint.format.manifest import FORMAT_VERSION, Manifest, TensorEntry
from accelkit.checkpoint.read import same_source
from accelkit.checkpoint.read.reader import CheckpointReader
from accelkit.checkpoint.read.verify import verify_share
from accelkit.checkpoint.shards import dense
from accelkit.checkpoint.shards.fragments import (
    Fragment,
    ObjectInfo,
    classify_state,
    dense_fragments,
    load_dense_fragments,
)
from accelkit.checkpoint.shards.validate import Sections, read_sections
from accelkit.checkpoint.store import posix as storage
from accelkit.checkpoint.store import s3_client as objectstore
from accelkit.checkpoint.write import writer
from accelkit.checkpoint.write.writer import agree, backend_of, was_agreed
from accelkit.errors import CheckpointError, PartialLoadError

log = logging.getLogger("accelkit")

# Backend's checkpoint hooks default to the dense format (the protocol never imports it)
set_checkpoint_defaults(dense)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointReader",
    "Fragment",
    "Manifest",
    "ObjectInfo",
    "TensorEntry",
    "canonical_fqn",
    "dense_fragments",
    "load",
    "load_dense_fragments",
    "load_pretrained",
    "resolve",
    "save",
]


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names (itself, or its ``latest``)."""
    return storage.resolve(path)


def save(
    accel: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Path | str:
    """Write a portable checkpoint of ``state`` to ``path``: a directory
    (:func:`accelkit.checkpoint.write.writer.save`, whose keywords apply to both) or an object-storage
    location ``s3://bucket/prefix`` (:mod:`accelkit.checkpoint.store.s3`; ``storage_options``
    overrides the AWS_* configuration). A path with another scheme is refused."""
    where = objectstore.location(path)
    if where is None:
        _no_options(storage_options, path)
        return writer.save(accel, path, state, **kwargs)
    from accelkit.checkpoint.write import s3

    return s3.save(accel, where, state, storage_options=storage_options, **kwargs)


def read_manifest(
    path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """The manifest of the checkpoint ``path`` names (after ``latest``), local or s3://."""
    where = objectstore.location(path)
    if where is None:
        return Manifest.read(storage.resolve(path), verify_checksum=False)
    from accelkit.checkpoint.store import s3

    with s3.fetched(where, storage_options, manifest_only=True) as local:
        return Manifest.read(local, verify_checksum=False)


def _no_options(storage_options: dict[str, Any] | None, path: Any) -> None:
    if storage_options is not None:
        raise CheckpointError(
            f"storage_options apply to object storage (s3://bucket/prefix), not to the local "
            f"path {path}; leave them out"
        )


def load(
    accel: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
    rng: bool = True,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fill the objects of ``state`` in place from the checkpoint at ``path``.

    ``path`` is a checkpoint directory or a directory with a ``latest`` pointer, on disk or in
    object storage (``s3://bucket/prefix``; ``storage_options`` overrides the AWS_* settings). Models and
    optimizers are filled by the backend's ``load_fragments`` (this rank's ranges only);
    schedulers and other stateful objects through ``load_state_dict``; plain values in ``state``
    are replaced by the saved ones. Returns the saved values whose names are not in ``state``.
    With ``strict``, names in ``state`` missing from the checkpoint, and tensors missing on
    either side, raise :class:`~accelkit.errors.CheckpointError` listing all of them.
    ``rng`` restores this rank's RNG state (exact when the world size is unchanged).
    ``verify`` checks every fragment's checksum before anything is written.

    All or nothing: everything is validated first (manifest, files, checksums, keys, shapes,
    optimizer state keys, hyperparameter and section types) on every rank, and nothing live is
    written unless every rank passed; a failure there raises
    :class:`~accelkit.errors.CheckpointError` and changes nothing. Only an I/O error during the
    writes can leave objects partly loaded: that raises :class:`~accelkit.errors.PartialLoadError`.
    """
    from accelkit.checkpoint.write import background

    background.wait()  # an asynchronous save in flight commits first (it may be this one)
    backend = backend_of(accel)
    unconsumed: dict[str, Any] = {}
    error = None
    try:
        unconsumed = _load(
            backend,
            path,
            state,
            strict=strict,
            rng=rng,
            verify=verify,
            storage_options=storage_options,
        )
    except Exception as err:
        if was_agreed(err):  # every rank raises it already
            raise
        error = err
    agree(error, f"loading {path}")
    return unconsumed


def load_pretrained(
    accel: Any,
    model: Any,
    source: str | os.PathLike,
    *,
    strict: bool = True,
    rename: Any = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Fill ``model`` (set up on any backend) from pretrained weights; see
    :mod:`accelkit.checkpoint.read.pretrained`. An accelkit checkpoint loads its ``"model"``. An
    ``s3://`` source is downloaded to a temporary directory first (its safetensors files, with
    their index)."""
    from accelkit.checkpoint.read.pretrained import open_pretrained
    from accelkit.checkpoint.write import background

    background.wait()
    where = objectstore.location(source)
    if where is not None:
        from accelkit.checkpoint.read.pretrained import fetched_pretrained
        from accelkit.checkpoint.store import s3

        if s3.holds_checkpoint(where, storage_options):
            if rename is not None or strip_prefix or add_prefix:
                raise CheckpointError(
                    f"{where} is an accelkit checkpoint: its names are the model's own; rename, "
                    "strip_prefix and add_prefix apply to safetensors sources only"
                )
            load(
                accel,
                where,
                {"model": model},
                strict=strict,
                rng=False,
                storage_options=storage_options,
            )
            return
        with fetched_pretrained(where, storage_options) as local:
            load_pretrained(
                accel,
                model,
                local,
                strict=strict,
                rename=rename,
                strip_prefix=strip_prefix,
                add_prefix=add_prefix,
            )
        return
    _no_options(storage_options, source)
    source = Path(source)
    if source.is_dir() and (
        (source / "accelkit.json").is_file() or (source / storage.LATEST_NAME).is_file()
    ):
        if rename is not None or strip_prefix or add_prefix:
            raise CheckpointError(
                f"{source} is an accelkit checkpoint: its names are the model's own; rename, "
                "strip_prefix and add_prefix apply to safetensors sources only"
            )
        load(accel, source, {"model": model}, strict=strict, rng=False)
        return
    backend = backend_of(accel)
    reader, error = None, None
    try:
        reader = open_pretrained(
            source, strict=strict, rename=rename, strip_prefix=strip_prefix, add_prefix=add_prefix
        )
    except Exception as err:
        error = err
    agree(error, f"loading {source}")
    assert reader is not None
    with reader:
        _load_from(backend, reader, {"model": model}, rng=False)


def _load(
    backend: Any,
    path: Any,
    state: dict[str, Any],
    *,
    strict: bool,
    rng: bool,
    verify: bool,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    where = objectstore.location(path)
    profile = profiling.SaveProfile()
    if where is not None:  # object storage: the disk reader, over a copy fetched as it reads
        from accelkit.checkpoint.read import s3_copy as remote_load

        with remote_load.opened(
            where,
            storage_options,
            rank=backend.rank,
            world=backend.world_size,
            strict=strict,
            verify=verify,
            profile=profile,
        ) as reader:
            unconsumed = _load_from(backend, reader, state, rng=rng, profile=profile)
        profiling.record(profile, "load")
        return unconsumed
    _no_options(storage_options, path)
    with profile.phase("open"):
        directory = storage.resolve(path)
        reader = CheckpointReader(directory, strict=strict, verify=verify)
    with reader:
        unconsumed = _load_from(backend, reader, state, rng=rng, profile=profile)
    profiling.record(profile, "load")
    return unconsumed


def _load_from(
    backend: Any,
    reader: CheckpointReader,
    state: dict[str, Any],
    *,
    rng: bool,
    profile: profiling.SaveProfile | None = None,
) -> dict[str, Any]:
    """Validate everything (no live object is touched), agree across ranks, then commit."""
    same_source.check_same_checkpoint(reader.manifest, reader.directory)
    profile = profile or profiling.SaveProfile()
    error: BaseException | None = None
    try:
        tensor_state, sections = _validate(backend, reader, state, rng=rng, profile=profile)
    except Exception as err:
        if was_agreed(err):  # every rank raises it already
            raise
        error = err
    agree(error, f"loading {reader.directory}")  # no rank writes unless every rank validated
    try:
        return _commit(backend, reader, state, tensor_state, sections, rng=rng, profile=profile)
    except Exception as err:
        raise PartialLoadError(
            f"loading {reader.directory} failed after it began writing ({type(err).__name__}: "
            f"{err}). The models, optimizers and schedulers of the state now hold a mix of old "
            "and loaded values: do not train them; load a checkpoint again (this one once the "
            "cause is fixed, or an older one)."
        ) from err


def _validate(
    backend: Any,
    reader: CheckpointReader,
    state: dict[str, Any],
    *,
    rng: bool,
    profile: profiling.SaveProfile,
) -> tuple[dict[str, Any], Sections]:
    objects = classify_state(state)
    saved = reader.manifest.objects
    missing = [name for name in state if name not in saved]
    reader.check_keys("state", missing, [])
    expected_types = {"module": objects.modules, "optimizer": objects.optimizers}
    tensor_state = {}
    for name, obj in state.items():
        if name not in saved:
            continue
        saved_type = saved[name].get("type")
        for kind, group in expected_types.items():
            if name in group and saved_type != kind:
                raise CheckpointError(
                    f"{reader.manifest_path}: {name!r} is a {saved_type} in the checkpoint, "
                    f"a {kind} in the state"
                )
        if name in objects.modules or name in objects.optimizers:
            tensor_state[name] = obj
    error: BaseException | None = None
    try:
        with profile.phase("headers"):
            reader.check_headers()
        with profile.phase("verify"):
            if reader.verify:  # every fragment checked once, the work split over the ranks
                verify_share(reader, backend.rank, backend.world_size)
    except Exception as err:
        error = err
    # the checks so far are rank-local and may fail on one rank only; a backend's check_load may
    # run collectives (a sharded module's state_dict gathers), so every rank learns the outcome
    # first, or a rank that failed leaves the others waiting in that collective
    with profile.phase("verify"):
        agree(error, f"loading {reader.directory}")
    with profile.phase("check"):
        if tensor_state and getattr(backend.settings, "pipeline", None) is not None:
            # each stage checks its own tensors: a failure on one must stop every rank
            # before any writes (the other stages' checks pass)
            reader.held_anywhere = _held_anywhere(backend, reader, tensor_state)
            failure: BaseException | None = None
            try:
                backend.check_load(reader, tensor_state)
            except Exception as err:
                failure = err
            agree(failure, f"loading {reader.directory}")
        elif tensor_state:
            backend.check_load(reader, tensor_state)
    with profile.phase("sections"):
        sections = read_sections(backend, reader, state, rng=rng)
    return tensor_state, sections


def _held_anywhere(backend: Any, reader: CheckpointReader, state: dict[str, Any]) -> dict[str, Any]:
    """Under pipeline parallelism a rank holds one stage: ``strict`` compares the checkpoint
    with what every rank holds. Per module object, the names held on any rank; per optimizer,
    each group's names on any rank (one collective)."""
    from accelkit import distributed
    from accelkit.checkpoint.format.fqn import module_tensors, user_module
    from accelkit.checkpoint.shards.fragments import param_group_names, param_owners

    objects = classify_state(state)
    mine: dict[str, Any] = {}
    for name, module in objects.modules.items():
        mine[name] = sorted(
            {
                n
                for fqn, _, _, aliases in module_tensors(user_module(module, backend))
                for n in (fqn, *aliases)
            }
        )
    owners = param_owners(objects.modules, backend)
    for name, opt in objects.optimizers.items():
        primary = (reader.manifest.objects.get(name) or {}).get("model")
        names, _ = param_group_names([g["params"] for g in opt.param_groups], owners, primary)
        mine[name] = names
    merged: dict[str, Any] = {}
    for theirs in distributed.all_gather_object(mine):
        for name, value in theirs.items():
            if name in objects.modules:
                merged.setdefault(name, set()).update(value)
            else:
                groups = merged.setdefault(name, [set() for _ in value])
                for group, names in zip(groups, value):
                    group.update(names)
    return merged


def _commit(
    backend: Any,
    reader: CheckpointReader,
    state: dict[str, Any],
    tensor_state: dict[str, Any],
    sections: Sections,
    *,
    rng: bool,
    profile: profiling.SaveProfile,
) -> dict[str, Any]:
    objects = classify_state(state)
    reader.trust_verified()  # the validate phase checked every fragment (or verify=False)
    with profile.phase("fill"):
        if tensor_state:
            bar = progress.rank_zero_bar(
                progress.read_estimate(backend, reader, tensor_state),
                backend.rank,
                f"loading {reader.directory.name}",
            )
            with progress.counting_reads(reader, bar):
                backend.load_fragments(reader, tensor_state)
        reader.finish()
    with profile.phase("restore"):
        return _restore(backend, reader, state, sections, objects, rng=rng)


def _restore(
    backend: Any,
    reader: CheckpointReader,
    state: dict[str, Any],
    sections: Sections,
    objects: Any,
    *,
    rng: bool,
) -> dict[str, Any]:
    """The commit's last part: the non-tensor state, in place."""
    for group in (objects.schedulers, objects.statefuls):
        for name, obj in group.items():
            if name in sections.states:
                obj.load_state_dict(sections.states[name])
    for name in objects.extras:
        if name in sections.extras:
            state[name] = sections.extras[name]
    if sections.backend_state is not None:
        backend.load_state_dict(sections.backend_state)
    if sections.rank_states is not None:
        backend.load_rank_state_dict(*sections.rank_states)
    if rng:
        if sections.rng is not None:
            rng_io.restore(*sections.rng)
            if reader.manifest.world_size != backend.world_size:
                log.warning(
                    "restored rank %d's RNG state from a checkpoint of world size %d (now %d): "
                    "random streams continue per rank, not as one run would",
                    backend.rank,
                    reader.manifest.world_size,
                    backend.world_size,
                )
        elif reader.manifest.data.get("rng"):
            log.warning("rank %d: the checkpoint has no RNG state for this rank", backend.rank)
    return sections.unconsumed
