"""Conversions: the portable checkpoint to one consolidated file, and foreign formats into it.

Export: a module's parameters and buffers, gathered tensor by tensor from the fragments (peak
memory: one tensor for ``.safetensors``; the whole model for ``.pt``), under the names a plain
``model.load_state_dict`` expects (tied names included).

Import: a plain state-dict file (``.safetensors``; ``.pt``/``.pth``/``.bin`` with
``trust_pickle``), a torch.distributed.checkpoint directory (its ``.metadata`` is a pickle:
``trust_pickle``), a Lightning/Fabric checkpoint (pickled: ``trust_pickle``). Each importer is
an object with ``detect(path)`` and ``convert(path, dst, *, trust_pickle, **options)``,
registered through the ``accelkit_checkpoint_importers`` hook; these are the native ones.
The result is a world-size-1 portable checkpoint that any backend loads at any world size.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import torch

from accelkit.checkpoint import storage
from accelkit.checkpoint.codec import drop_callables, encode
from accelkit.checkpoint.fqn import canonical_fqn
from accelkit.checkpoint.fragments import param_group_hyperparams
from accelkit.checkpoint.manifest import (
    EXTRA_OBJECT,
    FORMAT,
    FORMAT_VERSION,
    rank_file_name,
)
from accelkit.checkpoint.reader import CheckpointReader
from accelkit.checkpoint.safetensors_io import DTYPE_NAMES, LazyTensor, write_file
from accelkit.errors import CheckpointError
from accelkit.hookspecs import hookimpl

log = logging.getLogger("accelkit")

#: conversions at least this large show a progress bar by default
PROGRESS_BYTES = 256 << 20

PICKLE_HINT = (
    "is a pickle. Pass --trust-pickle (trust_pickle=True) to read it with accelkit's restricted "
    "unpickler: tensors, plain containers and numpy values, and no other global"
)


def _progress(total: int, enabled: bool | None, desc: str) -> Any:
    if enabled is False or (enabled is None and total < PROGRESS_BYTES):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)


# ---- export -------------------------------------------------------------------------------------
def export_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    obj: str | None = None,
    fmt: str | None = None,
    progress: bool | None = None,
) -> Path:
    """Write module ``obj`` of portable checkpoint ``src`` as one state-dict file ``dst``.

    ``fmt``: ``safetensors`` (default; streamed, one tensor in memory at a time) or ``pt``
    (``torch.save`` of the whole state dict). The keys are the module's canonical names and
    its tied aliases, so ``model.load_state_dict(...)`` accepts the file as is.
    """
    dst = Path(dst)
    fmt = fmt or ("pt" if dst.suffix in (".pt", ".pth", ".bin") else "safetensors")
    if fmt not in ("safetensors", "pt"):
        raise CheckpointError(f"unknown export format {fmt!r}; use safetensors or pt")
    with CheckpointReader(src) as reader:
        obj = _module_object(reader, obj)
        entries = [e for e in reader.entries(obj) if e.kind in ("param", "buffer")]
        masters = {e.fqn: e for e in reader.entries(obj) if e.kind == "master"}
        items: list[tuple[str, Any]] = []
        for entry in entries:
            source = entry
            if entry.fqn in masters and entry.dtype != masters[entry.fqn].dtype:
                log.info(
                    "%s: exporting the stored %s weights (the master is %s)",
                    entry.fqn,
                    entry.dtype,
                    masters[entry.fqn].dtype,
                )
            for name in (entry.fqn, *entry.aliases):
                items.append((name, source))
        total = sum(e.numel * torch.empty((), dtype=_dtype(e)).element_size() for _, e in items)
        bar = _progress(total, progress, f"export {dst.name}")
        try:
            if fmt == "pt":
                state = {}
                for name, entry in items:
                    state[name] = reader.read(entry)
                    if bar is not None:
                        bar.update(state[name].numel() * state[name].element_size())
                reader.finish()
                _atomic_write(dst, lambda tmp: torch.save(state, tmp))
            else:
                lazy = [
                    (name, LazyTensor(entry.shape, _dtype(entry), _reader_fetch(reader, entry)))
                    for name, entry in items
                ]

                def write(tmp: Path) -> None:
                    with ThreadPoolExecutor(max_workers=2) as pool:
                        write_file(tmp, lazy, {"format": "pt"}, pool=pool, progress=bar, flat=False)
                    reader.finish()

                _atomic_write(dst, write)
        finally:
            if bar is not None:
                bar.close()
    return dst


def export_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    obj: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    config: str | os.PathLike | None = None,
    progress: bool | None = None,
) -> Path:
    """Write module ``obj`` of checkpoint ``src`` as Hugging Face's layout in directory ``dst``:
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``; ``dtype`` casts floating-point tensors; ``config`` (a
    ``config.json`` or a directory holding one) is copied beside them, for ``from_pretrained``.
    Streamed tensor by tensor: peak memory is one tensor. Tied names are written once (the
    loading model ties them again), as ``save_pretrained`` does."""
    import json
    import shutil

    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty; export into a new directory")
    with CheckpointReader(src) as reader:
        obj = _module_object(reader, obj)
        entries = [e for e in reader.entries(obj) if e.kind in ("param", "buffer")]

        def out_dtype(entry: Any) -> torch.dtype:
            stored = _dtype(entry)
            return dtype if dtype is not None and stored.is_floating_point else stored

        shards: list[list[Any]] = [[]]
        used = 0
        for entry in entries:
            size = entry.numel * out_dtype(entry).itemsize
            if shards[-1] and used + size > max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append(entry)
            used += size
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        total = sum(e.numel * out_dtype(e).itemsize for e in entries)
        bar = _progress(total, progress, f"export {dst.name}")
        tmp = dst.parent / f".{dst.name}.accelkit-export"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            weight_map = {}
            for name, shard in zip(names, shards):
                lazy = []
                for entry in shard:
                    fetch = _reader_fetch(reader, entry)
                    cast = out_dtype(entry)
                    lazy.append(
                        (
                            entry.fqn,
                            LazyTensor(entry.shape, cast, lambda f=fetch, c=cast: f().to(c)),
                        )
                    )
                    weight_map[entry.fqn] = name
                with ThreadPoolExecutor(max_workers=2) as pool:
                    write_file(
                        tmp / name, lazy, {"format": "pt"}, pool=pool, progress=bar, flat=False
                    )
            reader.finish()
            if len(shards) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            if config is not None:
                config = Path(config)
                config = config / "config.json" if config.is_dir() else config
                shutil.copy(config, tmp / "config.json")
            if dst.exists():
                dst.rmdir()
            os.rename(tmp, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if bar is not None:
                bar.close()
    return dst


#: the top-level keys of a DCP export: what ``dcp.load({"model": ..., "optim": ...})`` names
DCP_MODEL_KEY, DCP_OPTIM_KEY = "model", "optim"


def export_dcp(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    obj: str | None = None,
    optimizer: str | bool | None = None,
    progress: bool | None = None,
) -> Path:
    """Write module ``obj`` of checkpoint ``src`` as a torch.distributed.checkpoint directory
    ``dst`` holding ``{"model": weights}``, plus ``"optim"`` with ``optimizer`` (True: the one
    optimizer of that module; or its object name): the state ``get_optimizer_state_dict`` gives
    for a plain model, keyed by parameter name, so ``dcp.load`` + ``set_state_dict`` restore it.

    Streamed: DCP writes one file per tensor, and each tensor is read from ``src`` (checksum
    verified) only when DCP writes it, so peak memory is one tensor. Written into a temporary
    directory beside ``dst`` and renamed at the end: a failure leaves no ``dst``."""
    import shutil

    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst} exists and is not empty; export into a new directory")
    with CheckpointReader(src) as reader:
        obj = _module_object(reader, obj)
        sources: dict[int, Any] = {}  # id(placeholder) -> the entry it stands for

        def placeholder(entry: Any) -> torch.Tensor:
            shell = torch.empty(entry.shape, dtype=_dtype(entry), device="meta")
            sources[id(shell)] = entry
            return shell

        weights = {}
        for entry in reader.entries(obj):
            if entry.kind in ("param", "buffer"):
                for name in (entry.fqn, *entry.aliases):
                    weights[name] = placeholder(entry)
        state: dict[str, Any] = {DCP_MODEL_KEY: weights}
        if optimizer:
            name = _optimizer_object(reader, obj, None if optimizer is True else str(optimizer))
            state[DCP_OPTIM_KEY] = _fqn_optimizer_state(reader, name, set(weights), placeholder)
        total = sum(e.numel * _dtype(e).itemsize for e in map(sources.get, sources))
        bar = _progress(total, progress, f"export {dst.name}")
        tmp = dst.parent / f".{dst.name}.accelkit-export"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _dcp_save(state, tmp, _streaming_planner(reader, sources, bar))
            if dst.exists():
                dst.rmdir()
            os.rename(tmp, dst)
            storage.fsync_dir(dst.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if bar is not None:
                bar.close()
    log.info("wrote %s: a torch.distributed.checkpoint of %s", dst, ", ".join(state))
    return dst


def _optimizer_object(reader: CheckpointReader, module: str, name: str | None) -> str:
    """The optimizer of ``module`` to export: ``name``, or the checkpoint's only one."""
    objects = reader.manifest.objects
    found = [
        n
        for n, info in objects.items()
        if info.get("type") == "optimizer" and info.get("model") in (module, None)
    ]
    if name is None:
        if len(found) != 1:
            raise CheckpointError(
                f"{reader.directory}: module {module!r} has optimizers {found}; name the one "
                "to export with --with-optimizer NAME"
                if found
                else f"{reader.directory}: no optimizer of module {module!r} to export"
            )
        return found[0]
    if name not in found:
        raise CheckpointError(
            f"{reader.directory}: no optimizer {name!r} of module {module!r} (optimizers: {found})"
        )
    return name


