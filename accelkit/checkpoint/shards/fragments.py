"""Fragments: the unit every backend writes and reads.

Every sharded backend holds a tensor as contiguous ranges of its flattened form (ZeRO-1/2 flat
partitions, ZeRO-3 partitions, FSDP2 row shards). A :class:`Fragment` is one such range on one
rank. A backend's ``local_fragments(state)`` yields the fragments this rank holds, plus one
:class:`ObjectInfo` per object with its non-tensor description (an optimizer's family and param
groups); ``load_fragments(reader, state)`` fills this rank's pieces from any checkpoint through
:class:`~accelkit.checkpoint.read.reader.CheckpointReader`, whatever wrote it.

This module holds the default pair used by the torch-native backends: plain tensors (one
process, or replicas under data parallelism) and DTensor parameters, without naming any backend.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from accelkit.checkpoint.format.codec import decode, encode
from accelkit.checkpoint.format.fqn import module_tensors, user_module
from accelkit.checkpoint.shards.dtensor import (
    dtensor_writes_here,
    flat_range,
    is_dtensor,
    local_region,
)
from accelkit.errors import CheckpointError

if TYPE_CHECKING:
    from accelkit.checkpoint.format.manifest import TensorEntry
    from accelkit.checkpoint.read.reader import CheckpointReader

log = logging.getLogger("accelkit")

PARAM, BUFFER, MASTER = "param", "buffer", "master"
OPTIM_PREFIX = "optim:"

#: ``(canonical fqn, target, is_parameter, aliases)``: one tensor of a module to write or fill
ModuleEntry = tuple[str, Any, bool, list[str]]

#: replicated tensors at least this large are split across ranks, so each rank writes a slice
SPLIT_BYTES = 4 << 20


@dataclass
class Fragment:
    """The range ``[flat_offset, flat_offset + data.numel())`` of the flattened tensor ``fqn``.

    ``data`` is 1-D (a view is best: nothing is copied until it is written) on any device.
    ``meta`` holds tensor-level manifest fields: ``aliases`` (tied names), ``trainable``,
    ``upcast`` (an fp32 master made from low-precision weights), ``gathered`` (written from a
    gathered full tensor). A fragment with no elements just declares the tensor.
    """

    object: str
    fqn: str
    kind: str
    shape: tuple[int, ...]
    flat_offset: int
    data: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.data.numel()


@dataclass
class ObjectInfo:
    """The non-tensor description of one object of the state (JSON-ready; rank 0's is kept)."""

    object: str
    info: dict[str, Any]


# ---- what is in a state dict ----------------------------------------------------------------------
@dataclass
class StateObjects:
    """The objects of a user's ``state`` dict, sorted by what they are."""

    modules: dict[str, torch.nn.Module] = field(default_factory=dict)
    #: the inner torch optimizers (accelkit's proxy unwrapped)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    statefuls: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

    def kind_of(self, name: str) -> str:
        for kind in ("modules", "optimizers", "schedulers", "statefuls", "extras"):
            if name in getattr(self, kind):
                return kind[:-1] if kind != "extras" else "extra"
        raise KeyError(name)


def inner_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside the one ``setup`` returned. A class that wraps an optimizer says so
    with ``wraps_optimizer = True`` and holds it as ``.optimizer`` (the facade's
    ``AcceleratedOptimizer`` does), so the format needs no import of the facade."""
    while getattr(type(opt), "wraps_optimizer", False):
        opt = opt.optimizer
    return opt


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def classify_state(state: dict[str, Any]) -> StateObjects:
    """Sort the objects of a save/load ``state`` dict into modules, optimizers, loaders,
    stateful objects and plain extras (what the checkpoint writes each of)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of name -> object, got {type(state).__name__}")
    out = StateObjects()
    for name, obj in state.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("__"):
            raise CheckpointError(
                f"state key {name!r}: use a non-empty string without '/' that does not start "
                "with '__' (reserved)"
            )
        if isinstance(obj, torch.nn.Module):
            out.modules[name] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            out.optimizers[name] = inner_optimizer(obj)
        elif is_stateful(obj) and isinstance(
            getattr(obj, "optimizer", None), torch.optim.Optimizer
        ):
            out.schedulers[name] = obj
        elif is_stateful(obj):
            out.statefuls[name] = obj
        else:
            out.extras[name] = obj
    return out


# ---- optimizer description --------------------------------------------------------------------------
_FAMILIES = {
    "adam": "adam",
    "adamw": "adamw",
    "fusedadam": "adam",
    "distributedfusedadam": "adam",
    "deepspeedcpuadam": "adam",
    "sgd": "sgd",
    "fusedsgd": "sgd",
    "adagrad": "adagrad",
    "rmsprop": "rmsprop",
    "adamax": "adamax",
    "nadam": "nadam",
    "radam": "radam",
    "adadelta": "adadelta",
    "lamb": "lamb",
    "fusedlamb": "lamb",
    "lion": "lion",
    "adafactor": "adafactor",
}


def optimizer_family(opt: torch.optim.Optimizer) -> str:
    """``adam``, ``adamw``, ``sgd``, ...: what the state keys mean, across implementations.

    A fused Adam that decouples weight decay (Apex's and DeepSpeed's ``adam_w_mode``) is ``adamw``.
    """
    name = type(opt).__name__.lower()
    family = _FAMILIES.get(name, name)
    if family == "adam" and getattr(opt, "adam_w_mode", False):
        return "adamw"
    return family


def param_owners(
    modules: dict[str, torch.nn.Module],
    backend: Any = None,
    entries: Callable[[torch.nn.Module], Iterable[ModuleEntry]] = module_tensors,
) -> dict[int, tuple[str, str]]:
    """id(parameter) -> (module object name, canonical fqn) over every module of the state.

    ``entries`` lists a module's tensors (default :func:`module_tensors`); a backend whose
    state dict builds new tensors passes one that resolves them to the Parameters."""
    owners: dict[int, tuple[str, str]] = {}
    for name, module in modules.items():
        for fqn, tensor, is_param, _aliases in entries(user_module(module, backend)):
            if is_param:
                owners.setdefault(id(tensor), (name, fqn))
    return owners


def optimizer_param_names(
    opt: torch.optim.Optimizer,
    owners: dict[int, tuple[str, str]],
    primary: str | None = None,
) -> tuple[list[list[str]], str | None]:
    """Each param group's parameter names, and the module object most of them belong to."""
    return param_group_names([group["params"] for group in opt.param_groups], owners, primary)


def param_group_names(
    groups: Iterable[Iterable[Any]],
    owners: dict[int, tuple[str, str]],
    primary: str | None = None,
) -> tuple[list[list[str]], str | None]:
    """The canonical names of the parameters of each group, and the module object most of them
    belong to (``primary``, unless the given one holds some of them).

    A parameter of the primary module is named by its fqn; one of another module by
    ``"<object>/<fqn>"``; one of no module in the state by its position. Sharded backends pass
    the module parameters their optimizer's groups train (not the flat partitions it steps), so
    every backend names the same parameter the same way.
    """
    groups = [list(params) for params in groups]
    counts: dict[str, int] = {}
    for params in groups:
        for p in params:
            if id(p) in owners:
                counts[owners[id(p)][0]] = counts.get(owners[id(p)][0], 0) + 1
    if primary not in counts:
        primary = max(counts, key=counts.get) if counts else None
    names: list[list[str]] = []
    for g, params in enumerate(groups):
        group_names = []
        for i, p in enumerate(params):
            owner = owners.get(id(p))
            if owner is None:
                group_names.append(f"param_groups.{g}.params.{i}")
            elif owner[0] == primary:
                group_names.append(owner[1])
            else:
                group_names.append(f"{owner[0]}/{owner[1]}")
        names.append(group_names)
    return names, primary


def param_group_hyperparams(group: dict[str, Any], where: str) -> dict[str, Any]:
    """A param group's settings (lr, betas, ...) as JSON for the manifest; ``params`` left out,
    a 1-element tensor (a tensor lr) stored as its number, an entry JSON cannot hold skipped with
    a warning."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        try:
            out[key] = encode(value, f"{where}/{key}")
        except CheckpointError:
            log.warning("%s: param group entry %r is not stored (not JSON-able)", where, key)
    return out


def optimizer_info(
    name: str,
    opt: Any,
    group_names: list[list[str]],
    primary: str | None,
    *,
    groups: list[dict[str, Any]] | None = None,
    step_granularity: str = "param",
    scalar_state: dict[str, Any] | None = None,
    sharding: str | None = None,
) -> ObjectInfo:
    """The manifest record of optimizer ``name``: its class and family, the model its parameter
    names belong to, and each param group (``groups``, default ``opt.param_groups``) by canonical
    parameter name with its settings. Every writer, core and plugin, describes optimizers the same
    way, so every reader can rebuild the groups (``load_param_groups``)."""
    record: dict[str, Any] = {
        "type": "optimizer",
        "class": qualname(opt),
        "family": optimizer_family(opt),
        "model": primary,
        "step_granularity": step_granularity,
        "param_groups": [
            {"params": pnames, **param_group_hyperparams(group, f"{name}/param_groups/{g}")}
            for g, (group, pnames) in enumerate(
                zip(opt.param_groups if groups is None else groups, group_names)
            )
        ],
        "scalar_state": scalar_state if scalar_state is not None else {},
    }
    if sharding is not None:
        record["sharding"] = sharding
    return ObjectInfo(name, record)


# ---- planning which rank writes what ----------------------------------------------------------------
class ReplicaPlanner:
    """Splits the writing of replicated tensors across ranks, the same way on every rank.

    Large tensors (>= ``SPLIT_BYTES``) are cut into ``world`` even contiguous ranges, one per
    rank; small ones go whole to the least-loaded rank. Every rank sees the same tensors in the
    same order (data-parallel replicas), so every rank computes the same plan without talking.
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.loads = [0] * world

    def ranges(self, numel: int, nbytes: int, *, owner: int | None = None) -> list[tuple[int, int]]:
        if self.world == 1:
            return [(0, numel)]
        if owner is None and nbytes >= SPLIT_BYTES and numel >= self.world:
            base, rest = divmod(numel, self.world)
            start = self.rank * base + min(self.rank, rest)
            size = base + (1 if self.rank < rest else 0)
            for r in range(self.world):
                self.loads[r] += nbytes // self.world
            return [(start, size)]
        if owner is None:
            owner = min(range(self.world), key=lambda r: (self.loads[r], r))
        self.loads[owner] += nbytes
        return [(0, numel)] if owner == self.rank else []


# ---- the default writer -----------------------------------------------------------------------------
def tensor_fragments(
    obj: str,
    fqn: str,
    kind: str,
    tensor: torch.Tensor,
    planner: ReplicaPlanner,
    *,
    meta: dict[str, Any] | None = None,
    owner: int | None = None,
) -> Iterator[Fragment]:
    """This rank's fragments of one tensor: its DTensor shard, or its planned slice of a replica."""
    meta = dict(meta or {})
    shape = tuple(tensor.shape)
    tensor = tensor.detach()
    if is_dtensor(tensor):
        writes = dtensor_writes_here(tensor)
        local_shape, offset = local_region(tensor)
        rng = flat_range(shape, local_shape, offset) if writes is not None else None
        if rng is not None:
            local = tensor.to_local().reshape(-1)
            if writes and local.numel():
                yield Fragment(obj, fqn, kind, shape, rng[0], local, meta)
            else:
                yield Fragment(obj, fqn, kind, shape, 0, local[:0], meta)
            return
        tensor = tensor.full_tensor()  # a collective: same order on every rank
        meta["gathered"] = True
    flat = tensor.reshape(-1)
    ranges = planner.ranges(flat.numel(), flat.numel() * flat.element_size(), owner=owner)
    for start, size in ranges:
        yield Fragment(obj, fqn, kind, shape, start, flat[start : start + size], meta)
    if not ranges:
        yield Fragment(obj, fqn, kind, shape, 0, flat[:0], meta)


def dense_fragments(
    backend: Any, state: dict[str, Any], names: list[str] | None = None
) -> Iterator[Fragment | ObjectInfo]:
    """Fragments of the modules and torch optimizers in ``state`` (all, or those in ``names``).

    Plain tensors are replicas: with a distributed backend each rank holding them
    (``Backend.replica_holders``) writes a disjoint part (:class:`ReplicaPlanner`); buffers are
    written by the first holder, whose copy is authoritative (DDP broadcasts rank 0's buffers). DTensor shards are written by the rank holding them.
    """
    objects = classify_state(state)
    distributed = bool(getattr(backend.capabilities, "distributed", False))
    if not distributed and backend.rank != 0:
        return  # independent processes: rank 0 writes everything
    # over the ranks holding the same tensors (under pipeline parallelism: one stage's)
    planner = ReplicaPlanner(*(backend.replica_holders() if distributed else (0, 1)))
    wanted = set(names) if names is not None else None
    for name, module in objects.modules.items():
        if wanted is not None and name not in wanted:
            continue
        inner = user_module(module, backend)
        yield module_info(name, inner)
        # a pipeline stage's copy of a weight tied across stages: the first holder writes it
        elsewhere = getattr(inner, "_accelkit_written_elsewhere", ())
        for fqn, tensor, is_param, aliases in module_tensors(inner):
            if fqn in elsewhere:
                continue
            if tensor.device.type == "meta":
                raise CheckpointError(
                    f"{name}.{fqn} is on the meta device (not materialized); nothing to save"
                )
            meta: dict[str, Any] = {"aliases": aliases}
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
    owners = param_owners(objects.modules, backend)
    for name, opt in objects.optimizers.items():
        if wanted is not None and name not in wanted:
            continue
        group_names, primary = optimizer_param_names(opt, owners)
        scalar_state: dict[str, Any] = {}
        elsewhere = _written_elsewhere(objects.modules, backend)
        yield from param_state_fragments(
            name, opt.param_groups, group_names, opt.state, planner, scalar_state, skip=elsewhere
        )
        yield optimizer_info(name, opt, group_names, primary, scalar_state=scalar_state)


def _written_elsewhere(modules: dict[str, torch.nn.Module], backend: Any) -> set[str]:
    """The parameter names (as optimizers name them) another pipeline stage writes."""
    out: set[str] = set()
    for module in modules.values():
        out |= set(getattr(user_module(module, backend), "_accelkit_written_elsewhere", ()))
    return out


def param_state_fragments(
    obj: str,
    groups: list[dict[str, Any]],
    names: list[list[str]],
    state: dict[Any, dict[str, Any]],
    planner: ReplicaPlanner,
    scalar_state: dict[str, Any],
    owner: int | None = None,
    skip: frozenset[str] | set[str] = frozenset(),
) -> Iterator[Fragment]:
    """Per-parameter optimizer ``state`` (whole tensors, one per parameter): each tensor as a
    replica (or written by rank ``owner``), each other value into ``scalar_state`` (JSON);
    the parameters named in ``skip`` are written by another rank."""
    for group, pnames in zip(groups, names):
        for p, pname in zip(group["params"], pnames):
            if pname in skip:
                continue
            for key, value in state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    kind = OPTIM_PREFIX + key
                    yield from tensor_fragments(obj, pname, kind, value, planner, owner=owner)
                else:
                    scalar_state.setdefault(pname, {})[key] = encode(
                        value, f"{obj}/state/{pname}/{key}"
                    )


def qualname(obj: Any) -> str:
    """``module.Class`` of an object: what the manifest records as an object's class."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


#: the attribute :meth:`Accelerator.load_pretrained` leaves on the user's module: the directory
#: of the pretrained source, recorded by :func:`module_info` (``accelkit convert --to hf`` looks
#: there for a ``config.json``)
PRETRAINED_FROM = "_accelkit_pretrained_from"


def _as_save_pretrained_writes(module: torch.nn.Module, config: Any) -> dict[str, Any]:
    """The ``config.json`` that ``save_pretrained`` writes: the values that differ from the
    config class's defaults, no private keys, the model's class as its architecture and the
    dtype of its weights (``from_pretrained`` then builds the model the same way)."""
    data = {k: v for k, v in json.loads(config.to_json_string()).items() if not k.startswith("_")}
    if not data.get("architectures"):
        data["architectures"] = [type(module).__name__]
    if data.get("torch_dtype") is None:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        if dtype is not None:
            data["torch_dtype"] = str(dtype).removeprefix("torch.")
    return data


def module_info(name: str, module: torch.nn.Module) -> ObjectInfo:
    """The manifest record of module object ``name`` (every writer records a module so).

    A model with a Hugging Face-style ``config`` (one with ``to_json_string``: Transformers'
    ``PretrainedConfig``) records it as ``hf_config``, and a model filled by ``load_pretrained``
    records where from (``pretrained_from``): ``accelkit convert --to hf`` writes the
    ``config.json`` that ``from_pretrained`` needs from either."""
    info: dict[str, Any] = {"type": "module", "class": qualname(module)}
    config = getattr(module, "config", None)
    if callable(getattr(config, "to_json_string", None)):
        try:
            info["hf_config"] = _as_save_pretrained_writes(module, config)
        except (TypeError, ValueError) as err:  # a config JSON cannot hold: export asks for one
            log.debug("the model's config is not stored: %s", err)
    source = module.__dict__.get(PRETRAINED_FROM)
    if isinstance(source, str):
        info["pretrained_from"] = source
    return ObjectInfo(name, info)


# ---- the default reader -----------------------------------------------------------------------------
@torch.no_grad()
def fill_tensor(reader: CheckpointReader, entry: TensorEntry, target: torch.Tensor) -> None:
    """Copy this rank's part of ``entry`` into ``target`` (a plain tensor or a DTensor)."""
    shape = tuple(target.shape)
    if shape != entry.shape:
        raise CheckpointError(
            f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) has shape "
            f"{list(entry.shape)}, the target has {list(shape)}"
        )
    if target.device.type == "meta":
        raise CheckpointError(
            f"tensor {entry.label}: the target is on the meta device (a model built in "
            "init_module() gets its storage in setup()): load into the model setup() returned"
        )
    if is_dtensor(target):
        local = target.to_local()
        local_shape, offset = local_region(target)
        rng = flat_range(shape, local_shape, offset)
        if rng is None:  # not contiguous once flattened: read the whole tensor, cut the box
            full = reader.read(entry).reshape(shape)
            box = full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
            local.copy_(box)
            return
        _fill_flat(reader, entry, local, rng[0])
        return
    _fill_flat(reader, entry, target, 0)


