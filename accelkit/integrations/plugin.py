"""The integrations' plugin: what they add to accelkit's own commands, registered cheaply.

Entry point ``integrations`` of the accelkit distribution. Importing it imports no framework
(MMEngine is imported when an export runs), so it loads with every other plugin.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from accelkit.errors import CheckpointError
from accelkit.hookspecs import hookimpl


def export_mmengine(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """``accelkit convert SRC DST --to mmengine``: a portable checkpoint of the MMEngine adapter
    into the ``.pth`` plain MMEngine resumes (:mod:`accelkit.integrations.mmengine.checkpoint`)."""
    try:
        from accelkit.integrations.mmengine.checkpoint import export_mmengine as export
    except ImportError as err:
        raise CheckpointError(f"--to mmengine needs MMEngine installed ({err})") from err
    return export(src, dst)


@hookimpl
def accelkit_checkpoint_exporters() -> dict[str, Any]:
    return {"mmengine": export_mmengine}
