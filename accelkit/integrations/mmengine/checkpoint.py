"""MMEngine checkpoints through accelkit's portable format, without pickle.

An MMEngine checkpoint is a pickled dict: ``state_dict``, ``optimizer``, ``param_schedulers``,
``message_hub`` (HistoryBuffers of numpy arrays) and ``meta``. Here weights and optimizer state go
through ``accel.save``/``accel.load`` (each rank writes and reads its own fragments), and the rest
is encoded as tagged JSON (tuples, Counters, numpy arrays and HistoryBuffers survive the round
trip), stored as one extra of the checkpoint; tensors in it (a metric a hook put into the message
hub, EMAHook's averaged weights) are stored as tensors in the rank file and referenced from the
JSON. Loading unpickles nothing. :func:`export_mmengine` writes the same content as MMEngine's
own ``.pth`` (``accelkit convert SRC DST --to mmengine``).

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accelkit.checkpoint.formats.unpickle import (
    PickleAllowlist,
    PickleRefused,
    conversion_allowlist,
    restricted_torch_load,
    tensor_allowlist,
)
from accelkit.checkpoint.store import is_remote
from accelkit.errors import CheckpointError

if TYPE_CHECKING:
    from accelkit.accelerator import Accelerator

log = logging.getLogger("accelkit")

#: name of the checkpoint extra that holds MMEngine's own state (tagged JSON)
EXTRA_KEY = "mmengine"
#: the extra where earlier versions kept entries holding tensors (read, no longer written)
TENSOR_EXTRA_KEY = "mmengine_tensors"
#: file that marks a directory as an accelkit portable checkpoint
MANIFEST = "accelkit.json"
#: the names the adapter gives the model and the optimizer in a portable checkpoint
MODEL_OBJECT, OPTIMIZER_OBJECT = "model", "optimizer"
#: several optimizers (an OptimWrapperDict): each submodule set up on its own is the object
#: ``model.<submodule>``, each wrapper's optimizer ``optimizer.<wrapper name>``, and the rest
#: of the model (its own tensors, submodules no optimizer trains) ``model`` where it has any
PART_PREFIX, OPTIMIZER_PREFIX = f"{MODEL_OBJECT}.", f"{OPTIMIZER_OBJECT}."


def checkpoint_objects(
    model: torch.nn.Module,
    parts: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
) -> dict[str, Any]:
    """The objects ``accel.save``/``accel.load`` get for a model and its optimizers.

    One optimizer: ``{"model": model, "optimizer": opt}`` (``optimizers`` keyed ``""``).
    Several: see :data:`PART_PREFIX`."""
    if not parts:
        objects: dict[str, Any] = {MODEL_OBJECT: model}
        objects.update((OPTIMIZER_OBJECT, opt) for opt in optimizers.values())
        return objects
    objects = {}
    rest = _remainder(model, parts)
    if rest is not None:
        objects[MODEL_OBJECT] = rest
    objects.update((PART_PREFIX + name, part) for name, part in parts.items())
    objects.update((OPTIMIZER_PREFIX + name, opt) for name, opt in optimizers.items())
    return objects


def _remainder(model: torch.nn.Module, parts: dict[str, torch.nn.Module]) -> Any:
    """A module sharing ``model``'s own tensors and the submodules not in ``parts`` (None when
    that holds no tensor): what a several-optimizer checkpoint keeps beside the parts."""
    rest = torch.nn.Module()
    rest._parameters = model._parameters
    rest._buffers = model._buffers
    rest._non_persistent_buffers_set = model._non_persistent_buffers_set
    for name, child in model._modules.items():
        if name not in parts and child is not None:
            rest._modules[name] = child
    return rest if rest.state_dict() else None


#: a small text file in every checkpoint directory the adapter writes: MMEngine's own loader
#: (``load_checkpoint`` without accelkit imported: ``tools/test.py`` with the old config) says
#: only "epoch_2.pth can not be found." for a directory; its listing then says what it is
MARKER = "THIS_IS_AN_ACCELKIT_CHECKPOINT.txt"
MARKER_TEXT = """\
This directory is an accelkit portable checkpoint, written by MMEngine's Runner on accelkit
(AccelkitRunner / AccelkitStrategy): accelkit.json (the manifest), rank-NNNNN.safetensors (each
rank's tensors), extra.json (MMEngine's meta, message hub and scheduler states).

MMEngine's own loader expects a file here; without accelkit it reports
"<this path> can not be found." To open this directory:

- in the config:   custom_imports = dict(imports=["accelkit.integrations.mmengine"])
  (or `import accelkit.integrations.mmengine` in your script): then load_checkpoint,
  tools/test.py, load_from, resume and the inferencers read it as MMEngine's .pth;
