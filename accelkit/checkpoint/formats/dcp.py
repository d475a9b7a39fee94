"""torch.distributed.checkpoint, both ways: export (``accelkit convert --to dcp``) and import.

DCP's ``.metadata`` is a pickle, so an import reads it with the restricted unpickler
(:mod:`accelkit.checkpoint.formats.unpickle`) and only with ``trust_pickle``.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import IO, Any

import torch

from accelkit.checkpoint.format.safetensors_io import LazyTensor
from accelkit.checkpoint.formats.importing import (
    Imported,
    is_optimizer_state,
    model_tensors,
    optimizer_import,
    try_encode,
    write_portable,
)
from accelkit.checkpoint.formats.portable import entry_dtype, module_object
from accelkit.checkpoint.formats.unpickle import (
    CONVERT_REFUSED_HINT,
    PICKLE_HINT,
    PickleRefused,
    RestrictedUnpickler,
    conversion_allowlist,
    restricted_torch_load,
    safe_global_name,
)
from accelkit.checkpoint.progress import progress_bar
from accelkit.checkpoint.read.reader import CheckpointReader
from accelkit.checkpoint.store import posix as storage
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")


#: the top-level keys of a DCP export: what ``dcp.load({"model": ..., "optim": ...})`` names
DCP_MODEL_KEY, DCP_OPTIM_KEY = "model", "optim"


def export_dcp(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    obj: str | None = None,
    optimizer: str | bool | None = None,
    progress: bool | None = None,
) -> Path:
    """Write module ``obj`` of checkpoint ``src`` as a torch.distributed.checkpoint directory
    ``dst`` holding ``{"model": weights}``, plus ``"optim"`` with ``optimizer`` (True: the one
    optimizer of that module; or its object name): the state ``get_optimizer_state_dict`` gives
    for a plain model, keyed by parameter name, so ``dcp.load`` + ``set_state_dict`` restore it.

    Streamed: DCP writes one file per tensor, and each tensor is read from ``src`` (checksum
    verified) only when DCP writes it, so peak memory is one tensor. Written into a temporary
    directory beside ``dst`` and renamed at the end: a failure leaves no ``dst``."""
    import shutil

    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst} exists and is not empty; export into a new directory")
    with CheckpointReader(src) as reader:
        obj = module_object(reader, obj)
        sources: dict[int, Any] = {}  # id(placeholder) -> the entry it stands for

        def placeholder(entry: Any) -> torch.Tensor:
            shell = torch.empty(entry.shape, dtype=entry_dtype(entry), device="meta")
            sources[id(shell)] = entry
            return shell

        weights = {}
        for entry in reader.entries(obj):
            if entry.kind in ("param", "buffer"):
                for name in (entry.fqn, *entry.aliases):
                    weights[name] = placeholder(entry)
        state: dict[str, Any] = {DCP_MODEL_KEY: weights}
        if optimizer:
            name = _optimizer_object(reader, obj, None if optimizer is True else str(optimizer))
            state[DCP_OPTIM_KEY] = _fqn_optimizer_state(reader, name, set(weights), placeholder)
        total = sum(e.numel * entry_dtype(e).itemsize for e in map(sources.get, sources))
        bar = progress_bar(total, progress, f"export {dst.name}")
        tmp = dst.parent / f".{dst.name}.accelkit-export"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _dcp_save(state, tmp, _streaming_planner(reader, sources, bar))
            if dst.exists():
                dst.rmdir()
            os.rename(tmp, dst)
            storage.fsync_dir(dst.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if bar is not None:
                bar.close()
    log.info("wrote %s: a torch.distributed.checkpoint of %s", dst, ", ".join(state))
    return dst


def _optimizer_object(reader: CheckpointReader, module: str, name: str | None) -> str:
    """The optimizer of ``module`` to export: ``name``, or the checkpoint's only one."""
    objects = reader.manifest.objects
    found = [
        n
        for n, info in objects.items()
        if info.get("type") == "optimizer" and info.get("model") in (module, None)
    ]
    if name is None:
        if len(found) != 1:
            raise CheckpointError(
                f"{reader.directory}: module {module!r} has optimizers {found}; name the one "
                "to export with --with-optimizer NAME"
                if found
                else f"{reader.directory}: no optimizer of module {module!r} to export"
            )
        return found[0]
    if name not in found:
        raise CheckpointError(
            f"{reader.directory}: no optimizer {name!r} of module {module!r} (optimizers: {found})"
        )
    return name


