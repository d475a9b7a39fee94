"""FairScale state in the portable checkpoint (docs/architecture.md, "The portable checkpoint").

Nothing is gathered to write a checkpoint; every rank writes what it holds:

- **OSS** (``fairscale_oss``, ``fairscale_sdp``): each parameter's optimizer state lives on the
  one rank that owns it (``OSS.partition_parameters()``); that rank writes it whole. The
  parameters are replicas, written like DDP's (each rank a disjoint part). On load each rank
  reads the state of the parameters it owns now, whatever world size wrote them.
- **FSDP** (``fairscale_fsdp``): a unit's flat parameter is the concatenation of its original
  parameters, flattened, cut into ``world_size`` equal chunks (the last padded). Rank ``r``
  holds flat elements ``[r*S, r*S + S)``; where that range meets original parameter ``p``
  (flat offset ``o``) it writes the fragment ``p[max(r*S, o) - o : ...]``. Optimizer state with
  the flat shard's shape is cut the same way; a 0-d state (Adam's ``step``) is written once per
  original parameter, by the rank holding its first element. The layout comes from FairScale's
  public ``local_metadata_dict()``. On load each rank reads exactly its ranges back.

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

from accelkit.checkpoint.codec import decode, encode
from accelkit.checkpoint.fqn import canonical_fqn
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
    optimizer_param_names,
    param_owners,
    tensor_fragments,
    warn_family_mismatch,
)
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

#: wrapper path components FairScale adds (FSDP's, and its FlattenParamsWrapper's)
_FAIRSCALE_COMPONENTS = ("_fsdp_wrapped_module", "_fpw_module")


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def clean_fqn(name: str) -> str:
    parts = [p for p in name.split(".") if p not in _FAIRSCALE_COMPONENTS]
    return canonical_fqn(".".join(parts))


def _new_state(like: torch.Tensor, key: str, entry: Any) -> torch.Tensor:
    """Optimizer state placed as torch's ``Optimizer.load_state_dict`` would: ``step`` on the
    CPU (optimizers that are not capturable), the rest like the parameter (its dtype if both are
    floating point)."""
    from accelkit.checkpoint.safetensors_io import DTYPES_BY_NAME

    stored = DTYPES_BY_NAME[entry.dtype]
    if key == "step":
        return torch.zeros(entry.shape, dtype=stored)
    dtype = like.dtype if (like.is_floating_point() and stored.is_floating_point) else stored
    if entry.shape == tuple(like.shape):
        return torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)
    return torch.zeros(entry.shape, dtype=dtype, device=like.device)


# ---- OSS (fairscale_oss, fairscale_sdp) --------------------------------------------------------
def oss_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    from fairscale.optim import OSS

    objects = classify_state(state)
    yield from dense_fragments(backend, state, names=list(objects.modules))
    owners = param_owners(objects.modules, backend)
    for name, opt in objects.optimizers.items():
        if not isinstance(opt, OSS):
            yield from dense_fragments(backend, state, names=[name])
            continue
        yield from _oss_optimizer_fragments(backend, name, opt, owners)


def _oss_optimizer_fragments(
    backend: Any, name: str, oss: Any, owners: dict[int, tuple[str, str]]
) -> Iterator[Fragment | ObjectInfo]:
    import torch.distributed as dist

    group_names, primary = optimizer_param_names(oss, owners)
    planner = ReplicaPlanner(backend.rank, backend.world_size)
    scalar_state: dict[str, Any] = {}
    for group, pnames in zip(oss.param_groups, group_names):
        for param, pname in zip(group["params"], pnames):
            for key, value in oss.optim.state.get(param, {}).items():  # owned parameters only
                if isinstance(value, torch.Tensor):
                    yield from tensor_fragments(
                        name, pname, OPTIM_PREFIX + key, value, planner, owner=backend.rank
                    )
                else:
                    scalar_state.setdefault(pname, {})[key] = encode(
                        value, f"{name}/state/{pname}/{key}"
                    )
    if dist.is_initialized() and dist.get_world_size() > 1:  # rank 0's info is the one kept
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, scalar_state)
        scalar_state = {k: v for part in gathered for k, v in part.items()}
    yield optimizer_info(
        name,
        oss.optim,
        group_names,
        primary,
        groups=oss.param_groups,
        scalar_state=scalar_state,
        sharding="fairscale-oss: each parameter's state written by its owner rank",
    )


def load_oss_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    from fairscale.optim import OSS

    objects = classify_state(state)
    load_dense_fragments(backend, reader, state, names=list(objects.modules))
    owners = param_owners(objects.modules, backend)
    for name, opt in objects.optimizers.items():
        if not isinstance(opt, OSS):
            load_dense_fragments(backend, reader, state, names=[name])
            continue
        _load_oss_optimizer(reader, name, opt, owners)


@torch.no_grad()
def _load_oss_optimizer(
    reader: Any, name: str, oss: Any, owners: dict[int, tuple[str, str]]
) -> None:
    info = reader.object_info(name, "optimizer")
    group_names, _ = optimizer_param_names(oss, owners, primary=info.get("model"))
    load_param_groups(
        reader, name, reader.object_info(name, "optimizer"), oss.param_groups, group_names
    )
    warn_family_mismatch(name, info, oss.optim)
    # the wrapped optimizer's groups follow OSS's (OSS syncs them at each step; do it now)
    owned = {id(p) for group in oss.optim.param_groups for p in group["params"]}
    for group, local in zip(oss.param_groups, oss.optim.param_groups):
        for key, value in group.items():
            if key != "params":
                local[key] = value
    per_param = reader.optimizer_entries(name)
    scalars = info.get("scalar_state", {})
    for group, pnames in zip(oss.param_groups, group_names):
        for param, pname in zip(group["params"], pnames):
            if id(param) not in owned:
                continue  # another rank owns this parameter's state now
            entries, saved_scalars = per_param.get(pname, {}), scalars.get(pname, {})
            if not entries and not saved_scalars:
                continue
            slot = oss.optim.state[param]
            for key, entry in entries.items():
                target = slot.get(key)
                if not isinstance(target, torch.Tensor) or tuple(target.shape) != entry.shape:
                    target = slot[key] = _new_state(param, key, entry)
                fill_tensor(reader, entry, target)
            for key, value in saved_scalars.items():
                slot[key] = decode(value)


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

    def local_range(self, piece: _Piece) -> tuple[int, int, int] | None:
        """(start in the local shard, start in the piece, count), or None if disjoint."""
        lo = max(self.start, piece.offset)
        hi = min(self.start + self.size, piece.offset + piece.numel)
        if lo >= hi:
            return None
        return lo - self.start, lo - piece.offset, hi - lo

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
        yield ObjectInfo(name, {"type": "module", "class": _qualname(backend.unwrap(root))})
        for flat in flats:
            local = flat.param.data.reshape(-1)
            shard = flat.param.data.numel()
            for piece in flat.pieces:
                meta: dict[str, Any] = {"aliases": piece.aliases}
                if not flat.param.requires_grad:
                    meta["trainable"] = False
                span = flat.local_range(piece)
                if span is not None:
                    at, offset, count = span
                    data = local[at : at + count]
                    yield Fragment(name, piece.fqn, PARAM, piece.shape, offset, data, meta)
                elif piece.numel == 0 and rank == flat.owner_of_first_element(piece, shard, world):
                    yield Fragment(name, piece.fqn, PARAM, piece.shape, 0, local[:0], meta)
        planner = ReplicaPlanner(rank, world)
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
    group_names: list[list[str]] = []
    scalar_state: dict[str, Any] = {}
    for group in opt.param_groups:
        names: list[str] = []
        for param in group["params"]:
            flat = by_param[id(param)]
            names.extend(piece.fqn for piece in flat.pieces)
            shard = param.data.numel()
            for key, value in opt.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor):
                    for piece in flat.pieces:  # the same on every rank: rank 0's is kept
                        scalar_state.setdefault(piece.fqn, {})[key] = encode(
                            value, f"{name}/state/{piece.fqn}/{key}"
                        )
                    continue
                if value.dim() == 0:
                    for piece in flat.pieces:
                        if rank == flat.owner_of_first_element(piece, shard, world):
                            yield Fragment(
                                name, piece.fqn, OPTIM_PREFIX + key, (), 0, value.reshape(-1)
                            )
                    continue
                if value.numel() != shard:
                    raise CheckpointError(
                        f"fairscale_fsdp: optimizer state {key!r} has shape "
                        f"{list(value.shape)}, neither a scalar nor the flat shard's "
                        f"({shard} elements); this optimizer's state cannot be mapped back to "
                        "the original parameters"
                    )
                local = value.reshape(-1)
                for piece in flat.pieces:
                    span = flat.local_range(piece)
                    if span is not None:
                        at, offset, count = span
                        yield Fragment(
                            name,
                            piece.fqn,
                            OPTIM_PREFIX + key,
                            piece.shape,
                            offset,
                            local[at : at + count],
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


@torch.no_grad()
def _load_fsdp_module(reader: Any, name: str, root: Any, flats: list[_Flat]) -> None:
    saved = reader.module_entries(name)
    by_alias = {alias: entry for entry in saved.values() for alias in entry.aliases}
    used: set[str] = set()
    missing: list[str] = []
    plan: list[tuple[Any, _Flat, _Piece]] = []
    for flat in flats:
        for piece in flat.pieces:
            entry = saved.get(piece.fqn) or by_alias.get(piece.fqn)
            for alias in piece.aliases:
                entry = entry or saved.get(alias) or by_alias.get(alias)
            if entry is None:
                missing.append(piece.fqn)
                continue
            used.add(entry.fqn)
            used.update(a for a in piece.aliases if a in saved)
            plan.append((entry, flat, piece))
    buffers = list(_persistent_buffers(root))
    for fqn, _ in buffers:
        if fqn in saved:
            used.add(fqn)
        else:
            missing.append(fqn)
    reader.check_keys(f"module {name!r}", missing, sorted(set(saved) - used))
    for entry, flat, piece in plan:
        if entry.shape != piece.shape:
            raise CheckpointError(
                f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) has shape "
                f"{list(entry.shape)}, the target has {list(piece.shape)}"
            )
        master = reader.entry(name, MASTER, entry.fqn)
        source = master if master is not None else entry
        span = flat.local_range(piece)
        if span is None:
            continue
        at, offset, count = span
        local = flat.param.data.reshape(-1)
        reader.read_flat(source, offset, count, out=local[at : at + count])
    for fqn, buffer in buffers:
        if fqn in saved:
            fill_tensor(reader, saved[fqn], buffer)
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
    info = reader.object_info(name, "optimizer")
    load_param_groups(reader, name, info, opt.param_groups, names)
    warn_family_mismatch(name, info, opt)
    per_param = reader.optimizer_entries(name)
    scalars = info.get("scalar_state", {})
    for group in opt.param_groups:
        for param in group["params"]:
            flat = by_param[id(param)]
            keys: dict[str, Any] = {}
            for piece in flat.pieces:
                for key, entry in per_param.get(piece.fqn, {}).items():
                    keys.setdefault(key, []).append((piece, entry))
            saved_scalars = {
                k: v for piece in flat.pieces for k, v in scalars.get(piece.fqn, {}).items()
            }
            if not keys and not saved_scalars:
                continue
            slot = opt.state[param]
            for key, pairs in keys.items():
                if all(entry.shape == () for _, entry in pairs):
                    values = {float(reader.read(entry)) for _, entry in pairs}
                    if len(values) > 1:
                        message = (
                            f"optimizer {name!r}: {key!r} differs between the parameters of "
                            f"one flat parameter ({sorted(values)}); FairScale keeps one per "
                            "flat parameter, so the largest is used"
                        )
                        if reader.strict:
                            raise CheckpointError(message + " (pass strict=False to accept)")
                        log.warning(message)
                    top = max(pairs, key=lambda pair: float(reader.read(pair[1])))[1]
                    target = _new_state(param, key, top)
                    fill_tensor(reader, top, target)
                    slot[key] = target
                    continue
                target = slot.get(key)
                if not isinstance(target, torch.Tensor) or target.shape != param.data.shape:
                    from accelkit.checkpoint.safetensors_io import DTYPES_BY_NAME

                    stored = DTYPES_BY_NAME[pairs[0][1].dtype]
                    dtype = param.dtype if stored.is_floating_point else stored
                    target = slot[key] = torch.zeros_like(param.data, dtype=dtype)
                local = target.reshape(-1)
                for piece, entry in pairs:
                    if entry.shape != piece.shape:
                        raise CheckpointError(
                            f"tensor {entry.label}: the checkpoint has shape "
                            f"{list(entry.shape)}, the target {list(piece.shape)}"
                        )
                    span = flat.local_range(piece)
                    if span is None:
                        continue
                    at, offset, count = span
                    reader.read_flat(entry, offset, count, out=local[at : at + count])
            for key, value in saved_scalars.items():
                slot[key] = decode(value)
