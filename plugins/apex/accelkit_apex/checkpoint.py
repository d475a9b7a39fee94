"""Apex optimizers in accelkit's portable checkpoint.

**Per-group steps.** torch's Adam keeps ``step`` per parameter (a 0-d tensor in each parameter's
state); Apex's FusedAdam, FusedLAMB and FusedNovoGrad keep one ``step`` per param group (an int
in the group), DistributedFusedAdam one for the whole optimizer. The checkpoint always holds
torch's layout: a group's step is written for each parameter of the group that has state, as a
0-d fp32 tensor (``optim:step``), with ``"step_granularity": "group"`` in the manifest, and the
group's ``step`` entry is left out of the stored hyperparameters. So a torch AdamW resumes from
a FusedAdam checkpoint as it would from its own, and the reverse: loading per-parameter steps
into a group takes their common value (``accelkit.checkpoint.shards.sharded.group_scalar``).

**State dtype.** FusedAdam keeps ``exp_avg`` / ``exp_avg_sq`` in fp32 whatever the parameters'
dtype; state loaded into it is made fp32 (torch's bf16 state from ``bf16-true`` is upcast).

**DistributedFusedAdam** (``apex_distributed_adam``): parameters are replicas (written like
DDP's, each rank a disjoint part); the optimizer state lives in flat buckets, sharded across
ranks. Each rank writes the ranges of each parameter that its shards hold
(``ParameterFragment.shard_param_range``), reads back the ranges it holds now, and refreshes
its fp32 copy of the parameters (``store_params``) from what was loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from accelkit.sdk import (
    MASTER,
    OPTIM_PREFIX,
    Fragment,
    ObjectInfo,
    Slot,
    UnsupportedError,
    check_shape,
    classify_state,
    decode,
    dense_fragments,
    group_scalar,
    load_dense_fragments,
    load_param_states,
    new_state,
    optimizer_info,
    optimizer_load,
    param_group_names,
    param_owners,
    put_scalar,
    read_slot,
    scalar_tensor,
    state_like,
)

#: Apex optimizers that keep ``step`` in each param group
GROUP_STEP_CLASSES = ("FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedMixedPrecisionLamb")
STEP = OPTIM_PREFIX + "step"


def keeps_group_steps(opt: torch.optim.Optimizer) -> bool:
    cls = type(opt)
    return cls.__module__.split(".")[0] == "apex" and cls.__name__ in GROUP_STEP_CLASSES


def is_distributed_adam(opt: torch.optim.Optimizer) -> bool:
    cls = type(opt)
    return cls.__module__.split(".")[0] == "apex" and cls.__name__ == "DistributedFusedAdam"


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0].item())
    return float(value)


# ---- apex: FusedAdam & co. on one device ------------------------------------------------------------
def local_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    """accelkit's dense fragments, with each Apex group step written per parameter."""
    objects = classify_state(state)
    grouped = {n: o for n, o in objects.optimizers.items() if keeps_group_steps(o)}
    owners = param_owners(objects.modules, backend) if grouped else {}
    for item in dense_fragments(backend, state):
        if isinstance(item, ObjectInfo) and item.object in grouped:
            yield from _with_steps(item, grouped[item.object], owners)
        else:
            yield item


def _with_steps(
    item: ObjectInfo, opt: torch.optim.Optimizer, owners: dict[int, tuple[str, str]]
) -> Iterator[Fragment | ObjectInfo]:
    info = dict(item.info)
    names, _ = param_group_names([g["params"] for g in opt.param_groups], owners)
    saved_groups = [dict(g) for g in info["param_groups"]]
    for group, saved, pnames in zip(opt.param_groups, saved_groups, names):
        saved.pop("step", None)
        if group.get("step") is None:
            continue  # not stepped yet: no state either
        value = _as_float(group["step"])
        for p, pname in zip(group["params"], pnames):
            if opt.state.get(p):
                yield Fragment(item.object, pname, STEP, (), 0, scalar_tensor(value))
    info.update(param_groups=saved_groups, step_granularity="group")
    yield ObjectInfo(item.object, info)