def _fqn_optimizer_state(
    reader: CheckpointReader, name: str, params: set[str], placeholder: Any
) -> dict[str, Any]:
    """Optimizer ``name`` as ``get_optimizer_state_dict`` gives it for a plain model: per-
    parameter state and each group's ``params`` by parameter name, settings as stored."""
    from accelkit.checkpoint.format.codec import decode

    info = reader.object_info(name, "optimizer")
    tensors = reader.optimizer_entries(name)
    scalars = info.get("scalar_state", {}) or {}
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in info.get("param_groups", []):
        names = list(group.get("params", []))
        foreign = [p for p in names if p not in params]
        if foreign:
            raise CheckpointError(
                f"{reader.directory}: optimizer {name!r} holds parameters that are not the "
                f"exported module's ({', '.join(foreign[:3])}); DCP's layout names each by the "
                "module's parameter names"
            )
        for pname in names:
            per_param = {key: placeholder(e) for key, e in tensors.get(pname, {}).items()}
            per_param.update({k: decode(v) for k, v in scalars.get(pname, {}).items()})
            if per_param:
                state[pname] = per_param
        settings = {k: decode(v) for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": names})
    return {"state": state, "param_groups": groups}


def _streaming_planner(reader: CheckpointReader, sources: dict[int, Any], bar: Any) -> Any:
    """DCP's default save planner, reading each placeholder's tensor only when DCP writes it."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class StreamingPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            value = super().lookup_object(index)
            entry = sources.get(id(value))
            if entry is None:
                return value
            tensor = reader.read(entry)  # checksums verified before it returns
            if bar is not None:
                bar.update(tensor.numel() * tensor.element_size())
            return tensor

    return StreamingPlanner()


def _dcp_save(state: dict[str, Any], directory: Path, planner: Any) -> None:
    """One process's ``dcp.save``: one file per tensor (DCP keeps a file's tensors in memory
    until the file is written, so one file per tensor bounds memory to one tensor)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=False, overwrite=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        try:
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as err:  # DCP wraps what failed (a BaseException)
            causes = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
            for cause in causes:
                if isinstance(cause, CheckpointError):
                    raise cause from None
            raise CheckpointError(f"{directory}: DCP could not write it: {causes}") from None


