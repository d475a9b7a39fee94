"""DeepSpeed state in the portable checkpoint (docs/architecture.md, "The portable checkpoint").

Each rank writes the ranges of each parameter it holds, as fragments of the parameter's
flattened form, and reads back the ranges it holds now, whatever world size or backend wrote the
checkpoint. Nothing is gathered.

- **ZeRO-1/2** (and DeepSpeed's BF16_Optimizer): a trainable parameter's fp32 master and
  optimizer state live in a flat partition per param group; ``param._hp_mapping`` says which
  elements of the parameter (``lp_fragment_address``) sit where in that partition
  (``hp_fragment_address``). A rank writes that range: the fp32 master (``master``, next to the
  bf16/fp16 weights as ``param``; or as ``param`` itself in fp32), and each optimizer state of
  the partition's shape (``optim:exp_avg``, ...), read from the base optimizer's state of the
  partition (ZeRO-1/2 link their per-parameter optimizer views only after the first step).
- **ZeRO-3**: parameter ``p`` of ``n`` elements is split in pieces of ``S = ceil(n / W)``; rank
  ``r`` holds flat elements ``[r*S, r*S + S)`` (cut at ``n``), its low-precision copy in
  ``p.ds_tensor`` and its fp32 master and optimizer state at ``grad_position`` in its sub-group's
  fp32 flat tensor: the same ranges DeepSpeed's ``safe_get_local_fp32_param`` /
  ``safe_get_local_optimizer_state`` return, read as views (no copy to the GPU under offload).
- **ZeRO-0** with fp32 weights (torch autocast included): the module and the user's torch
  optimizer as they are (accelkit's dense writer). ZeRO-0 with bf16/fp16 weights (DeepSpeed's
  FP16 optimizers): a whole fp32 master per parameter on every rank, written split like a replica.

DeepSpeed keeps ``step`` per param group (per flat partition); it is written for each parameter
of the group (a 0-d fp32 tensor, as torch's Adam keeps it) with ``"step_granularity":
"group"``. Loading per-parameter steps into a group warns; steps that differ within a group
raise under ``strict`` (otherwise: a warning and the largest). Frozen parameters are written as
their low-precision weights (``"trainable": false``), buffers by rank 0. After the fp32 masters
are loaded the low-precision weights are refreshed from them (ZeRO-1/2: DeepSpeed's
``update_lp_params``; ZeRO-3: each ``ds_tensor``, then the persistent parameters re-gathered).

Several engines (one per model set up): each model and optimizer of the state goes through the
layout of the engine that holds it; objects no engine holds in a sharded layout (an
evaluation-only ZeRO-0 engine, a plain module) go through accelkit's dense writer. The backend
state keeps each engine's loss scale and counters in setup order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.checkpoint.codec import decode, encode
from accelkit.checkpoint.fqn import module_tensors, user_module
from accelkit.checkpoint.fragments import (
    BUFFER,
    MASTER,
    OPTIM_PREFIX,
    PARAM,
    Fragment,
    ObjectInfo,
    ReplicaPlanner,
    classify_state,
    dense_fragments,
    fill_tensor,
    load_dense_fragments,
    load_param_groups,
    optimizer_info,
    tensor_fragments,
    warn_family_mismatch,
)
from accelkit.checkpoint.writer import agree
from accelkit.errors import CheckpointError, UnsupportedError

log = logging.getLogger("accelkit")


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


# ---- where each parameter's pieces live on this rank -----------------------------------------
@dataclass
class Slot:
    """A trainable parameter's range on this rank: flat elements ``[start, start + count)`` of
    the parameter, whose fp32 master is ``flat[offset : offset + count]``."""

    param: torch.nn.Parameter
    shape: tuple[int, ...]
    start: int
    count: int
    #: the fp32 tensor the base optimizer keys this parameter's state by
    flat: torch.Tensor
    offset: int
    group: int
    #: every rank holds the same whole range (ZeRO-0's FP16 optimizers): written split
    replicated: bool = False
    #: 1-D view of the low-precision weights of the range (None: the parameter is the master)
    lp: torch.Tensor | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slot's range of a tensor shaped like ``flat`` (the master, or a state)."""
        return tensor.view(-1)[self.offset : self.offset + self.count]

    @property
    def master(self) -> torch.Tensor:
        return self.view(self.flat.detach())

    @property
    def separate_master(self) -> bool:
        return self.lp is not None and self.lp.dtype != self.flat.dtype


