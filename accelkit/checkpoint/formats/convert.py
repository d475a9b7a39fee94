"""Conversions: a portable checkpoint out to another format, and foreign formats into one.

:func:`convert` picks the converter. Export: to one file (:mod:`.formats.portable`), Hugging
Face (:mod:`.formats.hf`), torch.distributed.checkpoint (:mod:`.formats.dcp`), or a target a plugin
or integration registers through the ``accelkit_checkpoint_exporters`` hook (``mmengine``, from
:mod:`accelkit.integrations.plugin`). Import: the first registered importer
(``accelkit_checkpoint_importers``: the native ones of :mod:`.formats`, then plugins') whose
``detect(path)`` accepts the path; each is an object with ``detect(path)`` and
``convert(path, dst, *, trust_pickle, **options)``. The result is a world-size-1 portable
checkpoint that any backend loads at any world size.

The names of the conversion kit keep their old home here: they are defined in
:mod:`accelkit.checkpoint.formats.importing` (writing what an importer found), :mod:`.unpickle` (restricted
unpickling), :mod:`.progress` and :mod:`.formats`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from accelkit.checkpoint.formats.dcp import DCPImporter, export_dcp
from accelkit.checkpoint.formats.hf import export_hf
from accelkit.checkpoint.formats.importing import (
    Imported,
    optimizer_import,
    positional_names,
    write_portable,
)
from accelkit.checkpoint.formats.portable import export_file
from accelkit.checkpoint.formats.state_dict import SafetensorsImporter, TorchFileImporter
from accelkit.checkpoint.formats.unpickle import (
    CONVERT_REFUSED_HINT,
    PICKLE_HINT,
    TENSOR_CONTAINERS,
    TENSOR_REBUILDERS,
    PickleAllowlist,
    PickleRefused,
    RestrictedUnpickler,
    conversion_allowlist,
    numpy_allowlist,
    restricted_torch_load,
    tensor_allowlist,
)
from accelkit.checkpoint.progress import PROGRESS_BYTES
from accelkit.checkpoint.store import posix as storage
from accelkit.errors import CheckpointError
from accelkit.hookspecs import hookimpl

log = logging.getLogger("accelkit")

__all__ = [
    "CONVERT_REFUSED_HINT",
    "PICKLE_HINT",
    "PROGRESS_BYTES",
    "TENSOR_CONTAINERS",
    "TENSOR_REBUILDERS",
    "DCPImporter",
    "Imported",
    "PickleAllowlist",
    "PickleRefused",
    "RestrictedUnpickler",
    "SafetensorsImporter",
    "TorchFileImporter",
    "conversion_allowlist",
    "convert",
    "export_dcp",
    "export_file",
    "export_hf",
    "export_targets",
    "exporters",
    "importers",
    "native_importers",
    "numpy_allowlist",
    "optimizer_import",
    "positional_names",
    "restricted_torch_load",
    "tensor_allowlist",
    "write_portable",
]

#: ``convert(..., to=NAME)`` targets built in here; others come from ``exporters()``
BUILTIN_EXPORT_TARGETS = ("hf", "dcp")


def native_importers() -> dict[str, Any]:
    return {
        "safetensors": SafetensorsImporter(),
        "torch": TorchFileImporter(),
        "dcp": DCPImporter(),
    }


def _plugin_host() -> Any:
    from accelkit import registry

    host = registry.host()
    host.ensure_loaded()
    return host


def importers() -> dict[str, Any]:
    """Every registered importer (native ones and plugins'), by format name."""
    found: dict[str, Any] = {}
    for result in reversed(_plugin_host().pm.hook.accelkit_checkpoint_importers()):
        for name, importer in (result or {}).items():
            found.setdefault(name, importer)  # the first registered (native) wins a name
    return found


def exporters() -> dict[str, Any]:
    """Every registered export target (``accelkit_checkpoint_exporters``), by name: a
    callable ``(src, dst) -> Path`` that writes a portable checkpoint in another format."""
    found: dict[str, Any] = {}
    for result in reversed(_plugin_host().pm.hook.accelkit_checkpoint_exporters()):
        for name, exporter in (result or {}).items():
            if name not in BUILTIN_EXPORT_TARGETS:
                found.setdefault(name, exporter)
    return found


def export_targets() -> tuple[str, ...]:
    """What ``convert(..., to=...)`` accepts: the registered targets, then the built-in ones."""
    return (*sorted(exporters()), *BUILTIN_EXPORT_TARGETS)


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
    config: str | os.PathLike | bool | None = None,
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
    """A registered export target: it writes its own format, so no option of convert applies."""
    found = exporters()
    if to not in found:
        raise CheckpointError(f"unknown export target {to!r}; choose from {export_targets()}")
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
    return Path(found[to](src, dst))


@hookimpl
def accelkit_checkpoint_importers() -> dict[str, Any]:
    """The native importers, registered like a plugin's (accelkit.backends re-exports this)."""
    return native_importers()
