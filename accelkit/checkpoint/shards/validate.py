"""Validate, then commit: what a load checks before it writes to any live object.

A load that fails must leave the model, optimizer, scheduler, loaders and RNG as they were, or a
user who catches the error (or an auto-resume that falls back to an older checkpoint) trains a
corrupted model. So :func:`accelkit.checkpoint.load` runs in two phases:

1. **validate** (this module, and :mod:`accelkit.checkpoint.read.verify` for the checksums; nothing live is written): the manifest's schema and every rank
   file's size, place and header (at open); every fragment's checksum, the work split over the
   ranks; every target's key and shape, each optimizer's param groups, hyperparameters and
   per-parameter state keys (the backend's :meth:`~accelkit.backend.Backend.check_load`); the
   scheduler, stateful, extras, backend and RNG sections, decoded and type-checked against the
   live objects. Every rank learns whether any rank failed before any rank writes.
2. **commit**: the backend fills its tensors from fragments already verified, then the decoded
   sections are applied. Only an I/O error can still fail here; it raises
   :class:`~accelkit.errors.PartialLoadError`, which says the objects must not be trained.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.checkpoint.format.codec import decode
from accelkit.checkpoint.format.fqn import module_tensors, user_module
from accelkit.checkpoint.format.manifest import BACKEND_OBJECT
from accelkit.checkpoint.read.rank_state import read_rank_states
from accelkit.checkpoint.shards.fragments import (
    check_param_groups,
    classify_state,
    match_module_entries,
    param_group_names,
    param_owners,
    weights_entry,
)
from accelkit.errors import CheckpointError


# ---- modules and torch optimizers (the default Backend.check_load) -----------------------------
def check_dense_load(
    backend: Any,
    reader: Any,
    state: dict[str, Any],
    shape_of: Callable[[Any], tuple[int, ...]] | None = None,
    names: Iterable[str] | None = None,
) -> None:
    """Check what the dense loader will fill, without writing: each module's keys (the
    ``strict`` rule) and shapes (:func:`check_module_targets`), then each torch optimizer
    (:func:`check_optimizer`). ``shape_of`` gives a live tensor's full shape (default
    ``tensor.shape``: a DTensor's is global); ``names`` limits the check to those objects of
    ``state`` (a backend checks the others its own way)."""
    objects = classify_state(state)
    wanted = set(state if names is None else names)
    for name, module in objects.modules.items():
        if name in wanted:
            targets = module_tensors(user_module(module, backend))
            check_module_targets(reader, name, targets, shape_of)
    owners = param_owners(objects.modules, backend)
    from accelkit.checkpoint.shards.owned import live_state_keys, owned_state

    for name, opt in objects.optimizers.items():
        if name not in wanted:
            continue
        owned = owned_state(backend, opt)
        if owned is not None:  # ZeRO-1: the groups are the module's, the state spread over ranks
            group_names, _ = param_group_names(
                [g["params"] for g in owned.groups], owners, primary=_primary(reader, name)
            )
            keys = live_state_keys(owned)  # a collective: every rank gets here
            check_optimizer(reader, name, owned.groups, group_names, live_keys=keys)
            continue
        groups = opt.param_groups
        group_names, _ = param_group_names(
            [g["params"] for g in groups], owners, primary=_primary(reader, name)
        )
        params = [p for g in groups for p in g["params"]]
        if not params or not all(id(p) in owners for p in params):
            # the groups hold what a library steps (flat partitions, or nothing on this rank),
            # not the modules' parameters: the backend's own loader names and checks them
            continue
        # a library's own optimizer keeps its state its own way (flat buffers, other keys):
        # compare state keys with the live ones only for torch's optimizers
        live = opt.state if type(opt).__module__.startswith("torch.optim") else None
        check_optimizer(reader, name, groups, group_names, live)


def check_module_targets(
    reader: Any,
    name: str,
    targets: Iterable[tuple[str, Any, bool, list[str]]],
    shape_of: Callable[[Any], tuple[int, ...]] | None = None,
) -> None:
    """Module ``name``'s saved tensors against its live ``targets`` (``(fqn, target,
    is_param, aliases)``, as :func:`~accelkit.checkpoint.format.fqn.module_tensors` lists them):
    keys under the ``strict`` rule, full shapes, float/integer kind, no meta tensor. A target
    needs only ``shape`` (and ``dtype``, ``device`` where it has them), so a backend whose
    parameters are flat buffers passes one stand-in per original parameter."""
    shape_of = shape_of or (lambda t: tuple(t.shape))
    for entry, target, _is_param in match_module_entries(reader, name, targets):
        source = weights_entry(reader, name, entry)
        live = shape_of(target)
        if math.prod(live) == 0 and entry.numel:
            continue  # a placeholder of a library that partitions (ZeRO-3): its loader checks
        for saved in {id(entry): entry, id(source): source}.values():
            if tuple(saved.shape) != live:
                raise CheckpointError(
                    f"tensor {saved.label}: the checkpoint ({reader.manifest_path}) has shape "
                    f"{list(saved.shape)}, the target has {list(live)}; "
                    "nothing was loaded"
                )
        _check_kind(reader, source, target)
        if getattr(target, "device", None) is not None and target.device.type == "meta":
            raise CheckpointError(
                f"tensor {entry.label}: the target is on the meta device (a model built in "
                "init_module() gets its storage in setup()): load into the model setup() returned"
            )


def _check_kind(reader: Any, entry: Any, target: Any) -> None:
    """Values convert between float dtypes (bf16 files into fp32 weights), never between a
    float and an integer or boolean tensor."""
    from accelkit.checkpoint.format.safetensors_io import DTYPES_BY_NAME

    stored = DTYPES_BY_NAME.get(entry.dtype)
    dtype = getattr(target, "dtype", None)
    if stored is None or dtype is None:
        return
    if (stored.is_floating_point, stored == torch.bool) != (
        dtype.is_floating_point,
        dtype == torch.bool,
    ):
        raise CheckpointError(
            f"tensor {entry.label}: the checkpoint ({reader.manifest_path}) holds {entry.dtype}, "
            f"the target is {str(dtype).removeprefix('torch.')}; a value of one cannot become "
            "the other. Nothing was loaded"
        )


def _primary(reader: Any, name: str) -> Any:
    info = reader.manifest.objects.get(name) or {}
    return info.get("model")


def check_optimizer(
    reader: Any,
    name: str,
    groups: list[dict[str, Any]],
    group_names: list[list[str]],
    live_state: dict[Any, dict[str, Any]] | None = None,
    *,
    live_keys: set[str] | None = None,
) -> None:
    """An optimizer's saved record against the live one, without writing: the same parameters
    group by group, hyperparameters of the live types (finite numbers where numbers are), and,
    under ``strict``, per-parameter state with no entry missing or extra. The live state keys
    are those of ``live_state``'s parameters, or ``live_keys`` where the state lives on other
    ranks too (ZeRO-1: every rank's keys)."""
    info = reader.object_info(name, "optimizer")
    saved_groups = info.get("param_groups")
    where = f"optimizer {name!r} in {reader.manifest_path}"
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
        raise CheckpointError(f"{where}: field 'param_groups' is not a list of objects")
    check_param_groups(reader, name, saved_groups, group_names)
    for index, (group, saved) in enumerate(zip(groups, saved_groups)):
        for key, value in saved.items():
            if key != "params" and key in group:
                check_value(
                    f"{where}: param group {index} {key!r}", _decoded(value, where), group[key]
                )
    _check_state_keys(reader, name, where, groups, group_names, live_state, live_keys)


def check_state_keys(reader: Any, name: str, live_keys: set[str]) -> None:
    """Optimizer ``name``'s saved per-parameter state holds every key the live optimizer keeps
    (``live_keys``, read wherever its state lives: a library's flat partitions, other ranks), or
    the load is refused under ``strict`` before anything is written: a checkpoint of another
    optimizer (SGD's ``momentum_buffer`` into a trained Adam) would leave the live keys stale
    or missing. Nothing to compare where either side has no state yet. For a backend whose
    optimizer steps flat tensors, which :func:`check_dense_load` cannot name."""
    tensors = reader.optimizer_entries(name)
    info = reader.manifest.objects.get(name) or {}
    scalars = info.get("scalar_state", {}) or {}
    saved = {key for keys in tensors.values() for key in keys}
    saved |= {key for keys in scalars.values() for key in (keys or {})}
    missing = sorted(set(live_keys) - saved)
    if saved and live_keys and missing:
        family = info.get("family") or info.get("class") or "another optimizer"
        reader.check_keys(
            f"optimizer {name!r} state",
            [],
            [],
            extra=f"the checkpoint ({family}) keeps {', '.join(sorted(saved))} per parameter and "
            f"lacks {', '.join(missing)}, which this optimizer keeps: it is another optimizer's "
            "state",
        )


def _decoded(value: Any, where: str) -> Any:
    try:
        return decode(value)
    except Exception as err:
        raise CheckpointError(f"{where}: cannot decode {value!r}: {err}") from err


def _check_state_keys(
    reader: Any,
    name: str,
    where: str,
    groups: list[dict[str, Any]],
    group_names: list[list[str]],
    live_state: dict[Any, dict[str, Any]] | None,
    live_keys: set[str] | None = None,
) -> None:
    """Every parameter the checkpoint has state for has the same state keys (those of the live
    optimizer where it has state already): a missing ``exp_avg`` would mix old and new state."""
    tensors = reader.optimizer_entries(name)
    scalars = (reader.manifest.objects.get(name) or {}).get("scalar_state", {}) or {}
    if not isinstance(scalars, dict):
        raise CheckpointError(f"{where}: field 'scalar_state' is not an object")
    saved_keys = {
        pname: set(tensors.get(pname, {})) | set(scalars.get(pname, {}) or {})
        for names in group_names
        for pname in names
    }
    with_state = {p: k for p, k in saved_keys.items() if k}
    if not with_state:
        return  # saved before the first step: the load clears the live state, as torch does
    live_keys = set(live_keys or ())
    for group in groups:
        for p in group["params"]:
            live_keys |= set((live_state or {}).get(p, {}) or {})
    expected = live_keys or set.union(*with_state.values())
    problems = []
    for pname, keys in saved_keys.items():
        if not keys:
            continue  # a parameter that never had a gradient keeps no state (torch does this)
        missing, extra = sorted(expected - keys), sorted(keys - expected)
        if missing:
            problems.append(f"{pname} lacks {', '.join(missing)}")
        if extra and live_keys:
            problems.append(f"{pname} has {', '.join(extra)}, which this optimizer does not keep")
    if problems:
        reader.check_keys(f"optimizer {name!r} state", [], [], extra="; ".join(problems[:8]))


# ---- JSON sections -------------------------------------------------------------------------------
def check_value(where: str, saved: Any, live: Any) -> None:
    """A saved value fits where a live one of ``live``'s type is: numbers finite and numeric,
    booleans boolean, strings strings, sequences of the same length, dicts key by key."""
    if isinstance(live, bool):
        if not isinstance(saved, bool):
            raise _bad(where, saved, "true or false")
    elif isinstance(live, (int, float)) or (
        isinstance(live, torch.Tensor) and live.numel() == 1 and live.is_floating_point()
    ):
        if isinstance(saved, bool) or not isinstance(saved, (int, float)):
            raise _bad(where, saved, "a number")
        if isinstance(saved, float) and not math.isfinite(saved) and math.isfinite(_num(live)):
            raise _bad(where, saved, "a finite number")
    elif isinstance(live, str):
        if not isinstance(saved, str):
            raise _bad(where, saved, "a string")
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            raise _bad(where, saved, f"a list of {len(live)}")
        for i, (s, v) in enumerate(zip(saved, live)):
            check_value(f"{where}[{i}]", s, v)
    elif isinstance(live, dict):
        if not isinstance(saved, dict):
            raise _bad(where, saved, "an object")
        for key in saved.keys() & live.keys():
            check_value(f"{where}[{key!r}]", saved[key], live[key])


def _num(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _bad(where: str, saved: Any, expected: str) -> CheckpointError:
    return CheckpointError(
        f"{where} is {str(saved)[:60]!r} in the checkpoint, expected {expected}; nothing was loaded"
    )


@dataclass
class Sections:
    """The decoded non-tensor sections of a checkpoint, ready to apply once tensors are in."""

    states: dict[str, Any] = field(default_factory=dict)  # scheduler / stateful name -> state
    extras: dict[str, Any] = field(default_factory=dict)
    backend_state: dict[str, Any] | None = None
    #: what ``load_rank_state_dict`` gets (states by rank, saved world size), or None
    rank_states: tuple[Any, int] | None = None
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
    unconsumed: dict[str, Any] = field(default_factory=dict)


def read_sections(backend: Any, reader: Any, state: dict[str, Any], *, rng: bool) -> Sections:
    """Decode every non-tensor section this load will apply, checking schedulers' and the
    backend's state against the live objects' own (keys of the same types, finite numbers)."""
    objects = classify_state(state)
    saved = reader.manifest.objects
    out = Sections()
    for group in (objects.schedulers, objects.statefuls):
        for name, obj in group.items():
            if name not in saved:
                continue
            info = saved[name]
            if "state" not in info:
                raise CheckpointError(
                    f"{reader.manifest_path}: {name!r} is a {info.get('type')} in the "
                    "checkpoint and has no state to load into a stateful object"
                )
            value = _section(reader, name, info["state"])
            if name in objects.schedulers:
                _check_against(reader, f"scheduler {name!r}", value, obj.state_dict())
            check = getattr(obj, "check_state_dict", None)
            if callable(check):  # a stateful that can tell, without loading (accelkit's loaders)
                try:
                    check(value)
                except Exception as err:
                    raise CheckpointError(
                        f"{reader.manifest_path}: the state of {name!r} does not fit it: {err}; "
                        "nothing was loaded"
                    ) from err
            out.states[name] = value
    out.extras = reader.extras()
    backend_state = reader.manifest.data.get("backend_state")
    if backend_state:
        out.backend_state = _section(reader, BACKEND_OBJECT, backend_state)
        _check_against(reader, "backend state", out.backend_state, backend.state_dict())
    out.rank_states = read_rank_states(backend, reader)
    if rng:
        out.rng = reader.rng(backend.rank)
    for name, info in saved.items():
        if name in state:
            continue
        kind = info.get("type")
        if kind == "extra" and name in out.extras:
            out.unconsumed[name] = out.extras[name]
        elif kind in ("scheduler", "stateful") and "state" in info:
            out.unconsumed[name] = _section(reader, name, info["state"])
    return out


def _section(reader: Any, name: str, data: Any) -> Any:
    try:
        return decode(data, reader.tensor_source(name, "state"))
    except CheckpointError:
        raise
    except Exception as err:  # bad base64, a malformed tag: name the object and the file
        raise CheckpointError(
            f"{reader.manifest_path}: the state of {name!r} cannot be decoded "
            f"({type(err).__name__}: {err}); nothing was loaded"
        ) from err


def _check_against(reader: Any, what: str, saved: Any, live: Any) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{reader.manifest_path}: the state of {what} is a {type(saved).__name__}, not an "
            "object; nothing was loaded"
        )
    if isinstance(live, dict):
        for key in saved.keys() & live.keys():
            check_value(f"{reader.manifest_path}: {what} {key!r}", saved[key], live[key])
