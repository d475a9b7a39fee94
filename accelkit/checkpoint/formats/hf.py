"""Hugging Face's sharded safetensors layout (``accelkit convert --to hf``)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from accelkit.checkpoint.format.safetensors_io import LazyTensor, write_file
from accelkit.checkpoint.formats.portable import entry_dtype, module_object, reader_fetch
from accelkit.checkpoint.progress import progress_bar
from accelkit.checkpoint.read.reader import CheckpointReader
from accelkit.errors import CheckpointError


def export_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    obj: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    config: str | os.PathLike | bool | None = None,
    progress: bool | None = None,
) -> Path:
    """Write module ``obj`` of checkpoint ``src`` as Hugging Face's layout in directory ``dst``:
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``; ``dtype`` casts floating-point tensors. ``config.json``,
    which ``from_pretrained`` needs, comes from ``config`` (a ``config.json`` or a directory
    holding one), else from the checkpoint (:func:`find_config`); ``config=False`` writes the
    weights alone.
    Streamed tensor by tensor: peak memory is one tensor. Tied names are written once (the
    loading model ties them again), as ``save_pretrained`` does."""
    import json
    import shutil

    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty; export into a new directory")
    with CheckpointReader(src) as reader:
        obj = module_object(reader, obj)
        config_text = _config_text(reader, obj, config)
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
            if config_text is not None:
                (tmp / "config.json").write_text(config_text)
            if dst.exists():
                dst.rmdir()
            os.rename(tmp, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if bar is not None:
                bar.close()
    return dst


def find_config(reader: CheckpointReader, obj: str) -> str | None:
    """The ``config.json`` text of module ``obj``: the Hugging Face config the save stored
    (``hf_config``), else the ``config.json`` beside the pretrained source it was loaded from
    (``pretrained_from``); None when neither is there."""
    import json

    info = reader.manifest.objects.get(obj, {})
    if isinstance(info.get("hf_config"), dict):
        return json.dumps(info["hf_config"], indent=2, sort_keys=True) + "\n"
    source = info.get("pretrained_from")
    if not isinstance(source, str):
        return None
    from accelkit.checkpoint.store import store_for
    from accelkit.errors import CheckpointError

    store = store_for(source)
    if store.local_directory(source) is None:  # object storage: its config.json, if it has one
        try:
            where = store.where(source)
            return store.bucket(where).get(where.child("config.json").key)[0].decode()
        except (CheckpointError, AttributeError, UnicodeDecodeError):
            return None
    if (Path(source) / "config.json").is_file():
        return (Path(source) / "config.json").read_text()
    return None


def _config_text(reader: CheckpointReader, obj: str, config: Any) -> str | None:
    """What goes into the export's ``config.json`` (None: nothing, as ``config=False`` asks)."""
    if config is False:
        return None
    if config is not None and config is not True:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise CheckpointError(f"--config {config}: no config.json there")
        return path.read_text()
    found = find_config(reader, obj)
    if found is None:
        raise CheckpointError(
            f"{reader.directory}: the checkpoint holds no model config for {obj!r} (the model was "
            "not a Transformers model, nor loaded with load_pretrained from a folder with a "
            "config.json), and from_pretrained cannot open weights without one. Pass "
            "--config DIR (the pretrained model's folder, or any folder or file with its "
            "config.json), or --no-config to write the weights alone."
        )
    return found
