"""The default checkpoint hooks of :class:`~accelkit.backend.Backend`: whole tensors (or
DTensors) and torch optimizers, and optimizers whose state one rank owns per parameter.

``Backend.local_fragments``, ``load_fragments`` and ``check_load`` run these unless a backend
overrides them. They live here, in the format, so that the backend protocol never imports the
checkpoint package; the package installs this module into the protocol when it loads
(:func:`~accelkit.backend.set_checkpoint_defaults`). An optimizer for which the backend's
``owned_optimizer_state`` answers goes to :mod:`accelkit.checkpoint.shards.owned`; every other
object is dense.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from accelkit.checkpoint.shards.fragments import (
    Fragment,
    ObjectInfo,
    classify_state,
    dense_fragments,
    load_dense_fragments,
    param_owners,
)
from accelkit.checkpoint.shards.owned import load_owned, owned_fragments, owned_state
from accelkit.checkpoint.shards.validate import check_dense_load


def _owned(backend: Any, state: dict[str, Any]) -> tuple[Any, dict[str, Any], list[str]]:
    """The state's objects, the owned optimizers' states by name, the names of the others."""
    objects = classify_state(state)
    owned = {}
    for name, optimizer in objects.optimizers.items():
        if (found := owned_state(backend, optimizer)) is not None:
            owned[name] = found
    others = [name for name in (*objects.modules, *objects.optimizers) if name not in owned]
    return objects, owned, others


def local_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    """Every model and torch optimizer of ``state``, as this rank's dense fragments; an owned
    optimizer's state from the ranks that own it."""
    objects, owned, others = _owned(backend, state)
    if not owned:
        yield from dense_fragments(backend, state)
        return
    yield from dense_fragments(backend, state, names=others)
    owners = param_owners(objects.modules, backend)
    for name, found in owned.items():
        yield from owned_fragments(name, found, owners, backend.rank, backend.world_size)


def load_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    """Fill every model and torch optimizer of ``state`` from ``reader``; an owned optimizer's
    state into the ranks that own it now."""
    objects, owned, others = _owned(backend, state)
    load_dense_fragments(backend, reader, state, names=others if owned else None)
    owners = param_owners(objects.modules, backend)
    for name, found in owned.items():
        load_owned(reader, name, found, owners)


def check_load(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    """Check, writing nothing, that ``load_fragments`` fits ``state`` (owned optimizers against
    every rank's live state: :func:`~accelkit.checkpoint.shards.validate.check_dense_load`)."""
    check_dense_load(backend, reader, state)
