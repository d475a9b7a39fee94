"""Apex optimizers in accelkit's portable checkpoint.

**Per-group steps.** torch's Adam keeps ``step`` per parameter (a 0-d tensor in each parameter's
state); Apex's FusedAdam, FusedLAMB and FusedNovoGrad keep one ``step`` per param group (an int
in the group), DistributedFusedAdam one for the whole optimizer. The checkpoint always holds
torch's layout: a group's step is written for each parameter of the group that has state, as a
0-d fp32 tensor (``optim:step``), with ``"step_granularity": "group"`` in the manifest, and the
group's ``step`` entry is left out of the stored hyperparameters. So a torch AdamW resumes from
a FusedAdam checkpoint as it would from its own, and the reverse: loading per-parameter steps
into a group takes their common value (warning that the granularity changes); steps that differ
within a group raise under ``strict`` and otherwise warn and take the largest.

**State dtype.** FusedAdam keeps ``exp_avg`` / ``exp_avg_sq`` in fp32 whatever the parameters'
dtype; state loaded into it is made fp32 (torch's bf16 state from ``bf16-true`` is upcast).

**DistributedFusedAdam** (``apex_distributed_adam``): parameters are replicas (written like
DDP's, each rank a disjoint part); the optimizer state lives in flat buckets, sharded across
ranks. Each rank writes the ranges of each parameter that its shards hold
(``ParameterFragment.shard_param_range``), reads back the ranges it holds now, and refreshes
its fp32 copy of the parameters (``store_params``) from what was loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from accelkit.checkpoint.codec import decode
from accelkit.checkpoint.fragments import (
    MASTER,
    OPTIM_PREFIX,
    Fragment,
    ObjectInfo,
    classify_state,
    dense_fragments,
    fill_tensor,
    load_dense_fragments,
    load_param_groups,
    optimizer_info,
    optimizer_param_names,
    param_owners,
    warn_family_mismatch,
)
from accelkit.errors import CheckpointError, UnsupportedError

log = logging.getLogger("accelkit")

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


def _step_tensor(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


_EMPTY = torch.zeros(0, dtype=torch.float32)


def common_step(
    reader: Any, name: str, info: dict[str, Any], where: str, steps: dict[str, float]
) -> float:
    """The one step of a group (or optimizer) from its parameters' steps."""
    distinct = sorted(set(steps.values()))
    if info.get("step_granularity", "param") != "group":
        log.warning(
            "optimizer %r: converting per-parameter steps into Apex's per-group step (%s: %s)",
            name,
            where,
            f"{distinct[0]:g}" if len(distinct) == 1 else f"{len(distinct)} different values",
        )
    if len(distinct) > 1:
        message = (
            f"optimizer {name!r}: {where} holds parameters whose 'step' differ in "
            f"{reader.directory} ({distinct[0]:g} .. {distinct[-1]:g}); Apex keeps one 'step' per "
            "param group"
        )
        if reader.strict:
            raise CheckpointError(message + " (pass strict=False to take the largest)")
        log.warning("%s; taking the largest", message)
    return distinct[-1]


def _put_step(container: dict[Any, Any], value: float) -> None:
    current = container.get("step")
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    else:
        container["step"] = int(value) if float(value).is_integer() else value


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
    names, _ = optimizer_param_names(opt, owners)
    saved_groups = [dict(g) for g in info["param_groups"]]
    for group, saved, pnames in zip(opt.param_groups, saved_groups, names):
        saved.pop("step", None)
        if group.get("step") is None:
            continue  # not stepped yet: no state either
        value = _as_float(group["step"])
        for p, pname in zip(group["params"], pnames):
            if opt.state.get(p):
                yield Fragment(item.object, pname, STEP, (), 0, _step_tensor(value))
    info.update(param_groups=saved_groups, step_granularity="group")
    yield ObjectInfo(item.object, info)


def load_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    objects = classify_state(state)
    grouped = [n for n, o in objects.optimizers.items() if keeps_group_steps(o)]
    if not grouped:
        load_dense_fragments(backend, reader, state)
        return
    load_dense_fragments(backend, reader, state, names=[n for n in state if n not in grouped])
    owners = param_owners(objects.modules, backend)
    for name in grouped:
        load_group_step_optimizer(reader, name, objects.optimizers[name], owners)


def _state_target(opt: Any, p: torch.Tensor, entry: Any, reader: Any) -> torch.Tensor:
    from accelkit.checkpoint.safetensors_io import DTYPES_BY_NAME

    stored = DTYPES_BY_NAME[entry.dtype]
    if not stored.is_floating_point:
        dtype = stored
    elif type(opt).__name__ == "FusedAdam":
        dtype = torch.float32  # FusedAdam's moments are fp32 whatever the parameter's dtype
    else:
        dtype = p.dtype
    if entry.shape != tuple(p.shape):
        raise CheckpointError(
            f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) has shape "
            f"{list(entry.shape)}, the parameter {list(p.shape)}"
        )
    return torch.zeros(entry.shape, dtype=dtype, device=p.device)


