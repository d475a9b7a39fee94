"""A small tagged JSON codec for the non-tensor parts of a checkpoint.

Scheduler, dataloader and grad-scaler states and the user's extras are numbers, strings and
containers; JSON keeps them readable and loads without unpickling anything. Tensors found inside
are handed to the caller (they go into the safetensors files) and replaced by a reference.
Anything else is refused with the path to the offending value, so the user knows what to change.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

import torch

from accelkit.errors import CheckpointError

_TAGS = ("__tuple__", "__dict__", "__bytes__", "__tensor__", "__ndarray__", "__float__")

#: called with (path, tensor) for every tensor met while encoding; returns the reference key
TensorSink = Callable[[str, torch.Tensor], str]
#: called with a reference key while decoding; returns the tensor
TensorSource = Callable[[str], torch.Tensor]


def encode(value: Any, path: str = "", tensors: TensorSink | None = None) -> Any:
    """Turn ``value`` into JSON-ready data; tensors go to ``tensors`` (refused when None)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        # NaN and infinities are tagged so the file stays strict JSON
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise CheckpointError(f"{path or 'value'}: a tensor cannot be stored here")
        return {"__tensor__": tensors(path, value)}
    if type(value).__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray):
            if tensors is None:
                raise CheckpointError(f"{path or 'value'}: an array cannot be stored here")
            return {"__ndarray__": tensors(path, torch.from_numpy(np.ascontiguousarray(value)))}
        if isinstance(value, np.generic):
            return encode(value.item(), path, tensors)
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        plain = all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and next(iter(value)) in _TAGS
        )
        if plain:
            return {k: encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise CheckpointError(
                    f"{path or 'value'}: dictionary key {k!r} of type {type(k).__name__} cannot "
                    "be stored; use str or int keys"
                )
            pairs.append([encode(k, path, None), encode(v, f"{path}/{k}", tensors)])
        return {"__dict__": pairs}
    raise CheckpointError(
        f"{path or 'value'}: cannot store a {type(value).__module__}.{type(value).__qualname__} "
        "without pickle. Store numbers, strings, tensors and containers of them, or give the "
        "object state_dict()/load_state_dict() methods."
    )


def decode(data: Any, tensors: TensorSource | None = None) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        ((tag, inner),) = data.items()
        if tag == "__tuple__":
            return tuple(decode(v, tensors) for v in inner)
        if tag == "__dict__":
            return {_hashable(decode(k)): decode(v, tensors) for k, v in inner}
        if tag == "__bytes__":
            return base64.b64decode(inner, validate=True)
        if tag == "__float__":
            return float(inner)
        if tag in ("__tensor__", "__ndarray__"):
            if tensors is None:
                raise CheckpointError(f"tensor reference {inner!r} found where none may be")
            tensor = tensors(inner)
            return tensor.numpy() if tag == "__ndarray__" else tensor
    return {k: decode(v, tensors) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def drop_callables(state: dict[str, Any], what: str) -> dict[str, Any]:
    """Top-level callables (a scheduler's lambdas, a patched ``step``) cannot be saved; the
    object's constructor recreates them, so they are left out."""
    import logging

    kept = {}
    for key, value in state.items():
        if callable(value) and not isinstance(value, (torch.Tensor, type)):
            logging.getLogger("accelkit").debug("%s: not saving callable %r", what, key)
            continue
        kept[key] = value
    return kept