def _dcp_metadata_allowlist() -> dict[str, Any]:
    """What torch.distributed.checkpoint's ``.metadata`` names: its metadata dataclasses, paths,
    ``torch.Size``, dtypes and layouts."""
    import collections
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    objects = [
        getattr(metadata, name, None)
        for name in (
            "Metadata",
            "MetadataIndex",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "TensorStorageMetadata",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    objects += [getattr(filesystem, "_StorageInfo", None), torch.Size, collections.OrderedDict]
    objects += [pathlib.PurePosixPath, pathlib.PosixPath, torch.serialization._get_layout]
    allowed = {safe_global_name(obj): obj for obj in objects if obj is not None}
    allowed.update({str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)})
    return allowed


def _restricted_dcp_reader(path: str | os.PathLike) -> Any:
    """A ``FileSystemReader`` whose ``.metadata`` and non-tensor values go through the
    restricted unpicklers (torch reads its tensors with ``weights_only=True``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RestrictedReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(where, "rb") as file:
                try:
                    metadata = RestrictedUnpickler(file, _dcp_metadata_allowlist()).load()
                except PickleRefused as err:
                    raise PickleRefused(
                        f"{where}: {err}. {CONVERT_REFUSED_HINT}", err.refused
                    ) from None
                except (pickle.UnpicklingError, EOFError, ValueError) as err:
                    raise CheckpointError(f"{where}: cannot unpickle it: {err}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return RestrictedReader(str(path))


def _restricted_dcp_planner(path: str | os.PathLike) -> Any:
    """A load planner that reads DCP's non-tensor values (``torch.save`` bytes) restricted,
    into the dict handed to ``dcp.load`` (DCP's flat keys: nothing to flatten)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class RestrictedPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: IO[bytes]) -> None:
            fqn = read_item.dest_index.fqn
            self.state_dict[fqn] = restricted_torch_load(
                value, conversion_allowlist(), hint=CONVERT_REFUSED_HINT, name=f"{path}: {fqn}"
            )

    return RestrictedPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


class DCPImporter:
    """A torch.distributed.checkpoint directory (any world size that wrote it). Its
    ``.metadata`` is a pickle: needs ``trust_pickle``. Nested state (``{"model": ...,
    "optimizer": ...}`` as ``get_state_dict`` gives) becomes those objects; a flat one, "model"."""

    def detect(self, path: str | os.PathLike) -> bool:
        return Path(path).is_dir() and (Path(path) / ".metadata").is_file()

    def convert(
        self,
        path: str | os.PathLike,
        dst: str | os.PathLike,
        *,
        trust_pickle: bool = False,
        strip_prefix: str | None = None,
        progress: bool | None = None,
    ) -> Path:
        if not trust_pickle:
            raise CheckpointError(
                f"{path}: the torch.distributed.checkpoint .metadata {PICKLE_HINT}"
            )
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = _restricted_dcp_reader(path).read_metadata()
        paths = dict(getattr(metadata, "planner_data", None) or {})
        tensors_meta = {
            k: v
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        others = [k for k in metadata.state_dict_metadata if k not in tensors_meta]

        def load(keys: dict[str, Any]) -> dict[str, Any]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    dcp.load(
                        keys,
                        storage_reader=_restricted_dcp_reader(path),
                        planner=_restricted_dcp_planner(path),
                        no_dist=True,
                    )
                except CheckpointException as err:  # DCP wraps what its reader raised
                    for failure in err.failures.values():
                        cause = failure[0] if isinstance(failure, tuple) else failure
                        if isinstance(cause, PickleRefused):
                            raise cause from None
                    raise
            return keys

        def fetch(key: str):
            meta = tensors_meta[key]
            return lambda: load({key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)})[
                key
            ]

        values = load(dict.fromkeys(others)) if others else {}
        nested: dict[str, Any] = {}
        for key in metadata.state_dict_metadata:
            route = paths.get(key, (key,))
            value = (
                LazyTensor(
                    tuple(tensors_meta[key].size), tensors_meta[key].properties.dtype, fetch(key)
                )
                if key in tensors_meta
                else values.get(key)
            )
            _insert(nested, list(route), value)
        if not any(_is_module_state_like(v) or is_optimizer_state(v) for v in nested.values()):
            nested = {"model": nested}
        imported = _from_mapping_lazy(nested, strip_prefix)
        return write_portable(imported, dst, progress=progress)


def _insert(tree: dict[Any, Any], route: list[Any], value: Any) -> None:
    node = tree
    for part in route[:-1]:
        node = node.setdefault(part, {})
    node[route[-1]] = value


def _is_module_state_like(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) for k in value)
        and all(isinstance(v, (torch.Tensor, LazyTensor)) for v in value.values())
    )


def _from_mapping_lazy(nested: dict[str, Any], strip_prefix: str | None) -> Imported:
    """Like :func:`from_mapping` for DCP's tree (lazy tensors; param groups as lists)."""
    tensors: dict[tuple[str, str, str], Any] = {}
    objects: dict[str, dict[str, Any]] = {}
    extras: dict[str, Any] = {}
    modules = [k for k, v in nested.items() if _is_module_state_like(v)]
    for key, value in nested.items():
        if key in modules:
            tensors.update(model_tensors(value, key, strip_prefix=strip_prefix))
            objects[key] = {"type": "module", "class": "(imported)"}
        elif is_optimizer_state(value):
            groups = value["param_groups"]
            if isinstance(groups, dict):  # flattened by DCP: {"0": {...}} or {0: {...}}
                groups = [groups[k] for k in sorted(groups, key=int)]
            osd = {"state": value["state"], "param_groups": groups}
            objects[key] = optimizer_import(
                key, osd, None, tensors, modules[0] if modules else "model"
            )
        elif try_encode(value, key):
            extras[key] = value
    return Imported(tensors, objects, extras, "import:dcp")