def _fill_flat(reader: CheckpointReader, entry: TensorEntry, dst: torch.Tensor, start: int) -> None:
    if dst.numel() == 0:
        return
    if dst.is_contiguous():  # checksums run in the background; load() waits for them
        reader.read_flat(entry, start, dst.numel(), out=dst.view(-1), defer_verify=True)
    else:
        dst.copy_(reader.read_flat(entry, start, dst.numel()).view(dst.shape))


def load_dense_fragments(
    backend: Any, reader: CheckpointReader, state: dict[str, Any], names: list[str] | None = None
) -> None:
    """Fill the modules and torch optimizers of ``state`` (all, or ``names``) from ``reader``."""
    objects = classify_state(state)
    wanted = set(names) if names is not None else None
    with reader.parallel_reads():  # every target is only filled here, so reads may overlap
        for name, module in objects.modules.items():
            if wanted is None or name in wanted:
                load_module(reader, name, user_module(module, backend))
        owners = param_owners(objects.modules, backend)
        for name, opt in objects.optimizers.items():
            if wanted is None or name in wanted:
                load_optimizer(reader, name, opt, owners)


def load_module(reader: CheckpointReader, name: str, module: torch.nn.Module) -> None:
    """Fill parameters and buffers of ``module`` by canonical fqn (tied names through aliases)."""
    for entry, tensor, _is_param in match_module_entries(reader, name, module_tensors(module)):
        fill_tensor(reader, weights_entry(reader, name, entry), tensor)


