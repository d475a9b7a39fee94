"""The sharded-checkpoint kit: what every backend that shards its state writes and reads alike.

A sharded backend (DeepSpeed ZeRO, ColossalAI's LowLevelZero, FairScale FSDP, Apex's
DistributedFusedAdam) holds each trainable parameter on a rank as one contiguous range of the
parameter's flattened form, with its fp32 master and optimizer state in some flat tensor the
library's optimizer steps. Only the *reading of the library's partitioning* differs between
them; everything after that is the same and lives here, once:

- :class:`Slot` (one parameter's range on this rank and where its master sits) and
  :class:`Layout` (every slot of a model, plus the optimizer that steps them), which a plugin
  builds from its library's partitioning;
- :func:`ranged_fragments`, :func:`slot_fragments`, :func:`module_fragments` and
  :func:`slot_state_fragments`: the fragments a layout writes (split like a replica where every
  rank holds the same range);
- :func:`match_module_entries`, :func:`read_slot`, :func:`optimizer_load`: reading back, with the
  names matched, the saved param groups checked and copied, and new optimizer state made by
  :func:`new_state` / :func:`state_like`.

The helpers the dense path (:mod:`accelkit.checkpoint.fragments`) uses too are defined there and
exported from here, so a plugin imports its whole kit from one module. See docs/plugins.md,
"Checkpoints of a sharded backend".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.checkpoint.codec import encode
from accelkit.checkpoint.fragments import (
    BUFFER,
    MASTER,
    OPTIM_PREFIX,
    PARAM,
    Fragment,
    ModuleEntry,
    ObjectInfo,
    ReplicaPlanner,
    classify_state,
    fill_tensor,
    load_param_groups,
    match_module_entries,
    module_info,
    new_state,
    optimizer_info,
    param_group_names,
    param_owners,
    qualname,
    state_like,
    tensor_fragments,
    warn_family_mismatch,
    weights_entry,
)
from accelkit.errors import CheckpointError

__all__ = [
    "BUFFER",
    "MASTER",
    "OPTIM_PREFIX",
    "PARAM",
    "Fragment",
    "Layout",
    "ModuleEntry",
    "ObjectInfo",
    "OptimizerLoad",
    "ReplicaPlanner",
    "Slot",
    "check_shape",
    "classify_state",
    "fill_tensor",
    "match_module_entries",
    "module_fragments",
    "module_info",
    "new_state",
    "optimizer_info",
    "optimizer_load",
    "param_group_names",
    "param_owners",
    "qualname",
    "ranged_fragments",
    "read_slot",
    "scalar_tensor",
    "slot_fragments",
    "slot_state_fragments",
    "state_like",
    "tensor_fragments",
    "weights_entry",
]


# ---- where each parameter's pieces live on this rank ----------------------------------------------
@dataclass
class Slot:
    """A trainable parameter's range on this rank: flat elements ``[start, start + count)`` of the
    parameter (of ``shape``), whose fp32 master is ``flat[offset : offset + count]``.

    ``flat`` is the tensor the library's optimizer keys the state by (a flat partition shared by
    many slots, or the parameter's own master); optimizer state of ``flat``'s shape holds the
    slot's range at the same place (:meth:`view`).
    """

    param: Any
    shape: tuple[int, ...]
    start: int
    count: int
    flat: torch.Tensor
    offset: int = 0
    group: int = 0
    #: every rank holds the same whole range (a replicated master): written split like a replica
    replicated: bool = False
    #: 1-D view of the working (low-precision) weights of the range; None: the master is them
    lp: torch.Tensor | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slot's range of a tensor shaped like ``flat`` (the master, or a state)."""
        return tensor.view(-1)[self.offset : self.offset + self.count]

    @property
    def master(self) -> torch.Tensor:
        return self.view(self.flat.detach())

    @property
    def separate_master(self) -> bool:
        """The working weights are a lower precision than the master: both are written."""
        return self.lp is not None and self.lp.dtype != self.flat.dtype


