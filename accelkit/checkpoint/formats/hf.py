"""Hugging Face's sharded safetensors layout (``accelkit convert --to hf``)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from accelkit.checkpoint.formats.portable import entry_dtype, module_object, reader_fetch
from accelkit.checkpoint.progress import progress_bar
from accelkit.checkpoint.reader import CheckpointReader
from accelkit.checkpoint.safetensors_io import LazyTensor, write_file
from accelkit.errors import CheckpointError


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
        obj = module_object(reader, obj)
        entries = [e for e in reader.entries(obj) if e.kind in ("param", "buffer")]

        def out_dtype(entry: Any) -> torch.dtype:
            stored = entry_dtype(entry)
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
        bar = progress_bar(total, progress, f"export {dst.name}")
        tmp = dst.parent / f".{dst.name}.accelkit-export"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            weight_map = {}
            for name, shard in zip(names, shards):
                lazy = []
                for entry in shard:
                    fetch = reader_fetch(reader, entry)
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