def _fqn_optimizer_state(
    reader: CheckpointReader, name: str, params: set[str], placeholder: Any
) -> dict[str, Any]:
    """Optimizer ``name`` as ``get_optimizer_state_dict`` gives it for a plain model: per-
    parameter state and each group's ``params`` by parameter name, settings as stored."""
    from accelkit.checkpoint.codec import decode

    info = reader.object_info(name, "optimizer")
    tensors = reader.optimizer_entries(name)
    scalars = info.get("scalar_state", {}) or {}
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in info.get("param_groups", []):
        names = list(group.get("params", []))
        foreign = [p for p in names if p not in params]
        if foreign:
            raise CheckpointError(
                f"{reader.directory}: optimizer {name!r} holds parameters that are not the "
                f"exported module's ({', '.join(foreign[:3])}); DCP's layout names each by the "
                "module's parameter names"
            )
        for pname in names:
            per_param = {key: placeholder(e) for key, e in tensors.get(pname, {}).items()}
            per_param.update({k: decode(v) for k, v in scalars.get(pname, {}).items()})
            if per_param:
                state[pname] = per_param
        settings = {k: decode(v) for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": names})
    return {"state": state, "param_groups": groups}


def _streaming_planner(reader: CheckpointReader, sources: dict[int, Any], bar: Any) -> Any:
    """DCP's default save planner, reading each placeholder's tensor only when DCP writes it."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class StreamingPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            value = super().lookup_object(index)
            entry = sources.get(id(value))
            if entry is None:
                return value
            tensor = reader.read(entry)  # checksums verified before it returns
            if bar is not None:
                bar.update(tensor.numel() * tensor.element_size())
            return tensor

    return StreamingPlanner()


def _dcp_save(state: dict[str, Any], directory: Path, planner: Any) -> None:
    """One process's ``dcp.save``: one file per tensor (DCP keeps a file's tensors in memory
    until the file is written, so one file per tensor bounds memory to one tensor)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=False, overwrite=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        try:
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as err:  # DCP wraps what failed (a BaseException)
            causes = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
            for cause in causes:
                if isinstance(cause, CheckpointError):
                    raise cause from None
            raise CheckpointError(f"{directory}: DCP could not write it: {causes}") from None