@dataclass
class Layout:
    """How the engine holds the model's trainable state on this rank."""

    kind: str = "dense"  # dense | hp_mapping | zero3 | fp16_replicated
    slots: dict[int, Slot] = field(default_factory=dict)  # id(param) -> slot
    #: base optimizer param group -> the module parameters it trains (the same on every rank)
    groups: list[list[torch.nn.Parameter]] = field(default_factory=list)
    #: base optimizer param group -> the fp32 tensors (flat partitions) it steps on this rank
    flats: list[list[torch.Tensor]] = field(default_factory=list)
    base: Any = None  # the torch optimizer DeepSpeed steps
    wrapper: Any = None  # engine.optimizer
    granularity: str = "group"
    module: torch.nn.Module | None = None


def _z3_range(param: Any) -> tuple[int, int]:
    """(start, count) of the flattened ZeRO-3 parameter this rank's ``ds_tensor`` holds."""
    import torch.distributed as dist

    group = getattr(param, "ds_process_group", None)
    rank = dist.get_rank(group=group) if dist.is_initialized() else 0
    size = int(param.ds_tensor.ds_numel)
    start = rank * size
    return start, max(0, min(size, int(param.ds_numel) - start))


def _check_not_on_nvme(backend: Any, param: Any) -> None:
    location = getattr(getattr(param, "ds_tensor", None), "final_location", None)
    if str(getattr(location, "value", location)) == "nvme":  # DeepSpeed also writes "not-nvme"
        raise UnsupportedError(
            f"{backend.name}: parameters offloaded to NVMe are not read or written by the "
            "portable checkpoint yet; use accel.save(..., format='native')"
        )


def layout_of(backend: Any, engine: Any = None) -> Layout:
    """This rank's layout of ``engine`` (default: the first one; ``dense`` before setup, and for
    ZeRO-0 with fp32 weights)."""
    engine = engine if engine is not None else backend.engine
    layout = Layout()
    if engine is None:
        return layout
    layout.module = engine.module
    wrapper = engine.optimizer
    layout.wrapper = wrapper
    base = getattr(wrapper, "optimizer", None)
    layout.base = base
    if hasattr(wrapper, "fp32_partitioned_groups_flat") and hasattr(wrapper, "grad_position"):
        _zero3_layout(backend, layout)
    elif any(hasattr(p, "_hp_mapping") for p in engine.module.parameters()):
        _hp_mapping_layout(layout)
    elif hasattr(wrapper, "fp16_groups") and (
        hasattr(wrapper, "fp32_groups") or hasattr(wrapper, "fp32_groups_flat")
    ):
        _fp16_layout(layout)
    elif any(hasattr(p, "ds_id") for p in engine.module.parameters()):
        layout.kind = "zero3"  # ZeRO-3 without an optimizer: partitioned weights only
        layout.base = None
    return layout


def _zero3_layout(backend: Any, layout: Layout) -> None:
    wrapper = layout.wrapper
    layout.kind = "zero3"
    swappable = getattr(wrapper, "_swappable_optimizer_subgroup", None)
    flats = wrapper.fp32_partitioned_groups_flat
    to_group = wrapper.sub_group_to_group_id
    count = len(layout.base.param_groups)
    layout.groups = [[] for _ in range(count)]
    layout.flats = [[] for _ in range(count)]
    for sub, params in enumerate(wrapper.fp16_groups):
        if swappable is not None and swappable(sub):
            raise UnsupportedError(
                f"{backend.name}: optimizer state swapped to NVMe is not read or written by the "
                "portable checkpoint yet; use accel.save(..., format='native')"
            )
        group = to_group[sub]
        layout.flats[group].append(flats[sub])
        for param in params:
            _check_not_on_nvme(backend, param)
            layout.groups[group].append(param)
            sub_group, offset, numel = wrapper.grad_position[wrapper.get_param_id(param)]
            start, count_here = _z3_range(param)
            if sub_group != sub or numel != param.ds_tensor.ds_numel:
                raise CheckpointError(  # pragma: no cover - a DeepSpeed invariant
                    f"{backend.name}: unexpected ZeRO-3 layout of a parameter of shape "
                    f"{list(param.ds_shape)}"
                )
            layout.slots[id(param)] = Slot(
                param,
                tuple(param.ds_shape),
                start,
                count_here,
                flats[sub],
                int(offset),
                group,
                lp=param.ds_tensor.detach().view(-1)[:count_here],
            )


