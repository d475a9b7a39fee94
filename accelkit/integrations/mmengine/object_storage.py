"""Object storage for MMEngine's file layer: the ``accelkit_s3`` backend, over accelkit's stores.

MMEngine maps the ``s3://`` prefix to its Petrel backend, which needs the ``petrel_client``
package of one cluster; without it, ``CheckpointHook(out_dir="s3://...")`` fails before the first
save. :func:`register` (run when ``accelkit.integrations.mmengine`` is imported) registers
:class:`AccelkitS3Backend` as ``backend='accelkit_s3'`` with both of MMEngine's registries, and
for the ``s3`` prefix too where ``petrel_client`` is not installed; :func:`serve` adds the
scheme of a store plugin's ``out_dir`` (``gs://`` with accelkit-gcs), which MMEngine has no
backend for, when AccelkitCheckpointHook starts training. It serves what the checkpoint
hook asks of a file backend (join, exists, remove a checkpoint, read and write small files); the
checkpoints themselves go through accelkit's commit protocol (:mod:`accelkit.checkpoint.store.bucket`).

``backend_args`` (the hook's and the runner's) become the store's ``storage_options``: the
endpoint and credentials, else the store's own variables (AWS_* and profiles for S3)::

    default_hooks = dict(checkpoint=dict(
        type="CheckpointHook", interval=1, out_dir="s3://bucket/runs",
        backend_args=dict(backend="accelkit_s3", endpoint_url="http://minio:9000")))
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmengine.fileio import FileClient, register_backend
from mmengine.fileio.backends import BaseStorageBackend

from accelkit.checkpoint.format.manifest import MANIFEST_NAME
from accelkit.checkpoint.store import is_remote, scheme_of, store_for, stores
from accelkit.checkpoint.store.bucket import ObjectLocation
from accelkit.errors import ConfigError

BACKEND_NAME = "accelkit_s3"


#: MMEngine file backends accelkit's checkpoints go through: the local disk, and its own S3
WRITTEN_THROUGH = ("local", "disk", BACKEND_NAME)


def check_backend_args(backend_args: Any, where: str = "backend_args") -> None:
    """Refuse a ``backend_args`` naming a file backend accelkit does not write checkpoints
    through (Petrel, HTTP, LMDB, memcached, a project's own): MMEngine writes through it (or
    raises when its client is missing); accelkit would write elsewhere without saying so."""
    if not backend_args:
        return
    if not hasattr(backend_args, "get"):
        raise ConfigError(f"{where} must be a dict, got {type(backend_args).__name__}")
    backend = backend_args.get("backend")
    if backend is None or backend in WRITTEN_THROUGH:
        return
    raise ConfigError(
        f"{where}=dict(backend={backend!r}, ...) names MMEngine's {backend!r} file backend, "
        "which accelkit's checkpoints are not written through: a local out_dir would be "
        "written to the local disk instead, not where that backend writes. For the local disk "
        "leave out backend_args (or backend='local'); for S3-compatible object storage set "
        "out_dir='s3://bucket/prefix' and backend_args=dict(backend='accelkit_s3', "
        "endpoint_url=..., ...) (accelkit's commit protocol); otherwise train with MMEngine's "
        "own CheckpointHook and Runner, which write through that backend"
    )


def storage_options(backend_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """``backend_args`` less MMEngine's ``backend`` key: the object store's options. A backend
    accelkit does not write through is refused (:func:`check_backend_args`)."""
    check_backend_args(backend_args)
    if not backend_args:
        return None
    options = {k: v for k, v in backend_args.items() if k != "backend"}
    return options or None


class AccelkitS3Backend(BaseStorageBackend):
    """MMEngine's file-backend interface on accelkit's store of a URL (``s3://bucket/key``, or
    a plugin's scheme such as ``gs://``)."""

    def __init__(self, **options: Any) -> None:
        self.options = options or None

    def _where(self, filepath: Any) -> ObjectLocation:
        if not is_remote(str(filepath)):
            raise ValueError(
                f"{filepath}: the {BACKEND_NAME} backend serves object storage URLs only"
            )
        return store_for(str(filepath), self.options).where(str(filepath))

    def _store(self, where: ObjectLocation) -> Any:
        return store_for(str(where), self.options).bucket(where)

    def get(self, filepath: Any) -> bytes:
        where = self._where(filepath)
        return self._store(where).get(where.key)[0]

    def get_text(self, filepath: Any, encoding: str = "utf-8") -> str:
        return self.get(filepath).decode(encoding)

    def put(self, obj: bytes, filepath: Any) -> None:
        where = self._where(filepath)
        self._store(where).put(where.key, obj)

    def put_text(self, obj: str, filepath: Any, encoding: str = "utf-8") -> None:
        self.put(obj.encode(encoding), filepath)

    def isfile(self, filepath: Any) -> bool:
        where = self._where(filepath)
        return bool(where.key) and self._store(where).head(where.key) is not None

    def isdir(self, filepath: Any) -> bool:
        where = self._where(filepath)
        prefix = f"{where.key}/" if where.key else ""
        return next(iter(self._store(where).list(prefix)), None) is not None

    def exists(self, filepath: Any) -> bool:
        return self.isfile(filepath) or self.isdir(filepath)

    def join_path(self, filepath: Any, *filepaths: Any) -> str:
        parts = [str(filepath).rstrip("/"), *(str(p).strip("/") for p in filepaths)]
        return "/".join(p for p in parts if p)

    def remove(self, filepath: Any) -> None:
        where = self._where(filepath)
        self._store(where).delete([where.key])

    def rmtree(self, dir_path: Any) -> None:
        """Delete everything under ``dir_path``; a checkpoint's manifest goes first, so it is
        never seen half deleted."""
        where = self._where(dir_path)
        store = self._store(where)
        store.delete([where.child(MANIFEST_NAME).key])
        store.delete([o.key for o in store.list(where.key + "/")])

    @contextmanager
    def get_local_path(self, filepath: Any) -> Iterator[str]:
        """The object downloaded into a temporary file, for tools that need a path."""
        with tempfile.TemporaryDirectory(prefix="accelkit-s3-") as tmp:
            local = Path(tmp) / self._where(filepath).name
            local.write_bytes(self.get(filepath))
            yield str(local)

    def list_dir_or_file(
        self,
        dir_path: Any,
        list_dir: bool = True,
        list_file: bool = True,
        suffix: Any = None,
        recursive: bool = False,
    ) -> Iterator[str]:
        where = self._where(dir_path)
        prefix = f"{where.key}/" if where.key else ""
        seen: set[str] = set()
        for found in self._store(where).list(prefix):
            relative = found.key[len(prefix) :]
            parts = relative.split("/")
            if len(parts) > 1 and list_dir and parts[0] not in seen and not recursive:
                seen.add(parts[0])
                yield parts[0]
            wanted = suffix is None or relative.endswith(suffix)
            if (len(parts) == 1 or recursive) and list_file and wanted:
                yield relative


def register(prefix: str | None = "s3") -> None:
    """Register the backend by name, and for ``prefix`` (``s3`` where Petrel is absent)."""
    if prefix == "s3" and importlib.util.find_spec("petrel_client"):
        prefix = None
    register_backend(BACKEND_NAME, AccelkitS3Backend, force=True, prefixes=prefix)
    FileClient.register_backend(BACKEND_NAME, AccelkitS3Backend, force=True, prefixes=prefix)
    if prefix:  # FileClient's force=True drops the old prefix's instances but keeps its class
        FileClient._prefix_to_backends[prefix] = AccelkitS3Backend


def serve(out_dir: Any) -> None:
    """Serve ``out_dir``'s URL scheme in MMEngine's file layer through this backend, where an
    accelkit store serves it and MMEngine has no backend of its own for it."""
    from mmengine.fileio.backends import prefix_to_backends

    scheme = scheme_of(str(out_dir))
    if scheme and scheme not in prefix_to_backends and scheme in stores():
        register(scheme)


def holds_checkpoint(path: str) -> bool:
    """Whether the URL ``path`` is an accelkit checkpoint (or holds a ``latest``); False for a
    scheme no accelkit store serves (MMEngine's own backends read it)."""
    return scheme_of(path) in stores() and store_for(path).is_checkpoint(path)
