"""The progress bar of long conversions: shown by default from :data:`PROGRESS_BYTES` up."""

from __future__ import annotations

from typing import Any

#: conversions at least this large show a progress bar by default
PROGRESS_BYTES = 256 << 20


def progress_bar(total: int, enabled: bool | None, desc: str) -> Any:
    if enabled is False or (enabled is None and total < PROGRESS_BYTES):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
