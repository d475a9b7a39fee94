"""The values ``accel.log`` takes besides numbers: :class:`Image` and :class:`Histogram`.

Value types of their own, so that every tracker (:mod:`accelkit.tracking`'s built-in ones,
:mod:`accelkit.tracking_backends`'s W&B and MLflow) reads them without importing another
tracker's module. ``accelkit.tracking`` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from accelkit.errors import ConfigError


@dataclass(frozen=True)
class Image:
    """An image value for ``accel.log``: a tensor or numpy array laid out as ``"HW"``,
    ``"HWC"`` or ``"CHW"`` (``"auto"`` reads a first dimension of 1, 3 or 4 as channels),
    floats in [0, 1] or integers in [0, 255]. Trackers without ``log_images`` skip it (warned
    once)."""

    data: Any
    caption: str | None = None
    layout: str = "auto"

    def to_numpy(self) -> Any:
        """HWC uint8 (HW for one channel), the layout both W&B and MLflow take."""
        import numpy as np

        data = self.data
        if isinstance(data, torch.Tensor):
            data = data.detach().cpu()
            data = data.float().numpy() if data.is_floating_point() else data.numpy()
        array = np.asarray(data)
        layout = self.layout
        if layout == "auto":
            chw = array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (3, 4)
            layout = {2: "HW", 3: "CHW" if chw else "HWC"}.get(array.ndim, "")
        if layout not in ("HW", "HWC", "CHW") or array.ndim != len(layout):
            raise ConfigError(
                f"an Image is HW, HWC or CHW; got shape {tuple(array.shape)} as {self.layout!r}"
            )
        if layout == "CHW":
            array = array.transpose(1, 2, 0)
        if array.ndim == 3 and array.shape[-1] == 1:
            array = array[..., 0]
        if array.dtype.kind == "f":
            array = np.clip(array, 0.0, 1.0) * 255.0 + 0.5
        return np.clip(array, 0, 255).astype(np.uint8)


@dataclass(frozen=True)
class Histogram:
    """A histogram value for ``accel.log``: the distribution of ``values`` (a tensor or array of
    any shape) in ``bins`` equal bins between its minimum and maximum."""

    values: Any
    bins: int = 64

    def counts_and_edges(self) -> tuple[Any, Any]:
        """``(counts, edges)`` as numpy arrays (``bins`` counts, ``bins + 1`` edges)."""
        values = torch.as_tensor(self.values).detach().cpu().double().reshape(-1)
        values = values[torch.isfinite(values)]
        if values.numel() == 0:
            raise ConfigError("a Histogram needs at least one finite value")
        counts, edges = torch.histogram(values, bins=self.bins)
        return counts.long().numpy(), edges.numpy()
