"""Seeding and RNG state, so that a run is reproducible and a resume continues it exactly."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import torch

log = logging.getLogger("accelkit")


def seed_everything(seed: int, *, workers: bool = True) -> int:
    """Seed Python, NumPy (if installed) and torch on every device; return the seed.

    With ``workers=True``, dataloader workers set up by accelkit derive their seeds from this
    seed, their worker id and the process rank, so no two workers anywhere share a stream.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    os.environ["ACCELKIT_SEED"] = str(seed)
    os.environ["ACCELKIT_SEED_WORKERS"] = "1" if workers else "0"
    return seed


def worker_init_fn(worker_id: int) -> None:
    """Seed a dataloader worker from torch's per-worker seed mixed with the global rank."""
    rank = int(os.environ.get("RANK", "0"))
    base = torch.initial_seed()
    seed = (base + 1_000_003 * rank) % 2**63
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def rng_state() -> dict[str, Any]:
    """This process's RNG state: Python, NumPy, torch CPU and the current CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