def load_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    objects = classify_state(state)
    grouped = [n for n, o in objects.optimizers.items() if keeps_group_steps(o)]
    load_dense_fragments(backend, reader, state, names=[n for n in state if n not in grouped])
    owners = param_owners(objects.modules, backend) if grouped else {}
    for name in grouped:
        load_group_step_optimizer(reader, name, objects.optimizers[name], owners)


@torch.no_grad()
def load_group_step_optimizer(
    reader: Any, name: str, opt: torch.optim.Optimizer, owners: dict[int, tuple[str, str]]
) -> None:
    """Fill an Apex optimizer that keeps per-group steps from any checkpoint."""
    params = [group["params"] for group in opt.param_groups]
    saved = optimizer_load(reader, name, opt, opt.param_groups, params, owners)
    # FusedAdam's moments are fp32 whatever the parameters' dtype
    moments = torch.float32 if type(opt).__name__ == "FusedAdam" else None

    def make(p: torch.Tensor, key: str, entry: Any, _group: Any) -> torch.Tensor:
        if key == "step":
            return state_like(p, key, entry)
        check_shape(reader, entry, tuple(p.shape), "parameter")
        return new_state(p, entry, float_dtype=moments)

    load_param_states(reader, saved, opt.param_groups, opt.state, make=make)
    for g, (group, pnames) in enumerate(zip(opt.param_groups, saved.names)):
        steps = {  # loaded per parameter, as torch keeps them; Apex keeps one in the group
            pname: _as_float(opt.state[p].pop("step"))
            for p, pname in zip(group["params"], pnames)
            if "step" in opt.state.get(p, {})
        }
        if steps:
            where = f"param group {g}"
            put_scalar(
                group, "step", group_scalar(reader, name, saved.info, "step", steps, where, "Apex")
            )


# ---- apex_distributed_adam: DistributedFusedAdam's sharded buckets ----------------------------------
def _slots(opt: Any, p: torch.Tensor) -> Iterator[tuple[Any, Slot]]:
    """(state bucket, slot) of each range of ``p`` in this rank's shards of the buckets: flat
    elements ``shard_param_range`` of ``p``, at ``shard_range`` of the bucket's shards."""
    for frag in opt.state[p].get("fragments", ()):
        start, end = frag.shard_range if frag.in_local_shard else (0, 0)
        if end > start:
            bucket = opt.state["buckets"][frag.bucket_id]
            shape, at = tuple(p.shape), frag.shard_param_range[0]
            yield bucket, Slot(p, shape, at, end - start, bucket.exp_avg_shard, start)


def check_flat_layout(opt: Any) -> None:
    """DistributedFusedAdam flattens channels-last 4-D parameters as (N, H, W, C)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if (
                p.dim() == 4
                and not p.is_contiguous()
                and p.is_contiguous(memory_format=torch.channels_last)
            ):
                raise UnsupportedError(
                    "apex_distributed_adam: a channels-last parameter of shape "
                    f"{list(p.shape)}: DistributedFusedAdam flattens it in (N, H, W, C) order, "
                    "which the portable checkpoint would store scrambled. Make the parameters "
                    "contiguous (model.to(memory_format=torch.contiguous_format)) before setup()"
                )


def distributed_adam_fragments(
    backend: Any, state: dict[str, Any]
) -> Iterator[Fragment | ObjectInfo]:
    objects = classify_state(state)
    sharded = {n: o for n, o in objects.optimizers.items() if is_distributed_adam(o)}
    for opt in backend_optimizers(backend, sharded.values()):
        opt.param_sync()  # finish an overlapped parameter all-gather: the weights are current
    yield from dense_fragments(backend, state, names=[n for n in state if n not in sharded])
    if not sharded:
        return
    owners = param_owners(objects.modules, backend)
    rank = backend.rank
    for name, opt in sharded.items():
        opt.init_params()  # every parameter's place in the buckets (a no-op once done)
        check_flat_layout(opt)
        names, primary = param_group_names([g["params"] for g in opt.param_groups], owners)
        step = _as_float(opt.state["step"])
        for group, pnames in zip(opt.param_groups, names):
            for p, pname in zip(group["params"], pnames):
                if not p.requires_grad:
                    continue  # frozen: no optimizer state and no master (the design's rule)
                shape = tuple(p.shape)
                owner = owners.get(id(p))
                for bucket, slot in _slots(opt, p):
                    for key in ("exp_avg", "exp_avg_sq") if step > 0 else ():
                        local = slot.view(getattr(bucket, f"{key}_shard"))
                        yield Fragment(name, pname, OPTIM_PREFIX + key, shape, slot.start, local)
                    master = bucket.params_shard
                    if master is not None and owner is not None and master.dtype != p.dtype:
                        yield Fragment(*owner, MASTER, shape, slot.start, slot.view(master))
                if step > 0:  # one step for all; rank 0 writes it, the others declare it
                    data = scalar_tensor(step) if rank == 0 else scalar_tensor(step)[:0]
                    yield Fragment(name, pname, STEP, (), 0, data)
        yield optimizer_info(
            name,
            opt,
            names,
            primary,
            step_granularity="group",
            sharding="apex DistributedFusedAdam (ZeRO-2): each rank writes the ranges of "
            "its optimizer-state shards",
        )


def backend_optimizers(backend: Any, extra: Any) -> list[Any]:
    """The backend's DistributedFusedAdam instances and ``extra``, each once."""
    return list({id(opt): opt for opt in [*getattr(backend, "_optimizers", []), *extra]}.values())


