"""The portable checkpoint: one format every backend writes and reads, at any world size.

A checkpoint is a directory::

    ckpt/
      accelkit.json            manifest: versions, world size, precision, step, objects, and
                               every tensor with its fragments and their checksums (XXH3-128 or SHA-256)
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
from accelkit.checkpoint.format.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, TensorEntry
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
from accelkit.checkpoint.store import store_for
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
    return Path(store_for(path).resolve(str(path)))


def save(
    accel: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Path | str:
    """Write a portable checkpoint of ``state`` to ``path``: a directory, or a location of
    object storage (``s3://bucket/prefix``, a plugin's ``gs://``; ``storage_options`` overrides
    the store's configuration). :func:`accelkit.checkpoint.write.writer.save` says what the
    keywords do; a scheme no store serves is refused."""
    return writer.save(accel, path, state, storage_options=storage_options, **kwargs)


def read_manifest(
    path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """The manifest of the checkpoint ``path`` names (after ``latest``), on any store."""
    store = store_for(path, storage_options)
    target = store.resolve(str(path))
    return _manifest(store, target, store.read_manifest(target), verify_checksum=False)


def _manifest(store: Any, target: str, raw: bytes, *, verify_checksum: bool = True) -> Manifest:
    directory = store.local_directory(target)
    source = str(directory / MANIFEST_NAME) if directory else store.child(target, MANIFEST_NAME)
    return Manifest.parse(raw, source, directory, verify_checksum=verify_checksum)


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
    unconsumed, _ = load_resolved(
        accel, path, state, strict=strict, rng=rng, verify=verify, storage_options=storage_options
    )
    return unconsumed


def load_resolved(
    accel: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
    rng: bool = True,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], Manifest]:
    """:func:`load`, and the manifest of the checkpoint it loaded: ``latest`` is resolved once
    and the manifest read once, so what the caller reads of it (``applied_steps``) is of the
    checkpoint whose weights it loaded, even while another job moves ``latest``."""
    from accelkit.checkpoint.write import background

    background.wait()  # an asynchronous save in flight commits first (it may be this one)
    backend = backend_of(accel)
    unconsumed: dict[str, Any] = {}
    manifest: Manifest | None = None
    error = None
    try:
        unconsumed, manifest = _load(
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
    assert manifest is not None
    return unconsumed, manifest


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
    store = store_for(source, storage_options)
    if store.is_checkpoint(str(source)):
        if rename is not None or strip_prefix or add_prefix:
            raise CheckpointError(
                f"{store.display(str(source))} is an accelkit checkpoint: its names are the "
                "model's own; rename, strip_prefix and add_prefix apply to safetensors sources "
                "only"
            )
        load(
            accel,
            source,
            {"model": model},
            strict=strict,
            rng=False,
            storage_options=storage_options,
        )
        return
    if store.local_directory(str(source)) is None:  # fetched to a local folder first
        from accelkit.checkpoint.read.pretrained import fetched_pretrained

        with fetched_pretrained(store, str(source)) as local:
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
    source = Path(source)
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
) -> tuple[dict[str, Any], Manifest]:
    """One load, on any store: ``latest`` resolved once, the manifest read once; a local
    directory is read in place, any other store through a partial local copy."""
    store = store_for(path, storage_options)
    profile = profiling.SaveProfile()
    with profile.phase("open"):
        target = store.resolve(str(path))
        raw = store.read_manifest(target)
        directory = store.local_directory(target)
    if directory is None:
        from accelkit.checkpoint.read import ranged_copy

        with ranged_copy.opened(
            store,
            target,
            raw,
            rank=backend.rank,
            world=backend.world_size,
            strict=strict,
            verify=verify,
            profile=profile,
        ) as reader:
            unconsumed = _load_from(backend, reader, state, rng=rng, profile=profile)
        profiling.record(profile, "load")
        return unconsumed, reader.manifest
    with profile.phase("open"):
        manifest = _manifest(store, target, raw)
        reader = CheckpointReader(directory, strict=strict, verify=verify, manifest=manifest)
    with reader:
        unconsumed = _load_from(backend, reader, state, rng=rng, profile=profile)
    profiling.record(profile, "load")
    return unconsumed, manifest


def _load_from(
    backend: Any,
    reader: CheckpointReader,
    state: dict[str, Any],
    *,
    rng: bool,
    profile: profiling.SaveProfile | None = None,
) -> dict[str, Any]:
    """Validate everything (no live object is touched), agree across ranks, then commit."""
    same_source.check_same_checkpoint(
        reader.manifest, reader.directory, getattr(reader, "versions", None)
    )
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
