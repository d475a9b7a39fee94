"""ColossalAI state in the portable checkpoint (docs/architecture.md, "The portable checkpoint").

- **TorchDDP, Hybrid without a separate master** (fp32, ZeRO off): parameters and optimizer state
  are whole replicas; accelkit's dense writer splits the writing across ranks.
- **LowLevelZero and Hybrid ZeRO 1/2**: each trainable parameter of ``n`` elements is flattened,
  padded to a multiple of the data-parallel size ``W`` and split in ``W`` equal pieces of
  ``S = ceil(n / W)``; rank ``r`` holds the fp32 master of flat elements ``[r*S, r*S + S)`` and
  the optimizer state of the same range. Rank ``r`` writes exactly that range (the padding cut
  off) as fragments of the original parameter: weights (``param``; plus ``master`` when the
  working weights are bf16/fp16), and ``optim:<key>``. On load each rank reads back the range it
  holds now, whatever world size or backend wrote the checkpoint. No gather either way.
- **Hybrid ZeRO 0 in bf16/fp16**: a whole fp32 master per parameter on every rank, written
  split across ranks like a replica.
- **Gemini**: chunks are not flat ranges of single parameters, so the state is gathered with
  Gemini's own ``state_dict`` calls (a collective; rank 0 holds the whole model and optimizer
  state while it writes) and every tensor is marked ``"gathered": true`` in the manifest.

Tensor-parallel layouts (``colossalai_hybrid`` with ``tp_size > 1``) are refused for now.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.checkpoint.codec import decode, encode
from accelkit.checkpoint.fqn import canonical_fqn, module_tensors
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
from accelkit.errors import CheckpointError, UnsupportedError

log = logging.getLogger("accelkit")


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@dataclass
class Slot:
    """One trainable parameter: its working tensor, its master and the flat range it covers."""

    working: torch.nn.Parameter
    master: torch.Tensor
    #: flat elements [start, start + count) of the parameter are in master.view(-1)[:count]
    start: int
    count: int
    #: True: every data-parallel rank holds the same range (write it split like a replica)
    replicated: bool

    @property
    def separate_master(self) -> bool:
        return self.master is not self.working and self.master.dtype != self.working.dtype


@dataclass
class Layout:
    """Where the trainable parameters of the boosted model live on this rank."""

    slots: dict[int, Slot] = field(default_factory=dict)  # id(working) -> slot
    by_master: dict[int, Slot] = field(default_factory=dict)  # id(master) -> slot
    kind: str = "dense"  # dense | flat | master | replica | gathered

    def add(self, slot: Slot) -> None:
        self.slots[id(slot.working)] = slot
        self.by_master[id(slot.master)] = slot


def layout_of(backend: Any) -> Layout:
    """This rank's layout for the backend's boosted optimizer (or dense before setup)."""
    wrapper = backend.optimizer
    layout = Layout()
    if wrapper is None:
        return layout
    if getattr(backend.options, "tp_size", 1) > 1:
        raise UnsupportedError(
            f"{backend.name}: the portable checkpoint does not read or write tensor-parallel "
            "(tp_size > 1) layouts yet; save with tp_size=1, or use ColossalAI's own "
            "booster.save_model/save_optimizer"
        )
    from colossalai.amp.naive_amp.mixed_precision_optimizer import MixedPrecisionOptimizer
    from colossalai.zero import LowLevelZeroOptimizer
    from colossalai.zero.gemini.gemini_optimizer import GeminiOptimizer

    if isinstance(wrapper, GeminiOptimizer):
        layout.kind = "gathered"
        return layout
    if isinstance(wrapper, LowLevelZeroOptimizer):
        from colossalai.zero.low_level._utils import get_nd_rank, get_nd_world_size

        layout.kind = "flat"
        for masters in wrapper._master_param_groups_of_current_rank.values():
            for master in masters:
                working = wrapper.master_to_working_param[id(master)]
                group = wrapper.param_to_pg[working]
                world, rank = get_nd_world_size(group), get_nd_rank(group)
                size = master.numel()
                if size * world != working.numel() + wrapper.get_param_padding_size(working):
                    raise CheckpointError(  # pragma: no cover - ColossalAI invariant
                        f"{backend.name}: unexpected ZeRO split of a parameter of shape "
                        f"{list(working.shape)}"
                    )
                start = rank * size
                count = max(0, min(size, working.numel() - start))
                layout.add(Slot(working, master, start, count, replicated=False))
        return layout
    if isinstance(wrapper, MixedPrecisionOptimizer):
        layout.kind = "master"
        for master, working in wrapper.master_to_working_map.items():
            layout.add(Slot(working, master, 0, working.numel(), replicated=True))
        return layout
    if getattr(backend.capabilities, "init_context", "") == "lazy":
        # Shardformer models (colossalai_hybrid): parameters are matched by name, not by the
        # tensors their state_dict builds; the optimizer steps the working parameters
        layout.kind = "replica"
        for group in backend.torch_optimizer(wrapper).param_groups:
            for param in group["params"]:
                layout.add(Slot(param, param, 0, param.numel(), replicated=True))
    return layout


def module_entries(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool, list[str]]]:
    """``module_tensors`` with every parameter resolved to the Parameter object itself.

    Shardformer's layers (``colossalai_hybrid``) build their ``state_dict`` entries as new
    tensors, so the tensor a state dict holds for ``lm_head.weight`` is not the Parameter that
    ColossalAI's optimizer maps to its master; the name is what links them.
    """
    params = {canonical_fqn(n): p for n, p in module.named_parameters(remove_duplicate=False)}
    for fqn, tensor, is_param, aliases in module_tensors(module):
        param = params.get(fqn)
        if param is not None and tuple(param.shape) == tuple(tensor.shape):
            yield fqn, param, True, aliases
        else:
            yield fqn, tensor, is_param, aliases


def _owner_names(
    objects: Any, backend: Any
) -> tuple[dict[int, tuple[str, str]], dict[str, torch.nn.Module]]:
    owners: dict[int, tuple[str, str]] = {}
    inners: dict[str, torch.nn.Module] = {}
    for name, module in objects.modules.items():
        inner = backend.unwrap(module)
        inners[name] = inner
        for fqn, tensor, is_param, _aliases in module_entries(inner):
            if is_param:
                owners.setdefault(id(tensor), (name, fqn))
    return owners, inners


def _param_name(owner: tuple[str, str] | None, primary: str | None, fallback: str) -> str:
    if owner is None:
        return fallback
    return owner[1] if owner[0] == primary else f"{owner[0]}/{owner[1]}"


# ---- writing ---------------------------------------------------------------------------------
def local_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    layout = layout_of(backend)
    if layout.kind == "dense":
        yield from dense_fragments(backend, state)
        return
    if layout.kind == "gathered":
        yield from _gathered_fragments(backend, state)
        return
    objects = classify_state(state)
    planner = ReplicaPlanner(backend.rank, backend.world_size)
    for name, module in objects.modules.items():
        inner = backend.unwrap(module)
        yield ObjectInfo(name, {"type": "module", "class": _qualname(inner)})
        for fqn, tensor, is_param, aliases in module_entries(inner):
            slot = layout.slots.get(id(tensor)) if is_param else None
            meta: dict[str, Any] = {"aliases": aliases}
            if slot is None:
                if is_param and not tensor.requires_grad:
                    meta["trainable"] = False
                yield from tensor_fragments(
                    name,
                    fqn,
                    PARAM if is_param else BUFFER,
                    tensor,
                    planner,
                    meta=meta,
                    owner=None if is_param else 0,
                )
                continue
            shape = tuple(tensor.shape)
            if slot.separate_master:
                local = tensor.detach().reshape(-1)[slot.start : slot.start + slot.count]
                yield from _slot_fragments(name, fqn, PARAM, shape, slot, local, planner, meta)
                master = slot.master.detach().reshape(-1)[: slot.count]
                yield from _slot_fragments(name, fqn, MASTER, shape, slot, master, planner, {})
            else:
                master = slot.master.detach().reshape(-1)[: slot.count]
                yield from _slot_fragments(name, fqn, PARAM, shape, slot, master, planner, meta)
    owners, _ = _owner_names(objects, backend)
    for name, opt in objects.optimizers.items():
        yield from _optimizer_fragments(backend, name, opt, layout, owners, planner)


def _slot_fragments(
    obj: str,
    fqn: str,
    kind: str,
    shape: tuple[int, ...],
    slot: Slot,
    local: torch.Tensor,
    planner: ReplicaPlanner,
    meta: dict[str, Any],
) -> Iterator[Fragment]:
    """This rank's fragments of one tensor whose local part covers the slot's flat range."""
    if slot.replicated:
        ranges = planner.ranges(local.numel(), local.numel() * local.element_size())
        for start, size in ranges:
            yield Fragment(
                obj, fqn, kind, shape, slot.start + start, local[start : start + size], meta
            )
        if not ranges:
            yield Fragment(obj, fqn, kind, shape, 0, local[:0], meta)
        return
    yield Fragment(obj, fqn, kind, shape, slot.start if slot.count else 0, local, meta)


def _optimizer_fragments(
    backend: Any,
    name: str,
    opt: torch.optim.Optimizer,
    layout: Layout,
    owners: dict[int, tuple[str, str]],
    planner: ReplicaPlanner,
) -> Iterator[Fragment | ObjectInfo]:
    counts: dict[str, int] = {}
    for group in opt.param_groups:
        for master in group["params"]:
            slot = layout.by_master.get(id(master))
            owner = owners.get(id(slot.working)) if slot is not None else None
            if owner is not None:
                counts[owner[0]] = counts.get(owner[0], 0) + 1
    primary = max(counts, key=counts.get) if counts else None
    group_names: list[list[str]] = []
    scalar_state: dict[str, Any] = {}
    rank = backend.rank
    for g, group in enumerate(opt.param_groups):
        names = []
        for i, master in enumerate(group["params"]):
            slot = layout.by_master.get(id(master))
            if slot is None:
                raise CheckpointError(
                    f"{backend.name}: optimizer {name!r} holds a tensor ColossalAI does not map "
                    "to a model parameter; save the optimizer returned by accel.setup()"
                )
            pname = _param_name(
                owners.get(id(slot.working)), primary, f"param_groups.{g}.params.{i}"
            )
            names.append(pname)
            shape = tuple(slot.working.shape)
            for key, value in opt.state.get(master, {}).items():
                if not isinstance(value, torch.Tensor):
                    scalar_state.setdefault(pname, {})[key] = encode(
                        value, f"{name}/state/{pname}/{key}"
                    )
                elif value.dim() == 0:
                    if rank == 0:
                        yield Fragment(name, pname, OPTIM_PREFIX + key, (), 0, value.reshape(-1))
                elif value.numel() == master.numel():
                    local = value.detach().reshape(-1)[: slot.count]
                    yield from _slot_fragments(
                        name, pname, OPTIM_PREFIX + key, shape, slot, local, planner, {}
                    )
                else:
                    raise CheckpointError(
                        f"{backend.name}: optimizer state {key!r} of {pname} has shape "
                        f"{list(value.shape)}, neither a scalar nor the shape of the parameter's "
                        "master; it cannot be mapped back to the parameter"
                    )
        group_names.append(names)
    yield optimizer_info(
        name,
        opt,
        group_names,
        primary,
        scalar_state=scalar_state,
        sharding=f"colossalai-{layout.kind}: each rank writes the flat range it holds",
    )


# ---- reading ---------------------------------------------------------------------------------
def load_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    layout = layout_of(backend)
    if layout.kind == "dense":
        load_dense_fragments(backend, reader, state)
        return
    if layout.kind == "gathered":
        _load_gathered(backend, reader, state)
        return
    objects = classify_state(state)
    for name, module in objects.modules.items():
        _load_module(reader, name, backend.unwrap(module), layout)
    owners, _ = _owner_names(objects, backend)
    for name, opt in objects.optimizers.items():
        _load_optimizer(backend, reader, name, opt, layout, owners)


@torch.no_grad()
def _load_module(reader: Any, name: str, module: torch.nn.Module, layout: Layout) -> None:
    saved = reader.module_entries(name)
    by_alias = {alias: entry for entry in saved.values() for alias in entry.aliases}
    used: set[str] = set()
    missing: list[str] = []
    plan: list[tuple[Any, torch.Tensor, bool]] = []
    for fqn, tensor, is_param, aliases in module_entries(module):
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
        master_entry = reader.entry(name, MASTER, entry.fqn)
        source = master_entry if master_entry is not None else entry
        slot = layout.slots.get(id(tensor)) if is_param else None
        fill_tensor(reader, source, tensor.data if is_param else tensor)
        if slot is None or slot.master is slot.working:
            continue
        flat = slot.master.view(-1)
        if slot.count:
            reader.read_flat(source, slot.start, slot.count, out=flat[: slot.count])
        flat[slot.count :].zero_()


def _state_entries(reader: Any, info: dict[str, Any], name: str) -> tuple[Any, dict[str, Any]]:
    return reader.optimizer_entries(name), info.get("scalar_state", {})


@torch.no_grad()
def _load_optimizer(
    backend: Any,
    reader: Any,
    name: str,
    opt: torch.optim.Optimizer,
    layout: Layout,
    owners: dict[int, tuple[str, str]],
) -> None:
    info = reader.object_info(name, "optimizer")
    primary = info.get("model")
    names = []
    for g, group in enumerate(opt.param_groups):
        row = []
        for i, master in enumerate(group["params"]):
            slot = layout.by_master.get(id(master))
            owner = owners.get(id(slot.working)) if slot is not None else None
            row.append(_param_name(owner, primary, f"param_groups.{g}.params.{i}"))
        names.append(row)
    load_param_groups(reader, name, info, opt.param_groups, names)
    warn_family_mismatch(name, info, opt)
    per_param, scalars = _state_entries(reader, info, name)
    from accelkit.checkpoint.safetensors_io import DTYPES_BY_NAME

    for group, row in zip(opt.param_groups, names):
        for master, pname in zip(group["params"], row):
            slot = layout.by_master[id(master)]
            entries, saved_scalars = per_param.get(pname, {}), scalars.get(pname, {})
            if not entries and not saved_scalars:
                continue
            slot_state = opt.state[master]
            for key, entry in entries.items():
                stored = DTYPES_BY_NAME[entry.dtype]
                if entry.shape == ():
                    target = torch.zeros((), dtype=stored)
                    fill_tensor(reader, entry, target)
                    slot_state[key] = target
                    continue
                if entry.shape != tuple(slot.working.shape):
                    raise CheckpointError(
                        f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) has shape "
                        f"{list(entry.shape)}, the target parameter {list(slot.working.shape)}"
                    )
                target = slot_state.get(key)
                if not isinstance(target, torch.Tensor) or target.shape != master.shape:
                    dtype = master.dtype if stored.is_floating_point else stored
                    target = torch.zeros_like(master, dtype=dtype)
                    slot_state[key] = target
                flat = target.view(-1)
                if slot.count:
                    reader.read_flat(entry, slot.start, slot.count, out=flat[: slot.count])
                flat[slot.count :].zero_()
            for key, value in saved_scalars.items():
                slot_state[key] = decode(value)


# ---- Gemini: gathered ------------------------------------------------------------------------
def _gemini_parts(backend: Any, state: dict[str, Any]) -> tuple[Any, str, str | None]:
    objects = classify_state(state)
    boosted = [n for n, m in objects.modules.items() if m is backend.model]
    if len(objects.modules) != 1 or not boosted:
        raise UnsupportedError(
            f"{backend.name}: a Gemini checkpoint holds exactly the model returned by "
            "accel.setup() (and its optimizer); other modules cannot be saved alongside"
        )
    opt_names = list(objects.optimizers)
    if len(opt_names) > 1:
        raise UnsupportedError(f"{backend.name}: one optimizer per Gemini checkpoint")
    return objects, boosted[0], opt_names[0] if opt_names else None


def _real_param_names(backend: Any) -> dict[int, str]:
    inner = backend.unwrap(backend.model)
    return {id(t): fqn for fqn, t, is_param, _ in module_entries(inner) if is_param}


def _gathered_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    objects, model_name, opt_name = _gemini_parts(backend, state)
    model, wrapper = backend.model, backend.optimizer
    exact = bool(model.chunk_manager.reuse_fp16_chunk)
    saved_dtype = model.mixed_precision
    model.mixed_precision = torch.float32  # gather the fp32 master chunks as they are
    try:
        full = model.state_dict(only_rank_0=True)  # a collective
    finally:
        model.mixed_precision = saved_dtype
    rank0 = backend.rank == 0
    inner = backend.unwrap(model)
    yield ObjectInfo(model_name, {"type": "module", "class": _qualname(inner)})
    params = {fqn for fqn, _t, is_param, _a in module_entries(inner) if is_param}
    for key, value in full.items():
        if not rank0 or not isinstance(value, torch.Tensor):
            continue  # other ranks hold empty placeholders: rank 0 declares every tensor
        kind = PARAM if key in params else BUFFER
        meta = {"gathered": True}
        if kind == PARAM and not exact:
            meta["upcast"] = True  # gathered from the half-precision chunks
        yield Fragment(
            model_name, key, kind, tuple(value.shape), 0, value.detach().reshape(-1), meta
        )
    if opt_name is None:
        return
    gathered = wrapper.state_dict(only_rank_0=True)  # a collective
    names = _real_param_names(backend)
    id_names = {pid: names[id(p)] for pid, p in wrapper.id_to_real_params.items()}
    scalar_state: dict[str, Any] = {}
    if rank0:
        for pid, states in gathered["state"].items():
            pname = id_names[pid]
            for key, value in states.items():
                if isinstance(value, torch.Tensor):
                    shape = tuple(value.shape)
                    yield Fragment(
                        opt_name,
                        pname,
                        OPTIM_PREFIX + key,
                        shape,
                        0,
                        value.detach().reshape(-1),
                        {"gathered": True},
                    )
                else:
                    scalar_state.setdefault(pname, {})[key] = encode(
                        value, f"{opt_name}/{pname}/{key}"
                    )
    groups = gathered["param_groups"]
    yield optimizer_info(
        opt_name,
        objects.optimizers[opt_name],
        [[id_names[pid] for pid in group["params"]] for group in groups],
        model_name,
        groups=groups,
        scalar_state=scalar_state,
        sharding="colossalai-gemini: gathered by GeminiOptimizer.state_dict on rank 0",
    )


@torch.no_grad()
def _load_gathered(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    _objects, model_name, opt_name = _gemini_parts(backend, state)
    model, wrapper = backend.model, backend.optimizer
    inner = backend.unwrap(model)
    saved = reader.module_entries(model_name)
    wanted = [fqn for fqn, *_ in module_tensors(inner)]
    reader.check_keys(
        f"module {model_name!r}",
        sorted(set(wanted) - set(saved)),
        sorted(set(saved) - set(wanted)),
    )
    full = {}
    for fqn in wanted:
        if fqn not in saved:
            continue
        master = reader.entry(model_name, MASTER, fqn)
        full[fqn] = reader.read(master if master is not None else saved[fqn])
    saved_dtype = model.mixed_precision
    model.mixed_precision = torch.float32  # stage through fp32, or the master gets rounded
    try:
        model.load_state_dict(full, strict=reader.strict)
    finally:
        model.mixed_precision = saved_dtype
    if opt_name is None:
        return
    info = reader.object_info(opt_name, "optimizer")
    names = _real_param_names(backend)
    pid_of = {names[id(p)]: pid for pid, p in wrapper.id_to_real_params.items()}
    current = wrapper.get_param_groups_for_saving()
    rows = [
        [next(n for n, i in pid_of.items() if i == pid) for pid in g["params"]] for g in current
    ]
    load_param_groups(reader, opt_name, info, current, rows)
    per_param, scalars = _state_entries(reader, info, opt_name)
    loaded: dict[int, dict[str, Any]] = {}
    for pname, entries in per_param.items():
        if pname not in pid_of:
            continue
        row = {key: reader.read(entry) for key, entry in entries.items()}
        for key, value in scalars.get(pname, {}).items():
            row[key] = decode(value)
        loaded[pid_of[pname]] = row
    wrapper.load_state_dict({"param_groups": current, "state": loaded})
