"""Reading a portable checkpoint: ranges of any tensor, checked against their checksums.

Every fragment is read through ``safetensors.safe_open(...).get_slice``, so a rank reads only the
ranges it needs, whatever world size or backend wrote them. A fragment is verified (SHA-256 of
its bytes) the first time any part of it is read, which reads that whole fragment once: peak
extra memory is about one fragment.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch

from accelkit.checkpoint.codec import decode
from accelkit.checkpoint.manifest import (
    EXTRA_NAME,
    EXTRA_OBJECT,
    MANIFEST_NAME,
    RNG_OBJECT,
    Manifest,
    TensorEntry,
)
from accelkit.checkpoint.safetensors_io import DTYPE_TO_ST, DTYPES_BY_NAME, tensor_bytes
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")


class CheckpointReader:
    """Random access to the tensors of one checkpoint (a directory, or one with ``latest``).

    Backends use :meth:`entry` / :meth:`read_flat` in ``load_fragments``; the rest serves the
    default loader and the tools.
    """

    def __init__(
        self, directory: str | os.PathLike, *, strict: bool = True, verify: bool = True
    ) -> None:
        from accelkit.checkpoint.storage import resolve

        self.directory = resolve(directory)
        self.strict = strict
        self.verify = verify
        self.manifest = Manifest.read(self.directory)
        self.manifest_path = self.directory / MANIFEST_NAME
        self._index: dict[tuple[str, str, str], TensorEntry] = {
            (t.object, t.kind, t.fqn): t for t in self.manifest.tensors
        }
        self._by_file: dict[str, list[str]] = {}
        for t in self.manifest.tensors:
            for f in t.fragments:
                self._by_file.setdefault(f.file, []).append(t.label)
        self._handles: dict[str, Any] = {}
        self._verified: set[tuple[str, str]] = set()
        self.check_files()

    # ---- integrity ----------------------------------------------------------------------------
    def check_files(self) -> None:
        """Every file the manifest lists exists with the recorded size (a truncated or missing
        rank file fails here, before any tensor is touched)."""
        for name, info in self.manifest.files.items():
            path = self.directory / name
            tensors = self._by_file.get(name, [])
            names = ", ".join(tensors[:3]) + (
                f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
            )
            if not path.is_file():
                raise CheckpointError(
                    f"{path}: file missing from the checkpoint"
                    + (f"; it holds tensors {names}" if tensors else "")
                )
            size = path.stat().st_size
            if "bytes" in info and size != int(info["bytes"]):
                raise CheckpointError(
                    f"{path}: {size} bytes, the manifest says {info['bytes']} (truncated or "
                    f"replaced)" + (f"; it holds tensors {names}" if tensors else "")
                )

    def _handle(self, file: str) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open

            path = self.directory / file
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as err:
                raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from err
            self._handles[file] = handle
        return handle

    def _slice(self, entry: TensorEntry, file: str, key: str, numel: int) -> Any:
        path = self.directory / file
        try:
            piece = self._handle(file).get_slice(key)
        except Exception as err:
            raise CheckpointError(
                f"{path}: key {key} of tensor {entry.label} is not in the file ({err})"
            ) from err
        dtype_code = piece.get_dtype()
        if dtype_code != DTYPE_TO_ST.get(DTYPES_BY_NAME.get(entry.dtype)):
            raise CheckpointError(
                f"{path}: key {key} of tensor {entry.label} is {dtype_code}, the manifest says "
                f"{entry.dtype}"
            )
        if list(piece.get_shape()) != [numel]:
            raise CheckpointError(
                f"{path}: key {key} of tensor {entry.label} has shape {piece.get_shape()}, the "
                f"manifest says [{numel}]"
            )
        return piece

    def verify_fragment(self, entry: TensorEntry, index: int) -> torch.Tensor:
        """Read one whole fragment and check its SHA-256; return its data."""
        frag = entry.fragments[index]
        data = self._slice(entry, frag.file, frag.key, frag.numel)[0 : frag.numel]
        digest = hashlib.sha256(tensor_bytes(data)).hexdigest()
        if digest != frag.sha256:
            raise CheckpointError(
                f"{self.directory / frag.file}: fragment {frag.key} of tensor {entry.label} "
                f"(flat_offset {frag.flat_offset}, numel {frag.numel}) failed its checksum: "
                f"expected {frag.sha256}, got {digest}"
            )
        self._verified.add((frag.file, frag.key))
        return data

    # ---- lookup -------------------------------------------------------------------------------
    def entry(self, obj: str, kind: str, fqn: str) -> TensorEntry | None:
        return self._index.get((obj, kind, fqn))

    def entries(self, obj: str | None = None) -> list[TensorEntry]:
        return [t for t in self.manifest.tensors if obj is None or t.object == obj]

    def module_entries(self, obj: str) -> dict[str, TensorEntry]:
        """fqn -> entry of the parameters and buffers of module object ``obj``."""
        return {
            t.fqn: t
            for t in self.manifest.tensors
            if t.object == obj and t.kind in ("param", "buffer")
        }

    def optimizer_entries(self, obj: str) -> dict[str, dict[str, TensorEntry]]:
        """parameter name -> state key -> entry, for optimizer object ``obj``."""
        out: dict[str, dict[str, TensorEntry]] = {}
        for t in self.manifest.tensors:
            if t.object == obj and t.kind.startswith("optim:"):
                out.setdefault(t.fqn, {})[t.kind.removeprefix("optim:")] = t
        return out

    def object_info(self, obj: str, expected_type: str | None = None) -> dict[str, Any]:
        info = self.manifest.objects.get(obj)
        if info is None:
            raise CheckpointError(f"{self.manifest_path}: no object {obj!r} in this checkpoint")
        if expected_type is not None and info.get("type") != expected_type:
            raise CheckpointError(
                f"{self.manifest_path}: object {obj!r} is a {info.get('type')}, not a {expected_type}"
            )
        return info

    def check_keys(
        self, what: str, missing: list[str], unexpected: list[str], extra: str | None = None
    ) -> None:
        """Fail (strict) or warn about keys that do not match, listing them all."""
        if not missing and not unexpected and not extra:
            return
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the target: {', '.join(unexpected)}")
        if extra:
            parts.append(extra)
        message = f"{what} does not match {self.directory}: " + "; ".join(parts)
        if self.strict:
            raise CheckpointError(message + " (pass strict=False to load what matches)")
        log.warning(message)

    # ---- reading ------------------------------------------------------------------------------
    def read_flat(
        self,
        entry: TensorEntry,
        start: int = 0,
        numel: int | None = None,
        *,
        out: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor, as a 1-D tensor.

        Written into ``out`` (1-D, any device and dtype: cast on copy) when given.
        """
        numel = entry.numel - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > entry.numel:
            raise CheckpointError(
                f"tensor {entry.label}: range [{start}, {start + numel}) is outside its "
                f"{entry.numel} elements"
            )
        stored = DTYPES_BY_NAME.get(entry.dtype)
        if stored is None:
            raise CheckpointError(f"tensor {entry.label}: unknown dtype {entry.dtype!r}")
        if out is None:
            out = torch.empty(numel, dtype=dtype or stored)
        elif out.numel() != numel or out.dim() != 1:
            raise ValueError(f"out must be 1-D with {numel} elements")
        end = start + numel
        for i, frag in enumerate(entry.fragments):
            lo, hi = max(start, frag.flat_offset), min(end, frag.flat_offset + frag.numel)
            if lo >= hi:
                continue
            a, b = lo - frag.flat_offset, hi - frag.flat_offset
            if self.verify and (frag.file, frag.key) not in self._verified:
                piece = self.verify_fragment(entry, i)[a:b]
            else:
                piece = self._slice(entry, frag.file, frag.key, frag.numel)[a:b]
            out[lo - start : hi - start].copy_(piece)
        return out

    def read(self, entry: TensorEntry, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor in its global shape."""
        return self.read_flat(entry, dtype=dtype).view(entry.shape)

    def read_named(self, obj: str, kind: str, fqn: str) -> torch.Tensor:
        entry = self.entry(obj, kind, fqn)
        if entry is None:
            raise CheckpointError(f"{self.manifest_path}: no tensor {obj}:{kind}:{fqn}")
        return self.read(entry)

    def tensor_source(self, obj: str, kind: str):
        """A decoder callback for tensors referenced from JSON state (extras, statefuls)."""
        return lambda path: self.read_named(obj, kind, path)

    def extras(self) -> dict[str, Any]:
        """The user's extras from ``extra.json`` (tensors read from the rank files)."""
        path = self.directory / EXTRA_NAME
        info = self.manifest.files.get(EXTRA_NAME)
        if info is None:
            return {}
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise CheckpointError(f"{path}: {err}") from err
        digest = hashlib.sha256(raw).hexdigest()
        if digest != info.get("sha256"):
            raise CheckpointError(
                f"{path}: checksum mismatch (expected {info.get('sha256')}, got {digest})"
            )
        import json

        data = json.loads(raw)
        return {
            k: decode(v, self.tensor_source(EXTRA_OBJECT, "extra"))
            for k, v in data["extras"].items()
        }

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The RNG state rank ``rank`` saved, or None."""
        record = self.manifest.data.get("rng", {}).get(str(rank))
        if record is None:
            return None
        tensors = {}
        for name in record.get("tensors", []):
            tensors[name] = self.read_named(f"{RNG_OBJECT}.{rank}", "rng", name)
        return tensors, record.get("scalars", {})

    def verify_all(self, progress: Any = None) -> list[str]:
        """Check every fragment's checksum; return the problems found (empty when intact)."""
        problems = []
        for entry in self.manifest.tensors:
            for i, frag in enumerate(entry.fragments):
                try:
                    self.verify_fragment(entry, i)
                except CheckpointError as err:
                    problems.append(str(err))
                if progress is not None:
                    progress.update(
                        frag.numel
                        * torch.empty(
                            (), dtype=DTYPES_BY_NAME.get(entry.dtype, torch.uint8)
                        ).element_size()
                    )
        if EXTRA_NAME in self.manifest.files:
            try:
                self.extras()
            except CheckpointError as err:
                problems.append(str(err))
        return problems
