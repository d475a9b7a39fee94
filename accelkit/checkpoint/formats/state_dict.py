"""Plain state-dict files into a portable checkpoint: ``.safetensors``, and ``torch.save`` files
(``.pt``/``.pth``/``.bin``/``.ckpt``; pickled: ``trust_pickle``), Lightning's and Fabric's
among them (:mod:`accelkit.checkpoint.formats.lightning`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from accelkit.checkpoint.format.safetensors_io import LazyTensor
from accelkit.checkpoint.formats.importing import (
    Imported,
    from_mapping,
    is_module_state,
    model_tensors,
    write_portable,
)
from accelkit.checkpoint.formats.lightning import from_lightning, is_lightning
from accelkit.checkpoint.formats.unpickle import torch_load
from accelkit.errors import CheckpointError


class SafetensorsImporter:
    """A plain state-dict ``.safetensors`` file (weights only; no pickle)."""

    def detect(self, path: str | os.PathLike) -> bool:
        return Path(path).is_file() and Path(path).suffix == ".safetensors"

    def convert(
        self,
        path: str | os.PathLike,
        dst: str | os.PathLike,
        *,
        trust_pickle: bool = False,
        strip_prefix: str | None = None,
        progress: bool | None = None,
    ) -> Path:
        from safetensors import safe_open

        handle = safe_open(str(path), framework="pt", device="cpu")
        state: dict[str, Any] = {}
        for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
            piece = handle.get_slice(key)
            dtype = _st_dtype(piece.get_dtype())
            state[key] = LazyTensor(tuple(piece.get_shape()), dtype, _safe_fetch(handle, key))
        imported = Imported(
            model_tensors(state, "model", strip_prefix=strip_prefix),
            {"model": {"type": "module", "class": "(imported)"}},
            {},
            "import:safetensors",
        )
        return write_portable(imported, dst, progress=progress)


def _st_dtype(code: str) -> torch.dtype:
    from accelkit.checkpoint.format.safetensors_io import ST_TO_DTYPE

    return ST_TO_DTYPE[code]


def _safe_fetch(handle: Any, key: str):
    return lambda: handle.get_tensor(key)


class TorchFileImporter:
    """A ``torch.save`` file: a plain state dict, a dict of state dicts (Fabric's ``save``),
    or a dict with ``state_dict``/``model``/``module`` inside. Pickled: needs ``trust_pickle``."""

    suffixes = (".pt", ".pth", ".bin", ".ckpt")

    def detect(self, path: str | os.PathLike) -> bool:
        return Path(path).is_file() and Path(path).suffix in self.suffixes

    def convert(
        self,
        path: str | os.PathLike,
        dst: str | os.PathLike,
        *,
        trust_pickle: bool = False,
        strip_prefix: str | None = None,
        progress: bool | None = None,
    ) -> Path:
        checkpoint = torch_load(path, trust_pickle)
        if not isinstance(checkpoint, dict):
            raise CheckpointError(f"{path}: holds a {type(checkpoint).__name__}, not a dict")
        if is_lightning(checkpoint):
            imported = from_lightning(checkpoint, strip_prefix)
        else:
            for key in ("state_dict", "model_state_dict", "module"):
                if is_module_state(checkpoint.get(key)) and not any(
                    is_module_state(v) for k, v in checkpoint.items() if k != key
                ):
                    checkpoint = {"model" if k == key else k: v for k, v in checkpoint.items()}
            imported = from_mapping(checkpoint, "import:torch", strip_prefix)
        return write_portable(imported, dst, progress=progress)
