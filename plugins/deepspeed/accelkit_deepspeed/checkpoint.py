"""DeepSpeed state in the portable checkpoint (docs/architecture.md, "The portable checkpoint").

What is DeepSpeed's own: reading its partitioning into :class:`~accelkit.checkpoint.shards.sharded.Slot`
s (each rank writes and reads back the flat ranges it holds; the kit does that, nothing is
gathered), its per-group ``step``, refreshing its low-precision weights, its engine state.

- **ZeRO-1/2** (and DeepSpeed's BF16_Optimizer): a trainable parameter's fp32 master and
  optimizer state live in a flat partition per param group; ``param._hp_mapping`` says which
  elements of the parameter (``lp_fragment_address``) sit where in that partition
  (``hp_fragment_address``). State is read from the base optimizer's state of the partition
  (ZeRO-1/2 link their per-parameter optimizer views only after the first step).
- **ZeRO-3**: parameter ``p`` of ``n`` elements is split in pieces of ``S = ceil(n / W)``; rank
  ``r`` holds flat elements ``[r*S, r*S + S)`` (cut at ``n``), its low-precision copy in
  ``p.ds_tensor`` and its fp32 master and optimizer state at ``grad_position`` in its sub-group's
  fp32 flat tensor: the same ranges DeepSpeed's ``safe_get_local_fp32_param`` /
  ``safe_get_local_optimizer_state`` return, read as views (no copy to the GPU under offload).
- **ZeRO-0** with fp32 weights (torch autocast included): dense. ZeRO-0 with bf16/fp16 weights
  (DeepSpeed's FP16 optimizers): a whole fp32 master per parameter on every rank (replicated).

DeepSpeed keeps ``step`` per param group (per flat partition); it is written for each parameter
of the group with ``"step_granularity": "group"`` and loaded back by ``group_scalar``. After the
fp32 masters are loaded the low-precision weights are refreshed from them (ZeRO-1/2: DeepSpeed's
``update_lp_params``; ZeRO-3: each ``ds_tensor``, then the persistent parameters re-gathered).
Several engines: each has its layout (``held_objects`` routes the state's objects); the backend
state keeps each engine's loss scale and counters in setup order.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from accelkit.sdk import (
    PARAM,
    CheckpointError,
    Fragment,
    Layout,
    ObjectInfo,
    ReplicaPlanner,
    Slot,
    UnsupportedError,
    agree,
    check_group_scalars,
    check_shape,
    check_state_keys,
    decode,
    fill_tensor,
    group_scalar,
    held_objects,
    load_dense_fragments,
    load_slot_states,
    match_module_entries,
    module_tensors,
    optimizer_load,
    optimizer_slot_fragments,
    param_owners,
    put_scalar,
    read_slot,
    sharded_fragments,
    user_module,
    weights_entry,
)

log = logging.getLogger("accelkit")


def _z3_range(param: Any) -> tuple[int, int]:
    """(start, count) of the flattened ZeRO-3 parameter this rank's ``ds_tensor`` holds."""
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
    if engine is None:
        return Layout(granularity="group")
    wrapper = engine.optimizer
    base = getattr(wrapper, "optimizer", None)
    layout = Layout(granularity="group", base=base, wrapper=wrapper, module=engine.module)
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
            slot = Slot(param, tuple(param.shape), start, count, flats[index], offset, index)
            layout.add(slot)


def _fp16_layout(layout: Layout) -> None:
    """ZeRO-0 with bf16/fp16 weights: a whole fp32 master per parameter on every rank, one
    tensor per parameter (unfused) or one flat per group (fused)."""
    wrapper = layout.wrapper
    layout.kind = "fp16_replicated"
    layout.groups = [list(g) for g in wrapper.fp16_groups]
    per_param = getattr(wrapper, "fp32_groups", None)
    layout.granularity = "param" if per_param is not None else "group"
    for index, params in enumerate(wrapper.fp16_groups):
        fused = per_param is None
        flats = [wrapper.fp32_groups_flat[index]] if fused else list(per_param[index])
        layout.flats.append(flats)
        offset = 0
        for j, param in enumerate(params):
            flat, at = (flats[0], offset) if fused else (flats[j], 0)
            shape, numel = tuple(param.shape), param.numel()
            layout.add(Slot(param, shape, 0, numel, flat, at, index, replicated=True))
            offset += numel


# ---- which objects of the state each engine holds ---------------------------------------------
def _layouts(backend: Any) -> list[Layout]:
    """This rank's layout of every engine, in setup order (the same order on every rank)."""
    return [layout_of(backend, engine) for engine in getattr(backend, "engines", ())]