def _module_object(reader: CheckpointReader, obj: str | None) -> str:
    """The module object to export: ``obj``, or the checkpoint's only one."""
    modules = [n for n, info in reader.manifest.objects.items() if info.get("type") == "module"]
    if obj is None:
        if len(modules) != 1:
            raise CheckpointError(
                f"{reader.directory} holds modules {modules}; choose one with --object"
            )
        obj = modules[0]
    if obj not in modules:
        raise CheckpointError(f"{reader.directory}: no module {obj!r} (modules: {modules})")
    return obj


def _dtype(entry: Any) -> torch.dtype:
    from accelkit.checkpoint.safetensors_io import DTYPES_BY_NAME

    return DTYPES_BY_NAME[entry.dtype]


def _reader_fetch(reader: CheckpointReader, entry: Any):
    return lambda: reader.read(entry)


def _atomic_write(dst: Path, write: Any) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.accelkit-tmp"
    try:
        write(tmp)
        storage.fsync_file(tmp)
        os.replace(tmp, dst)
        storage.fsync_dir(dst.parent)
    finally:
        tmp.unlink(missing_ok=True)


# ---- import: writing a portable checkpoint from foreign tensors -----------------------------------------
@dataclass
class Imported:
    """What an importer found: tensors by (object, kind, fqn), object descriptions, extras."""

    tensors: dict[tuple[str, str, str], torch.Tensor | LazyTensor]
    objects: dict[str, dict[str, Any]]
    extras: dict[str, Any]
    source: str
    step: int | None = None


def write_portable(
    imported: Imported, dst: str | os.PathLike, *, progress: bool | None = None
) -> Path:
    """Write ``imported`` as a world-size-1 portable checkpoint at ``dst`` (atomically)."""
    from accelkit.checkpoint.writer import _build_manifest, finalize

    path = Path(dst).absolute()
    storage.prepare(path)
    tmp = storage.temp_dir(path)

    def sink(obj: str, kind: str):
        def put(where: str, tensor: torch.Tensor) -> str:
            imported.tensors[(obj, kind, where)] = tensor
            return where

        return put

    objects = {}
    for name, info in imported.objects.items():
        if "state" in info:
            info = {**info, "state": encode(info["state"], name, sink(name, "state"))}
        objects[name] = info
    extras = {k: encode(v, k, sink(EXTRA_OBJECT, "extra")) for k, v in imported.extras.items()}
    for name in imported.extras:
        objects.setdefault(name, {"type": "extra"})
    items = []
    records = []
    for (obj, kind, fqn), value in imported.tensors.items():
        key = f"{obj}/{kind}/{fqn}@0"
        if not isinstance(value, LazyTensor):
            value = value.detach().reshape(-1)
            shape: tuple[int, ...] = tuple(imported.tensors[(obj, kind, fqn)].shape)
        else:
            shape = tuple(value.shape)
            value = LazyTensor((value.numel(),), value.dtype, _flattened(value.fetch))
        if value.numel():
            items.append((key, value))
        records.append(
            {
                "object": obj,
                "fqn": fqn,
                "kind": kind,
                "shape": list(shape),
                "dtype": DTYPE_NAMES[value.dtype],
                "flat_offset": 0,
                "numel": value.numel(),
                "key": key if value.numel() else "",
                "meta": {},
            }
        )
    total = sum(v.numel() * torch.empty((), dtype=v.dtype).element_size() for _, v in items)
    bar = _progress(total, progress, f"import {path.name}")
    try:
        file_path = tmp / rank_file_name(0)
        with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 2))) as pool:
            digests = write_file(
                file_path,
                items,
                {"format": FORMAT, "format_version": FORMAT_VERSION, "rank": "0"},
                pool=pool,
                progress=bar,
            )
    finally:
        if bar is not None:
            bar.close()
    for rec in records:
        rec["digest"] = digests.get(rec["key"], "")
        rec["algorithm"] = "sha256"
    record = {
        "rank": 0,
        "infos": objects,
        "extras": extras,
        "backend_state": {},
        "fragments": records,
        "file": {"name": rank_file_name(0), "bytes": file_path.stat().st_size},
    }
    backend = SimpleNamespace(name=imported.source, settings=SimpleNamespace(precision=None))
    manifest, extras = _build_manifest(backend, None, [record], list(objects), imported.step)
    finalize(path, manifest, extras, latest=False, keep_last=None, writer=imported.source)
    return path


def _flattened(fetch: Any):
    return lambda: fetch().detach().reshape(-1)


def _model_tensors(
    state: dict[str, Any], obj: str, *, strip_prefix: str | None
) -> dict[tuple[str, str, str], torch.Tensor | LazyTensor]:
    out: dict[tuple[str, str, str], Any] = {}
    for key, value in state.items():
        if not isinstance(value, (torch.Tensor, LazyTensor)):
            continue
        name = key[len(strip_prefix) :] if strip_prefix and key.startswith(strip_prefix) else key
        out[(obj, "param", canonical_fqn(name, strip_module_prefix=True))] = value
    return out


def _is_module_state(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) for k in value)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, dict) and "state" in value and "param_groups" in value


def _family(osd: dict[str, Any]) -> str:
    keys = {k for per in osd.get("state", {}).values() for k in per}
    if {"exp_avg", "exp_avg_sq"} <= keys:
        groups = osd.get("param_groups", [{}])
        return "adamw" if groups and groups[0].get("decoupled_weight_decay") else "adam"
    if "momentum_buffer" in keys:
        return "sgd"
    return "unknown"


