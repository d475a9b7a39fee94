"""FairScale state in the portable checkpoint (docs/architecture.md, "The portable checkpoint").

Nothing is gathered to write a checkpoint; every rank writes what it holds:

- **OSS** (``fairscale_oss``, ``fairscale_sdp``): each parameter's optimizer state lives on the
  one rank that owns it (``OSS.partition_parameters()``). The backend says so through the SDK's
  ``owned_optimizer_state`` hook (accelkit_fairscale/oss.py), and the SDK's default hooks write
  each state whole from its owner, read back the state of the parameters a rank owns now
  (whatever world size wrote them) and check a load against every rank's live state. The
  parameters are replicas, written like DDP's (each rank a disjoint part).
- **FSDP** (``fairscale_fsdp``): a unit's flat parameter is the concatenation of its original
  parameters, flattened, cut into ``world_size`` equal chunks (the last padded). Rank ``r``
  holds flat elements ``[r*S, r*S + S)``; where that range meets original parameter ``p``
  (flat offset ``o``) it holds the slot ``p[max(r*S, o) - o : ...]``, optimizer state with the
  flat shard's shape likewise; a 0-d state (Adam's ``step``) is written once per original
  parameter, by the rank holding its first element. The layout comes from FairScale's public
  ``local_metadata_dict()``.

FairScale's own gathers (``consolidate_state_dict``, ``state_dict()``,
``gather_full_optim_state_dict``) are not used here; the tests use them as the independent path
that checks what was loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.sdk import (
    BUFFER,
    PARAM,
    CheckpointError,
    Fragment,
    ObjectInfo,
    ReplicaPlanner,
    Slot,
    canonical_fqn,
    check_dense_load,
    check_group_scalars,
    check_module_targets,
    check_optimizer,
    check_shape,
    classify_state,
    decode,
    dense_fragments,
    fill_tensor,
    group_scalar,
    load_dense_fragments,
    load_slot_states,
    match_module_entries,
    module_info,
    optimizer_info,
    optimizer_load,
    ranged_fragments,
    read_slot,
    slot_state_fragments,
    state_like,
    tensor_fragments,
    weights_entry,
)

log = logging.getLogger("accelkit")

#: wrapper path components FairScale adds (FSDP's, and its FlattenParamsWrapper's)
_FAIRSCALE_COMPONENTS = ("_fsdp_wrapped_module", "_fpw_module")


def clean_fqn(name: str) -> str:
    parts = [p for p in name.split(".") if p not in _FAIRSCALE_COMPONENTS]
    return canonical_fqn(".".join(parts))


# ---- FSDP (fairscale_fsdp) --------------------------------------------------------------------
@dataclass
class _Piece:
    """One original parameter inside a flat parameter."""

    fqn: str
    shape: tuple[int, ...]
    offset: int  # where it starts in the unpadded flat parameter
    numel: int
    aliases: list[str] = field(default_factory=list)


@dataclass
class _Flat:
    """A flat parameter (or an unflattened one) and which elements this rank holds."""

    param: torch.nn.Parameter
    pieces: list[_Piece]
    start: int  # flat index of this rank's first element
    size: int  # elements of the flat parameter this rank holds (padding excluded)

    def slot(self, piece: _Piece) -> Slot:
        """The piece's elements this rank holds (none: a count of 0), where they sit in the
        local shard; keyed by the piece's fqn."""
        lo = max(self.start, piece.offset)
        count = max(0, min(self.start + self.size, piece.offset + piece.numel) - lo)
        start, at = (lo - piece.offset, lo - self.start) if count else (0, 0)
        return Slot(piece.fqn, piece.shape, start, count, self.param.data, at)

    def owner_of_first_element(self, piece: _Piece, shard: int, world: int) -> int:
        if piece.numel == 0 or shard == 0:
            return 0
        return min(piece.offset // shard, world - 1)


def fsdp_layout(root: Any) -> list[_Flat]:
    """Every flat parameter of every unit under ``root``, with its original parameters."""
    from fairscale.nn import FullyShardedDataParallel

    for unit in _units(root):
        if unit.training_state.name != "IDLE":
            raise CheckpointError(
                "fairscale_fsdp: save/load between optimizer steps, not inside forward/backward"
            )
    metadata = root.local_metadata_dict()["param_metadata"]
    units = [m for _, m in root.named_modules() if isinstance(m, FullyShardedDataParallel)]
    if len(units) != len(metadata):  # pragma: no cover - FairScale invariant
        raise CheckpointError("fairscale_fsdp: unit metadata does not match the model")
    flats: list[_Flat] = []
    for unit, meta in zip(units, metadata):
        prefix = meta["fsdp_path"]
        aliases: dict[str, list[str]] = {}
        for src, dst in meta["shared_param_info"]:
            aliases.setdefault(_join(prefix, src), []).append(_join(prefix, dst))
        world = unit.world_size
        for param, info in zip(unit.params, meta["params"].values()):
            pieces, offset = [], 0
            for name, shape, numel in zip(info["names"], info["shapes"], info["numels"]):
                fqn = _join(prefix, name)
                pieces.append(_Piece(fqn, tuple(shape), offset, int(numel), aliases.get(fqn, [])))
                offset += int(numel)
            shard = param.data.numel()  # the local shard (p.data is the fp32 shard when idle)
            sharded = bool(getattr(param, "_is_sharded", False))
            rank = unit.rank if sharded else 0
            start = rank * shard if sharded else 0
            size = max(0, min(shard, offset - start))
            if not sharded and world > 1:  # pragma: no cover - FairScale shards when world > 1
                raise CheckpointError("fairscale_fsdp: unexpected unsharded parameter")
            flats.append(_Flat(param, pieces, start, size))
    return flats


def _units(root: Any) -> list[Any]:
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import get_fsdp_instances

    return get_fsdp_instances(root)


def _join(prefix: str, name: str) -> str:
    return clean_fqn(f"{prefix}.{name}" if prefix else name)


def _persistent_buffers(root: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for module_name, module in root.named_modules():
        for buffer_name, buffer in module._buffers.items():
            if buffer is None or buffer_name in module._non_persistent_buffers_set:
                continue
            if id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield _join(module_name, buffer_name), buffer


def _fsdp_root(module: torch.nn.Module) -> Any:
    from fairscale.nn import FullyShardedDataParallel

    return module if isinstance(module, FullyShardedDataParallel) else None


def fsdp_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    objects = classify_state(state)
    rank, world = backend.rank, backend.world_size
    layouts: dict[str, list[_Flat]] = {}
    for name, module in objects.modules.items():
        root = _fsdp_root(module)
        if root is None:
            yield from dense_fragments(backend, state, names=[name])
            continue
        flats = layouts[name] = fsdp_layout(root)
        yield module_info(name, backend.unwrap(root))
        planner = ReplicaPlanner(rank, world)
        for flat in flats:
            for piece in flat.pieces:
                meta: dict[str, Any] = {"aliases": piece.aliases}
                if not flat.param.requires_grad:
                    meta["trainable"] = False
                slot = flat.slot(piece)
                yield from ranged_fragments(
                    name, piece.fqn, PARAM, slot, slot.master, planner, meta
                )
        for fqn, buffer in _persistent_buffers(root):
            yield from tensor_fragments(name, fqn, BUFFER, buffer, planner, owner=0)
    for name, opt in objects.optimizers.items():
        owner_module = _module_of(opt, layouts)
        if owner_module is None:
            yield from dense_fragments(backend, state, names=[name])
            continue
        yield from _fsdp_optimizer_fragments(backend, name, opt, owner_module, layouts)


def _module_of(opt: torch.optim.Optimizer, layouts: dict[str, list[_Flat]]) -> str | None:
    """The module object whose flat parameters this optimizer holds (all of them), or None."""
    ids = {id(p) for group in opt.param_groups for p in group["params"]}
    for name, flats in layouts.items():
        flat_ids = {id(f.param) for f in flats}
        if ids and ids <= flat_ids:
            return name
        if ids & flat_ids:
            raise CheckpointError(
                f"fairscale_fsdp: an optimizer holds parameters of module {name!r} and others; "
                "one optimizer per FSDP model"
            )
    return None


def _fsdp_optimizer_fragments(
    backend: Any,
    name: str,
    opt: torch.optim.Optimizer,
    module_name: str,
    layouts: dict[str, list[_Flat]],
) -> Iterator[Fragment | ObjectInfo]:
    rank, world = backend.rank, backend.world_size
    by_param = {id(f.param): f for f in layouts[module_name]}
    planner = ReplicaPlanner(rank, world)  # passed through: no slot here is replicated
    group_names: list[list[str]] = []
    scalar_state: dict[str, Any] = {}
    for group in opt.param_groups:
        names: list[str] = []
        for param in group["params"]:
            flat = by_param[id(param)]
            names.extend(piece.fqn for piece in flat.pieces)
            shard = param.data.numel()
            for piece in flat.pieces:  # a 0-d state by the rank holding the first element
                yield from slot_state_fragments(
                    name,
                    piece.fqn,
                    flat.slot(piece),
                    opt.state.get(param, {}),
                    planner,
                    rank=rank,
                    scalar_state=scalar_state,
                    scalar_rank=flat.owner_of_first_element(piece, shard, world),
                    where="fairscale_fsdp: ",
                )
        group_names.append(names)
    yield optimizer_info(
        name,
        opt,
        group_names,
        module_name,
        scalar_state=scalar_state,
        sharding="fairscale-fsdp: flat-parameter shards cut back to original parameters",
    )


def load_fsdp_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    objects = classify_state(state)
    layouts: dict[str, list[_Flat]] = {}
    for name, module in objects.modules.items():
        root = _fsdp_root(module)
        if root is None:
            load_dense_fragments(backend, reader, state, names=[name])
            continue
        layouts[name] = fsdp_layout(root)
        _load_fsdp_module(reader, name, root, layouts[name])
    for name, opt in objects.optimizers.items():
        module_name = _module_of(opt, layouts)
        if module_name is None:
            load_dense_fragments(backend, reader, state, names=[name])
            continue
        _load_fsdp_optimizer(reader, name, opt, layouts[module_name])


def check_fsdp_load(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    """The load's validate phase for FSDP units: each original parameter (a piece of a flat
    parameter, by its full shape) and buffer, and each optimizer's groups and state keys, by
    the pieces' names; no gather. Other objects get the dense check."""
    objects = classify_state(state)
    layouts: dict[str, list[_Flat]] = {}
    dense: list[str] = []
    for name, module in objects.modules.items():
        root = _fsdp_root(module)
        if root is None:
            dense.append(name)
            continue
        layouts[name] = fsdp_layout(root)
        targets: list[Any] = [
            (piece.fqn, _Shape(piece.shape, flat.param.dtype), True, piece.aliases)
            for flat in layouts[name]
            for piece in flat.pieces
        ]
        targets += [(fqn, buffer, False, []) for fqn, buffer in _persistent_buffers(root)]
        check_module_targets(reader, name, targets)
    for name, opt in objects.optimizers.items():
        module_name = _module_of(opt, layouts)
        if module_name is None:
            dense.append(name)
            continue
        by_param = {id(f.param): f for f in layouts[module_name]}
        names = [
            [piece.fqn for p in group["params"] for piece in by_param[id(p)].pieces]
            for group in opt.param_groups
        ]
        live = opt.state if type(opt).__module__.startswith("torch.optim") else None
        check_optimizer(reader, name, opt.param_groups, names, live)
        # FairScale keeps one step per flat parameter: steps that differ inside one are refused
        # now, not halfway through the fill
        flats = {
            f"the flat parameter of {', '.join(p.fqn for p in flat.pieces)}": [
                piece.fqn for piece in flat.pieces
            ]
            for group in opt.param_groups
            for flat in (by_param[id(p)] for p in group["params"])
        }
        check_group_scalars(reader, name, "FairScale", groups=flats, per="flat parameter")
    if dense:
        check_dense_load(backend, reader, state, names=dense)


@dataclass
class _Shape:
    """What the validate phase needs of an original parameter that lives inside a flat one."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@torch.no_grad()
def _load_fsdp_module(reader: Any, name: str, root: Any, flats: list[_Flat]) -> None:
    targets: list[Any] = [
        (piece.fqn, flat.slot(piece), True, piece.aliases)
        for flat in flats
        for piece in flat.pieces
    ]
    targets += [(fqn, buffer, False, []) for fqn, buffer in _persistent_buffers(root)]
    for entry, target, is_param in match_module_entries(reader, name, targets):
        if not is_param:
            fill_tensor(reader, entry, target)
            continue
        check_shape(reader, entry, target.shape)
        read_slot(reader, weights_entry(reader, name, entry), target, target.flat)
    for unit in _units(root):
        if unit.has_full_params:  # a gathered copy from before the load would be stale
            unit._free_full_params()
            unit._use_fp32_param_shard()


@torch.no_grad()
def _load_fsdp_optimizer(
    reader: Any, name: str, opt: torch.optim.Optimizer, flats: list[_Flat]
) -> None:
    by_param = {id(f.param): f for f in flats}
    names = [
        [piece.fqn for p in group["params"] for piece in by_param[id(p)].pieces]
        for group in opt.param_groups
    ]
    saved = optimizer_load(reader, name, opt, opt.param_groups, [], {}, names=names)
    per_param, scalars = saved.per_param, saved.scalars
    for group in opt.param_groups:
        for param in group["params"]:
            slots = [by_param[id(param)].slot(piece) for piece in by_param[id(param)].pieces]
            entries = [per_param.get(slot.param, {}) for slot in slots]
            saved_scalars = {k: v for s in slots for k, v in scalars.get(s.param, {}).items()}
            if not any(entries) and not saved_scalars:
                continue
            state = opt.state[param]
            zero_d: dict[str, dict[str, Any]] = {}
            for slot, saved_entries in zip(slots, entries):
                for key, entry in load_slot_states(reader, slot, state, saved_entries).items():
                    zero_d.setdefault(key, {})[slot.param] = entry
            for key, pieces in zero_d.items():  # FairScale keeps one per flat parameter
                values = {fqn: float(reader.read(entry)) for fqn, entry in pieces.items()}
                where = f"the flat parameter of {', '.join(values)}"
                value = group_scalar(
                    reader,
                    name,
                    saved.info,
                    key,
                    values,
                    where,
                    "FairScale",
                    per="flat parameter",
                    warn_conversion=False,
                )
                state[key] = state_like(param, key, next(iter(pieces.values())))
                state[key].fill_(value)
            for key, value in saved_scalars.items():
                state[key] = decode(value)
