"""Shared fixtures of the core tests: every test starts from a clean process state.

accelkit keeps process-wide state on purpose (the plugin host, a process group, environment
variables a launcher would set, the default dtype inside ``init_module``); a test that leaks
any of it into the next one makes both unreliable, so each test gets them reset.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip themselves where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `nox -s gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_process_state():
    """Restore os.environ, the default dtype and the process group; forget the plugin host
    when the test changed it (in-process plugins, plugins disabled)."""
    saved_env = dict(os.environ)
    saved_dtype = torch.get_default_dtype()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    from accelkit import registry

    host = registry._HOST
    if host is not None and (
        any(p.distribution == "(in process)" for p in host.plugins)
        or os.environ.get(registry.DISABLE_ENV) != saved_env.get(registry.DISABLE_ENV)
    ):
        registry.reset()
    torch.set_default_dtype(saved_dtype)
    os.environ.clear()
    os.environ.update(saved_env)


@pytest.fixture
def only_native_plugins(monkeypatch: pytest.MonkeyPatch):
    """A registry that sees accelkit's own entry point only, whatever else is installed here."""
    from accelkit import registry

    real = registry._entry_points

    def native_only():
        return [ep for ep in real() if ep.value == "accelkit.backends"]

    monkeypatch.setattr(registry, "_entry_points", native_only)
    registry.reset()
    yield registry
    registry.reset()  # the next test sees every installed plugin again