def positional_names(
    module_state: dict[str, torch.Tensor], osd: dict[str, Any]
) -> list[str] | None:
    """Names for a torch optimizer's integer parameter ids (id k is the k-th parameter of its
    groups in order), as a subsequence of the state dict's floating tensors (tied copies once,
    known buffers out) whose shapes match each parameter's state. Only a match that is unique
    is returned (the leftmost and the rightmost matches coincide); otherwise None."""
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    candidates, seen = [], set()
    for name, value in module_state.items():
        if not value.is_floating_point() or name.rsplit(".", 1)[-1] in buffers:
            continue
        storage_id = (value.untyped_storage().data_ptr(), value.storage_offset(), value.numel())
        if storage_id in seen and value.numel():
            continue
        seen.add(storage_id)
        candidates.append(name)
    ids = [i for group in osd["param_groups"] for i in group["params"]]
    if not ids or not all(isinstance(i, int) for i in ids) or ids != list(range(len(ids))):
        return None
    shapes: dict[int, tuple[int, ...]] = {}
    for pid, per_param in osd["state"].items():
        for value in per_param.values():
            if isinstance(value, torch.Tensor) and value.dim():
                shapes[pid] = tuple(value.shape)

    def fits(pid: int, index: int) -> bool:
        return pid not in shapes or shapes[pid] == tuple(module_state[candidates[index]].shape)

    def leftmost() -> list[int] | None:
        chosen, j = [], 0
        for pid in ids:
            while j < len(candidates) and not fits(pid, j):
                j += 1
            if j == len(candidates):
                return None
            chosen.append(j)
            j += 1
        return chosen

    def rightmost() -> list[int] | None:
        chosen, j = [], len(candidates) - 1
        for pid in reversed(ids):
            while j >= 0 and not fits(pid, j):
                j -= 1
            if j < 0:
                return None
            chosen.append(j)
            j -= 1
        return chosen[::-1]

    left = leftmost()
    if left is None or left != rightmost():
        return None
    return [candidates[j] for j in left]


#: the former private name, kept for code that imported it
_positional_names = positional_names


def optimizer_import(
    name: str,
    osd: dict[str, Any],
    param_names: list[str] | None,
    tensors: dict[tuple[str, str, str], Any],
    model_object: str = "model",
) -> dict[str, Any]:
    """Add a torch optimizer state dict's tensors (by fqn) to ``tensors``; return its info."""

    def fqn(pid: Any) -> str:
        if isinstance(pid, str):
            return canonical_fqn(pid, strip_module_prefix=True)
        if param_names is None:
            raise CheckpointError("optimizer parameter ids cannot be named")
        return canonical_fqn(param_names[pid], strip_module_prefix=True)

    scalar_state: dict[str, Any] = {}
    for pid, per_param in osd["state"].items():
        for key, value in per_param.items():
            if isinstance(value, (torch.Tensor, LazyTensor)):
                tensors[(name, f"optim:{key}", fqn(pid))] = value
            else:
                scalar_state.setdefault(fqn(pid), {})[key] = encode(value, f"{name}/{key}")
    groups = []
    for g, group in enumerate(osd["param_groups"]):
        settings = param_group_hyperparams(group, f"{name}/param_groups/{g}")
        groups.append({"params": [fqn(p) for p in group["params"]], **settings})
    return {
        "type": "optimizer",
        "class": "(imported)",
        "family": _family(osd),
        "model": model_object,
        "step_granularity": "param",
        "param_groups": groups,
        "scalar_state": scalar_state,
    }


def _try_encode(value: Any, where: str) -> bool:
    try:
        encode(value, where, lambda path, tensor: path)
        return True
    except CheckpointError as err:
        log.warning("not imported: %s", err)
        return False


def _from_mapping(checkpoint: dict[str, Any], source: str, strip_prefix: str | None) -> Imported:
    """A Fabric-style dict: module state dicts, optimizer state dicts, stateful states, values."""
    tensors: dict[tuple[str, str, str], Any] = {}
    objects: dict[str, dict[str, Any]] = {}
    extras: dict[str, Any] = {}
    modules = {k: v for k, v in checkpoint.items() if _is_module_state(v)}
    if not modules and _is_module_state({k: v for k, v in checkpoint.items()}):
        modules = {"model": checkpoint}
        checkpoint = {"model": checkpoint}
    for key, value in checkpoint.items():
        if key in modules:
            tensors.update(_model_tensors(value, key, strip_prefix=strip_prefix))
            objects[key] = {"type": "module", "class": "(imported)"}
        elif _is_optimizer_state(value):
            model_name = next(iter(modules), "model")
            names = None
            if modules and any(
                isinstance(p, int) for g in value["param_groups"] for p in g["params"]
            ):
                names = positional_names(modules[model_name], value)
                if names is None:
                    log.warning(
                        "%s: optimizer %r not imported: its integer parameter ids cannot be "
                        "matched to the model's names unambiguously (frozen parameters or "
                        "floating-point buffers of the same shapes); the model is imported",
                        source,
                        key,
                    )
                    continue
                if strip_prefix:
                    names = [
                        n[len(strip_prefix) :] if n.startswith(strip_prefix) else n for n in names
                    ]
            objects[key] = optimizer_import(key, value, names, tensors, model_name)
        elif isinstance(value, dict) and ("last_epoch" in value or "base_lrs" in value):
            if _try_encode(value, key):
                objects[key] = {
                    "type": "scheduler",
                    "class": "(imported)",
                    "state": drop_callables(value, key),
                }
        elif _try_encode(value, key):
            extras[key] = value
    step = checkpoint.get("step", checkpoint.get("global_step"))
    return Imported(tensors, objects, extras, source, step if isinstance(step, int) else None)


# ---- restricted unpickling ------------------------------------------------------------------------
# A pickle is a program: each global it names is looked up, and may be called. trust_pickle never
# means "run it": every pickled input is read by an unpickler that resolves only the globals of a
# PickleAllowlist and refuses any other before anything is called. No allowed callable looks up an
# attribute, imports or evaluates by a name taken from the file (``_codecs.encode`` finds the codec
# the file names in Python's codec registry, nowhere else), or calls a function the file hands it;
# so a file can build tensors, containers and the listed types, and nothing else.