@dataclass
class Layout:
    """How a library holds a model's trainable state on this rank (``dense``: it does not shard,
    accelkit's dense writer and reader apply)."""

    kind: str = "dense"
    slots: dict[int, Slot] = field(default_factory=dict)  # id(param) -> slot
    #: optimizer param group -> the module parameters it trains (the same on every rank)
    groups: list[list[Any]] = field(default_factory=list)
    #: optimizer param group -> the flat tensors it steps on this rank
    flats: list[list[torch.Tensor]] = field(default_factory=list)
    base: Any = None  # the torch optimizer the library steps
    wrapper: Any = None  # the library's optimizer wrapper
    granularity: str = "param"  # "group": the optimizer keeps ``step`` per param group
    module: torch.nn.Module | None = None

    def add(self, slot: Slot) -> None:
        self.slots[id(slot.param)] = slot

    def by_flat(self) -> dict[int, Slot]:
        """id(flat) -> slot, where each slot has a flat of its own (a per-parameter master)."""
        return {id(slot.flat): slot for slot in self.slots.values()}


# ---- writing ---------------------------------------------------------------------------------------
def ranged_fragments(
    obj: str,
    fqn: str,
    kind: str,
    slot: Slot,
    local: torch.Tensor,
    planner: ReplicaPlanner,
    meta: dict[str, Any] | None = None,
) -> Iterator[Fragment]:
    """This rank's fragments of one tensor whose 1-D ``local`` covers the slot's range: all of
    it, or (a replicated slot) this rank's planned part, so every rank writes a disjoint part."""
    meta = {} if meta is None else meta
    if slot.replicated:
        ranges = planner.ranges(local.numel(), local.numel() * local.element_size())
        for start, size in ranges:
            data = local[start : start + size]
            yield Fragment(obj, fqn, kind, slot.shape, slot.start + start, data, meta)
        if not ranges:
            yield Fragment(obj, fqn, kind, slot.shape, 0, local[:0], meta)
        return
    yield Fragment(obj, fqn, kind, slot.shape, slot.start if slot.count else 0, local, meta)


def slot_fragments(
    obj: str, fqn: str, slot: Slot, planner: ReplicaPlanner, meta: dict[str, Any]
) -> Iterator[Fragment]:
    """A trained parameter's weights: the master as ``param``, or, where the working weights are
    of lower precision, those as ``param`` and the master as ``master``."""
    if slot.separate_master:
        yield from ranged_fragments(obj, fqn, PARAM, slot, slot.lp, planner, meta)
        yield from ranged_fragments(obj, fqn, MASTER, slot, slot.master, planner)
    else:
        yield from ranged_fragments(obj, fqn, PARAM, slot, slot.master, planner, meta)


def module_fragments(
    obj: str,
    targets: Iterable[ModuleEntry],
    layout: Layout,
    planner: ReplicaPlanner,
    unsharded: Callable[[str, torch.Tensor, dict[str, Any]], Iterable[Fragment] | None]
    | None = None,
) -> Iterator[Fragment]:
    """Module object ``obj``'s tensors: a parameter with a slot through it; any other through
    ``unsharded(fqn, tensor, meta)`` where that returns fragments (a library's partitioned
    frozen weights), else as a replica (buffers by rank 0, whose copy is authoritative)."""
    for fqn, tensor, is_param, aliases in targets:
        meta: dict[str, Any] = {"aliases": aliases}
        slot = layout.slots.get(id(tensor)) if is_param else None
        if slot is not None:
            yield from slot_fragments(obj, fqn, slot, planner, meta)
            continue
        if is_param and not tensor.requires_grad:
            meta["trainable"] = False
        special = unsharded(fqn, tensor, meta) if unsharded is not None and is_param else None
        if special is not None:
            yield from special
            continue
        kind, owner = (PARAM, None) if is_param else (BUFFER, 0)
        yield from tensor_fragments(obj, fqn, kind, tensor, planner, meta=meta, owner=owner)


