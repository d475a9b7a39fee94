"""Helpers shared by the Apex plugin tests (a module of its own: every plugin has a conftest.py,
so ``from conftest import ...`` could meet another plugin's)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

FAKE_ROOT = Path(__file__).resolve().parent / "fake_apex"
FAKE_MODULES = ("apex", "amp_C", "fused_layer_norm_cuda", "distributed_adam_cuda")

#: figures the GPU tests measured: printed at the end of the run (conftest.py), and appended as
#: JSON lines to $ACCELKIT_GPU_REPORT/apex-gpu.jsonl when that variable names a folder
GPU_FIGURES: list[dict] = []


def report_gpu(test: str, **figures) -> None:
    entry = {"test": test, **figures}
    GPU_FIGURES.append(entry)
    print(json.dumps(entry, default=str))
    folder = os.environ.get("ACCELKIT_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "apex-gpu.jsonl", "a") as out:
            out.write(json.dumps(entry, default=str) + "\n")


def purge_apex_modules() -> None:
    """Forget every imported module of the names the fake stands in for."""
    for name in list(sys.modules):
        if name.split(".")[0] in FAKE_MODULES:
            del sys.modules[name]
    from accelkit_apex import probe

    probe._child_probe.cache_clear()


def use_apex_at(root: Path):
    """Put ``root`` first on sys.path (and nothing named apex from before in sys.modules)."""
    purge_apex_modules()
    sys.path.insert(0, str(root))
    import apex

    return apex


def drop_apex_at(root: Path) -> None:
    while str(root) in sys.path:
        sys.path.remove(str(root))
    purge_apex_modules()