def match_module_entries(
    reader: CheckpointReader, name: str, targets: Iterable[ModuleEntry]
) -> list[tuple[TensorEntry, Any, bool]]:
    """``(saved entry, target, is_parameter)`` for each target of module object ``name``.

    A target is matched by its fqn or any of its aliases against the saved names and theirs
    (tied weights load whichever way either side tied them); missing and unexpected names go to
    ``reader.check_keys`` (the ``strict`` rule). A frozen parameter left out by
    ``exclude_frozen=True`` is not missing: the model keeps its own. Every backend matches its
    targets (tensors, or its own handles on a flat range) so.
    """
    saved = reader.module_entries(name)
    by_alias = {alias: entry for entry in saved.values() for alias in entry.aliases}
    used: set[str] = set()
    missing: list[str] = []
    plan: list[tuple[TensorEntry, Any, bool]] = []
    frozen_left_out = bool(reader.manifest.data.get("excluded_frozen"))
    for fqn, target, is_param, aliases in targets:
        entry = saved.get(fqn) or by_alias.get(fqn)
        for alias in aliases:
            entry = entry or saved.get(alias) or by_alias.get(alias)
        if entry is None:
            if frozen_left_out and is_param and not getattr(target, "requires_grad", True):
                continue
            missing.append(fqn)
            continue
        used.add(entry.fqn)
        plan.append((entry, target, is_param))
        # the target ties what the checkpoint stored separately: fine, same values
        used.update(a for a in aliases if a in saved)
    # under pipeline parallelism the other stages' tensors are not unexpected: they are held
    # by other ranks (reader.held_anywhere, gathered once per load)
    elsewhere = getattr(reader, "held_anywhere", {}).get(name, set())
    reader.check_keys(f"module {name!r}", missing, sorted(set(saved) - used - elsewhere))
    return plan


