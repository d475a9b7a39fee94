"""ColossalAI state in the portable checkpoint (docs/architecture.md, "The portable checkpoint").

ColossalAI's partitioning is read into :class:`~accelkit.checkpoint.shards.sharded.Slot` s, which the
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

- **Hybrid tensor parallel** (``tp_size > 1``, ZeRO 0): Shardformer's Linear1D_Col,
  Linear1D_Row and vocabulary-parallel layers split a weight into ``tp_size`` equal pieces
  along one dimension; rank ``i`` of the tensor-parallel group holds piece ``i``. A piece along
  dimension 0 is one flat range of the original tensor: written (by the first data-parallel
  replica) and read back as such, with its fp32 master and optimizer state. A piece along a later
  dimension is not a range: the pieces are all-gathered over the tensor-parallel group, one
  tensor at a time, and the whole tensor is written split across ranks (``"gathered": true``).
  A fused parameter (GPT-2's q|k|v ``c_attn``: a "customized" distributed tensor, sharded by
  ColossalAI's own functions) or a padded one (vocabulary rows the original does not have) is
  not a set of pieces of the original tensor and is refused, named.

ZeRO 1/2 under tensor parallelism (flat ranges of a piece) is refused for now.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    check_shape,
    check_state_keys,
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
    new_state,
    optimizer_info,
    optimizer_load,
    optimizer_slot_fragments,
    param_group_names,
    param_owners,
    read_slot,
    sharded_fragments,
    slot_state_fragments,
    tensor_fragments,
    weights_entry,
)


@dataclass(frozen=True)
class Piece:
    """Piece ``index`` of ``parts`` equal pieces along ``dim`` of a tensor of ``shape``: what a
    tensor-parallel rank holds of a Shardformer weight (and of its master and optimizer state)."""

    shape: tuple[int, ...]
    dim: int
    index: int
    parts: int
    #: the fp32 master ColossalAI's AMP optimizer keeps of the piece; None: the weight is its own
    master: torch.Tensor | None = None

    @property
    def is_range(self) -> bool:
        """A piece along the first dimension of size > 1 is one flat range of the tensor."""
        return math.prod(self.shape[: self.dim]) == 1

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        size = self.shape[self.dim] // self.parts
        return full.narrow(self.dim, self.index * size, size)


@dataclass
class HybridLayout(Layout):
    """A :class:`Layout` plus the tensor-parallel pieces (``tp_size > 1``), kept out of the slots:
    a piece is not one flat range of the original tensor (see :class:`Piece`)."""

    pieces: dict[int, Piece] = field(default_factory=dict)  # id(param) -> its piece
    by_master: dict[int, Any] = field(default_factory=dict)  # id(master) -> param
    tp_group: Any = None
    #: the first data-parallel replica writes the pieces that are ranges (the others hold copies)
    writes_pieces: bool = True


def layout_of(backend: Any) -> Layout:
    """This rank's layout for the backend's boosted optimizer (or dense before setup)."""
    wrapper = backend.optimizer
    if wrapper is None:
        return Layout()
    base = backend.torch_optimizer(wrapper)
    layout = HybridLayout(wrapper=wrapper, base=base, module=backend.unwrap(backend.model))
    tensor_parallel = getattr(backend.options, "tp_size", 1) > 1
    if tensor_parallel and getattr(backend.options, "zero_stage", 0) > 0:
        raise UnsupportedError(
            f"{backend.name}: the portable checkpoint does not read or write ZeRO "
            f"(zero_stage={backend.options.zero_stage}) under tensor parallelism (tp_size > 1) "
            "yet; use zero_stage=0, or ColossalAI's own booster.save_model/save_optimizer"
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
    masters: dict[Any, torch.Tensor] = {}
    if isinstance(wrapper, MixedPrecisionOptimizer):
        layout.kind = "master"
        masters = {w: m for m, w in wrapper.master_to_working_map.items()}
    elif getattr(backend.capabilities, "init_context", "") == "lazy":
        # Shardformer models (colossalai_hybrid): parameters are matched by name, not by the
        # tensors their state_dict builds; the optimizer steps the working parameters
        layout.kind = "replica"
        masters = {p: p for group in base.param_groups for p in group["params"]}
    if tensor_parallel:
        _add_pieces(backend, layout, masters)
    for working, master in masters.items():
        if id(working) not in layout.pieces:
            layout.add(
                Slot(working, tuple(working.shape), 0, working.numel(), master, replicated=True)
            )
    return layout


def _add_pieces(backend: Any, layout: HybridLayout, masters: dict[Any, torch.Tensor]) -> None:
    """Record each tensor-parallel parameter's piece; refuse what is not pieces of one tensor."""
    import torch.distributed as dist
    from colossalai.tensor.d_tensor import (
        get_global_shape,
        get_sharding_spec,
        is_customized_distributed_tensor,
        is_distributed_tensor,
    )
    from colossalai.tensor.padded_tensor import is_padded_tensor

    group = backend.plugin.tp_group
    parts, index = dist.get_world_size(group), dist.get_rank(group)
    layout.tp_group, layout.writes_pieces = group, backend.data_parallel_rank == 0
    refuse = (
        f"{backend.name}: the portable checkpoint cannot save or load parameter {{name!r}} "
        f"under tensor parallelism: {{why}}; save with ColossalAI's own "
        "booster.save_model/save_optimizer (or train with tp_size=1)"
    )
    for name, param in layout.module.named_parameters():
        if is_customized_distributed_tensor(param):
            why = "ColossalAI shards it with its own functions (a fused layer, as GPT-2's q|k|v)"
            raise UnsupportedError(refuse.format(name=name, why=why))
        if is_padded_tensor(param):
            why = "its rows are padded (vocab_size not a multiple of the padding)"
            raise UnsupportedError(refuse.format(name=name, why=why))
        if not is_distributed_tensor(param):
            continue
        shape = tuple(get_global_shape(param))
        dims = [d % len(shape) for d, axes in get_sharding_spec(param).dim_partition_dict.items()]
        expected = list(shape)
        if len(dims) == 1:
            expected[dims[0]] //= parts
        if len(dims) != 1 or shape[dims[0]] % parts or tuple(param.shape) != tuple(expected):
            why = f"its shard {list(param.shape)} is not one of {parts} pieces of {list(shape)}"
            raise UnsupportedError(refuse.format(name=name, why=why))
        master = masters.get(param)
        separate = master if master is not None and master is not param else None
        layout.pieces[id(param)] = Piece(shape, dims[0], index, parts, separate)
        layout.by_master[id(master if master is not None else param)] = param


