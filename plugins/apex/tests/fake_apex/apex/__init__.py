"""A FAKE ``apex`` for accelkit-apex's CPU tests: not NVIDIA Apex (see ../README.md)."""

from __future__ import annotations

from typing import Any

ACCELKIT_FAKE = True
__version__ = "0.0+accelkit.fake"

#: what the fake classes were built with, in order: {"class": ..., "kwargs": ..., ...}
CALLS: list[dict[str, Any]] = []


def record(cls: str, **what: Any) -> None:
    CALLS.append({"class": cls, **what})


from apex import normalization, optimizers  # noqa: E402  (as Apex's own __init__ does)

__all__ = ["optimizers", "normalization"]
