"""The ``accelkit`` entry point of accelkit-gcs: the ``gs`` scheme, nothing imported."""

from __future__ import annotations

from typing import Any

from accelkit.sdk import hookimpl


@hookimpl
def accelkit_checkpoint_stores() -> dict[str, Any]:
    from accelkit_gcs import gcs_store

    return {"gs": gcs_store}