def module_entries(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool, list[str]]]:
    """``module_tensors`` with every parameter resolved to the Parameter object itself.

    Shardformer's layers (``colossalai_hybrid``) build their ``state_dict`` entries as new
    tensors (gathered ones under tensor parallelism), so the tensor a state dict holds for
    ``lm_head.weight`` is not the Parameter that ColossalAI's optimizer maps to its master; the
    name is what links them.
    """
    params = {canonical_fqn(n): p for n, p in module.named_parameters(remove_duplicate=False)}
    for fqn, tensor, is_param, aliases in module_tensors(module):
        param = params.get(fqn)
        if param is not None and _global_shape(param) == tuple(tensor.shape):
            yield fqn, param, True, aliases
        else:
            yield fqn, tensor, is_param, aliases


def _global_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A Shardformer piece's whole shape (its ``dist_layout``), else the parameter's own."""
    dist_layout = getattr(param, "dist_layout", None)
    return tuple(dist_layout.global_shape if dist_layout is not None else param.shape)


# ---- writing ---------------------------------------------------------------------------------
def local_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    """The layout's models and optimizers by flat range (tensor-parallel pieces by piece),
    Gemini's gathered, the rest dense."""
    layout = layout_of(backend)
    if layout.kind == "gathered":
        return _gathered_fragments(backend, state)
    write_optimizer = functools.partial(_optimizer_fragments, backend)
    unsharded = None
    if isinstance(layout, HybridLayout) and layout.pieces:
        planner = ReplicaPlanner(*backend.replica_holders())
        unsharded = functools.partial(_piece_weights, layout, planner)
    return sharded_fragments(
        backend, state, [layout], write_optimizer, entries=module_entries, unsharded=unsharded
    )