def _hp_mapping_layout(layout: Layout) -> None:
    """ZeRO-1/2 (DeepSpeedZeroOptimizer) and BF16_Optimizer: ``_hp_mapping`` on each parameter."""
    wrapper = layout.wrapper
    layout.kind = "hp_mapping"
    flats = getattr(wrapper, "single_partition_of_fp32_groups", None)
    groups = getattr(wrapper, "bit16_groups", None)
    if flats is None:
        flats = wrapper.fp32_groups_flat_partition
        groups = wrapper.bf16_groups
    layout.groups = [list(g) for g in groups]
    layout.flats = [[flat] for flat in flats]
    for index, params in enumerate(groups):
        for param in params:
            mapping = getattr(param, "_hp_mapping", None)
            start = count = offset = 0
            if mapping is not None:
                start = int(mapping.lp_fragment_address.start)
                count = int(mapping.lp_fragment_address.numel)
                offset = int(mapping.hp_fragment_address.start)
            lp = param.detach().reshape(-1)[start : start + count]
            layout.slots[id(param)] = Slot(
                param, tuple(param.shape), start, count, flats[index], offset, index, lp=lp
            )


def _fp16_layout(layout: Layout) -> None:
    """ZeRO-0 with bf16/fp16 weights: a whole fp32 master per parameter on every rank, one
    tensor per parameter (unfused) or one flat per group (fused)."""
    wrapper = layout.wrapper
    layout.kind = "fp16_replicated"
    layout.groups = [list(g) for g in wrapper.fp16_groups]
    per_param = getattr(wrapper, "fp32_groups", None)
    layout.granularity = "param" if per_param is not None else "group"
    for index, params in enumerate(wrapper.fp16_groups):
        offset = 0
        if per_param is not None:
            layout.flats.append(list(per_param[index]))
        else:
            layout.flats.append([wrapper.fp32_groups_flat[index]])
        for j, param in enumerate(params):
            flat = per_param[index][j] if per_param is not None else wrapper.fp32_groups_flat[index]
            numel = param.numel()
            layout.slots[id(param)] = Slot(
                param,
                tuple(param.shape),
                0,
                numel,
                flat,
                offset if per_param is None else 0,
                index,
                replicated=True,
                lp=param.detach().reshape(-1),
            )
            offset += numel


# ---- which objects of the state each engine holds ---------------------------------------------
def _layouts(backend: Any) -> list[Layout]:
    """This rank's layout of every engine, in setup order (the same order on every rank)."""
    return [layout_of(backend, engine) for engine in getattr(backend, "engines", ())]


def _split_state(
    backend: Any, layouts: list[Layout], state: dict[str, Any]
) -> tuple[Any, dict[str, Layout], list[str]]:
    """The state's objects; the layout holding each model and optimizer an engine shards; the
    names of the others (written and read dense)."""
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


def _owners(backend: Any, objects: Any) -> dict[int, tuple[str, str]]:
    owners: dict[int, tuple[str, str]] = {}
    for name, module in objects.modules.items():
        for fqn, tensor, is_param, _aliases in module_tensors(user_module(module, backend)):
            if is_param:
                owners.setdefault(id(tensor), (name, fqn))
    return owners


def _group_names(
    layout: Layout, owners: dict[int, tuple[str, str]], primary: str | None = None
) -> tuple[list[list[str]], str | None]:
    counts: dict[str, int] = {}
    for params in layout.groups:
        for p in params:
            if id(p) in owners:
                counts[owners[id(p)][0]] = counts.get(owners[id(p)][0], 0) + 1
    if primary not in counts:
        primary = max(counts, key=counts.get) if counts else None
    names = []
    for g, params in enumerate(layout.groups):
        row = []
        for i, p in enumerate(params):
            owner = owners.get(id(p))
            if owner is None:
                row.append(f"param_groups.{g}.params.{i}")
            else:
                row.append(owner[1] if owner[0] == primary else f"{owner[0]}/{owner[1]}")
        names.append(row)
    return names, primary