@torch.no_grad()
def load_group_step_optimizer(
    reader: Any, name: str, opt: torch.optim.Optimizer, owners: dict[int, tuple[str, str]]
) -> None:
    """Fill an Apex optimizer that keeps per-group steps from any checkpoint."""
    info = reader.object_info(name, "optimizer")
    names, _ = optimizer_param_names(opt, owners, primary=info.get("model"))
    warn_family_mismatch(name, info, opt)
    load_param_groups(reader, name, info, opt.param_groups, names)
    per_param = reader.optimizer_entries(name)
    scalar_state = info.get("scalar_state", {})
    for g, (group, pnames) in enumerate(zip(opt.param_groups, names)):
        steps: dict[str, float] = {}
        for p, pname in zip(group["params"], pnames):
            entries = per_param.get(pname, {})
            scalars = scalar_state.get(pname, {})
            if not entries and not scalars:
                continue
            pstate = opt.state[p]
            for key, entry in entries.items():
                if key == "step":
                    steps[pname] = float(reader.read(entry).reshape(-1)[0])
                    continue
                target = pstate.get(key)
                if not isinstance(target, torch.Tensor) or tuple(target.shape) != entry.shape:
                    target = pstate[key] = _state_target(opt, p, entry, reader)
                fill_tensor(reader, entry, target)
            for key, value in scalars.items():
                value = decode(value)
                if key == "step" and isinstance(value, (int, float)):
                    steps[pname] = float(value)
                else:
                    pstate[key] = value
        if steps:
            _put_step(group, common_step(reader, name, info, f"param group {g}", steps))


# ---- apex_distributed_adam: DistributedFusedAdam's sharded buckets ----------------------------------
def _local_pieces(opt: Any, p: torch.Tensor) -> Iterator[tuple[Any, slice, int, int]]:
    """(state bucket, slice of its local shard, start and count in the flattened parameter)."""
    for frag in opt.state[p].get("fragments", ()):
        if not frag.in_local_shard:
            continue
        start, end = frag.shard_range
        if end <= start:
            continue
        bucket = opt.state["buckets"][frag.bucket_id]
        yield bucket, slice(start, end), frag.shard_param_range[0], end - start


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
        names, primary = optimizer_param_names(opt, owners)
        step = _as_float(opt.state["step"])
        for group, pnames in zip(opt.param_groups, names):
            for p, pname in zip(group["params"], pnames):
                if not p.requires_grad:
                    continue  # frozen: no optimizer state and no master (the design's rule)
                shape = tuple(p.shape)
                owner = owners.get(id(p))
                for bucket, where, start, _count in _local_pieces(opt, p):
                    if step > 0:
                        for key in ("exp_avg", "exp_avg_sq"):
                            shard = getattr(bucket, f"{key}_shard")
                            yield Fragment(
                                name, pname, OPTIM_PREFIX + key, shape, start, shard[where]
                            )
                    master = bucket.params_shard
                    if master is not None and owner is not None and master.dtype != p.dtype:
                        yield Fragment(owner[0], owner[1], MASTER, shape, start, master[where])
                if step > 0:  # one step for all; rank 0 writes it, the others declare it
                    data = _step_tensor(step) if rank == 0 else _EMPTY
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
    out: list[Any] = []
    for opt in [*getattr(backend, "_optimizers", []), *extra]:
        if all(opt is not o for o in out):
            out.append(opt)
    return out


@torch.no_grad()
def refresh_master(opt: Any) -> None:
    """Copy the (just loaded) parameters into DistributedFusedAdam's fp32 copy of them, which its
    next step would otherwise write back over the loaded weights."""
    opt.init_params()
    for group in opt.param_groups:
        for p in group["params"]:
            flat = p.detach().reshape(-1)
            for bucket, where, start, count in _local_pieces(opt, p):
                if bucket.params_shard is not None:
                    bucket.params_shard[where].copy_(flat[start : start + count])


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
    info = reader.object_info(name, "optimizer")
    names, _ = optimizer_param_names(opt, owners, primary=info.get("model"))
    warn_family_mismatch(name, info, opt)
    load_param_groups(reader, name, info, opt.param_groups, names)
    per_param = reader.optimizer_entries(name)
    scalar_state = info.get("scalar_state", {})
    steps: dict[str, float] = {}
    for group, pnames in zip(opt.param_groups, names):
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
                if entry is not None and entry.shape != tuple(p.shape):
                    raise CheckpointError(
                        f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) has shape "
                        f"{list(entry.shape)}, the parameter {list(p.shape)}"
                    )
                for bucket, where, start, count in _local_pieces(opt, p):
                    shard = getattr(bucket, f"{key}_shard")[where]
                    if entry is None:  # no state (never stepped, or no gradient yet): zeros
                        shard.zero_()
                    else:
                        reader.read_flat(entry, start, count, out=shard)
            if master is not None:
                for bucket, where, start, count in _local_pieces(opt, p):
                    if bucket.params_shard is not None:
                        reader.read_flat(master, start, count, out=bucket.params_shard[where])
    if steps:
        value = common_step(
            reader, name, info, "DistributedFusedAdam (one step for all groups)", steps
        )
    else:
        value = 0.0
    _put_step(opt.state, value)
