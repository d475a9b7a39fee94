"""Where a checkpoint's bytes live and how a save is committed there: a directory
(:mod:`.posix`: temporary sibling, fsync, rename) or object storage (:mod:`.bucket`: the manifest
written last and conditionally; :mod:`.s3` for ``s3://``). Stands on the format alone.

:func:`store_for` is the one place a path's scheme is read: a local path is a
:class:`~.posix.PosixStore`, ``s3://`` the built-in S3 store, any other scheme a store a plugin
registers (``accelkit_checkpoint_stores``), else a clear error naming what is supported.
"""

from __future__ import annotations

import os
import re
from typing import Any

from accelkit.checkpoint.store.base import Store
from accelkit.errors import CheckpointError

__all__ = ["Store", "is_remote", "register_store", "scheme_of", "store_for", "stores"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: what Path("s3://b/k") becomes: "s3:/b/k"
_FOLDED = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/(?!/)")
#: the stores accelkit ships, by scheme: ``factory(storage_options) -> Store``
BUILTIN = {"s3": "accelkit.checkpoint.store.s3:s3_store"}
HINTS = {"s3": "pip install 'accelkit[s3]'"}
#: stores registered in this process (:func:`register_store`), by scheme
_registered: dict[str, Any] = {}


def scheme_of(path: Any) -> str:
    """The URL scheme of ``path`` (``"s3"``), or ``""`` for a local path. A URL made into a
    ``pathlib.Path`` (which folds its ``//``) is refused: it would be written as a folder."""
    if isinstance(path, os.PathLike):
        if _FOLDED.match(os.fspath(path)):
            raise CheckpointError(
                f"{path}: a URL made into a pathlib.Path, which folds its '//' "
                f"({os.fspath(path)!r}); pass the URL as a string (s3://bucket/prefix)"
            )
        return ""
    if not isinstance(path, str):
        return ""
    match = _SCHEME.match(path)
    return match.group(1).lower() if match else ""


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL (object storage, ``s3://``, ``gs://``, a plugin's scheme)
    rather than a local or shared filesystem path: no local folder holds it, so nothing is
    written beside it and the filesystem is not asked about it. Asks nothing of any store."""
    return bool(scheme_of(path))


def stores() -> dict[str, Any]:
    """Every store factory by scheme: the built-in ones, then those plugins register."""
    found: dict[str, Any] = {**BUILTIN, **_registered}
    from accelkit import registry

    host = registry.host()
    host.ensure_loaded()
    for result in reversed(host.pm.hook.accelkit_checkpoint_stores()):
        for scheme, factory in (result or {}).items():
            found.setdefault(scheme.lower(), factory)  # a built-in scheme stays built in
    return found


def register_store(scheme: str, factory: Any) -> None:
    """Serve ``scheme://`` locations in this process with ``factory(storage_options) -> Store``
    (a plugin registers through the ``accelkit_checkpoint_stores`` hook instead; this is for a
    script or a test). A built-in scheme cannot be taken over."""
    scheme = scheme.lower()
    if scheme in BUILTIN:
        raise CheckpointError(f"{scheme}:// is served by accelkit itself; register another scheme")
    _registered[scheme] = factory


def _factory(scheme: str, path: Any) -> Any:
    if scheme in BUILTIN or scheme in _registered:  # no plugin is loaded for these
        found: Any = BUILTIN.get(scheme) or _registered[scheme]
    else:
        found = stores().get(scheme)
    if found is None:
        known = ", ".join(f"{s}:// ({HINTS.get(s, 'a plugin')})" for s in sorted(stores()))
        raise CheckpointError(
            f"{path}: the scheme {scheme}:// is not supported; no checkpoint store serves it. "
            f"Installed: a local or shared filesystem (a path), {known}. Install the plugin "
            "of that store (a package registering accelkit_checkpoint_stores), mount the "
            "storage as a filesystem, or use its S3-compatible endpoint."
        )
    if isinstance(found, str):
        import importlib

        module, _, name = found.partition(":")
        found = getattr(importlib.import_module(module), name)
    return found


def store_for(path: Any, storage_options: dict[str, Any] | None = None) -> Store:
    """The store of ``path``: a :class:`~.posix.PosixStore` for a local path (which takes no
    ``storage_options``), else the store registered for its URL scheme."""
    scheme = scheme_of(path)
    if not scheme:
        if storage_options is not None:
            raise CheckpointError(
                f"storage_options apply to object storage (s3://bucket/prefix), not to the "
                f"local path {path}"
            )
        from accelkit.checkpoint.store.posix import PosixStore

        return PosixStore()
    return _factory(scheme, path)(storage_options)