# ---- writing ---------------------------------------------------------------------------------
def local_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    objects, held, others = _split_state(backend, _layouts(backend), state)
    if not held:
        yield from dense_fragments(backend, state)
        return
    if others:
        yield from dense_fragments(backend, state, names=others)
    planner = ReplicaPlanner(backend.rank, backend.world_size)
    for name, module in objects.modules.items():
        if name not in held:
            continue
        inner = user_module(module, backend)
        yield ObjectInfo(name, {"type": "module", "class": _qualname(inner)})
        yield from _module_fragments(backend, name, inner, held[name], planner)
    owners = _owners(backend, objects)
    for name in objects.optimizers:
        if name in held:
            yield from _optimizer_fragments(backend, name, held[name], owners, planner)


def _module_fragments(
    backend: Any, name: str, inner: torch.nn.Module, layout: Layout, planner: ReplicaPlanner
) -> Iterator[Fragment]:
    for fqn, tensor, is_param, aliases in module_tensors(inner):
        meta: dict[str, Any] = {"aliases": aliases}
        slot = layout.slots.get(id(tensor)) if is_param else None
        if slot is not None:
            if slot.separate_master:
                yield from _ranged(name, fqn, PARAM, slot, slot.lp, planner, meta)
                yield from _ranged(name, fqn, MASTER, slot, slot.master, planner, {})
            else:
                yield from _ranged(name, fqn, PARAM, slot, slot.master, planner, meta)
            continue
        if is_param and not tensor.requires_grad:
            meta["trainable"] = False
        if is_param and hasattr(tensor, "ds_id"):  # ZeRO-3, not trained: its partition
            _check_not_on_nvme(backend, tensor)
            start, count = _z3_range(tensor)
            local = tensor.ds_tensor.detach().view(-1)[:count]
            shape = tuple(tensor.ds_shape)
            yield Fragment(name, fqn, PARAM, shape, start if count else 0, local, meta)
            continue
        yield from tensor_fragments(
            name,
            fqn,
            PARAM if is_param else BUFFER,
            tensor,
            planner,
            meta=meta,
            owner=None if is_param else 0,
        )


def _ranged(
    obj: str,
    fqn: str,
    kind: str,
    slot: Slot,
    local: torch.Tensor,
    planner: ReplicaPlanner,
    meta: dict[str, Any],
) -> Iterator[Fragment]:
    """Fragments of one tensor whose local part covers the slot's range."""
    if slot.replicated:
        ranges = planner.ranges(local.numel(), local.numel() * local.element_size())
        for start, size in ranges:
            yield Fragment(
                obj, fqn, kind, slot.shape, slot.start + start, local[start : start + size], meta
            )
        if not ranges:
            yield Fragment(obj, fqn, kind, slot.shape, 0, local[:0], meta)
        return
    yield Fragment(obj, fqn, kind, slot.shape, slot.start if slot.count else 0, local, meta)