def _piece_weights(
    layout: HybridLayout,
    planner: ReplicaPlanner,
    obj: str,
    fqn: str,
    tensor: torch.Tensor,
    meta: dict[str, Any],
) -> Iterator[Fragment] | None:
    """A tensor-parallel parameter's weights (and its fp32 master); None for any other."""
    piece = layout.pieces.get(id(tensor))
    if piece is None:
        return None

    def fragments() -> Iterator[Fragment]:
        yield from _piece_fragments(obj, fqn, PARAM, piece, tensor, layout, planner, meta)
        if piece.master is not None and piece.master.dtype != tensor.dtype:
            yield from _piece_fragments(obj, fqn, MASTER, piece, piece.master, layout, planner)

    return fragments()


def _piece_fragments(
    obj: str,
    fqn: str,
    kind: str,
    piece: Piece,
    local: torch.Tensor,
    layout: HybridLayout,
    planner: ReplicaPlanner,
    meta: dict[str, Any] | None = None,
) -> Iterator[Fragment]:
    """One tensor of a piece's shape: its flat range where it is one (written by the first
    data-parallel replica), else the whole tensor all-gathered over the tensor-parallel group
    (a collective, decided by the shape alone so every rank takes it) and written split."""
    import torch.distributed as dist

    meta = dict(meta or {})
    data = local.detach()
    if piece.is_range:
        flat = data.reshape(-1)
        if layout.writes_pieces and flat.numel():
            start = piece.index * flat.numel()
            yield Fragment(obj, fqn, kind, piece.shape, start, flat, meta)
        else:
            yield Fragment(obj, fqn, kind, piece.shape, 0, flat[:0], meta)
        return
    data = data.contiguous()
    gathered = [torch.empty_like(data) for _ in range(piece.parts)]
    dist.all_gather(gathered, data, group=layout.tp_group)
    meta["gathered"] = True
    full = torch.cat(gathered, dim=piece.dim)
    yield from tensor_fragments(obj, fqn, kind, full, planner, meta=meta)


def _optimizer_fragments(
    backend: Any,
    name: str,
    opt: torch.optim.Optimizer,
    layout: Layout,
    owners: dict[int, tuple[str, str]],
    planner: ReplicaPlanner,
) -> Iterator[Fragment | ObjectInfo]:
    by_master = layout.by_flat()
    pieces = layout.by_master if isinstance(layout, HybridLayout) else {}
    masters = [m for group in opt.param_groups for m in group["params"]]
    if any(id(m) not in by_master and id(m) not in pieces for m in masters):
        raise CheckpointError(
            f"{backend.name}: optimizer {name!r} holds a tensor ColossalAI does not map "
            "to a model parameter; save the optimizer returned by accel.setup()"
        )
    if pieces:
        return _piece_optimizer_fragments(backend, name, opt, layout, owners, planner)
    return optimizer_slot_fragments(
        name,
        opt,
        [[by_master[id(m)] for m in group["params"]] for group in opt.param_groups],
        lambda slot: opt.state.get(slot.flat, {}),
        owners,
        planner,
        rank=backend.replica_holders()[0],
        sharding=f"colossalai-{layout.kind}: each rank writes the flat range it holds",
        where=f"{backend.name}: ",
    )


