"""Fixtures of the FairScale plugin tests: a clean process state per test, GPU tests skipped
without CUDA. Multi-process tests run their workers in subprocesses (``accelkit.testing.run_ranks``);
the test-only CPU shim is applied only there, never in this process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