def _scalar_tensor(value: Any) -> torch.Tensor:
    """A per-group scalar (``step``) as the 0-d fp32 tensor torch's optimizers keep."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float32).reshape(-1).cpu()
    return torch.tensor([float(value)], dtype=torch.float32)


def _optimizer_fragments(
    backend: Any,
    name: str,
    layout: Layout,
    owners: dict[int, tuple[str, str]],
    planner: ReplicaPlanner,
) -> Iterator[Fragment | ObjectInfo]:
    base = layout.base
    if base is None:
        raise CheckpointError(f"{backend.name}: the engine has no optimizer to save")
    names, primary = _group_names(layout, owners)
    scalar_state: dict[str, Any] = {}
    rank = backend.rank
    for g, params in enumerate(layout.groups):
        for p, pname in zip(params, names[g]):
            slot = layout.slots[id(p)]
            values = base.state.get(slot.flat) or {}
            for key, value in values.items():
                is_tensor = isinstance(value, torch.Tensor)
                if is_tensor and value.dim() > 0:
                    if value.shape != slot.flat.shape:
                        raise CheckpointError(
                            f"{backend.name}: optimizer state {key!r} of {pname} has shape "
                            f"{list(value.shape)}, not its partition's {list(slot.flat.shape)}; "
                            "it cannot be mapped back to the parameter"
                        )
                    local = slot.view(value.detach())
                    yield from _ranged(name, pname, OPTIM_PREFIX + key, slot, local, planner, {})
                elif is_tensor or (key == "step" and isinstance(value, (int, float))):
                    # per group (per flat partition), the same on every rank: rank 0 writes it
                    if rank == 0:
                        data = _scalar_tensor(value)
                        yield Fragment(name, pname, OPTIM_PREFIX + key, (), 0, data)
                    else:
                        yield Fragment(name, pname, OPTIM_PREFIX + key, (), 0, _EMPTY)
                else:
                    scalar_state.setdefault(pname, {})[key] = encode(
                        value, f"{name}/state/{pname}/{key}"
                    )
    stage = getattr(backend, "stage", None)
    yield optimizer_info(
        name,
        base,
        names,
        primary,
        step_granularity=layout.granularity,
        scalar_state=scalar_state,
        sharding=f"deepspeed ZeRO-{stage} ({type(layout.wrapper).__name__}): each rank "
        "writes the flat ranges it holds",
    )


_EMPTY = torch.zeros(0, dtype=torch.float32)


# ---- reading ---------------------------------------------------------------------------------
def load_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    layouts = _layouts(backend)
    objects, held, others = _split_state(backend, layouts, state)
    if not held:
        load_dense_fragments(backend, reader, state)
        return
    refresh = []
    error = None
    try:  # this rank's reads only: no collective until every rank has read
        if others:
            load_dense_fragments(backend, reader, state, names=others)
        for layout in layouts:
            modules = [n for n in objects.modules if held.get(n) is layout]
            if modules:
                _read_modules(backend, reader, modules, objects, layout)
                refresh.append(layout)
    except Exception as err:
        error = err
    # A rank whose read failed (a corrupted or missing fragment) must not leave the others
    # waiting in the refresh's all-gather: every rank learns of it here and raises.
    agree(error, f"reading {reader.directory}")
    for layout in refresh:  # engine by engine, in setup order (the refresh is collective)
        _refresh_low_precision(layout)
    owners = _owners(backend, objects)
    for name in objects.optimizers:
        if name in held:
            _load_optimizer(backend, reader, name, held[name], owners)


def _read_modules(
    backend: Any, reader: Any, names: list[str], objects: Any, layout: Layout
) -> None:
    wrapper = layout.wrapper
    if layout.kind == "zero3" and hasattr(wrapper, "checkpoint_event_prologue"):
        wrapper.checkpoint_event_prologue()  # partition every parameter (persistent ones too)
    for name in names:
        _load_module(backend, reader, name, user_module(objects.modules[name], backend), layout)


def _refresh_low_precision(layout: Layout) -> None:
    """The low-precision weights from the fp32 masters just read (collective)."""
    wrapper = layout.wrapper
    if layout.kind == "hp_mapping":
        wrapper.update_lp_params()  # DeepSpeed's own: copy, then all-gather the partitions
    elif layout.kind == "zero3" and hasattr(wrapper, "checkpoint_event_epilogue"):
        wrapper.checkpoint_event_epilogue()  # re-gather the persistent parameters


def _shape_of(tensor: Any) -> tuple[int, ...]:
    return tuple(tensor.ds_shape) if hasattr(tensor, "ds_shape") else tuple(tensor.shape)


@torch.no_grad()
def _load_module(
    backend: Any, reader: Any, name: str, module: torch.nn.Module, layout: Layout
) -> None:
    saved = reader.module_entries(name)
    by_alias = {alias: entry for entry in saved.values() for alias in entry.aliases}
    used: set[str] = set()
    missing: list[str] = []
    plan = []
    for fqn, tensor, is_param, aliases in module_tensors(module):
        entry = saved.get(fqn) or by_alias.get(fqn)
        for alias in aliases:
            entry = entry or saved.get(alias) or by_alias.get(alias)
        if entry is None:
            missing.append(fqn)
            continue
        used.add(entry.fqn)
        used.update(a for a in aliases if a in saved)
        plan.append((entry, tensor, is_param))
    reader.check_keys(f"module {name!r}", missing, sorted(set(saved) - used))
    for entry, tensor, is_param in plan:
        shape = _shape_of(tensor)
        if shape != entry.shape:
            raise CheckpointError(
                f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) has shape "
                f"{list(entry.shape)}, the target has {list(shape)}"
            )
        master = reader.entry(name, MASTER, entry.fqn)
        source = master if master is not None else entry
        slot = layout.slots.get(id(tensor)) if is_param else None
        if slot is not None:
            if slot.count:
                reader.read_flat(source, slot.start, slot.count, out=slot.master)
            if layout.kind == "zero3" and slot.count:
                slot.lp.copy_(slot.master)  # the bf16/fp16 (or fp32) partition, from the master
            elif layout.kind == "fp16_replicated":
                slot.lp.copy_(slot.master)
            continue
        if is_param and hasattr(tensor, "ds_id"):  # ZeRO-3, not trained: its partition
            start, count = _z3_range(tensor)
            local = tensor.ds_tensor.data.view(-1)
            if count:
                reader.read_flat(source, start, count, out=local[:count])
            local[count:].zero_()
            continue
        fill_tensor(reader, source, tensor.data if is_param else tensor)


def _make_state_like(flat: torch.Tensor, entry: Any) -> torch.Tensor:
    from accelkit.checkpoint.safetensors_io import DTYPES_BY_NAME

    stored = DTYPES_BY_NAME[entry.dtype]
    dtype = flat.dtype if stored.is_floating_point else stored
    return torch.zeros(flat.shape, dtype=dtype, device=flat.device)


@torch.no_grad()
def _load_optimizer(
    backend: Any, reader: Any, name: str, layout: Layout, owners: dict[int, tuple[str, str]]
) -> None:
    base = layout.base
    if base is None:
        raise CheckpointError(f"{backend.name}: the engine has no optimizer to load into")
    info = reader.object_info(name, "optimizer")
    names, _ = _group_names(layout, owners, primary=info.get("model"))
    load_param_groups(reader, name, info, base.param_groups, names)
    warn_family_mismatch(name, info, base)
    per_param = reader.optimizer_entries(name)
    scalars = info.get("scalar_state", {})
    all_flats = [flat for flats in layout.flats for flat in flats]
    if not any(per_param.get(n) or scalars.get(n) for row in names for n in row):
        # saved before the first step: no state yet, as in a fresh engine
        for flat in all_flats:
            base.state.pop(flat, None)
        _relink(layout, all_flats)
        return
    for g, params in enumerate(layout.groups):
        group_scalars: dict[str, dict[str, float]] = {}
        for p, pname in zip(params, names[g]):
            slot = layout.slots[id(p)]
            flat_state = base.state.setdefault(slot.flat, {})
            for key, entry in per_param.get(pname, {}).items():
                if entry.shape == ():
                    group_scalars.setdefault(key, {})[pname] = float(reader.read(entry))
                    continue
                if entry.shape != slot.shape:
                    raise CheckpointError(
                        f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) has shape "
                        f"{list(entry.shape)}, the target parameter {list(slot.shape)}"
                    )
                target = flat_state.get(key)
                if not isinstance(target, torch.Tensor) or target.shape != slot.flat.shape:
                    target = flat_state[key] = _make_state_like(slot.flat, entry)
                if slot.count:
                    reader.read_flat(entry, slot.start, slot.count, out=slot.view(target))
            for key, value in scalars.get(pname, {}).items():
                value = decode(value)
                if key == "step" and isinstance(value, (int, float)):
                    group_scalars.setdefault(key, {})[pname] = float(value)
                else:
                    flat_state[key] = value
        for key, values in group_scalars.items():
            _set_group_scalar(reader, name, info, layout, g, key, values, names[g])
    _relink(layout, all_flats)


def _set_group_scalar(
    reader: Any,
    name: str,
    info: dict[str, Any],
    layout: Layout,
    group: int,
    key: str,
    values: dict[str, float],
    group_names: list[str],
) -> None:
    """Per-parameter scalars (``step``) into DeepSpeed's per-group (per-flat) state."""
    base = layout.base
    if layout.granularity == "param":
        for p, pname in zip(layout.groups[group], group_names):
            if pname in values:
                flat = layout.slots[id(p)].flat
                _put_scalar(base, base.state.setdefault(flat, {}), key, values[pname], flat)
        return
    distinct = sorted(set(values.values()))
    source = info.get("step_granularity", "param")
    if source != "group":
        log.warning(
            "optimizer %r: converting per-parameter %r values into DeepSpeed's per-group %r "
            "(param group %d: %s)",
            name,
            key,
            key,
            group,
            distinct[0] if len(distinct) == 1 else f"{len(distinct)} different values",
        )
    if len(distinct) > 1:
        message = (
            f"optimizer {name!r}: param group {group} holds parameters whose {key!r} differ in "
            f"{reader.directory} ({distinct[0]:g} .. {distinct[-1]:g}); DeepSpeed keeps one "
            f"{key!r} per param group"
        )
        if reader.strict:
            raise CheckpointError(message + " (pass strict=False to take the largest)")
        log.warning("%s; taking the largest", message)
    value = distinct[-1]
    for flat in layout.flats[group]:
        _put_scalar(base, base.state.setdefault(flat, {}), key, value, flat)


