"""accelkit's pytest plugin (entry point ``pytest11``), loaded wherever accelkit is installed:
the markers the conformance suite puts on its cases, registered for a plugin's own test suite
outside this repository.

Without a ``-m`` expression, the conformance cases marked ``slow`` (the other world sizes, the
resumes) are skipped with a note saying how to run them, as this repository's default test run
leaves them out; ``-m slow`` runs them, ``-m "slow or not slow"`` runs every case. Imports
nothing but pytest.
"""

from __future__ import annotations

import pytest

MARKERS = {
    "slow": "an accelkit conformance case beyond the default run (run them with -m slow)",
    "gpu": "needs a CUDA GPU",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def _is_contract(item: pytest.Item) -> bool:
    cls = getattr(item, "cls", None)
    return cls is not None and any(
        base.__module__ == "accelkit.testing.conformance" and base.__name__ == "BackendContract"
        for base in cls.__mro__
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("markexpr", ""):
        return  # the user chose the cases
    skip = pytest.mark.skip(
        reason='slow conformance case: run with -m slow or -m "slow or not slow"'
    )
    for item in items:
        if "slow" in item.keywords and _is_contract(item):
            item.add_marker(skip)
