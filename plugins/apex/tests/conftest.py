"""Fixtures of the Apex plugin tests.

The CPU tests run against ``fake_apex/`` (a stand-in *named* apex, see fake_apex/README.md),
which only the ``fake_apex`` fixture puts on ``sys.path`` and takes off again, purging every
module it brought. The GPU tests (``-m gpu``) never use it and check that the real NVIDIA Apex,
with its compiled ``amp_C``, is what they import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from apex_testlib import FAKE_ROOT, GPU_FIGURES, drop_apex_at, use_apex_at


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter) -> None:
    if GPU_FIGURES:
        terminalreporter.section("apex GPU summary")
        for figure in GPU_FIGURES:
            terminalreporter.write_line(json.dumps(figure, default=str))


@pytest.fixture(autouse=True)
def clean_process_state():
    """Restore os.environ, the plugin host and the process group after each test."""
    saved_env = dict(os.environ)
    from accelkit import registry

    registry.reset()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    registry.reset()
    os.environ.clear()
    os.environ.update(saved_env)


@pytest.fixture
def fake_apex():
    """The fake apex package, importable as ``apex`` for the duration of one test."""
    apex = use_apex_at(FAKE_ROOT)
    assert apex.ACCELKIT_FAKE and Path(apex.__file__).is_relative_to(FAKE_ROOT)
    apex.CALLS.clear()
    yield apex
    drop_apex_at(FAKE_ROOT)


@pytest.fixture
def on_cpu(fake_apex, monkeypatch):
    """The Apex backends on the CPU, for the fake only (the real ones refuse without CUDA)."""
    from accelkit_apex.backend import ApexBackend
    from accelkit_apex.distributed_adam import DistributedAdamBackend

    monkeypatch.setattr(ApexBackend, "_pick_device", lambda self: torch.device("cpu"))
    monkeypatch.setattr(DistributedAdamBackend, "_pick_device", lambda self: torch.device("cpu"))
    return fake_apex
