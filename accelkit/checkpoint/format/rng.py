"""Per-rank RNG state as tensors and JSON numbers, never pickle.

Python's ``random`` state is a tuple of 625 ints (the Mersenne Twister words and position),
NumPy's is a uint32 array plus a few numbers, torch's are byte tensors. The arrays go into the
rank's safetensors file; the few scalars go into the manifest.
"""

from __future__ import annotations

from typing import Any

import torch

from accelkit.seed import rng_state, set_rng_state


def capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's RNG state as (tensors by name, JSON scalars)."""
    state = rng_state()
    tensors: dict[str, torch.Tensor] = {"torch": state["torch"].clone()}
    scalars: dict[str, Any] = {}
    version, words, gauss_next = state["python"]
    tensors["python"] = torch.tensor(words, dtype=torch.int64)
    scalars["python"] = {"version": version, "gauss_next": gauss_next}
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        tensors["numpy"] = torch.from_numpy(keys.astype("int64"))
        scalars["numpy"] = {
            "kind": kind,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if "cuda" in state:
        tensors["cuda"] = state["cuda"].clone()
    return tensors, scalars


def restore(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    """Set this process's RNG state from :func:`capture`'s output."""
    state: dict[str, Any] = {}
    if "torch" in tensors:
        state["torch"] = tensors["torch"].to(torch.uint8).cpu()
    if "python" in tensors and "python" in scalars:
        words = tuple(int(w) for w in tensors["python"].tolist())
        py = scalars["python"]
        state["python"] = (int(py["version"]), words, py["gauss_next"])
    if "numpy" in tensors and "numpy" in scalars:
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            n = scalars["numpy"]
            keys = tensors["numpy"].numpy().astype(np.uint32)
            state["numpy"] = (
                n["kind"],
                keys,
                int(n["pos"]),
                int(n["has_gauss"]),
                float(n["cached_gaussian"]),
            )
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"].to(torch.uint8).cpu()
    set_rng_state(state)