def check_optimizer_states(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    """Each optimizer an engine holds: the saved per-parameter state keys against those of its
    base optimizer's live state (over flat partitions, so the dense check cannot name them); a
    checkpoint of another optimizer is refused before anything is written."""
    objects, held, _ = held_objects(backend, _layouts(backend), state)
    for name in objects.optimizers:
        layout = held.get(name)
        if layout is not None and layout.base is not None:
            live = {key for values in layout.base.state.values() for key in values}
            check_state_keys(reader, name, live)
            if layout.granularity == "group":
                check_group_scalars(reader, name, "DeepSpeed")


# ---- writing ---------------------------------------------------------------------------------
def local_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    return sharded_fragments(
        backend,
        state,
        _layouts(backend),
        functools.partial(_optimizer_fragments, backend),
        unsharded=functools.partial(_zero3_partition, backend),
    )


def _zero3_partition(
    backend: Any, name: str, fqn: str, param: Any, meta: dict[str, Any]
) -> list[Fragment] | None:
    """A ZeRO-3 parameter no optimizer trains: this rank's partition of its weights."""
    if not hasattr(param, "ds_id"):
        return None
    _check_not_on_nvme(backend, param)
    start, count = _z3_range(param)
    local = param.ds_tensor.detach().view(-1)[:count]
    shape = tuple(param.ds_shape)
    return [Fragment(name, fqn, PARAM, shape, start if count else 0, local, meta)]


def _optimizer_fragments(
    backend: Any,
    name: str,
    _opt: Any,
    layout: Layout,
    owners: dict[int, tuple[str, str]],
    planner: ReplicaPlanner,
) -> Iterator[Fragment | ObjectInfo]:
    base = layout.base
    if base is None:
        raise CheckpointError(f"{backend.name}: the engine has no optimizer to save")
    stage = getattr(backend, "stage", None)
    return optimizer_slot_fragments(
        name,
        base,
        [[layout.slots[id(p)] for p in params] for params in layout.groups],
        lambda slot: base.state.get(slot.flat) or {},
        owners,
        planner,
        rank=backend.replica_holders()[0],  # a stage's first holder writes scalars
        sharding=f"deepspeed ZeRO-{stage} ({type(layout.wrapper).__name__}): each rank "
        "writes the flat ranges it holds",
        step_granularity=layout.granularity,
        number_steps=True,  # DeepSpeed's fused/CPU Adam keep an int per group
        where=f"{backend.name}: ",
    )


# ---- reading ---------------------------------------------------------------------------------
def load_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    layouts = _layouts(backend)
    objects, held, others = held_objects(backend, layouts, state)
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
    owners = param_owners(objects.modules, backend)
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
    for entry, tensor, is_param in match_module_entries(reader, name, module_tensors(module)):
        check_shape(reader, entry, _shape_of(tensor))
        source = weights_entry(reader, name, entry)
        slot = layout.slots.get(id(tensor)) if is_param else None
        if slot is not None:
            read_slot(reader, source, slot, slot.flat.detach())
            if slot.count and layout.kind in ("zero3", "fp16_replicated"):
                slot.lp.copy_(slot.master)  # the bf16/fp16 (or fp32) weights, from the master
            continue
        if is_param and hasattr(tensor, "ds_id"):  # ZeRO-3, not trained: its partition
            start, count = _z3_range(tensor)
            local = tensor.ds_tensor.data.view(-1)
            if count:
                reader.read_flat(source, start, count, out=local[:count])
            local[count:].zero_()
            continue
        fill_tensor(reader, source, tensor.data if is_param else tensor)


@torch.no_grad()
def _load_optimizer(
    backend: Any, reader: Any, name: str, layout: Layout, owners: dict[int, tuple[str, str]]
) -> None:
    base = layout.base
    if base is None:
        raise CheckpointError(f"{backend.name}: the engine has no optimizer to load into")
    saved = optimizer_load(reader, name, base, base.param_groups, layout.groups, owners)
    all_flats = [flat for flats in layout.flats for flat in flats]
    if saved.empty:  # saved before the first step: no state yet, as in a fresh engine
        for flat in all_flats:
            base.state.pop(flat, None)
        _relink(layout, all_flats)
        return
    for g, params in enumerate(layout.groups):
        group_scalars: dict[str, dict[str, float]] = {}
        for p, pname in zip(params, saved.names[g]):
            slot = layout.slots[id(p)]
            flat_state = base.state.setdefault(slot.flat, {})
            entries = saved.per_param.get(pname, {})
            for key, entry in load_slot_states(reader, slot, flat_state, entries).items():
                group_scalars.setdefault(key, {})[pname] = float(reader.read(entry))
            for key, value in saved.scalars.get(pname, {}).items():
                value = decode(value)
                if key == "step" and isinstance(value, (int, float)):
                    group_scalars.setdefault(key, {})[pname] = float(value)
                else:
                    flat_state[key] = value
        for key, values in group_scalars.items():
            _set_group_scalar(reader, name, saved.info, layout, g, key, values, saved.names[g])
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
    where = f"param group {group}"
    value = group_scalar(reader, name, info, key, values, where, "DeepSpeed")
    for flat in layout.flats[group]:
        _put_scalar(base, base.state.setdefault(flat, {}), key, value, flat)


def _put_scalar(
    base: Any, flat_state: dict[str, Any], key: str, value: float, flat: torch.Tensor
) -> None:
    current = flat_state.get(key)
    if isinstance(current, (int, float)) and not isinstance(current, bool):
        flat_state[key] = type(current)(value)
    elif current is None and type(base).__module__.startswith("torch.optim"):
        group = base.param_groups[0] if base.param_groups else {}
        on_device = group.get("capturable") or group.get("fused")
        device = flat.device if on_device else torch.device("cpu")
        flat_state[key] = torch.tensor(value, dtype=torch.float32, device=device)
    else:  # a tensor in place; DeepSpeed's fused/CPU Adam keep an int
        put_scalar(flat_state, key, value)


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
