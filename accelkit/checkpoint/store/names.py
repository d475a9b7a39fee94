"""How the checkpoints of a series are named and ordered, on every store: ``latest``, the name
pattern that rotates together, the natural order of names, and the step a manifest records
(checkpoints are ordered by it, never by a clock)."""

from __future__ import annotations

import json
import re

LATEST_NAME = "latest"


def rotation_pattern(name: str) -> str:
    """``step-1200`` and ``step-900`` share the pattern ``step-#``: they rotate together."""
    return re.sub(r"\d+", "#", name)


def natural_key(name: str) -> tuple:
    """``step-9`` before ``step-10``: digit runs compare as numbers."""
    parts = re.split(r"(\d+)", name)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def manifest_step(raw: bytes | str) -> int | None:
    """The training step a manifest's text records (``step``, else ``applied_steps``)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    for field in ("step", "applied_steps"):
        value = data.get(field) if isinstance(data, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