- without accelkit: export MMEngine's file once with
      accelkit convert {name} {stem}_mmengine.pth --to mmengine
  or save it with every checkpoint: CheckpointHook(save_format="both") (or "pth").
"""


def write_marker(accel: Accelerator, path: str | os.PathLike) -> None:
    """Rank 0 puts :data:`MARKER` into the local checkpoint directory ``path`` it just wrote."""
    path = os.fspath(path)
    if accel.rank != 0 or is_remote(path) or not os.path.isdir(path):
        return
    name = os.path.basename(path.rstrip(os.sep))
    text = MARKER_TEXT.format(name=name, stem=os.path.splitext(name)[0])
    try:
        Path(path, MARKER).write_text(text)
    except OSError as err:  # the checkpoint itself is complete; the marker only explains it
        log.warning("could not write %s into %s: %s", MARKER, path, err)


def saved_parts(path: str | os.PathLike) -> list[str]:
    """The submodules a several-optimizer checkpoint holds one by one ([] for one optimizer)."""
    from accelkit.checkpoint import read_manifest

    objects = read_manifest(path).objects
    return [n[len(PART_PREFIX) :] for n in objects if n.startswith(PART_PREFIX)]


# ---- tagged JSON --------------------------------------------------------------------------------
class Unencodable(TypeError):
    """A value that tagged JSON cannot hold (a function, an open file, ...)."""


def _array(value: Any) -> dict[str, Any]:
    return {"dtype": str(value.dtype), "shape": list(value.shape), "data": value.ravel().tolist()}


def encode(obj: Any, path: str = "", *, keep_tensors: bool = False, lenient: bool = False) -> Any:
    """Turn MMEngine state into JSON-able data that :func:`decode` turns back, type for type.

    ``keep_tensors``: leave tensors as (detached, CPU) tensors for the checkpoint's own codec,
    which stores them in the rank file and references them from the JSON; otherwise they become
    tagged lists. ``lenient``: drop, with a warning, the dictionary entries that cannot be
    stored instead of failing the whole value (MMEngine pickles whatever a hook puts into the
    message hub; accelkit keeps what it can store without pickle).
    """
    import numpy as np
    from mmengine.logging import HistoryBuffer

    def inner(value: Any, where: str) -> Any:
        return encode(value, where, keep_tensors=keep_tensors, lenient=lenient)

    if isinstance(obj, np.ndarray):
        return {"$ndarray": _array(obj)}
    if isinstance(obj, np.generic):  # before float: np.float64 subclasses float
        return {"$npscalar": {"dtype": str(obj.dtype), "value": obj.item()}}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if keep_tensors:
            return t
        return {"$tensor": {**_array(t), "dtype": str(t.dtype).removeprefix("torch.")}}
    if isinstance(obj, torch.dtype):
        return {"$torch_dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, HistoryBuffer):
        return {
            "$history_buffer": {
                "log": inner(obj._log_history, f"{path}.log"),
                "count": inner(obj._count_history, f"{path}.count"),
                "max_length": obj.max_length,
            }
        }
    if isinstance(obj, list):
        return [inner(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"$tuple": [inner(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, (set, frozenset)):
        return {"$set": [inner(v, f"{path}{{}}") for v in obj]}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            try:
                items.append((k, inner(v, f"{path}.{k}")))
            except Unencodable as err:
                if not lenient:
                    raise
                log.warning("not saved in the checkpoint: %s", err)
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


def encode_lenient(obj: dict[str, Any], what: str, *, keep_tensors: bool = False) -> dict[str, Any]:
    """Encode each entry of a dict, dropping (with a warning) the ones that cannot be stored."""
    out = {}
    for key, value in obj.items():
        try:
            out[key] = encode(value, f"{what}.{key}", keep_tensors=keep_tensors, lenient=True)
        except Unencodable as err:
            log.warning("not saved in the checkpoint: %s", err)
    return out


def decode(data: Any) -> Any:
    """Inverse of :func:`encode` (tensors kept by ``keep_tensors`` come back as they are)."""
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
    if is_remote(path):  # an accelkit checkpoint in object storage
        from accelkit.integrations.mmengine.object_storage import holds_checkpoint

        return holds_checkpoint(str(path))
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


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
    objects: dict[str, Any],
    checkpoint: dict[str, Any],
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Write the fragments of ``objects`` (:func:`checkpoint_objects`) plus MMEngine's
    ``checkpoint`` dict (``storage_options``: an ``s3://`` path's, from ``backend_args``).

    The dict (meta, message hub, scheduler states, what hooks added) becomes tagged JSON with
    MMEngine's types; the tensors in it (a tensor metric in the message hub, EMAHook's
    ``ema_state_dict``) are stored as tensors, referenced from the JSON.
    """
    state: dict[str, Any] = dict(objects)
    state[EXTRA_KEY] = encode_lenient(checkpoint, "checkpoint", keep_tensors=True)
    options = {} if storage_options is None else {"storage_options": storage_options}
    accel.save(path, state, step=step, **options)
    write_marker(accel, path)