def weights_entry(reader: CheckpointReader, name: str, entry: TensorEntry) -> TensorEntry:
    """What a parameter's weights load from: its fp32 master where one was saved, else itself."""
    master = reader.entry(name, MASTER, entry.fqn)
    return master if master is not None else entry


def state_like(
    param: torch.Tensor, key: str, entry: TensorEntry, group: dict[str, Any] | None = None
) -> torch.Tensor:
    """A new optimizer-state tensor placed as torch's ``Optimizer.load_state_dict`` would:
    ``step`` on the CPU unless the group is capturable or fused, the rest like the parameter."""
    from accelkit.checkpoint.format.safetensors_io import DTYPES_BY_NAME

    group = group or {}
    stored = DTYPES_BY_NAME[entry.dtype]
    if key == "step":
        on_device = group.get("capturable") or group.get("fused")
        device = _local_device(param) if on_device else torch.device("cpu")
        return torch.zeros(entry.shape, dtype=stored, device=device)
    if entry.shape == tuple(param.shape):
        return new_state(param, entry)
    dtype = param.dtype if (param.is_floating_point() and stored.is_floating_point) else stored
    return torch.zeros(entry.shape, dtype=dtype, device=_local_device(param))


def new_state(
    like: torch.Tensor, entry: TensorEntry, float_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Zeros for optimizer state ``entry`` with the shape and device of ``like`` (a parameter, a
    master, a flat partition): ``like``'s dtype where both are floating point (``float_dtype``
    where the optimizer keeps its own, as FusedAdam's fp32 moments), the stored one otherwise."""
    from accelkit.checkpoint.format.safetensors_io import DTYPES_BY_NAME

    stored = DTYPES_BY_NAME[entry.dtype]
    if not stored.is_floating_point:
        dtype = stored
    elif float_dtype is not None:
        dtype = float_dtype
    else:
        dtype = like.dtype if like.is_floating_point() else stored
    return torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)


