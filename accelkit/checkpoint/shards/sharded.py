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

The helpers the dense path (:mod:`accelkit.checkpoint.shards.fragments`) uses too are defined there and
exported from here, so a plugin imports its whole kit from one module. See docs/plugins.md,
"Checkpoints of a sharded backend".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.checkpoint.format.codec import decode, encode
from accelkit.checkpoint.format.fqn import module_tensors, user_module
from accelkit.checkpoint.shards.fragments import (
    BUFFER,
    MASTER,
    OPTIM_PREFIX,
    PARAM,
    Fragment,
    ModuleEntry,
    ObjectInfo,
    OptimizerLoad,
    ReplicaPlanner,
    StateObjects,
    classify_state,
    dense_fragments,
    fill_tensor,
    load_param_groups,
    load_param_states,
    match_module_entries,
    module_info,
    new_state,
    optimizer_info,
    optimizer_load,
    param_group_names,
    param_owners,
    param_state_fragments,
    qualname,
    state_like,
    tensor_fragments,
    weights_entry,
)
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

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
    "check_group_scalars",
    "check_shape",
    "classify_state",
    "fill_tensor",
    "group_scalar",
    "held_objects",
    "load_param_groups",
    "load_param_states",
    "load_slot_states",
    "match_module_entries",
    "module_fragments",
    "module_info",
    "new_state",
    "optimizer_info",
    "optimizer_load",
    "optimizer_slot_fragments",
    "param_group_names",
    "param_owners",
    "param_state_fragments",
    "put_scalar",
    "qualname",
    "ranged_fragments",
    "read_slot",
    "scalar_tensor",
    "sharded_fragments",
    "slot_fragments",
    "slot_state_fragments",
    "state_like",
    "tensor_fragments",
    "Unsharded",
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
    #: 1-D view of the working (low-precision) weights of the range (default: the parameter's,
    #: where the parameter is a tensor other than ``flat``); None: the master is them
    lp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.lp is None and isinstance(self.param, torch.Tensor) and self.param is not self.flat:
            self.lp = self.param.detach().reshape(-1)[self.start : self.start + self.count]

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slot's range of a tensor shaped like ``flat`` (the master, or a state)."""
        return tensor.reshape(-1)[self.offset : self.offset + self.count]

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


#: a backend's writer of a parameter it does not train but still partitions (``obj, fqn, tensor,
#: meta``); None where the parameter is an ordinary replica
Unsharded = Callable[[str, str, torch.Tensor, dict[str, Any]], Iterable[Fragment] | None]


def held_objects(
    backend: Any, layouts: list[Layout], state: dict[str, Any]
) -> tuple[StateObjects, dict[str, Layout], list[str]]:
    """The state's objects; the layout holding each model (by its user module) and optimizer (the
    library's wrapper, or the torch optimizer it steps) that a library shards; the names of the
    others, which accelkit's dense writer and reader handle."""
    objects = classify_state(state)
    sharded = [layout for layout in layouts if layout.kind != "dense"]
    held: dict[str, Layout] = {}
    for name, module in objects.modules.items():
        inner = user_module(module, backend)
        for layout in sharded:
            if inner is layout.module:
                held[name] = layout
    for name, opt in objects.optimizers.items():
        for layout in sharded:
            if opt is layout.wrapper or opt is layout.base:
                held[name] = layout
    others = [n for n in (*objects.modules, *objects.optimizers) if n not in held]
    return objects, held, others


