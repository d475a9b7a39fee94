"""Backend discovery through pluggy and the ``accelkit`` entry-point group.

Entry points are read at the first :func:`accelkit.get` or ``accelkit env``, never at import.
accelkit loads each entry point itself inside its own try/except (pluggy's
``load_setuptools_entrypoints`` stops at the first failing one), so a broken plugin is
reported and never breaks another.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from accelkit import hookspecs
from accelkit._known_plugins import KNOWN_PLUGIN_BACKENDS, checkout_path, pip_install
from accelkit.backend_specs import DEVICE_WORDS, BackendRegistry, BackendSpec, device_available
from accelkit.config import closest
from accelkit.errors import BackendNotFoundError, PluginMissingError

log = logging.getLogger("accelkit")

ENTRY_POINT_GROUP = "accelkit"
DISABLE_ENV = "ACCELKIT_DISABLE_PLUGINS"
#: the plugins of the accelkit distribution itself: its pyproject's entry points, registered
#: from here too when the installed metadata lacks them (a source tree, an older install)
DISTRIBUTION_PLUGINS = {
    "native": "accelkit.backends",
    "integrations": "accelkit.integrations.plugin",
}

__all__ = [
    "DEVICE_WORDS",
    "BackendRegistry",
    "BackendSpec",
    "PluginHost",
    "checkout_path",
    "device_available",
    "host",
    "pip_install",
    "register_plugin",
    "reset",
]


@dataclass
class PluginRecord:
    name: str
    distribution: str
    version: str
    status: str  # "loaded" | "failed"
    error: str = ""
    backends: list[str] = field(default_factory=list)


class PluginHost:
    """The plugin manager plus the registry it filled; one per process (see :func:`host`)."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.registry = BackendRegistry()
        self.plugins: list[PluginRecord] = []
        self._loaded = False
        self._lock = threading.Lock()

    # ---- loading ------------------------------------------------------------------------------
    def ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
                self._register("native", "accelkit", _version(), "accelkit.backends")
                return
            seen = set()
            # the native backends first, whatever sys.path order says: a plugin may not take
            # their names (a plugin earlier on PYTHONPATH would otherwise shadow 'cpu')
            native_first = sorted(_entry_points(), key=lambda ep: ep.value != "accelkit.backends")
            for ep in native_first:
                if ep.name in seen:
                    continue
                seen.add(ep.name)
                dist = ep.dist.name if ep.dist else "?"
                version = ep.dist.version if ep.dist else "?"
                self._register(ep.name, dist, version, ep)
            for name, module in DISTRIBUTION_PLUGINS.items():
                if name not in seen:  # a source tree without (or with older) installed metadata
                    self._register(name, "accelkit", _version(), module)

    def register_plugin(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (tests, notebooks) and its backends now."""
        self.ensure_loaded()
        self._register(name, "(in process)", "", plugin)

    def _register(self, name: str, dist: str, version: str, source: Any) -> None:
        record = PluginRecord(name, dist, version, "loaded")
        try:
            if isinstance(source, str):
                plugin = importlib.import_module(source)
            elif _is_entry_point(source):
                plugin = source.load()
            else:
                plugin = source
            self.pm.register(plugin, name=name)
            before = set(self.registry.names())
            self.registry._current_plugin = name
            for impl in self.pm.hook.accelkit_register_backends.get_hookimpls():
                if impl.plugin_name == name:
                    impl.function(registry=self.registry)
            record.backends = sorted(set(self.registry.names()) - before)
        except Exception as err:  # a broken plugin must not break the others
            record.status = "failed"
            record.error = f"{type(err).__name__}: {err}"
            # names it registered before failing would otherwise resolve to a failed plugin
            for key in [k for k, spec in self.registry._specs.items() if spec.plugin == name]:
                del self.registry._specs[key]
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            log.warning("accelkit plugin %r (%s) failed to load: %s", name, dist, record.error)
        finally:
            self.registry._current_plugin = ""
        self.plugins.append(record)

    # ---- lookup -------------------------------------------------------------------------------
    def resolve(self, name: str) -> BackendSpec:
        """The spec for ``name``, or an error saying what is registered and what to install."""
        self.ensure_loaded()
        spec = self.registry.get(name)
        if spec is not None:
            missing = spec.missing_libraries()
            if missing:
                raise PluginMissingError(
                    f"backend {name!r} needs {', '.join(missing)}, which is not installed. "
                    + (f"Install it: {spec.install}" if spec.install else "")
                )
            return spec
        failed = [p for p in self.plugins if p.status == "failed"]
        known = KNOWN_PLUGIN_BACKENDS.get(name)
        if known:
            dist, pip_line = known
            for rec in failed:
                if rec.distribution.replace("_", "-") == dist:
                    raise PluginMissingError(
                        f"backend {name!r} comes from plugin {dist!r}, which is installed but failed "
                        f"to load: {rec.error}. Run `accelkit env` for details."
                    )
            raise PluginMissingError(
                f"backend {name!r} is provided by the plugin distribution {dist!r}, which is not "
                f"installed. Install it: {pip_line}"
            )
        msg = f"unknown backend {name!r}."
        hint = closest(name, self.registry.names())
        if hint:
            msg += f" Did you mean {hint!r}?"
        msg += f" Registered backends: {', '.join(self.registry.names())}."
        if failed:
            msg += " Plugins that failed to load: " + "; ".join(
                f"{p.name} ({p.error})" for p in failed
            )
        raise BackendNotFoundError(msg)

    def env_report(self) -> dict[str, Any]:
        self.ensure_loaded()
        report: dict[str, Any] = {}
        for plugin_name, plugin in self.pm.list_name_plugin():
            impl = getattr(plugin, "accelkit_env_report", None)
            if impl is None:
                continue
            try:
                report.update(impl() or {})
            except Exception as err:
                report[f"{plugin_name} (env report failed)"] = str(err)
        return report


def _version() -> str:
    from accelkit.version import __version__

    return __version__


def _is_entry_point(source: Any) -> bool:
    """An entry point of ``importlib.metadata``, or of the ``importlib_metadata`` backport that
    some packages (mlflow) install into ``sys.meta_path``: both load the same way."""
    return isinstance(source, metadata.EntryPoint) or (
        type(source).__name__ == "EntryPoint" and callable(getattr(source, "load", None))
    )


def _entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


_HOST: PluginHost | None = None


def host() -> PluginHost:
    """The process-wide plugin host (created lazily; entry points load on first use)."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    return _HOST


def reset() -> None:
    """Forget every loaded plugin (tests)."""
    global _HOST
    _HOST = None


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object in this process (no entry point needed): tests, notebooks."""
    host().register_plugin(plugin, name or getattr(plugin, "__name__", repr(plugin)))