def save_before_setup(
    accel: Accelerator,
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    checkpoint: dict[str, Any],
    before_save: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Save a model that ``train()``/``val()`` has not set up yet, as MMEngine's
    ``runner.save_checkpoint`` does before training: the weights as built, plus ``checkpoint``
    (meta, message hub).

    ``before_save`` (the ``before_save_checkpoint`` hooks) sees ``checkpoint['state_dict']`` as
    in MMEngine. Every rank holds the whole model, so rank 0 writes a world-size-1 portable
    checkpoint, which any backend loads; the others wait for it.
    """
    from accelkit.checkpoint.format.fqn import canonical_fqn
    from accelkit.checkpoint.formats.importing import Imported, write_portable

    checkpoint = dict(checkpoint)
    checkpoint["state_dict"] = model.state_dict()
    if before_save is not None:
        before_save(checkpoint)
    state_dict = checkpoint.pop("state_dict")
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tensors = {
        (MODEL_OBJECT, "param" if name in parameters else "buffer", canonical_fqn(name)): t.cpu()
        for name, t in state_dict.items()
        if isinstance(t, torch.Tensor)
    }
    if accel.rank == 0:
        objects = {MODEL_OBJECT: {"type": "module", "class": type(model).__qualname__}}
        extras = {EXTRA_KEY: encode_lenient(checkpoint, "checkpoint", keep_tensors=True)}
        step = checkpoint.get("meta", {}).get("iter")
        imported = Imported(tensors, objects, extras, f"mmengine:{accel.name}", step=step)
        from accelkit.checkpoint.formats.transfer import local_paths

        # an s3:// path: written locally, then uploaded with its manifest last
        with local_paths(None, os.fspath(path), storage_options) as (_, local, publish):
            write_portable(imported, local, progress=False)
            publish(local)
        write_marker(accel, path)
    accel.barrier()


def load(
    accel: Accelerator,
    path: str | os.PathLike,
    *,
    objects: dict[str, Any],
    strict: bool,
    rng: bool,
) -> dict[str, Any]:
    """Fill ``objects`` (:func:`checkpoint_objects`) from a portable checkpoint; return
    MMEngine's dict. ``rng``: restore the random state too (a resume; never ``load_from``,
    which keeps the new run's seed, as MMEngine's does)."""
    return mmengine_state(accel.load(path, dict(objects), strict=strict, rng=rng) or {})


def mmengine_state(extras: dict[str, Any]) -> dict[str, Any]:
    """MMEngine's checkpoint dict (less weights and optimizer) from a checkpoint's extras."""
    checkpoint = decode(extras.get(EXTRA_KEY) or {})
    checkpoint.update(extras.get(TENSOR_EXTRA_KEY) or {})  # written before tensors went inline
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
    (:func:`~accelkit.checkpoint.formats.unpickle.conversion_allowlist`), MMEngine's HistoryBuffer, and
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

    from accelkit.checkpoint.format.fqn import canonical_fqn
    from accelkit.checkpoint.formats.importing import (
        Imported,
        optimizer_import,
        positional_names,
        write_portable,
    )

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
        # every rank imports the same state dict into its own directory: one creation time
        # makes their manifests equal, so the load's check that all ranks read one checkpoint
        # passes where the ranks read the same .pth, and still refuses .pth files that differ
        path = write_portable(
            imported, os.path.join(tmp, "checkpoint"), progress=False, created_unix_ns=0
        )
        accel.load(path, state, strict=strict, rng=False)


# ---- export to MMEngine's own format -------------------------------------------------------------


def read_as_mmengine(src: str | os.PathLike) -> dict[str, Any]:
    """Portable checkpoint ``src`` (saved by AccelkitRunner or AccelkitStrategy) as the dict
    MMEngine's own Runner saves: ``meta``, ``state_dict`` (the model's weights, named as
    ``model.state_dict()`` names them), then ``optimizer`` (a torch optimizer state dict:
    parameters numbered in param-group order, as torch numbers them), ``param_schedulers``,
    ``message_hub`` (HistoryBuffers) and what hooks saved (EMAHook's ``ema_state_dict``, in
    MMEngine's swapped layout). Tensors are on the CPU.

    Reads any world size and backend. All or nothing: every checksum is verified before it
    returns, and a damaged or incomplete checkpoint raises :class:`CheckpointError`.
    """
    from accelkit.checkpoint.format.codec import decode as decode_json
    from accelkit.checkpoint.read.reader import CheckpointReader

    with CheckpointReader(src) as reader:
        objects = reader.manifest.objects
        modules = [
            n
            for n, info in objects.items()
            if (n == MODEL_OBJECT or n.startswith(PART_PREFIX)) and info.get("type") == "module"
        ]
        if EXTRA_KEY not in objects or not modules:
            raise CheckpointError(
                f"{reader.directory}: not a checkpoint of accelkit's MMEngine adapter (it has no "
                f"{MODEL_OBJECT!r} module and {EXTRA_KEY!r} extra; objects: {sorted(objects)}). "
                "Export its weights with `accelkit convert SRC DST.pt` instead"
            )
        checkpoint = mmengine_state(reader.extras())
        state_dict: dict[str, torch.Tensor] = {}
        for module in modules:  # several optimizers: the parts under their submodule's name
            prefix = "" if module == MODEL_OBJECT else module[len(PART_PREFIX) :] + "."
            for entry in reader.entries(module):
                if entry.kind in ("param", "buffer"):
                    tensor = reader.read(entry)
                    for name in (entry.fqn, *entry.aliases):
                        state_dict[prefix + name] = tensor
        if objects.get(OPTIMIZER_OBJECT, {}).get("type") == "optimizer":
            checkpoint["optimizer"] = _torch_optimizer_state(reader, OPTIMIZER_OBJECT, decode_json)
        several = [
            n
            for n, info in objects.items()
            if n.startswith(OPTIMIZER_PREFIX) and info.get("type") == "optimizer"
        ]
        if several:  # OptimWrapperDict.state_dict(): one torch state dict per wrapper
            checkpoint["optimizer"] = {
                n[len(OPTIMIZER_PREFIX) :]: _torch_optimizer_state(reader, n, decode_json)
                for n in several
            }
        reader.finish()  # every checksum verified before anything is handed out
    ema = checkpoint.get("ema_state_dict")
    if isinstance(ema, dict):
        ema = checkpoint["ema_state_dict"] = collections.OrderedDict(ema)
        swap_ema_state(state_dict, ema)  # MMEngine keeps the averaged weights in state_dict
    checkpoint["state_dict"] = collections.OrderedDict(state_dict)
    ordered = {k: checkpoint.pop(k) for k in ("meta", "state_dict") if k in checkpoint}
    ordered.update(checkpoint)
    return ordered


def write_pth(checkpoint: dict[str, Any], dst: str | os.PathLike) -> Path:
    """``torch.save`` ``checkpoint`` to ``dst`` through a temporary sibling and a rename: a
    crash leaves the old file or the new one, never half of one."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.accelkit-tmp")
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def export_mmengine(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write portable checkpoint ``src`` (saved by AccelkitRunner or AccelkitStrategy) as the
    ``.pth`` MMEngine's own Runner writes, so that plain MMEngine resumes it.

    The content is :func:`read_as_mmengine`'s, written by ``torch.save`` (a pickle, as
    MMEngine's are). Not carried: accelkit's RNG state (MMEngine stores none) and a backend's
    own state (a fp16 loss scale starts again from its initial value).
    """
    ordered = read_as_mmengine(src)
    dst = write_pth(ordered, dst)
    log.info("wrote %s: MMEngine's checkpoint format (%s)", dst, ", ".join(ordered))
    return dst


def _torch_optimizer_state(reader: Any, name: str, decode_json: Any) -> dict[str, Any]:
    """Optimizer ``name`` of a portable checkpoint as ``torch.optim.Optimizer.state_dict()``
    gives it: parameters numbered 0, 1, ... through the param groups in order, which is how
    ``load_state_dict`` matches them to the live optimizer's parameters."""
    info = reader.object_info(name, "optimizer")
    tensors = reader.optimizer_entries(name)
    scalars = info.get("scalar_state", {}) or {}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in info.get("param_groups", []):
        ids = []
        for pname in group.get("params", []):
            per_param = {key: reader.read(entry) for key, entry in tensors.get(pname, {}).items()}
            per_param.update({k: decode_json(v) for k, v in scalars.get(pname, {}).items()})
            if per_param:
                state[index] = per_param
            ids.append(index)
            index += 1
        settings = {k: decode_json(v) for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": ids})
    return {"state": state, "param_groups": groups}
