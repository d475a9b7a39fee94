"""Fixtures of the accelkit-deepspeed tests.

DeepSpeed is imported only in the processes the tests launch (dsk_launch.run_ranks), never in
pytest's own process: importing it here would leak its global state into every other test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip themselves where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `nox -s gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords and Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_registry():
    """Each test sees a freshly loaded plugin host and its own environment."""
    from accelkit import registry

    saved = dict(os.environ)
    registry.reset()
    yield
    registry.reset()
    os.environ.clear()
    os.environ.update(saved)
