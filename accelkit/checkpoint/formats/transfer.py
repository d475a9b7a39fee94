"""Local stand-ins for locations of object storage, for the tools that work on files
(``accelkit convert``, ``accelkit inspect``): a source downloaded whole, a destination written
locally and uploaded after. Errors name the store's locations, never the temporary files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from accelkit.checkpoint.format.manifest import MANIFEST_NAME
from accelkit.checkpoint.read.pretrained import cited, fetched_pretrained
from accelkit.checkpoint.store import store_for
from accelkit.checkpoint.store.scratch import LOAD_PREFIX, OUT_PREFIX, staging
from accelkit.errors import CheckpointError


@contextmanager
def fetched(store: Any, target: str) -> Iterator[Path]:
    """The committed checkpoint ``target`` (resolved already) downloaded into a local temporary
    directory: its manifest and every file the manifest lists."""
    with staging(LOAD_PREFIX) as folder:
        local = folder / (target.rstrip("/").rsplit("/", 1)[-1] or "checkpoint")
        local.mkdir()
        raw = store.read_manifest(target)
        try:
            listed = [str(name) for name in json.loads(raw).get("files", {})]
        except (ValueError, AttributeError) as err:
            raise CheckpointError(
                f"{store.child(target, MANIFEST_NAME)}: not a valid manifest ({err})"
            ) from err
        store.download(target, local, listed)
        (local / MANIFEST_NAME).write_bytes(raw)
        yield local


@contextmanager
def local_paths(
    src: Any, dst: Any = None, storage_options: dict[str, Any] | None = None
) -> Iterator[tuple[Any, Any, Any]]:
    """For tools that work on local files: a ``src`` of object storage downloaded (a
    checkpoint, after ``latest``; a single object; pretrained safetensors), and a local
    stand-in for such a ``dst``. Yields ``(src, dst, publish)``: ``publish(written)`` uploads
    what the tool wrote to ``dst`` (a checkpoint's manifest last) and returns where it now is.
    Local paths pass through unchanged."""
    pairs: list[tuple[Path, Any]] = []
    with ExitStack() as stack:
        local_src: Any = src
        source = None if src is None else store_for(src, storage_options)
        if source is not None and source.local_directory(str(src)) is None:
            if source.is_checkpoint(str(src)):
                target = source.resolve(str(src))
                local_src = stack.enter_context(fetched(source, target))
            else:
                target = source.display(str(src))
                local_src = stack.enter_context(fetched_pretrained(source, str(src)))
            pairs.append((Path(local_src), target))
        local_dst: Any = dst
        destination = None if dst is None else store_for(dst, storage_options)
        remote_dst = destination is not None and destination.local_directory(str(dst)) is None
        if remote_dst:
            folder = stack.enter_context(staging(OUT_PREFIX))
            local_dst = folder / (str(dst).rstrip("/").rsplit("/", 1)[-1] or "out")
            pairs.append((local_dst, destination.display(str(dst))))

        def publish(written: Any) -> Any:
            if not remote_dst:
                return written
            destination.upload(Path(written), str(dst))
            return destination.display(str(dst))

        try:
            yield local_src, local_dst, publish
        except CheckpointError as err:
            raise cited(err, pairs) from err