def _put_scalar(
    base: Any, flat_state: dict[str, Any], key: str, value: float, flat: torch.Tensor
) -> None:
    current = flat_state.get(key)
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    elif isinstance(current, (int, float)) and not isinstance(current, bool):
        flat_state[key] = type(current)(value)
    elif type(base).__module__.startswith("torch.optim"):
        group = base.param_groups[0] if base.param_groups else {}
        on_device = group.get("capturable") or group.get("fused")
        device = flat.device if on_device else torch.device("cpu")
        flat_state[key] = torch.tensor(value, dtype=torch.float32, device=device)
    else:  # DeepSpeed's fused/CPU Adam keep an int
        flat_state[key] = int(value) if float(value).is_integer() else value


def _relink(layout: Layout, flats: list[torch.Tensor]) -> None:
    """ZeRO-1/2: point each parameter's optimizer-state views at the state just loaded."""
    wrapper = layout.wrapper
    if layout.kind != "hp_mapping" or not hasattr(wrapper, "_hp_optimizer_states_linked"):
        return
    wrapper._hp_optimizer_states_linked = False
    if all(layout.base.state.get(flat) for flat in flats):
        wrapper._lazy_init_hp_params_optimizer_state()


# ---- the engine's own small state ---------------------------------------------------------------
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
_ENGINE_FIELDS = ("global_steps", "global_samples", "skipped_steps")


