"""Workers of the launcher tests (tests/test_conformance.py): raw Python, nothing of accelkit,
so a rank that runs one shows whether the launcher itself imported accelkit."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def rank_worker() -> dict[str, Any]:
    return {"rank": int(os.environ["RANK"]), "accelkit": "accelkit" in sys.modules}


def failing_worker(message: str) -> None:
    if os.environ["RANK"] == "1":
        raise RuntimeError(message)


def sleeping_worker(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"