def _piece_optimizer_fragments(
    backend: Any,
    name: str,
    opt: torch.optim.Optimizer,
    layout: HybridLayout,
    owners: dict[int, tuple[str, str]],
    planner: ReplicaPlanner,
) -> Iterator[Fragment | ObjectInfo]:
    """The optimizer under tensor parallelism: replicated parameters' state as slots, each
    piece's state (shaped like the piece's master) through :func:`_piece_fragments`."""
    by_master = layout.by_flat()
    params = [
        [
            layout.by_master[id(m)] if id(m) in layout.by_master else by_master[id(m)].param
            for m in group["params"]
        ]
        for group in opt.param_groups
    ]
    names, primary = param_group_names(params, owners)
    scalar_state: dict[str, Any] = {}
    where = f"{backend.name}: "
    for group, row in zip(opt.param_groups, names):
        for master, pname in zip(group["params"], row):
            values = opt.state.get(master, {})
            slot = by_master.get(id(master))
            if slot is None:  # a piece: its tensors here, its 0-d and other values below
                piece = layout.pieces[id(layout.by_master[id(master)])]
                tensors = {
                    k: v for k, v in values.items() if isinstance(v, torch.Tensor) and v.dim()
                }
                for key, value in tensors.items():
                    if tuple(value.shape) != tuple(master.shape):
                        raise CheckpointError(
                            f"{where}optimizer state {key!r} of {pname} has shape "
                            f"{list(value.shape)}, not its piece's {list(master.shape)}"
                        )
                    kind = OPTIM_PREFIX + key
                    yield from _piece_fragments(name, pname, kind, piece, value, layout, planner)
                values = {k: v for k, v in values.items() if k not in tensors}
                slot = Slot(master, piece.shape, 0, 0, master)  # only its 0-d values remain
            yield from slot_state_fragments(
                name,
                pname,
                slot,
                values,
                planner,
                rank=backend.replica_holders()[0],
                scalar_state=scalar_state,
                where=where,
            )
    yield optimizer_info(
        name,
        opt,
        names,
        primary,
        scalar_state=scalar_state,
        sharding="colossalai-tensor-parallel: each rank writes its pieces that are flat ranges; "
        "the others are gathered over the tensor-parallel group",
    )


# ---- reading ---------------------------------------------------------------------------------
def check_optimizer_states(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    """The boosted optimizer's saved per-parameter state keys against those of its torch
    optimizer's live state (over ZeRO's flat masters or the fp32 masters, which the dense check
    cannot name): a checkpoint of another optimizer is refused before anything is written."""
    layout = layout_of(backend)
    if layout.kind in ("dense", "gathered") or layout.base is None:
        return
    objects, held, _ = held_objects(backend, [layout], state)
    for name in objects.optimizers:
        if name in held:
            live = {key for values in layout.base.state.values() for key in values}
            check_state_keys(reader, name, live)


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
def _read_piece(reader: Any, entry: Any, piece: Piece, target: torch.Tensor) -> None:
    """Fill ``target`` (a piece's shape) with its piece of the saved whole tensor ``entry``."""
    check_shape(reader, entry, piece.shape, "tensor-parallel parameter")
    if piece.is_range:
        count = target.numel()
        start = piece.index * count
        if target.is_contiguous():
            reader.read_flat(entry, start, count, out=target.view(-1))
        else:
            target.copy_(reader.read_flat(entry, start, count).view(target.shape))
        return
    target.copy_(piece.cut(reader.read(entry)))  # not a range: read whole, cut the piece


@torch.no_grad()
def _load_module(reader: Any, name: str, module: torch.nn.Module, layout: Layout) -> None:
    pieces = layout.pieces if isinstance(layout, HybridLayout) else {}
    for entry, tensor, is_param in match_module_entries(reader, name, module_entries(module)):
        source = weights_entry(reader, name, entry)
        piece = pieces.get(id(tensor)) if is_param else None
        if piece is not None:
            _read_piece(reader, source, piece, tensor.data)
            if piece.master is not None:
                _read_piece(reader, source, piece, piece.master)
            continue
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
    piece_params = layout.by_master if isinstance(layout, HybridLayout) else {}
    params = [
        [piece_params.get(id(m), getattr(by_master.get(id(m)), "param", m)) for m in g["params"]]
        for g in opt.param_groups
    ]
    saved = optimizer_load(reader, name, opt, opt.param_groups, params, owners)
    for group, row in zip(opt.param_groups, saved.names):
        for master, pname in zip(group["params"], row):
            entries, scalars = saved.per_param.get(pname, {}), saved.scalars.get(pname, {})
            if not entries and not scalars:
                continue
            slot_state = opt.state[master]
            if id(master) in piece_params:
                piece = layout.pieces[id(piece_params[id(master)])]
                zero_d = {k: e for k, e in entries.items() if e.shape == ()}
                for key, entry in entries.items():
                    if key in zero_d:
                        continue
                    target = slot_state.get(key)
                    if not isinstance(target, torch.Tensor) or target.shape != master.shape:
                        target = slot_state[key] = new_state(master, entry)
                    _read_piece(reader, entry, piece, target)
            else:
                slot = by_master[id(master)]
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