#: torch's tensor reconstructors a restricted load allows. Left out of torch's own weights_only
#: list: ``_rebuild_from_type_v2`` (calls whatever function the file hands it, then sets the
#: attributes the file names), ``_rebuild_parameter_with_state`` (sets the attributes the file
#: names), ``_rebuild_wrapper_subclass`` (builds any tensor subclass) and the rebuilders of device
#: tensors without storage (``_rebuild_device_tensor_from_cpu_tensor`` calls ``.to`` on an object
#: from the file).
TENSOR_REBUILDERS = (
    "_rebuild_tensor",
    "_rebuild_tensor_v2",
    "_rebuild_tensor_v3",
    "_rebuild_parameter",
    "_rebuild_qtensor",
    "_rebuild_sparse_tensor",
    "_rebuild_nested_tensor",
    "_rebuild_meta_tensor_no_storage",
)
#: containers and values a ``torch.save`` of tensors names (``_codecs.encode`` is how pickle
#: protocol 2 writes ``bytes``, ``_get_layout`` how torch writes a tensor layout)
TENSOR_CONTAINERS = (
    "collections.OrderedDict",
    "collections.Counter",
    "builtins.set",
    "builtins.bytearray",
    "builtins.complex",
    "_codecs.encode",
    "torch.Size",
    "torch.device",
    "torch.Tensor",
    "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout",
)
#: what to do about a refused pickle, for ``accelkit convert``
CONVERT_REFUSED_HINT = (
    "accelkit unpickles nothing beyond its allowlist, with or without --trust-pickle. If you know "
    "where the file comes from and what else it holds, load it in your own code and save the "
    "tensors you need (.safetensors, or a torch.save of a plain state dict), then convert that"
)