def _local_device(param: torch.Tensor) -> torch.device:
    return param.to_local().device if is_dtensor(param) else param.device


def warn_family_mismatch(name: str, info: dict[str, Any], opt: Any) -> None:
    """Warn where a checkpoint's optimizer family (adam, sgd, ...) is not the target's: the state
    keys may still load, but they may not mean the same."""
    family = info.get("family")
    if family and family != optimizer_family(opt):
        log.warning(
            "optimizer %r: loading %s state into a %s optimizer",
            name,
            family,
            optimizer_family(opt),
        )


def load_optimizer(
    reader: CheckpointReader,
    name: str,
    opt: torch.optim.Optimizer,
    owners: dict[int, tuple[str, str]],
) -> None:
    """Fill a torch optimizer's hyperparameters and per-parameter state, matched by fqn."""
    groups = opt.param_groups
    saved = optimizer_load(reader, name, opt, groups, [g["params"] for g in groups], owners)
    load_param_states(reader, saved, groups, opt.state)


def load_param_states(
    reader: CheckpointReader,
    saved: OptimizerLoad,
    groups: list[dict[str, Any]],
    state: dict[Any, dict[str, Any]],
    *,
    holds: Callable[[Any], bool] | None = None,
    make: Callable[[Any, str, TensorEntry, dict[str, Any]], torch.Tensor] | None = None,
) -> None:
    """Replace the per-parameter ``state`` (an optimizer's ``state``) of the parameters of
    ``groups`` that this rank ``holds`` (default all) with what ``saved`` names for them (none
    saved: none kept, as torch's ``load_state_dict``): each tensor into
    the state's own where it has one of the saved shape, else into a new one from ``make(param,
    key, entry, group)`` (default :func:`state_like`); each JSON scalar decoded."""
    make = make or state_like
    for group, pnames in zip(groups, saved.names):
        for p, pname in zip(group["params"], pnames):
            if holds is not None and not holds(p):
                continue
            entries, scalars = saved.per_param.get(pname, {}), saved.scalars.get(pname, {})
            # as torch's load_state_dict: the checkpoint's state replaces the live one, so a
            # parameter without saved state has none after the load, and no stale key survives
            if not entries and not scalars:
                state.pop(p, None)
                continue
            param_state = state[p]
            for key in [k for k in param_state if k not in entries and k not in scalars]:
                del param_state[key]
            for key, entry in entries.items():
                target = param_state.get(key)
                if not isinstance(target, torch.Tensor) or tuple(target.shape) != entry.shape:
                    target = param_state[key] = make(p, key, entry, group)
                fill_tensor(reader, entry, target)
            for key, value in scalars.items():
                param_state[key] = decode(value)


