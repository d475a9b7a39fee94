"""Settings for every test run from this repository (core and plugins alike)."""

from __future__ import annotations

import os
from pathlib import Path

# DeepSpeed JIT-builds a C++ op on its first process group (~100 s on 2 cores): build it once into
# the workspace, where every later run (the README's, CI's, nox's) finds it.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).parent / ".cache" / "torch_extensions")
)
