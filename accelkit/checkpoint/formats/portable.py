"""accelkit's own checkpoint out to one file: a module's parameters and buffers as
``.safetensors`` or ``.pt``, gathered tensor by tensor from the fragments (peak memory: one
tensor for ``.safetensors``; the whole model for ``.pt``), under the names a plain
``model.load_state_dict`` expects (tied names included). Also the reading helpers the other
exporters share.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from accelkit.checkpoint.format.safetensors_io import LazyTensor, write_file
from accelkit.checkpoint.progress import progress_bar
from accelkit.checkpoint.read.reader import CheckpointReader
from accelkit.checkpoint.store import posix as storage
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")


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
        obj = module_object(reader, obj)
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
        total = sum(
            e.numel * torch.empty((), dtype=entry_dtype(e)).element_size() for _, e in items
        )
        bar = progress_bar(total, progress, f"export {dst.name}")
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
                    (name, LazyTensor(entry.shape, entry_dtype(entry), reader_fetch(reader, entry)))
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


def module_object(reader: CheckpointReader, obj: str | None) -> str:
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


def entry_dtype(entry: Any) -> torch.dtype:
    from accelkit.checkpoint.format.safetensors_io import DTYPES_BY_NAME

    return DTYPES_BY_NAME[entry.dtype]


def reader_fetch(reader: CheckpointReader, entry: Any):
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