def sharded_fragments(
    backend: Any,
    state: dict[str, Any],
    layouts: list[Layout],
    optimizer_fragments: Callable[..., Iterator[Fragment | ObjectInfo]],
    *,
    entries: Callable[[torch.nn.Module], Iterable[ModuleEntry]] = module_tensors,
    unsharded: Unsharded | None = None,
) -> Iterator[Fragment | ObjectInfo]:
    """A sharded backend's ``local_fragments``: each model a layout holds through
    :func:`module_fragments` (its tensors listed by ``entries``), each optimizer through the
    backend's ``optimizer_fragments(name, opt, layout, owners, planner)``, the rest dense."""
    objects, held, others = held_objects(backend, layouts, state)
    if others or not held:
        yield from dense_fragments(backend, state, names=others if held else None)
    if not held:
        return
    planner = ReplicaPlanner(*backend.replica_holders())
    for name, module in objects.modules.items():
        if name in held:
            inner = user_module(module, backend)
            yield module_info(name, inner)
            yield from module_fragments(name, entries(inner), held[name], planner, unsharded)
    owners = param_owners(objects.modules, backend, entries)
    for name, opt in objects.optimizers.items():
        if name in held:
            yield from optimizer_fragments(name, opt, held[name], owners, planner)


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
    unsharded: Unsharded | None = None,
) -> Iterator[Fragment]:
    """Module object ``obj``'s tensors: a parameter with a slot through it; any other through
    ``unsharded(obj, fqn, tensor, meta)`` where that returns fragments (a library's partitioned
    frozen weights), else as a replica (buffers by rank 0, whose copy is authoritative)."""
    for fqn, tensor, is_param, aliases in targets:
        meta: dict[str, Any] = {"aliases": aliases}
        slot = layout.slots.get(id(tensor)) if is_param else None
        if slot is not None:
            yield from slot_fragments(obj, fqn, slot, planner, meta)
            continue
        if is_param and not tensor.requires_grad:
            meta["trainable"] = False
        special = unsharded(obj, fqn, tensor, meta) if unsharded is not None and is_param else None
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
    scalar_rank: int = 0,
    where: str = "",
) -> Iterator[Fragment]:
    """The optimizer state ``values`` of ``flat``, cut to parameter ``pname``'s range.

    A state of ``flat``'s size is written over the slot's range; a 0-d state (or, with
    ``number_steps``, a ``step`` kept as a number) is the same on every rank, so rank
    ``scalar_rank`` writes it and the others declare it; any other value goes to
    ``scalar_state`` (JSON).
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
            yield Fragment(obj, pname, kind, (), 0, data if rank == scalar_rank else data[:0])
        else:
            where_key = f"{obj}/state/{pname}/{key}"
            scalar_state.setdefault(pname, {})[key] = encode(value, where_key)


def optimizer_slot_fragments(
    name: str,
    opt: Any,
    slots: list[list[Slot]],
    states: Callable[[Slot], dict[str, Any]],
    owners: dict[int, tuple[str, str]],
    planner: ReplicaPlanner,
    *,
    rank: int,
    sharding: str,
    step_granularity: str = "param",
    number_steps: bool = False,
    where: str = "",
) -> Iterator[Fragment | ObjectInfo]:
    """A sharded optimizer: each param group's slots (in the group's order), the state of each
    (``states(slot)``, the optimizer's state of ``slot.flat``) cut to the slot's range, and the
    manifest record naming the parameters as every other backend does."""
    names, primary = param_group_names([[slot.param for slot in row] for row in slots], owners)
    scalar_state: dict[str, Any] = {}
    for row, pnames in zip(slots, names):
        for slot, pname in zip(row, pnames):
            yield from slot_state_fragments(
                name,
                pname,
                slot,
                states(slot),
                planner,
                rank=rank,
                scalar_state=scalar_state,
                number_steps=number_steps,
                where=where,
            )
    yield optimizer_info(
        name,
        opt,
        names,
        primary,
        step_granularity=step_granularity,
        scalar_state=scalar_state,
        sharding=sharding,
    )


# ---- reading ---------------------------------------------------------------------------------------
def put_scalar(container: dict[Any, Any], key: str, value: float) -> None:
    """Set a scalar a library keeps per group (``step``): into its tensor in place, else as a
    number (an int where it is whole, as the fused optimizers count)."""
    current = container.get(key)
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    else:
        container[key] = int(value) if float(value).is_integer() else value


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
    flat = target.view(-1)  # a view, never a copy: the read lands in ``target``
    if slot.count:
        reader.read_flat(
            entry, slot.start, slot.count, out=flat[slot.offset : slot.offset + slot.count]
        )
    if zero_rest:
        flat[slot.offset + slot.count :].zero_()


@torch.no_grad()
def load_slot_states(
    reader: Any,
    slot: Slot,
    state: dict[str, Any],
    entries: dict[str, Any],
    *,
    zero_rest: bool = False,
) -> dict[str, Any]:
    """Fill ``state`` (the optimizer's state of ``slot.flat``) with the slot's range of each
    saved state tensor, making one of ``flat``'s shape where it has none yet. Returns the saved
    0-d entries (``step``), which each library keeps its own way."""
    zero_d = {}
    for key, entry in entries.items():
        if entry.shape == ():
            zero_d[key] = entry
            continue
        check_shape(reader, entry, slot.shape, "target parameter")
        target = state.get(key)
        if not isinstance(target, torch.Tensor) or target.shape != slot.flat.shape:
            target = state[key] = new_state(slot.flat, entry)
        read_slot(reader, entry, slot, target, zero_rest=zero_rest)
    return zero_d


def check_group_scalars(
    reader: Any,
    name: str,
    library: str,
    key: str = "step",
    *,
    groups: dict[str, list[str]] | None = None,
    per: str = "param group",
) -> None:
    """Before anything is written: under ``strict``, the parameters that share one ``key``
    (``step``) in ``library`` hold one value in the checkpoint. ``groups`` names those sets
    (``{where: [parameter names]}``; default: each saved param group). A checkpoint whose
    parameters' steps differ within a set is refused here, while the live state is still whole,
    not halfway through the load (:func:`group_scalar` then only picks the value)."""
    info = reader.object_info(name, "optimizer")
    if not reader.strict or info.get("step_granularity", "param") == "group":
        return
    entries = reader.optimizer_entries(name)
    scalars = info.get("scalar_state", {}) or {}
    if groups is None:
        groups = {
            f"param group {index}": list(group.get("params", []))
            for index, group in enumerate(info.get("param_groups") or [])
            if isinstance(group, dict)
        }
    for where, names in groups.items():
        values: dict[str, float] = {}
        for pname in names:
            if key in entries.get(pname, {}):
                values[pname] = float(reader.read(entries[pname][key]))
            else:
                value = decode((scalars.get(pname) or {}).get(key))
                if isinstance(value, (int, float)):
                    values[pname] = float(value)
        if len(set(values.values())) > 1:
            group_scalar(
                reader, name, info, key, values, where, library, per=per, warn_conversion=False
            )


def group_scalar(
    reader: Any,
    name: str,
    info: dict[str, Any],
    key: str,
    values: dict[str, float],
    where: str,
    library: str,
    *,
    per: str = "param group",
    warn_conversion: bool = True,
) -> float:
    """The one value of a scalar a library keeps per param group (``step``), from the values
    its parameters have in the checkpoint: a conversion from per-parameter values is logged
    (``warn_conversion``); values that differ raise under ``strict``, else the largest is taken."""
    distinct = sorted(set(values.values()))
    if warn_conversion and info.get("step_granularity", "param") != "group":
        log.warning(
            "optimizer %r: converting per-parameter %ss into %s's per-group %s (%s: %s)",
            name,
            key,
            library,
            key,
            where,
            f"{distinct[0]:g}" if len(distinct) == 1 else f"{len(distinct)} different values",
        )
    if len(distinct) > 1:
        message = (
            f"optimizer {name!r}: {where} holds parameters whose {key!r} differ in "
            f"{reader.directory} ({distinct[0]:g} .. {distinct[-1]:g}); {library} keeps one "
            f"{key!r} per {per}"
        )
        if reader.strict:
            raise CheckpointError(message + " (pass strict=False to take the largest)")
        log.warning("%s; taking the largest", message)
    return distinct[-1]