def engine_state(backend: Any) -> dict[str, Any]:
    """Every engine's loss scale and counters: one engine's as :func:`engine_state_of` gives
    them, several under ``"engines"``, in setup order."""
    engines = list(getattr(backend, "engines", ()))
    if len(engines) > 1:
        return {"engines": [engine_state_of(backend, engine) for engine in engines]}
    return engine_state_of(backend, engines[0]) if engines else {}


def load_engine_state(backend: Any, state: dict[str, Any]) -> None:
    """Restore what :func:`engine_state` saved: the i-th saved engine into the i-th engine set
    up (a count that differs is logged; the engines beyond the shorter list keep theirs)."""
    engines = list(getattr(backend, "engines", ()))
    if not engines or not state:
        return
    saved = state.get("engines", [state])
    if len(saved) != len(engines):
        log.warning(
            "%s: the checkpoint holds the loss scale and step counters of %d DeepSpeed "
            "engine(s), this accelerator has %d; restoring them in setup order for the first %d",
            backend.name,
            len(saved),
            len(engines),
            min(len(saved), len(engines)),
        )
    for engine, engine_saved in zip(engines, saved):
        load_engine_state_of(backend, engine, engine_saved)


def engine_state_of(backend: Any, engine: Any) -> dict[str, Any]:
    """One engine's DeepSpeed loss scale (16-true), torch GradScaler (16-mixed), step counters."""
    out: dict[str, Any] = {
        "engine": {k: int(getattr(engine, k)) for k in _ENGINE_FIELDS if hasattr(engine, k)}
    }
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and getattr(scaler, "dynamic", False):
        fields = {}
        for key in _SCALER_FIELDS:
            value = getattr(scaler, key, None)
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                fields[key] = value
        out["loss_scaler"] = fields
    grad_scaler = backend._grad_scaler(engine)
    if grad_scaler is not None:
        out["grad_scaler"] = {
            k: (v.item() if isinstance(v, torch.Tensor) else v)
            for k, v in grad_scaler.state_dict().items()
        }
    return out


def load_engine_state_of(backend: Any, engine: Any, state: dict[str, Any]) -> None:
    if not state:
        return
    for key, value in state.get("engine", {}).items():
        if hasattr(engine, key):
            setattr(engine, key, int(value))
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in state.get("loss_scaler", {}).items():
        if scaler is not None and hasattr(scaler, key):
            current = getattr(scaler, key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                setattr(scaler, key, value)
    grad_scaler = backend._grad_scaler(engine)
    if grad_scaler is not None and state.get("grad_scaler"):
        grad_scaler.load_state_dict(dict(state["grad_scaler"]))


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