class PickleRefused(CheckpointError):
    """A pickle names or calls something its restricted reader does not allow (nothing that the
    allowlist lacks was looked up or called)."""

    def __init__(self, message: str, refused: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: the refused globals (``module.name``) where the file named them
        self.refused = refused


@dataclass(frozen=True)
class PickleAllowlist:
    """The globals a restricted load lets a pickle name, and what each one is bound to.

    ``names``: every global the file may name. ``bindings``: the names torch's own weights_only
    list does not hold, each with the object it resolves to (a stand-in may take a builtin's
    name). ``instance_types``: types whose instances an allowed callable returns and the file may
    then fill (numpy's dtype classes).
    """

    names: frozenset[str]
    bindings: tuple[tuple[str, Any], ...] = ()
    instance_types: tuple[type, ...] = ()

    def extended(
        self, bindings: dict[str, Any], instance_types: tuple[type, ...] = ()
    ) -> PickleAllowlist:
        return PickleAllowlist(
            self.names | frozenset(bindings),
            self.bindings + tuple(bindings.items()),
            self.instance_types + instance_types,
        )


def tensor_allowlist() -> PickleAllowlist:
    """What a ``torch.save`` of tensors in plain containers names: :data:`TENSOR_REBUILDERS`,
    :data:`TENSOR_CONTAINERS`, and torch's dtypes, quantization schemes and storage types."""
    from torch._weights_only_unpickler import _get_allowed_globals

    kept = {f"torch._utils.{name}" for name in TENSOR_REBUILDERS} | set(TENSOR_CONTAINERS)
    names = {
        name
        for name, value in _get_allowed_globals().items()
        if name in kept
        or name.endswith("Storage")
        or isinstance(value, (torch.dtype, torch.qscheme))
    }
    return PickleAllowlist(frozenset(names))


def numpy_allowlist(base: PickleAllowlist) -> PickleAllowlist:
    """``base`` plus numpy arrays and scalars as numpy 1 and 2 pickle them (``ndarray``,
    ``dtype``, ``multiarray._reconstruct`` and ``multiarray.scalar``, under ``numpy.core`` and
    ``numpy._core``); the dtypes a file may fill are bool, integer, float and complex ones."""
    try:
        import numpy as np
    except ImportError:
        return base
    core = getattr(np, "_core", None) or np.core  # numpy 2, numpy 1
    bindings: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for package in ("numpy.core", "numpy._core"):
        bindings[f"{package}.multiarray._reconstruct"] = core.multiarray._reconstruct
        bindings[f"{package}.multiarray.scalar"] = core.multiarray.scalar
    kinds = "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]
    return base.extended(bindings, tuple(dict.fromkeys(type(np.dtype(c)) for c in kinds)))


def conversion_allowlist() -> PickleAllowlist:
    """What ``accelkit convert --trust-pickle`` reads: tensors, containers and numpy values."""
    return numpy_allowlist(tensor_allowlist())


def restricted_torch_load(
    source: str | os.PathLike | IO[bytes],
    allowlist: PickleAllowlist,
    *,
    hint: str,
    mmap: bool = False,
    name: str | None = None,
) -> Any:
    """``torch.load`` that unpickles only what ``allowlist`` allows; else :class:`PickleRefused`.

    Every global the file's pickles name is read first (torch's own parser of them, on the same
    bytes), and a name outside ``allowlist.names`` refuses the file before anything is called;
    then ``torch.load(weights_only=True)`` runs with the allowlist's bindings, so torch's
    restricted unpickler also checks each call and each object filled. ``hint`` (what to do)
    ends each refusal; ``name`` names a ``source`` that is not a path in it. ``mmap`` maps the
    tensors of a file given by path.
    """
    is_path = isinstance(source, (str, os.PathLike))
    where = os.fspath(source) if is_path else name or "the pickle"
    with contextlib.ExitStack() as stack:
        file = stack.enter_context(open(source, "rb")) if is_path else source
        try:
            named = _pickle_globals(file)
        except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as err:
            raise CheckpointError(
                f"{where}: not a torch.save file accelkit can read ({type(err).__name__}: {err})"
            ) from None
        refused = tuple(sorted(named - allowlist.names))
        if refused:
            raise PickleRefused(
                f"{where}: refused to unpickle: it names {', '.join(refused)}, which accelkit's "
                f"restricted unpickler does not allow (nothing in the file was run). {hint}",
                refused,
            )
        file.seek(0)
        with _bound(allowlist):
            try:
                return torch.load(
                    where if mmap and is_path else file,
                    map_location="cpu",
                    weights_only=True,
                    mmap=mmap and is_path,
                )
            except PickleRefused as err:
                raise PickleRefused(f"{where}: {err}. {hint}", err.refused) from None
            except pickle.UnpicklingError as err:
                raise PickleRefused(
                    f"{where}: refused to unpickle: {_unpickler_reason(err)}. {hint}"
                ) from None


def _pickle_globals(file: IO[bytes]) -> set[str]:
    """Every global the pickles that ``torch.load`` reads from ``file`` name, as torch reads
    them (its own record lookup, opcode parser and name mapping)."""
    from torch._weights_only_unpickler import get_globals_in_pkl
    from torch.serialization import _is_zipfile, _open_zipfile_reader

    file.seek(0)
    if _is_zipfile(file):
        with _open_zipfile_reader(file) as archive:
            return get_globals_in_pkl(io.BytesIO(archive.get_record("data.pkl")))
    names: set[str] = set()
    for _ in range(5):  # the legacy format: magic number, protocol, system info, data, storage keys
        try:
            names |= get_globals_in_pkl(file)
        except EOFError:  # a short file: torch.load fails on it too, after these names are checked
            break
    return names


def _unpickler_reason(err: pickle.UnpicklingError) -> str:
    """torch's own reason, without its advice to load with ``weights_only=False``."""
    text = str(err).split("WeightsUnpickler error:", 1)[-1]
    return next((part.strip() for part in text.split("\n\n") if part.strip()), type(err).__name__)


def _safe_global_name(entry: Any) -> str:
    return entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"


@contextlib.contextmanager
def _bound(allowlist: PickleAllowlist) -> Iterator[None]:
    """Register ``allowlist``'s bindings with torch for one load, setting aside what the process
    registered under the same names (torch would pick either one)."""
    from torch.serialization import add_safe_globals, clear_safe_globals, get_safe_globals

    ours = [(obj, name) for name, obj in allowlist.bindings] + list(allowlist.instance_types)
    taken = {_safe_global_name(entry) for entry in ours}
    before = get_safe_globals()
    clear_safe_globals()
    add_safe_globals([entry for entry in before if _safe_global_name(entry) not in taken] + ours)
    try:
        yield
    finally:
        clear_safe_globals()
        add_safe_globals(before)


class RestrictedUnpickler(pickle._Unpickler):
    """Python's unpickler limited to ``allowed`` (``"module.name"`` -> object), for pickles that
    are not ``torch.save`` files (torch.distributed.checkpoint's ``.metadata``).

    A global outside ``allowed`` is refused; a call only of an allowed object; a new instance
    only of an allowed class; filling an object's state only for an instance made by this load
    (nothing shared, a class or an enum member, can be changed); no persistent ids, extension
    codes or protocol-0 instance opcodes.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes], allowed: dict[str, Any]) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._allowed_ids = {id(value) for value in allowed.values()}
        self._made: dict[int, Any] = {}  # instances made here, by id (held, so ids stay unique)

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key not in self._allowed:
            raise PickleRefused(
                f"refused to unpickle: it names {key}, which this restricted unpickler does not "
                "allow (nothing in the file was run)",
                (key,),
            )
        return self._allowed[key]

    def _require_allowed(self, obj: Any, what: str) -> None:
        if id(obj) not in self._allowed_ids:
            raise PickleRefused(f"refused to unpickle: it {what} {type(obj).__name__} object")

    def load_reduce(self) -> None:
        self._require_allowed(self.stack[-2], "calls a")
        super().load_reduce()

    def load_newobj(self) -> None:
        self._require_allowed(self.stack[-2], "instantiates a")
        super().load_newobj()
        self._made[id(self.stack[-1])] = self.stack[-1]

    def load_newobj_ex(self) -> None:
        self._require_allowed(self.stack[-3], "instantiates a")
        super().load_newobj_ex()
        self._made[id(self.stack[-1])] = self.stack[-1]

    def load_build(self) -> None:
        inst = self.stack[-2]
        if self._made.get(id(inst)) is not inst:
            raise PickleRefused(
                f"refused to unpickle: it sets the state of a {type(inst).__name__} it did not make"
            )
        super().load_build()

    def _refuse_opcode(self) -> None:
        raise PickleRefused("refused to unpickle: it uses an opcode this unpickler does not allow")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    for _opcode in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_opcode[0]] = _refuse_opcode
    del _opcode


def _dcp_metadata_allowlist() -> dict[str, Any]:
    """What torch.distributed.checkpoint's ``.metadata`` names: its metadata dataclasses, paths,
    ``torch.Size``, dtypes and layouts."""
    import collections
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    objects = [
        getattr(metadata, name, None)
        for name in (
            "Metadata",
            "MetadataIndex",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "TensorStorageMetadata",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    objects += [getattr(filesystem, "_StorageInfo", None), torch.Size, collections.OrderedDict]
    objects += [pathlib.PurePosixPath, pathlib.PosixPath, torch.serialization._get_layout]
    allowed = {_safe_global_name(obj): obj for obj in objects if obj is not None}
    allowed.update({str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)})
    return allowed


def _restricted_dcp_reader(path: str | os.PathLike) -> Any:
    """A ``FileSystemReader`` whose ``.metadata`` and non-tensor values go through the
    restricted unpicklers (torch reads its tensors with ``weights_only=True``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RestrictedReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(where, "rb") as file:
                try:
                    metadata = RestrictedUnpickler(file, _dcp_metadata_allowlist()).load()
                except PickleRefused as err:
                    raise PickleRefused(
                        f"{where}: {err}. {CONVERT_REFUSED_HINT}", err.refused
                    ) from None
                except (pickle.UnpicklingError, EOFError, ValueError) as err:
                    raise CheckpointError(f"{where}: cannot unpickle it: {err}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return RestrictedReader(str(path))


def _restricted_dcp_planner(path: str | os.PathLike) -> Any:
    """A load planner that reads DCP's non-tensor values (``torch.save`` bytes) restricted,
    into the dict handed to ``dcp.load`` (DCP's flat keys: nothing to flatten)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class RestrictedPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: IO[bytes]) -> None:
            fqn = read_item.dest_index.fqn
            self.state_dict[fqn] = restricted_torch_load(
                value, conversion_allowlist(), hint=CONVERT_REFUSED_HINT, name=f"{path}: {fqn}"
            )

    return RestrictedPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


# ---- the native importers -------------------------------------------------------------------------------
class SafetensorsImporter:
    """A plain state-dict ``.safetensors`` file (weights only; no pickle)."""

    def detect(self, path: str | os.PathLike) -> bool:
        return Path(path).is_file() and Path(path).suffix == ".safetensors"

    def convert(
        self,
        path: str | os.PathLike,
        dst: str | os.PathLike,
        *,
        trust_pickle: bool = False,
        strip_prefix: str | None = None,
        progress: bool | None = None,
    ) -> Path:
        from safetensors import safe_open

        handle = safe_open(str(path), framework="pt", device="cpu")
        state: dict[str, Any] = {}
        for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
            piece = handle.get_slice(key)
            dtype = _st_dtype(piece.get_dtype())
            state[key] = LazyTensor(tuple(piece.get_shape()), dtype, _safe_fetch(handle, key))
        imported = Imported(
            _model_tensors(state, "model", strip_prefix=strip_prefix),
            {"model": {"type": "module", "class": "(imported)"}},
            {},
            "import:safetensors",
        )
        return write_portable(imported, dst, progress=progress)


def _st_dtype(code: str) -> torch.dtype:
    from accelkit.checkpoint.safetensors_io import ST_TO_DTYPE

    return ST_TO_DTYPE[code]


def _safe_fetch(handle: Any, key: str):
    return lambda: handle.get_tensor(key)


def _torch_load(path: str | os.PathLike, trust_pickle: bool) -> Any:
    if not trust_pickle:
        raise CheckpointError(f"{path} {PICKLE_HINT}")
    return restricted_torch_load(path, conversion_allowlist(), hint=CONVERT_REFUSED_HINT, mmap=True)


class TorchFileImporter:
    """A ``torch.save`` file: a plain state dict, a dict of state dicts (Fabric's ``save``),
    or a dict with ``state_dict``/``model``/``module`` inside. Pickled: needs ``trust_pickle``."""

    suffixes = (".pt", ".pth", ".bin", ".ckpt")

    def detect(self, path: str | os.PathLike) -> bool:
        return Path(path).is_file() and Path(path).suffix in self.suffixes

    def convert(
        self,
        path: str | os.PathLike,
        dst: str | os.PathLike,
        *,
        trust_pickle: bool = False,
        strip_prefix: str | None = None,
        progress: bool | None = None,
    ) -> Path:
        checkpoint = _torch_load(path, trust_pickle)
        if not isinstance(checkpoint, dict):
            raise CheckpointError(f"{path}: holds a {type(checkpoint).__name__}, not a dict")
        if "pytorch-lightning_version" in checkpoint or (
            "state_dict" in checkpoint and "optimizer_states" in checkpoint
        ):
            imported = _from_lightning(checkpoint, strip_prefix)
        else:
            for key in ("state_dict", "model_state_dict", "module"):
                if _is_module_state(checkpoint.get(key)) and not any(
                    _is_module_state(v) for k, v in checkpoint.items() if k != key
                ):
                    checkpoint = {"model" if k == key else k: v for k, v in checkpoint.items()}
            imported = _from_mapping(checkpoint, "import:torch", strip_prefix)
        return write_portable(imported, dst, progress=progress)


def _from_lightning(checkpoint: dict[str, Any], strip_prefix: str | None) -> Imported:
    """Lightning's layout: state_dict, optimizer_states[i], lr_schedulers[i], epoch, global_step."""
    mapping: dict[str, Any] = {"model": checkpoint["state_dict"]}
    for i, osd in enumerate(checkpoint.get("optimizer_states", [])):
        mapping["optimizer" if i == 0 else f"optimizer_{i}"] = osd
    for i, sched in enumerate(checkpoint.get("lr_schedulers", [])):
        mapping["scheduler" if i == 0 else f"scheduler_{i}"] = sched
    for key in ("epoch", "global_step"):
        if key in checkpoint:
            mapping[key] = checkpoint[key]
    imported = _from_mapping(mapping, "import:lightning", strip_prefix)
    if "pytorch-lightning_version" in checkpoint:
        imported.extras["lightning_version"] = str(checkpoint["pytorch-lightning_version"])
    return imported


class DCPImporter:
    """A torch.distributed.checkpoint directory (any world size that wrote it). Its
    ``.metadata`` is a pickle: needs ``trust_pickle``. Nested state (``{"model": ...,
    "optimizer": ...}`` as ``get_state_dict`` gives) becomes those objects; a flat one, "model"."""

    def detect(self, path: str | os.PathLike) -> bool:
        return Path(path).is_dir() and (Path(path) / ".metadata").is_file()

    def convert(
        self,
        path: str | os.PathLike,
        dst: str | os.PathLike,
        *,
        trust_pickle: bool = False,
        strip_prefix: str | None = None,
        progress: bool | None = None,
    ) -> Path:
        if not trust_pickle:
            raise CheckpointError(
                f"{path}: the torch.distributed.checkpoint .metadata {PICKLE_HINT}"
            )
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = _restricted_dcp_reader(path).read_metadata()
        paths = dict(getattr(metadata, "planner_data", None) or {})
        tensors_meta = {
            k: v
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        others = [k for k in metadata.state_dict_metadata if k not in tensors_meta]

        def load(keys: dict[str, Any]) -> dict[str, Any]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    dcp.load(
                        keys,
                        storage_reader=_restricted_dcp_reader(path),
                        planner=_restricted_dcp_planner(path),
                        no_dist=True,
                    )
                except CheckpointException as err:  # DCP wraps what its reader raised
                    for failure in err.failures.values():
                        cause = failure[0] if isinstance(failure, tuple) else failure
                        if isinstance(cause, PickleRefused):
                            raise cause from None
                    raise
            return keys

        def fetch(key: str):
            meta = tensors_meta[key]
            return lambda: load({key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)})[
                key
            ]

        values = load(dict.fromkeys(others)) if others else {}
        nested: dict[str, Any] = {}
        for key in metadata.state_dict_metadata:
            route = paths.get(key, (key,))
            value = (
                LazyTensor(
                    tuple(tensors_meta[key].size), tensors_meta[key].properties.dtype, fetch(key)
                )
                if key in tensors_meta
                else values.get(key)
            )
            _insert(nested, list(route), value)
        if not any(_is_module_state_like(v) or _is_optimizer_state(v) for v in nested.values()):
            nested = {"model": nested}
        imported = _from_mapping_lazy(nested, strip_prefix)
        return write_portable(imported, dst, progress=progress)


def _insert(tree: dict[Any, Any], route: list[Any], value: Any) -> None:
    node = tree
    for part in route[:-1]:
        node = node.setdefault(part, {})
    node[route[-1]] = value


def _is_module_state_like(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) for k in value)
        and all(isinstance(v, (torch.Tensor, LazyTensor)) for v in value.values())
    )


def _from_mapping_lazy(nested: dict[str, Any], strip_prefix: str | None) -> Imported:
    """Like :func:`_from_mapping` for DCP's tree (lazy tensors; param groups as lists)."""
    tensors: dict[tuple[str, str, str], Any] = {}
    objects: dict[str, dict[str, Any]] = {}
    extras: dict[str, Any] = {}
    modules = [k for k, v in nested.items() if _is_module_state_like(v)]
    for key, value in nested.items():
        if key in modules:
            tensors.update(_model_tensors(value, key, strip_prefix=strip_prefix))
            objects[key] = {"type": "module", "class": "(imported)"}
        elif _is_optimizer_state(value):
            groups = value["param_groups"]
            if isinstance(groups, dict):  # flattened by DCP: {"0": {...}} or {0: {...}}
                groups = [groups[k] for k in sorted(groups, key=int)]
            osd = {"state": value["state"], "param_groups": groups}
            objects[key] = optimizer_import(
                key, osd, None, tensors, modules[0] if modules else "model"
            )
        elif _try_encode(value, key):
            extras[key] = value
    return Imported(tensors, objects, extras, "import:dcp")


def native_importers() -> dict[str, Any]:
    return {
        "safetensors": SafetensorsImporter(),
        "torch": TorchFileImporter(),
        "dcp": DCPImporter(),
    }


def importers() -> dict[str, Any]:
    """Every registered importer (native ones and plugins'), by format name."""
    from accelkit import registry

    host = registry.host()
    host.ensure_loaded()
    found: dict[str, Any] = {}
    for result in reversed(host.pm.hook.accelkit_checkpoint_importers()):
        for name, importer in (result or {}).items():
            found.setdefault(name, importer)  # the first registered (native) wins a name
    return found


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    trust_pickle: bool = False,
    fmt: str | None = None,
    obj: str | None = None,
    strip_prefix: str | None = None,
    progress: bool | None = None,
    to: str | None = None,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    config: str | os.PathLike | None = None,
    optimizer: str | bool | None = None,
) -> Path:
    """Convert ``src`` to ``dst``: a portable checkpoint into one file, or any importable
    format into a portable checkpoint. ``to='mmengine'``: a portable checkpoint of accelkit's
    MMEngine adapter into the ``.pth`` plain MMEngine resumes (needs MMEngine). ``to='hf'``:
    Hugging Face's sharded safetensors layout (:func:`export_hf`). ``to='dcp'``: a
    torch.distributed.checkpoint directory, with ``optimizer``'s state on request
    (:func:`export_dcp`)."""
    try:
        storage.resolve(src)
        portable = True
    except CheckpointError:
        portable = False
    if optimizer and to != "dcp":
        raise CheckpointError("--with-optimizer applies to --to dcp only")
    if to == "dcp":
        if not portable:
            raise CheckpointError(
                f"{src}: --to dcp exports a portable checkpoint, and this is not one"
            )
        given = [f for f, v in (("--format", fmt), ("--strip-prefix", strip_prefix)) if v]
        if given:
            raise CheckpointError(
                f"--to dcp writes DCP's own format; {', '.join(given)} do not apply"
            )
        return export_dcp(src, dst, obj=obj, optimizer=optimizer, progress=progress)
    if to == "hf":
        if not portable:
            raise CheckpointError(
                f"{src}: --to hf exports a portable checkpoint, and this is not one"
            )
        return export_hf(
            src,
            dst,
            obj=obj,
            max_shard_bytes=max_shard_bytes or 5 * 10**9,
            dtype=dtype,
            config=config,
            progress=progress,
        )
    if to is not None:
        return _export_to(to, src, dst, portable=portable, fmt=fmt, obj=obj, strip=strip_prefix)
    if portable:
        return export_file(src, dst, obj=obj, fmt=fmt, progress=progress)
    if not Path(src).exists():
        raise CheckpointError(f"{src}: no such file or directory")
    available = importers()
    for name, importer in available.items():
        if importer.detect(src):
            log.info("converting %s (%s) into a portable checkpoint at %s", src, name, dst)
            options: dict[str, Any] = {"trust_pickle": trust_pickle}
            if strip_prefix is not None:
                options["strip_prefix"] = strip_prefix
            if progress is not None:
                options["progress"] = progress
            result = importer.convert(src, dst, **options)
            return Path(result) if result is not None else Path(dst)
    raise CheckpointError(
        f"{src}: not a portable checkpoint, and no importer recognises it "
        f"(importers: {', '.join(sorted(available))})"
    )


#: ``convert(..., to=NAME)``: the foreign training framework a portable checkpoint goes to
EXPORT_TARGETS = ("mmengine", "hf", "dcp")


def _export_to(
    to: str,
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    portable: bool,
    fmt: str | None,
    obj: str | None,
    strip: str | None,
) -> Path:
    if to not in EXPORT_TARGETS:
        raise CheckpointError(f"unknown export target {to!r}; choose from {EXPORT_TARGETS}")
    if not portable:
        raise CheckpointError(
            f"{src}: --to {to} exports a portable checkpoint, and this is not one"
        )
    given = [
        flag
        for flag, value in (("--format", fmt), ("--object", obj), ("--strip-prefix", strip))
        if value is not None
    ]
    if given:
        raise CheckpointError(
            f"--to {to} writes {to}'s own format; {', '.join(given)} do not apply"
        )
    try:
        from accelkit.integrations.mmengine.checkpoint import export_mmengine
    except ImportError as err:
        raise CheckpointError(f"--to mmengine needs MMEngine installed ({err})") from err
    return export_mmengine(src, dst)


@hookimpl
def accelkit_checkpoint_importers() -> dict[str, Any]:
    """The native importers, registered like a plugin's (accelkit.backends re-exports this)."""
    return native_importers()
