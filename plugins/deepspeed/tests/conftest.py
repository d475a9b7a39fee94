"""Fixtures of the accelkit-deepspeed tests.

DeepSpeed is imported only in the processes the tests launch (accelkit.testing.run_ranks), never in
pytest's own process: importing it here would leak its global state into every other test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

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


_REPORT_KEY = pytest.StashKey[list]()


@pytest.fixture
def gpu_report(request: pytest.FixtureRequest):
    """Record what a GPU test measured, scenario by scenario: printed in pytest's terminal
    summary and, where ``ACCELKIT_GPU_REPORT`` names a folder, appended to
    ``deepspeed-gpu.jsonl`` there (a GPU run is scarce: one run should tell everything)."""
    rows = request.config.stash.setdefault(_REPORT_KEY, [])
    folder = os.environ.get("ACCELKIT_GPU_REPORT")

    def record(**fields: Any) -> None:
        row = {"test": request.node.name, **fields}
        rows.append(row)
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with open(Path(folder) / "deepspeed-gpu.jsonl", "a") as out:
                out.write(json.dumps(row, default=str) + "\n")

    return record


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_short(v)}" for k, v in value.items()) + "}"
    return str(value)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    rows = config.stash.get(_REPORT_KEY, [])
    if not rows:
        return
    terminalreporter.section("accelkit-deepspeed GPU summary (measured)")
    for row in rows:
        status = "FAIL" if row.get("problems") else "ok"
        terminalreporter.write_line(f"[{status}] {row['test']} :: {row['scenario']}")
        for key, value in (row.get("measured") or {}).items():
            terminalreporter.write_line(f"    {key}: {_short(value)}")
        for problem in row.get("problems") or []:
            terminalreporter.write_line(f"    PROBLEM: {str(problem)[:1500]}")
