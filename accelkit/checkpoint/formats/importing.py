"""Writing a portable checkpoint from foreign tensors: what every importer builds
(:class:`Imported`) and writes (:func:`write_portable`), and how a foreign optimizer's state is
named by parameter (:func:`positional_names`, :func:`optimizer_import`).

The converters of each format (:mod:`accelkit.checkpoint.formats`, the DeepSpeed and ColossalAI
plugins' importers, the MMEngine integration) build on these.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from accelkit.checkpoint.format.codec import drop_callables, encode
from accelkit.checkpoint.format.fqn import canonical_fqn
from accelkit.checkpoint.format.manifest import (
    EXTRA_OBJECT,
    FORMAT,
    FORMAT_VERSION,
    rank_file_name,
)
from accelkit.checkpoint.format.safetensors_io import DTYPE_NAMES, LazyTensor, write_file
from accelkit.checkpoint.progress import progress_bar
from accelkit.checkpoint.shards.fragments import param_group_hyperparams
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")


@dataclass
class Imported:
    """What an importer found: tensors by (object, kind, fqn), object descriptions, extras."""

    tensors: dict[tuple[str, str, str], torch.Tensor | LazyTensor]
    objects: dict[str, dict[str, Any]]
    extras: dict[str, Any]
    source: str
    step: int | None = None


def write_portable(
    imported: Imported,
    dst: str | os.PathLike,
    *,
    progress: bool | None = None,
    created_unix_ns: int | None = None,
) -> Path:
    """Write ``imported`` as a world-size-1 portable checkpoint at ``dst`` (atomically).
    ``created_unix_ns`` (default: now) fixes the one field that differs between two imports of
    the same source, so that ranks importing one file each on their own write one manifest."""
    from accelkit.checkpoint.store import posix
    from accelkit.checkpoint.write.writer import _build_manifest, finalize

    path = Path(dst).absolute()
    posix.prepare(path)
    tmp = posix.temp_dir(path)

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
    bar = progress_bar(total, progress, f"import {path.name}")
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
    manifest, extras = _build_manifest(
        backend, None, [record], list(objects), imported.step, created_unix_ns
    )
    finalize(path, manifest, extras, latest=False, keep_last=None, writer=imported.source)
    return path


def _flattened(fetch: Any):
    return lambda: fetch().detach().reshape(-1)


def model_tensors(
    state: dict[str, Any], obj: str, *, strip_prefix: str | None
) -> dict[tuple[str, str, str], torch.Tensor | LazyTensor]:
    out: dict[tuple[str, str, str], Any] = {}
    for key, value in state.items():
        if not isinstance(value, (torch.Tensor, LazyTensor)):
            continue
        name = key[len(strip_prefix) :] if strip_prefix and key.startswith(strip_prefix) else key
        out[(obj, "param", canonical_fqn(name, strip_module_prefix=True))] = value
    return out


def is_module_state(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) for k in value)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )


def is_optimizer_state(value: Any) -> bool:
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


def try_encode(value: Any, where: str) -> bool:
    try:
        encode(value, where, lambda path, tensor: path)
        return True
    except CheckpointError as err:
        log.warning("not imported: %s", err)
        return False


def from_mapping(checkpoint: dict[str, Any], source: str, strip_prefix: str | None) -> Imported:
    """A Fabric-style dict: module state dicts, optimizer state dicts, stateful states, values."""
    tensors: dict[tuple[str, str, str], Any] = {}
    objects: dict[str, dict[str, Any]] = {}
    extras: dict[str, Any] = {}
    modules = {k: v for k, v in checkpoint.items() if is_module_state(v)}
    if not modules and is_module_state({k: v for k, v in checkpoint.items()}):
        modules = {"model": checkpoint}
        checkpoint = {"model": checkpoint}
    for key, value in checkpoint.items():
        if key in modules:
            tensors.update(model_tensors(value, key, strip_prefix=strip_prefix))
            objects[key] = {"type": "module", "class": "(imported)"}
        elif is_optimizer_state(value):
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
            if try_encode(value, key):
                objects[key] = {
                    "type": "scheduler",
                    "class": "(imported)",
                    "state": drop_callables(value, key),
                }
        elif try_encode(value, key):
            extras[key] = value
    step = checkpoint.get("step", checkpoint.get("global_step"))
    return Imported(tensors, objects, extras, source, step if isinstance(step, int) else None)
