"""Lazy module attributes: the public faces (``accelkit``, ``accelkit.sdk``) name many objects
and import none of them until one is used, so ``import accelkit`` stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(
    module: str, sources: dict[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module``: a name of ``sources`` (name -> the module
    that defines it) is imported on first access and kept in ``namespace`` (the module's
    globals), so later accesses are plain lookups."""

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        namespace[name] = value
        return value

    return __getattr__
