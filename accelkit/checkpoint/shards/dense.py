"""The default checkpoint hooks of :class:`~accelkit.backend.Backend`: whole tensors (or
DTensors) and torch optimizers.

``Backend.local_fragments``, ``load_fragments`` and ``check_load`` run these unless a backend
overrides them. They live here, in the format, so that the backend protocol never imports the
checkpoint package; the package installs this module into the protocol when it loads
(:func:`~accelkit.backend.set_checkpoint_defaults`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from accelkit.checkpoint.shards.fragments import (
    Fragment,
    ObjectInfo,
    dense_fragments,
    load_dense_fragments,
)
from accelkit.checkpoint.shards.validate import check_dense_load


def local_fragments(backend: Any, state: dict[str, Any]) -> Iterator[Fragment | ObjectInfo]:
    """Every model and torch optimizer of ``state``, as this rank's dense fragments."""
    return dense_fragments(backend, state)


def load_fragments(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    """Fill every model and torch optimizer of ``state`` from ``reader``."""
    load_dense_fragments(backend, reader, state)


def check_load(backend: Any, reader: Any, state: dict[str, Any]) -> None:
    """Check, writing nothing, that ``load_fragments`` fits ``state``."""
    check_dense_load(backend, reader, state)
