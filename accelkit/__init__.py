"""accelkit: one PyTorch training loop on any training backend.

>>> import accelkit
>>> accel = accelkit.get("cpu")
>>> accel.device
device(type='cpu')

Heavy pieces load lazily: ``import accelkit`` imports torch and nothing of any backend library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit.hookspecs import hookimpl
from accelkit.lazy import lazy_getattr
from accelkit.version import __version__

_LAZY = {
    "get": "accelkit.api",
    "describe": "accelkit.api",
    "launch": "accelkit.launcher",
    "Accelerator": "accelkit.accelerator",
    "Backend": "accelkit.backend",
    "Capabilities": "accelkit.backend",
    "Settings": "accelkit.backend",
    "StepResult": "accelkit.backend",
    "SetupResult": "accelkit.backend",
    "seed_everything": "accelkit.seed",
    "AccelkitError": "accelkit.errors",
    "BackendNotFoundError": "accelkit.errors",
    "CheckpointError": "accelkit.errors",
    "PartialLoadError": "accelkit.errors",
    "ConfigError": "accelkit.errors",
    "DistributedError": "accelkit.errors",
    "PluginMissingError": "accelkit.errors",
    "UnsupportedError": "accelkit.errors",
    "register_plugin": "accelkit.registry",
    "find_executable_batch_size": "accelkit.memory",
}

__all__ = [
    "__version__",
    "hookimpl",
    "get",
    "describe",
    "launch",
    "Accelerator",
    "Backend",
    "Capabilities",
    "Settings",
    "StepResult",
    "SetupResult",
    "seed_everything",
    "AccelkitError",
    "BackendNotFoundError",
    "CheckpointError",
    "PartialLoadError",
    "ConfigError",
    "DistributedError",
    "PluginMissingError",
    "UnsupportedError",
    "register_plugin",
    "find_executable_batch_size",
]

if TYPE_CHECKING:
    from accelkit.accelerator import Accelerator
    from accelkit.api import describe, get
    from accelkit.backend import Backend, Capabilities, Settings, SetupResult, StepResult
    from accelkit.errors import (
        AccelkitError,
        BackendNotFoundError,
        CheckpointError,
        ConfigError,
        DistributedError,
        PartialLoadError,
        PluginMissingError,
        UnsupportedError,
    )
    from accelkit.launcher import launch
    from accelkit.memory import find_executable_batch_size
    from accelkit.registry import register_plugin
    from accelkit.seed import seed_everything


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