@dataclass
class OptimizerLoad:
    """What a checkpoint holds for one optimizer: its manifest record, each parameter's saved
    tensors (``per_param[name][key]``) and JSON scalars (``scalars[name][key]``)."""

    info: dict[str, Any]
    names: list[list[str]]
    per_param: dict[str, dict[str, Any]]
    scalars: dict[str, dict[str, Any]]

    @property
    def empty(self) -> bool:
        """Saved before the first step: no parameter has state."""
        return not any(self.per_param.get(n) or self.scalars.get(n) for r in self.names for n in r)


def optimizer_load(
    reader: Any,
    name: str,
    opt: Any,
    groups: list[dict[str, Any]],
    param_groups: Iterable[Iterable[Any]],
    owners: dict[int, tuple[str, str]],
    names: list[list[str]] | None = None,
) -> OptimizerLoad:
    """Start loading optimizer ``name``: name the module parameters each of ``groups`` trains
    (``param_groups``, or ``names`` as given) as the checkpoint does, check the saved groups hold
    the same parameters and copy their hyperparameters into ``groups``, warn where the saved
    family (adam, sgd, ...) is not ``opt``'s."""
    info = reader.object_info(name, "optimizer")
    if names is None:
        names, _ = param_group_names(param_groups, owners, primary=info.get("model"))
    load_param_groups(reader, name, info, groups, names)
    warn_family_mismatch(name, info, opt)
    return OptimizerLoad(info, names, reader.optimizer_entries(name), info.get("scalar_state", {}))


