"""ColossalAI state in the portable checkpoint (docs/architecture.md, "The portable checkpoint").

ColossalAI's partitioning is read into :class:`~accelkit.checkpoint.sharded.Slot` s, which the
kit writes and reads back (each rank its own ranges, at any world size; no gather):

- **TorchDDP, Hybrid without a separate master** (fp32, ZeRO off): parameters and optimizer state
  are whole replicas; accelkit's dense writer splits the writing across ranks.
- **LowLevelZero and Hybrid ZeRO 1/2**: each trainable parameter of ``n`` elements is flattened,
  padded to a multiple of the data-parallel size ``W`` and split in ``W`` equal pieces of
  ``S = ceil(n / W)``; rank ``r`` holds the fp32 master of flat elements ``[r*S, r*S + S)`` and
  the optimizer state of the same range (the padding is cut off on writing, zeroed on loading).
- **Hybrid ZeRO 0 in bf16/fp16**: a whole fp32 master per parameter on every rank, written
  split across ranks like a replica.
- **Gemini**: chunks are not flat ranges of single parameters, so the state is gathered with
  Gemini's own ``state_dict`` calls (a collective; rank 0 holds the whole model and optimizer
  state while it writes) and every tensor is marked ``"gathered": true`` in the manifest.

Tensor-parallel layouts (``colossalai_hybrid`` with ``tp_size > 1``) are refused for now.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from accelkit.sdk import (
    BUFFER,
    DTYPES_BY_NAME,
    MASTER,
    OPTIM_PREFIX,
    PARAM,
    CheckpointError,
    Fragment,
    Layout,
    ObjectInfo,
    ReplicaPlanner,
    Slot,
    UnsupportedError,
    canonical_fqn,
    classify_state,
    decode,
    encode,
    fill_tensor,
    held_objects,
    load_dense_fragments,
    load_slot_states,
    match_module_entries,
    module_info,
    module_tensors,
    optimizer_info,
    optimizer_load,
    optimizer_slot_fragments,
    param_owners,
    read_slot,
    sharded_fragments,
    weights_entry,
)


def layout_of(backend: Any) -> Layout:
    """This rank's layout for the backend's boosted optimizer (or dense before setup)."""
    wrapper = backend.optimizer
    if wrapper is None:
        return Layout()
    base = backend.torch_optimizer(wrapper)
    layout = Layout(wrapper=wrapper, base=base, module=backend.unwrap(backend.model))
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
                layout.add(Slot(working, tuple(working.shape), start, count, master))
        return layout
    if isinstance(wrapper, MixedPrecisionOptimizer):
        layout.kind = "master"
        for master, working in wrapper.master_to_working_map.items():
            layout.add(
                Slot(working, tuple(working.shape), 0, working.numel(), master, replicated=True)
            )
        return layout
    if getattr(backend.capabilities, "init_context", "") == "lazy":
        # Shardformer models (colossalai_hybrid): parameters are matched by name, not by the
        # tensors their state_dict builds; the optimizer steps the working parameters
        layout.kind = "replica"
        for group in base.param_groups:
            for param in group["params"]:
                layout.add(
                    Slot(param, tuple(param.shape), 0, param.numel(), param, replicated=True)
                )
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


# ---- writing ---------------------------------------------------------------------------------
def local_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    """The layout's models and optimizers by flat range, Gemini's gathered, the rest dense."""
    layout = layout_of(backend)
    if layout.kind == "gathered":
        return _gathered_fragments(backend, state)
    write_optimizer = functools.partial(_optimizer_fragments, backend)
    return sharded_fragments(backend, state, [layout], write_optimizer, entries=module_entries)


def _optimizer_fragments(
    backend: Any,
    name: str,
    opt: torch.optim.Optimizer,
    layout: Layout,
    owners: dict[int, tuple[str, str]],
    planner: ReplicaPlanner,
) -> Iterator[Fragment | ObjectInfo]:
    by_master = layout.by_flat()
    if any(id(m) not in by_master for group in opt.param_groups for m in group["params"]):
        raise CheckpointError(
            f"{backend.name}: optimizer {name!r} holds a tensor ColossalAI does not map "
            "to a model parameter; save the optimizer returned by accel.setup()"
        )
    return optimizer_slot_fragments(
        name,
        opt,
        [[by_master[id(m)] for m in group["params"]] for group in opt.param_groups],
        lambda slot: opt.state.get(slot.flat, {}),
        owners,
        planner,
        rank=backend.rank,
        sharding=f"colossalai-{layout.kind}: each rank writes the flat range it holds",
        where=f"{backend.name}: ",
    )


# ---- reading ---------------------------------------------------------------------------------
def load_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    layout = layout_of(backend)
    if layout.kind == "gathered":
        _load_gathered(backend, reader, state)
        return
    objects, held, others = held_objects(backend, [layout], state)
    if others or not held:
        load_dense_fragments(backend, reader, state, names=others if held else None)
    for name in [n for n in objects.modules if n in held]:
        _load_module(reader, name, backend.unwrap(objects.modules[name]), layout)
    owners = param_owners(objects.modules, backend, entries=module_entries)
    for name in [n for n in objects.optimizers if n in held]:
        _load_optimizer(backend, reader, name, objects.optimizers[name], layout, owners)


@torch.no_grad()
def _load_module(reader: Any, name: str, module: torch.nn.Module, layout: Layout) -> None:
    for entry, tensor, is_param in match_module_entries(reader, name, module_entries(module)):
        source = weights_entry(reader, name, entry)
        fill_tensor(reader, source, tensor.data if is_param else tensor)
        slot = layout.slots.get(id(tensor)) if is_param else None
        if slot is not None and slot.flat is not slot.param:
            read_slot(reader, source, slot, slot.flat, zero_rest=True)


@torch.no_grad()
def _load_optimizer(
    backend: Any,
    reader: Any,
    name: str,
    opt: torch.optim.Optimizer,
    layout: Layout,
    owners: dict[int, tuple[str, str]],
) -> None:
    by_master = layout.by_flat()
    params = [
        [getattr(by_master.get(id(m)), "param", m) for m in g["params"]] for g in opt.param_groups
    ]
    saved = optimizer_load(reader, name, opt, opt.param_groups, params, owners)
    for group, row in zip(opt.param_groups, saved.names):
        for master, pname in zip(group["params"], row):
            entries, scalars = saved.per_param.get(pname, {}), saved.scalars.get(pname, {})
            if not entries and not scalars:
                continue
            slot, slot_state = by_master[id(master)], opt.state[master]
            zero_d = load_slot_states(reader, slot, slot_state, entries, zero_rest=True)
            for key, entry in zero_d.items():
                target = slot_state[key] = torch.zeros((), dtype=DTYPES_BY_NAME[entry.dtype])
                fill_tensor(reader, entry, target)
            for key, value in scalars.items():
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
    yield module_info(model_name, inner)
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
    objects, model_name, opt_name = _gemini_parts(backend, state)
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
    names = _real_param_names(backend)
    pid_of = {names[id(p)]: pid for pid, p in wrapper.id_to_real_params.items()}
    current = wrapper.get_param_groups_for_saving()
    rows = [
        [next(n for n, i in pid_of.items() if i == pid) for pid in g["params"]] for g in current
    ]
    opt = objects.optimizers[opt_name]
    saved = optimizer_load(reader, opt_name, opt, current, [], {}, names=rows)
    loaded: dict[int, dict[str, Any]] = {}
    for pname, entries in saved.per_param.items():
        if pname not in pid_of:
            continue
        row = {key: reader.read(entry) for key, entry in entries.items()}
        for key, value in saved.scalars.get(pname, {}).items():
            row[key] = decode(value)
        loaded[pid_of[pname]] = row
    wrapper.load_state_dict({"param_groups": current, "state": loaded})
