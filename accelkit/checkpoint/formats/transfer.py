"""Local stand-ins for object-storage paths, for the tools that work on files (``accelkit
convert``, ``accelkit inspect``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from accelkit.checkpoint.read.pretrained import fetched_pretrained
from accelkit.checkpoint.store import s3_client as objectstore
from accelkit.checkpoint.store.s3 import _cited, fetched, holds_checkpoint, resolve, upload_tree
from accelkit.checkpoint.store.scratch import OUT_PREFIX, staging
from accelkit.errors import CheckpointError


@contextmanager
def local_paths(
    src: str | os.PathLike | None,
    dst: str | os.PathLike | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[tuple[Any, Any, Any]]:
    """For tools that work on local files (``accelkit convert`` / ``inspect``): an ``s3://``
    ``src`` downloaded (a checkpoint, after ``latest``; a single object; pretrained
    safetensors), and a local stand-in for an ``s3://`` ``dst``. Yields ``(src, dst,
    publish)``: ``publish(written)`` uploads what the tool wrote to ``dst`` (a checkpoint's
    manifest last) and returns where it now is. Local paths pass through unchanged."""

    pairs: list[tuple[Path, Any]] = []
    with ExitStack() as stack:
        local_src: Any = src
        source = None if src is None else objectstore.location(src)
        if source is not None:
            if holds_checkpoint(source, storage_options):
                target = resolve(source, storage_options)
                local_src = stack.enter_context(fetched(target, storage_options))
            else:
                target = source
                local_src = stack.enter_context(fetched_pretrained(source, storage_options))
            pairs.append((Path(local_src), target))
        local_dst: Any = dst
        destination = objectstore.location(dst) if dst is not None else None
        if destination is not None:
            folder = stack.enter_context(staging(OUT_PREFIX))
            local_dst = folder / (destination.name or "out")
            pairs.append((local_dst, destination))

        def publish(written: Any) -> Any:
            if destination is None:
                return written
            upload_tree(Path(written), destination, storage_options)
            return str(destination)

        try:
            yield local_src, local_dst, publish
        except CheckpointError as err:
            raise _cited(err, pairs) from err