def check_param_groups(
    reader: Any, name: str, saved_groups: list[dict[str, Any]], group_names: list[list[str]]
) -> None:
    """The saved param groups hold the same parameters as the live ones (``group_names``),
    group by group; mismatches go to ``reader.check_keys`` (the ``strict`` rule). Under
    pipeline parallelism the groups compared are every rank's together
    (``reader.held_anywhere``)."""
    everywhere = getattr(reader, "held_anywhere", {}).get(name)
    if everywhere is not None and len(everywhere) == len(group_names):
        group_names = [sorted(g) for g in everywhere]
    if len(saved_groups) != len(group_names):
        reader.check_keys(
            f"optimizer {name!r}",
            [],
            [],
            extra=f"the checkpoint has {len(saved_groups)} param groups, the optimizer "
            f"{len(group_names)}",
        )
    target_all = {n for names in group_names for n in names}
    saved_all = {n for group in saved_groups for n in group.get("params", [])}
    reader.check_keys(
        f"optimizer {name!r} parameters",
        sorted(target_all - saved_all),
        sorted(saved_all - target_all),
    )
    for index, (saved, names) in enumerate(zip(saved_groups, group_names)):
        if set(saved.get("params", [])) != set(names):
            reader.check_keys(
                f"optimizer {name!r}",
                [],
                [],
                extra=f"param group {index} holds different parameters in the checkpoint",
            )


def load_param_groups(
    reader: Any,
    name: str,
    info: dict[str, Any],
    groups: list[dict[str, Any]],
    group_names: list[list[str]],
) -> None:
    """Check that ``groups`` hold the saved parameters (by fqn, group by group) and copy the saved
    hyperparameters into them. Shared by every backend that loads an optimizer."""
    saved_groups = info.get("param_groups", [])
    check_param_groups(reader, name, saved_groups, group_names)
    for group, saved in zip(groups, saved_groups):
        for key, value in saved.items():
            if key == "params":
                continue
            value = decode(value)
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple) and isinstance(value, list):
                group[key] = tuple(value)
            else:
                group[key] = value
