"""Optimizer state owned by one rank (ZeRO-1): written by its owner, read by whoever owns it now.

A backend says where such state lives with :meth:`~accelkit.backend.Backend.owned_optimizer_state`
(an :class:`~accelkit.backend.OwnedState`: the groups over the module's parameters, the live
state, which parameters this rank owns, the optimizer that steps). The dense hooks then route
the optimizer here:

- **write**: each owned parameter's tensors whole, from its owner; its other values (an ``int``
  or ``float`` a custom optimizer keeps per parameter) in the optimizer record's
  ``scalar_state``, which the writer merges from every rank;
- **read**: the saved groups checked and their hyperparameters copied (into the stepping
  optimizer's groups too), then the state of the parameters this rank owns now, at any world
  size, from any backend's checkpoint;
- **check**: the saved state keys against the live ones of *every* rank (one
  ``all_gather_object``): a rank that owns nothing yet, or a state that lives outside
  ``optimizer.state``, still refuses another optimizer's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from accelkit import distributed
from accelkit.checkpoint.shards.fragments import (
    Fragment,
    ObjectInfo,
    ReplicaPlanner,
    load_param_states,
    optimizer_info,
    optimizer_load,
    param_group_names,
    param_state_fragments,
)

#: the manifest's ``sharding`` note of an optimizer written this way
SHARDING = "by owner: each parameter's state written whole by the rank that owns it"


def owned_state(backend: Any, optimizer: Any) -> Any:
    """The backend's :class:`~accelkit.backend.OwnedState` of ``optimizer``, or None (a backend
    object without the hook, as in tools that pass a stand-in, counts as None)."""
    hook = getattr(backend, "owned_optimizer_state", None)
    return hook(optimizer) if callable(hook) else None


def _held(owned: Any) -> dict[Any, dict[str, Any]]:
    """The live state of the parameters this rank owns (by parameter, as ``state`` keys it)."""
    return {
        p: owned.state[p]
        for group in owned.groups
        for p in group["params"]
        if owned.owns(p) and p in owned.state
    }


def owned_fragments(
    name: str, owned: Any, owners: dict[int, tuple[str, str]], rank: int, world: int
) -> Iterator[Fragment | ObjectInfo]:
    """This rank's fragments of optimizer ``name`` (its owned parameters' state) and its record."""
    names, primary = param_group_names([g["params"] for g in owned.groups], owners)
    scalar_state: dict[str, Any] = {}
    planner = ReplicaPlanner(rank, world)
    yield from param_state_fragments(
        name, owned.groups, names, _held(owned), planner, scalar_state, owner=rank
    )
    yield optimizer_info(
        name,
        owned.optimizer,
        names,
        primary,
        groups=owned.groups,
        scalar_state=scalar_state,
        sharding=SHARDING,
    )


def load_owned(reader: Any, name: str, owned: Any, owners: dict[int, tuple[str, str]]) -> None:
    """Fill the state of the parameters this rank owns, and every group's hyperparameters."""
    params = [group["params"] for group in owned.groups]
    saved = optimizer_load(reader, name, owned.optimizer, owned.groups, params, owners)
    stepping = getattr(owned.optimizer, "param_groups", None)
    if stepping is not None and stepping is not owned.groups:
        for group, local in zip(owned.groups, stepping, strict=True):
            local.update({k: v for k, v in group.items() if k != "params"})
    load_param_states(reader, saved, owned.groups, owned.state, holds=owned.owns)


def live_state_keys(owned: Any) -> set[str]:
    """The state keys of every rank's owned parameters: a collective (the same call on every
    rank), so a rank that owns no state yet checks against the others'."""
    mine = sorted({key for values in _held(owned).values() for key in values})
    return {key for keys in distributed.all_gather_object(mine) for key in keys}
