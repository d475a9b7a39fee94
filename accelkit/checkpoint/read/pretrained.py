"""Pretrained weights straight into a set-up (sharded) model: ``accel.load_pretrained``.

The source is a Hugging Face-style directory (``model.safetensors``, or shards with
``model.safetensors.index.json``), one ``.safetensors`` file, or an accelkit checkpoint. Its
safetensors headers are read into the same description an accelkit manifest gives (each tensor
one fragment: its file, key, shape, dtype), so every backend's own loader fills its own pieces:
each rank reads only the byte ranges of the parameters it holds, through the reader's bounded
buffers, never the whole model. The load validates first (keys, shapes, dtypes: nothing is
written if one does not fit), like ``accel.load``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accelkit.checkpoint.format.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    FragmentRecord,
    Manifest,
    TensorEntry,
)
from accelkit.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

Rename = dict[str, str | None] | Callable[[str], str | None] | None


def source_files(source: Path) -> tuple[Path, list[str], Path]:
    """(directory, safetensors file names, what messages cite) of a pretrained source."""
    if source.is_file():
        if source.suffix != ".safetensors":
            raise CheckpointError(f"{source}: not a .safetensors file")
        return source.parent, [source.name], source
    index = source / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index ({err})") from err
        missing = [f for f in files if not (source / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names {', '.join(missing)}, which {source} does not hold; the "
                "download or copy is incomplete"
            )
        return source, files, index
    if (source / SINGLE_NAME).is_file():
        return source, [SINGLE_NAME], source / SINGLE_NAME
    raise CheckpointError(
        f"{source}: no {SINGLE_NAME}, {INDEX_NAME} or {MANIFEST_NAME}; pass a Hugging Face-style "
        "directory, a .safetensors file or an accelkit checkpoint"
    )


def renamer(rename: Rename, strip_prefix: str | None, add_prefix: str | None) -> Callable:
    """The key -> fqn function: ``rename`` (a mapping or callable; None drops the key), then
    the prefix shortcuts."""

    def name_of(key: str) -> str | None:
        new: str | None = key
        if callable(rename):
            new = rename(key)
        elif isinstance(rename, dict):
            new = rename.get(key, key)
        if new is None:
            return None
        if strip_prefix and new.startswith(strip_prefix):
            new = new[len(strip_prefix) :]
        if add_prefix:
            new = add_prefix + new
        return new

    return name_of


def manifest_of(
    directory: Path, files: list[str], name_of: Callable[[str], str | None], obj: str = "model"
) -> Manifest:
    """An accelkit manifest describing the tensors of safetensors ``files`` as module ``obj``."""
    from accelkit.checkpoint.format.safetensors_io import DTYPE_NAMES, ST_TO_DTYPE, read_header

    tensors: dict[str, TensorEntry] = {}
    sizes = {}
    for file in files:
        path = directory / file
        try:
            header, _ = read_header(path)
            sizes[file] = path.stat().st_size
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from err
        for key, info in header.items():
            if key == "__metadata__":
                continue
            fqn = name_of(key)
            if fqn is None:
                continue
            dtype = ST_TO_DTYPE.get(info.get("dtype")) if isinstance(info, dict) else None
            shape = info.get("shape") if isinstance(info, dict) else None
            if dtype is None or not isinstance(shape, list):
                raise CheckpointError(f"{path}: tensor {key} has an unreadable header entry")
            if fqn in tensors:
                raise CheckpointError(f"{path}: {key} is named {fqn!r}, as another tensor is")
            numel = math.prod(shape)
            entry = TensorEntry(obj, fqn, "param", tuple(shape), DTYPE_NAMES[dtype])
            if numel:
                entry.fragments.append(FragmentRecord(file, key, 0, numel, "", "none"))
            tensors[fqn] = entry
    data: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": 1,
        "files": {f: {"bytes": sizes[f]} for f in files},
        "objects": {obj: {"type": "module"}},
        "tensors": [],
    }
    manifest = Manifest(data, list(tensors.values()), directory)
    manifest.validate()
    return manifest


def open_pretrained(
    source: str | os.PathLike,
    *,
    strict: bool = True,
    rename: Rename = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
) -> Any:
    """A reader over a pretrained safetensors source (see :func:`source_files`)."""
    from accelkit.checkpoint.read.reader import CheckpointReader

    directory, files, cited = source_files(Path(source))
    manifest = manifest_of(directory, files, renamer(rename, strip_prefix, add_prefix))
    # safetensors files carry no checksums: nothing to verify beyond the headers and sizes
    return CheckpointReader(
        directory, strict=strict, verify=False, manifest=manifest, described_by=cited
    )


def cited(err: CheckpointError, pairs: list[tuple[Path, Any]]) -> CheckpointError:
    """``err`` with each local path of ``pairs`` replaced by its store's location."""
    message = str(err)
    for local, where in pairs:
        message = message.replace(str(local), str(where))
    out = type(err)(message)
    for attr, value in vars(err).items():
        setattr(out, attr, value)
    return out


@contextmanager
def fetched_pretrained(store: Any, source: str) -> Iterator[Path]:
    """Pretrained safetensors at ``source`` in object storage (one ``.safetensors`` object, or
    a prefix with ``model.safetensors`` or the shards of ``model.safetensors.index.json``) in a
    local temporary directory; what it yields is what :func:`load_pretrained` takes."""
    from accelkit.checkpoint.format.manifest import MANIFEST_NAME
    from accelkit.checkpoint.store.scratch import LOAD_PREFIX, staging

    where = store.where(source)
    bucket = store.bucket(where)
    single = bool(where.key) and bucket.head(where.key) is not None  # an object, not a prefix
    with staging(LOAD_PREFIX) as folder:
        local = folder / ("object" if single else (where.name or where.bucket))
        local.mkdir()
        if single:
            store.download(where.parent, local, [where.name])
            yielded = local / where.name
        elif bucket.head(where.child(INDEX_NAME).key) is not None:
            raw, _ = bucket.get(where.child(INDEX_NAME).key)
            (local / INDEX_NAME).write_bytes(raw)
            try:
                names = sorted(set(json.loads(raw)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise CheckpointError(
                    f"{where.child(INDEX_NAME)}: not a safetensors index ({err})"
                ) from err
            present = {o.key[len(where.prefix) :] for o in bucket.list(where.prefix)}
            missing = [str(where.child(n)) for n in names if n not in present]
            if missing:
                raise CheckpointError(
                    f"{where.child(INDEX_NAME)} names {', '.join(missing)}, which the store "
                    "does not hold; the upload or copy is incomplete"
                )
            store.download(where, local, names)
            yielded = local
        elif bucket.head(where.child(SINGLE_NAME).key) is not None:
            store.download(where, local, [SINGLE_NAME])
            yielded = local
        else:
            raise CheckpointError(
                f"{where}: no {SINGLE_NAME}, {INDEX_NAME} or {MANIFEST_NAME} there; pass a "
                "prefix holding Hugging Face-style safetensors, a .safetensors object or an "
                "accelkit checkpoint"
            )
        try:
            yield yielded
        except CheckpointError as err:
            pairs = [(yielded, where), (local, where.parent if single else where)]
            raise cited(err, pairs) from err