@torch.no_grad()
def refresh_master(opt: Any) -> None:
    """Copy the (just loaded) parameters into DistributedFusedAdam's fp32 copy of them, which its
    next step would otherwise write back over the loaded weights."""
    opt.init_params()
    for group in opt.param_groups:
        for p in group["params"]:
            flat = p.detach().reshape(-1)
            for bucket, slot in _slots(opt, p):
                if bucket.params_shard is not None:
                    slot.view(bucket.params_shard).copy_(flat[slot.start : slot.start + slot.count])


def load_distributed_adam_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    """Modules and other objects as dense; then every DistributedFusedAdam of the backend gets
    its fp32 parameter copy refreshed, and those in ``state`` their sharded state."""
    objects = classify_state(state)
    sharded = {n: o for n, o in objects.optimizers.items() if is_distributed_adam(o)}
    every = backend_optimizers(backend, sharded.values())
    for opt in every:
        opt.param_sync()  # no overlapped all-gather may land on the weights about to be loaded
    load_dense_fragments(backend, reader, state, names=[n for n in state if n not in sharded])
    for opt in every:
        refresh_master(opt)
    owners = param_owners(objects.modules, backend)
    for name, opt in sharded.items():
        _load_distributed_adam(reader, name, opt, owners)


@torch.no_grad()
def _load_distributed_adam(
    reader: Any, name: str, opt: Any, owners: dict[int, tuple[str, str]]
) -> None:
    check_flat_layout(opt)
    params = [group["params"] for group in opt.param_groups]
    saved = optimizer_load(reader, name, opt, opt.param_groups, params, owners)
    info, per_param, scalar_state = saved.info, saved.per_param, saved.scalars
    steps: dict[str, float] = {}
    for group, pnames in zip(opt.param_groups, saved.names):
        for p, pname in zip(group["params"], pnames):
            entries = per_param.get(pname, {})
            if "step" in entries:
                steps[pname] = float(reader.read(entries["step"]).reshape(-1)[0])
            elif "step" in scalar_state.get(pname, {}):
                steps[pname] = float(decode(scalar_state[pname]["step"]))
            owner = owners.get(id(p))
            master = reader.entry(owner[0], MASTER, owner[1]) if owner is not None else None
            for key in ("exp_avg", "exp_avg_sq"):
                entry = entries.get(key)
                if entry is not None:
                    check_shape(reader, entry, tuple(p.shape), "parameter")
                for bucket, slot in _slots(opt, p):
                    shard = getattr(bucket, f"{key}_shard")
                    if entry is None:  # no state (never stepped, or no gradient yet): zeros
                        slot.view(shard).zero_()
                    else:
                        read_slot(reader, entry, slot, shard)
            for bucket, slot in _slots(opt, p) if master is not None else ():
                if bucket.params_shard is not None:
                    read_slot(reader, master, slot, bucket.params_shard)
    where = "DistributedFusedAdam (one step for all groups)"
    value = group_scalar(reader, name, info, "step", steps, where, "Apex") if steps else 0.0
    put_scalar(opt.state, "step", value)