def scalar_tensor(value: Any) -> torch.Tensor:
    """A 0-d state (``step``) as the 1-element tensor a fragment holds (a number: fp32, as
    torch's optimizers keep ``step``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)
    return torch.tensor([float(value)], dtype=torch.float32)


def slot_state_fragments(
    obj: str,
    pname: str,
    slot: Slot,
    values: dict[str, Any],
    planner: ReplicaPlanner,
    *,
    rank: int,
    scalar_state: dict[str, Any],
    number_steps: bool = False,
    where: str = "",
) -> Iterator[Fragment]:
    """The optimizer state ``values`` of ``flat``, cut to parameter ``pname``'s range.

    A state of ``flat``'s size is written over the slot's range; a 0-d state (or, with
    ``number_steps``, a ``step`` kept as a number) is the same on every rank, so rank 0 writes it
    and the others declare it; any other value goes to ``scalar_state`` (JSON).
    """
    for key, value in values.items():
        is_tensor = isinstance(value, torch.Tensor)
        kind = OPTIM_PREFIX + key
        if is_tensor and value.dim() > 0:
            if value.numel() != slot.flat.numel():
                raise CheckpointError(
                    f"{where}optimizer state {key!r} of {pname} has shape {list(value.shape)}, "
                    f"not the {list(slot.flat.shape)} of the flat tensor its optimizer steps; it "
                    "cannot be mapped back to the parameter"
                )
            local = slot.view(value.detach())
            yield from ranged_fragments(obj, pname, kind, slot, local, planner)
        elif is_tensor or (number_steps and key == "step" and isinstance(value, (int, float))):
            data = scalar_tensor(value)
            yield Fragment(obj, pname, kind, (), 0, data if rank == 0 else data[:0])
        else:
            where_key = f"{obj}/state/{pname}/{key}"
            scalar_state.setdefault(pname, {})[key] = encode(value, where_key)


# ---- reading ---------------------------------------------------------------------------------------
def check_shape(reader: Any, entry: Any, shape: tuple[int, ...], what: str = "target") -> None:
    """Refuse to load a saved tensor into a target of another shape, naming both."""
    if tuple(entry.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) has shape "
            f"{list(entry.shape)}, the {what} has {list(shape)}"
        )


@torch.no_grad()
def read_slot(
    reader: Any, entry: Any, slot: Slot, target: torch.Tensor, *, zero_rest: bool = False
) -> None:
    """Read the slot's range of ``entry`` into its place in ``target`` (shaped like ``flat``);
    ``zero_rest`` zeroes what follows it (the padding of an equal split)."""
    if slot.count:
        reader.read_flat(entry, slot.start, slot.count, out=slot.view(target))
    if zero_rest:
        target.view(-1)[slot.offset + slot.count :].zero_()


@dataclass
class OptimizerLoad:
    """What a checkpoint holds for one optimizer: its manifest record, each parameter's saved
    tensors (``per_param[name][key]``) and JSON scalars (``scalars[name][key]``)."""

    info: dict[str, Any]
    names: list[list[str]]
    per_param: dict[str, dict[str, Any]]
    scalars: dict[str, dict[str, Any]]

    @property
    def empty(self) -> bool:
        """Saved before the first step: no parameter has state."""
        return not any(self.per_param.get(n) or self.scalars.get(n) for r in self.names for n in r)


def optimizer_load(
    reader: Any,
    name: str,
    opt: Any,
    groups: list[dict[str, Any]],
    param_groups: Iterable[Iterable[Any]],
    owners: dict[int, tuple[str, str]],
    names: list[list[str]] | None = None,
) -> OptimizerLoad:
    """Start loading optimizer ``name``: name the module parameters each of ``groups`` trains
    (``param_groups``, or ``names`` as given) as the checkpoint does, check the saved groups hold
    the same parameters and copy their hyperparameters into ``groups``, warn where the saved
    family (adam, sgd, ...) is not ``opt``'s."""
    info = reader.object_info(name, "optimizer")
    if names is None:
        names, _ = param_group_names(param_groups, owners, primary=info.get("model"))
    load_param_groups(reader, name, info, groups, names)
    warn_family_mismatch(name, info, opt)
    return OptimizerLoad(info, names, reader.optimizer_entries(name), info.get("scalar_state", {}))
