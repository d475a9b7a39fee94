"""MMEngine checkpoints through accelkit's portable format, without pickle.

An MMEngine checkpoint is a pickled dict: ``state_dict``, ``optimizer``, ``param_schedulers``,
``message_hub`` (HistoryBuffers of numpy arrays) and ``meta``. Here weights and optimizer state go
through ``accel.save``/``accel.load`` (each rank writes and reads its own fragments), and the rest
is encoded as tagged JSON (tuples, Counters, numpy arrays and HistoryBuffers survive the round
trip), stored as one extra of the checkpoint. Loading unpickles nothing.

A foreign, pickled ``.pth`` (MMEngine's own, or a plain ``torch.save`` of a state dict) loads only
with ``trust_pickle=True``, and then only with the globals an MMEngine checkpoint needs, allowed for
that one ``torch.load`` (``torch.serialization.safe_globals``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from accelkit.checkpoint.convert import (
    PickleAllowlist,
    PickleRefused,
    conversion_allowlist,
    restricted_torch_load,
    tensor_allowlist,
)
from accelkit.errors import CheckpointError

if TYPE_CHECKING:
    from accelkit.accelerator import Accelerator

log = logging.getLogger("accelkit")

#: name of the checkpoint extra that holds MMEngine's own state (tagged JSON)
EXTRA_KEY = "mmengine"
#: name of the extra that holds what hooks added as tensors (EMAHook's ``ema_state_dict``)
TENSOR_EXTRA_KEY = "mmengine_tensors"
#: file that marks a directory as an accelkit portable checkpoint
MANIFEST = "accelkit.json"


# ---- tagged JSON --------------------------------------------------------------------------------
class Unencodable(TypeError):
    """A value that tagged JSON cannot hold (a function, an open file, ...)."""


def _array(value: Any) -> dict[str, Any]:
    return {"dtype": str(value.dtype), "shape": list(value.shape), "data": value.ravel().tolist()}


def encode(obj: Any, path: str = "") -> Any:
    """Turn MMEngine state into JSON-able data that :func:`decode` turns back, type for type."""
    import numpy as np
    from mmengine.logging import HistoryBuffer

    if isinstance(obj, np.ndarray):
        return {"$ndarray": _array(obj)}
    if isinstance(obj, np.generic):  # before float: np.float64 subclasses float
        return {"$npscalar": {"dtype": str(obj.dtype), "value": obj.item()}}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return {"$tensor": {**_array(t), "dtype": str(t.dtype).removeprefix("torch.")}}
    if isinstance(obj, torch.dtype):
        return {"$torch_dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, HistoryBuffer):
        return {
            "$history_buffer": {
                "log": encode(obj._log_history, f"{path}.log"),
                "count": encode(obj._count_history, f"{path}.count"),
                "max_length": obj.max_length,
            }
        }
    if isinstance(obj, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, (set, frozenset)):
        return {"$set": [encode(v, f"{path}{{}}") for v in obj]}
    if isinstance(obj, dict):
        items = [(k, encode(v, f"{path}.{k}")) for k, v in obj.items()]
        plain = type(obj) is dict and all(isinstance(k, str) and not k.startswith("$") for k in obj)
        if plain:
            return dict(items)
        tag = (
            "$counter"
            if isinstance(obj, collections.Counter)
            else "$odict"
            if isinstance(obj, collections.OrderedDict)
            else "$dict"
        )
        return {tag: [[encode(k, f"{path}<key>"), v] for k, v in items]}
    raise Unencodable(f"{path or 'value'}: cannot store a {type(obj).__name__} without pickle")


def encode_lenient(obj: dict[str, Any], what: str) -> dict[str, Any]:
    """Encode each entry of a dict, dropping (with a warning) the ones that cannot be stored."""
    out = {}
    for key, value in obj.items():
        try:
            out[key] = encode(value, f"{what}.{key}")
        except Unencodable as err:
            log.warning("not saved in the checkpoint: %s", err)
    return out


def decode(data: Any) -> Any:
    """Inverse of :func:`encode`."""
    import numpy as np
    from mmengine.logging import HistoryBuffer

    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, body), *_ = data.items()
        if tag == "$ndarray":
            return np.array(body["data"], dtype=body["dtype"]).reshape(body["shape"])
        if tag == "$npscalar":
            return np.array(body["value"], dtype=body["dtype"])[()]
        if tag == "$tensor":
            dtype = getattr(torch, body["dtype"])
            return torch.tensor(body["data"], dtype=dtype).reshape(body["shape"])
        if tag == "$torch_dtype":
            return getattr(torch, body)
        if tag == "$history_buffer":
            log_history, count_history = decode(body["log"]), decode(body["count"])
            buf = HistoryBuffer(max_length=body["max_length"])
            buf._log_history, buf._count_history = log_history, count_history
            return buf
        if tag == "$tuple":
            return tuple(decode(v) for v in body)
        if tag == "$set":
            return {decode(v) for v in body}
        if tag in ("$counter", "$odict", "$dict"):
            pairs = dict((decode(k), decode(v)) for k, v in body)
            if tag == "$counter":
                return collections.Counter(pairs)
            return collections.OrderedDict(pairs) if tag == "$odict" else pairs
    return {k: decode(v) for k, v in data.items()}


# ---- the portable checkpoint ---------------------------------------------------------------------
def is_portable(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


def swap_ema_state(model_state: dict[str, Any], ema_state: dict[str, Any]) -> None:
    """Exchange ``module.<name>`` entries of ``ema_state`` with ``<name>`` of ``model_state``.

    MMEngine's EMAHook writes checkpoints in this swapped layout (the averaged weights under
    ``state_dict``, for deployment); the swap is its own inverse.
    """
    for key in list(ema_state):
        if key.startswith("module.") and key[7:] in model_state:
            name = key[7:]
            ema_state[key], model_state[name] = model_state[name], ema_state[key]


def save(
    accel: Accelerator,
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    checkpoint: dict[str, Any],
    step: int | None = None,
) -> None:
    """Write ``model`` (and ``optimizer``) fragments plus MMEngine's ``checkpoint`` dict.

    The dict's plain entries (meta, message hub, scheduler states) become tagged JSON; entries
    holding tensors that hooks added (EMAHook's ``ema_state_dict``) are stored as tensors.
    """
    state: dict[str, Any] = {"model": model}
    if optimizer is not None:
        state["optimizer"] = optimizer
    tensors = {k: v for k, v in checkpoint.items() if _holds_tensors(v)}
    plain = {k: v for k, v in checkpoint.items() if k not in tensors}
    state[EXTRA_KEY] = encode_lenient(plain, "checkpoint")
    if tensors:
        state[TENSOR_EXTRA_KEY] = {k: _plain_containers(v) for k, v in tensors.items()}
    accel.save(path, state, step=step)


def _plain_containers(value: Any) -> Any:
    """OrderedDicts as dicts, tensors detached on the CPU: what the checkpoint's codec takes."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _plain_containers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_containers(v) for v in value)
    return value


def load(
    accel: Accelerator,
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
) -> dict[str, Any]:
    """Fill ``model`` (and ``optimizer``) from a portable checkpoint; return MMEngine's dict."""
    state: dict[str, Any] = {"model": model}
    if optimizer is not None:
        state["optimizer"] = optimizer
    rest = accel.load(path, state, strict=strict) or {}
    checkpoint = decode(rest.get(EXTRA_KEY) or {})
    checkpoint.update(rest.get(TENSOR_EXTRA_KEY) or {})
    return checkpoint


# ---- foreign, pickled checkpoints ----------------------------------------------------------------
#: HistoryBuffer's statistics methods; it pickles them as ``getattr(HistoryBuffer, name)``
HISTORY_BUFFER_STATISTICS = ("min", "max", "current", "mean")

#: what to do about a ``.pth`` that names more than an MMEngine checkpoint does
MMENGINE_REFUSED_HINT = (
    "accelkit unpickles nothing beyond its allowlist, with or without trust_pickle. If you know "
    "where the file comes from and what else it holds, load it in your own code "
    "(mmengine.runner.load_checkpoint) and torch.save its state_dict alone, or save it as an "
    "accelkit checkpoint, then load_from that"
)


def _history_buffer_statistic(owner: Any, name: Any) -> Any:
    """Stands in for ``builtins.getattr`` in an MMEngine checkpoint: resolves HistoryBuffer's
    statistics methods, the one thing MMEngine pickles through ``getattr``, and refuses the rest."""
    from mmengine.logging import HistoryBuffer

    if owner is HistoryBuffer and name in HISTORY_BUFFER_STATISTICS:
        return getattr(HistoryBuffer, name)
    what = (
        f"{owner.__module__}.{owner.__qualname__}"
        if isinstance(owner, type)
        else f"a {type(owner).__name__}"
    )
    raise PickleRefused(
        f"refused to unpickle: it calls builtins.getattr({what}, {str(name)[:60]!r}); the "
        f"only one allowed is HistoryBuffer.{{{', '.join(HISTORY_BUFFER_STATISTICS)}}}",
        ("builtins.getattr",),
    )


def mmengine_allowlist() -> PickleAllowlist:
    """What ``trust_pickle=True`` lets a ``.pth`` name: tensors, containers and numpy values
    (:func:`~accelkit.checkpoint.convert.conversion_allowlist`), MMEngine's HistoryBuffer, and
    ``builtins.getattr`` bound to :func:`_history_buffer_statistic` (never the real one)."""
    from mmengine.logging import HistoryBuffer

    return conversion_allowlist().extended(
        {
            f"{HistoryBuffer.__module__}.{HistoryBuffer.__qualname__}": HistoryBuffer,
            "builtins.getattr": _history_buffer_statistic,
        }
    )


@contextlib.contextmanager
def _history_buffer_statistics_kept(path: str | os.PathLike) -> Iterator[None]:
    """Undo, and refuse, a load that rewrites HistoryBuffer's class-wide statistics methods.

    ``HistoryBuffer.__setstate__`` merges a file's ``statistics_methods`` into a dict the class
    shares; a checkpoint MMEngine wrote holds only the four defaults, resolved to themselves.
    """
    from mmengine.logging import HistoryBuffer

    methods = HistoryBuffer._statistics_methods
    expected = dict(methods)
    for name in HISTORY_BUFFER_STATISTICS:  # what HistoryBuffer.__setstate__ sets by default
        expected.setdefault(name, getattr(HistoryBuffer, name))
    try:
        yield
    finally:
        changed = sorted(
            name
            for name in set(methods) | set(expected)
            if methods.get(name) is not expected.get(name)
        )
        if changed:
            methods.clear()
            methods.update(expected)
    if changed:
        raise PickleRefused(
            f"{os.fspath(path)}: refused to unpickle: it replaces HistoryBuffer's statistics "
            f"methods {', '.join(changed)} (undone). {MMENGINE_REFUSED_HINT}"
        )


def read_pickled(path: str | os.PathLike, *, trust_pickle: bool) -> dict[str, Any]:
    """Load a ``.pth`` written by ``torch.save`` (MMEngine's checkpoints are these).

    Always through accelkit's restricted unpickler: a file of tensors in plain containers loads
    as is; with ``trust_pickle=True`` also numpy values and MMEngine's HistoryBuffer (see
    :func:`mmengine_allowlist`). Anything else is refused before it is looked up or called.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        return restricted_torch_load(path, tensor_allowlist(), hint=MMENGINE_REFUSED_HINT)
    except PickleRefused as err:
        if not err.refused:  # refused for what it calls, not for what it names
            raise
        if not trust_pickle:
            if not mmengine_allowlist().names.issuperset(err.refused):
                raise  # off the trusted list too: trust_pickle would not help
            raise CheckpointError(
                f"{str(path)!r} is a pickle that names more than tensors "
                f"({', '.join(err.refused)}). Reading it needs trust_pickle=True, which lets "
                "accelkit's restricted unpickler build numpy values and MMEngine's HistoryBuffer "
                "too, and still nothing else (AccelkitRunner: accelkit=dict(trust_pickle=True); "
                "AccelkitStrategy: strategy=dict(..., trust_pickle=True))."
            ) from None
    with _history_buffer_statistics_kept(path):
        return restricted_torch_load(path, mmengine_allowlist(), hint=MMENGINE_REFUSED_HINT)


def revise_state_dict(
    state_dict: dict[str, Any], revise_keys: list[tuple[str, str]]
) -> dict[str, Any]:
    for pattern, replacement in revise_keys:
        state_dict = {re.sub(pattern, replacement, k): v for k, v in state_dict.items()}
    return state_dict


def load_state_dict_into(
    accel: Accelerator,
    model: torch.nn.Module,
    state_dict: dict[str, Any],
    *,
    strict: bool,
    revise_keys: list[tuple[str, str]],
) -> None:
    """Load a full (unsharded) state dict into the model set up by ``accel``.

    On a backend that does not shard, MMEngine's own ``load_state_dict`` does it (its messages
    about missing and unexpected keys included); on a sharded one (FSDP, DeepSpeed ZeRO, ...)
    :func:`load_full_state_dict`.
    """
    from mmengine.runner.checkpoint import load_state_dict

    state_dict = revise_state_dict(dict(state_dict), revise_keys)
    if accel.capabilities.sharded:
        load_full_state_dict(accel, model, state_dict, strict=strict)
        return
    load_state_dict(accel.unwrap(model), state_dict, strict=strict)


def load_full_state_dict(
    accel: Accelerator,
    model: torch.nn.Module,
    state_dict: dict[str, Any],
    *,
    strict: bool,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> None:
    """Load a whole-model state dict (and a torch optimizer's state dict) into a model and
    optimizer that ``accel``'s backend shards.

    Every rank holds the whole state dict already (it read the ``.pth``); each writes it as a
    world-size-1 portable checkpoint into a temporary directory of its own (local disk, no shared
    filesystem needed; it takes the model's size in disk space for the duration of the load),
    then ``accel.load`` fills the model (and optimizer) from it, each rank taking its own ranges.
    With ``strict=False`` mismatched names are reported and skipped, as MMEngine's ``load_from``
    does. The optimizer's integer parameter ids are named by matching the state dict's
    parameters in order (unique matches only, as ``accelkit convert`` does).
    """
    import tempfile

    from accelkit.checkpoint.convert import (
        Imported,
        optimizer_import,
        positional_names,
        write_portable,
    )
    from accelkit.checkpoint.fqn import canonical_fqn

    tensors: dict[tuple[str, str, str], Any] = {
        ("model", "param", canonical_fqn(name, strip_module_prefix=True)): value
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor)
    }
    if not tensors:
        raise CheckpointError("the checkpoint's state_dict holds no tensors")
    objects: dict[str, dict[str, Any]] = {"model": {"type": "module", "class": "(imported)"}}
    state: dict[str, Any] = {"model": model}
    if optimizer is not None and optimizer_state is not None:
        names = None
        ids = [p for group in optimizer_state["param_groups"] for p in group["params"]]
        if any(isinstance(p, int) for p in ids):
            plain = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
            names = positional_names(plain, optimizer_state)
            if names is None:
                raise CheckpointError(
                    "the checkpoint's optimizer state cannot be matched to the model's "
                    "parameters unambiguously (its parameter ids are positions); resume with "
                    "resume_optimizer=False, or load_from it without resume"
                )
        objects["optimizer"] = optimizer_import("optimizer", optimizer_state, names, tensors)
        state["optimizer"] = optimizer
    imported = Imported(tensors, objects, {}, "import:mmengine")
    with tempfile.TemporaryDirectory(prefix="accelkit-load-from-") as tmp:
        path = write_portable(imported, os.path.join(tmp, "checkpoint"), progress=False)
        accel.load(path, state, strict=strict, rng=False)
