"""The table of backend names: what the ``accelkit_register_backends`` hook fills.

:class:`BackendRegistry` is the object a plugin's hook gets; :class:`BackendSpec` is one name in
it. Loading plugins and resolving names is :mod:`accelkit.registry`'s job; this module imports
neither pluggy nor any plugin, so the hook specifications can name its types.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: how a device type a backend may declare in ``devices=`` is named in messages
DEVICE_WORDS = {"cuda": "a CUDA GPU", "mps": "an Apple MPS device", "cpu": "a CPU"}


def device_available(device_type: str) -> bool:
    """Whether this machine has a device of ``device_type`` (imports torch, no backend library)."""
    import torch

    if device_type == "cuda":
        return torch.cuda.is_available()
    if device_type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return bool(mps and mps.is_available())
    return device_type == "cpu"


@dataclass
class BackendSpec:
    """One registered backend name."""

    name: str
    #: the Backend class, or "module:attribute" imported when first built
    factory: str | Callable[..., Any]
    #: options preset by this name (``deepspeed_stage_2`` presets ``zero_stage=2``)
    defaults: dict[str, Any] = field(default_factory=dict)
    #: import names of the libraries the backend needs (checked without importing them)
    requires: tuple[str, ...] = ()
    #: what to run when a required library is missing
    install: str = ""
    description: str = ""
    plugin: str = ""
    alias_of: str | None = None
    #: device types the backend runs on ("cuda", "mps", "cpu"); empty: any, the CPU included
    devices: tuple[str, ...] = ()
    #: why it needs those devices, for a user on a machine without them
    devices_reason: str = ""
    #: the models it trains when not any ``torch.nn.Module`` ("" for any), for tools that bring
    #: their own model (``accelkit demo``) to refuse before they launch
    models: str = ""

    def missing_libraries(self) -> list[str]:
        return [lib for lib in self.requires if importlib.util.find_spec(lib) is None]

    def not_runnable_reason(self) -> str:
        """Why the backend cannot run on this machine, from its declared ``devices`` ("" when it
        can). Imports torch; never the backend's library."""
        if not self.devices or any(device_available(d) for d in self.devices):
            return ""
        wanted = " or ".join(DEVICE_WORDS.get(d, f"a {d} device") for d in self.devices)
        return f"needs {wanted}" + (f" ({self.devices_reason})" if self.devices_reason else "")

    def load_class(self) -> Any:
        if isinstance(self.factory, str):
            module_name, _, attr = self.factory.partition(":")
            return getattr(importlib.import_module(module_name), attr)
        return self.factory


class BackendRegistry:
    """Names to backend factories; filled by the ``accelkit_register_backends`` hook."""

    def __init__(self) -> None:
        self._specs: dict[str, BackendSpec] = {}
        self._current_plugin = ""

    def add(
        self,
        name: str,
        factory: str | Callable[..., Any],
        *,
        aliases: Iterable[str] = (),
        defaults: dict[str, Any] | None = None,
        requires: Iterable[str] = (),
        install: str = "",
        description: str = "",
        devices: Iterable[str] = (),
        devices_reason: str = "",
        models: str = "",
    ) -> None:
        """Register ``name`` (and ``aliases``) for ``factory``; a later plugin may not shadow one.

        ``devices`` are the device types the backend runs on (empty: any, the CPU included) and
        ``devices_reason`` says why; ``models`` describes the models it trains when it cannot
        train any ``torch.nn.Module``. ``accelkit env`` and ``accelkit demo`` read them, so a
        backend that cannot run here is named with the reason before anything is launched."""
        spec = BackendSpec(
            name,
            factory,
            dict(defaults or {}),
            tuple(requires),
            install,
            description,
            self._current_plugin,
            devices=tuple(devices),
            devices_reason=devices_reason,
            models=models,
        )
        for key in (name, *aliases):
            if key in self._specs and self._specs[key].plugin != spec.plugin:
                raise ValueError(
                    f"backend name {key!r} is already registered by plugin {self._specs[key].plugin!r}"
                )
            self._specs[key] = (
                spec if key == name else BackendSpec(**{**spec.__dict__, "alias_of": name})
            )

    def names(self) -> list[str]:
        return sorted(self._specs)

    def get(self, name: str) -> BackendSpec | None:
        return self._specs.get(name)

    def specs(self) -> list[BackendSpec]:
        return [self._specs[n] for n in self.names()]
