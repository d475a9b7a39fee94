"""What a plugin's tests need to check its ``accelkit_estimate_memory`` hook by hand.

A bias-free ``Linear(1000, 1000)`` has exactly ``ONE_LINEAR_PARAMS`` parameters, so a test can
write every term as ``bytes per parameter x 1,000,000`` and compare it with what the hook
answers through the plugin manager, the way ``accelkit plan`` calls it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accelkit.benchmark.workloads import Workload

ONE_LINEAR_PARAMS = 1_000_000


class OneLinear(nn.Module):
    """Exactly 1,000,000 parameters; the loss is the mean square of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1000, 1000, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).square().mean()


ONE_LINEAR = Workload("one-linear", OneLinear, lambda b, g: (torch.randn(b, 1000, generator=g),))


def estimate_through_hooks(backend: str, stats: dict[str, Any], **options: Any) -> Any:
    """The registered plugins' answer for ``backend`` (one GPU, AdamW, the stats' precision,
    no backend options unless ``options`` says otherwise)."""
    from accelkit import registry

    host = registry.host()
    host.ensure_loaded()
    base = {
        "world_size": 1,
        "precision": stats["precision"],
        "optimizer": "adamw",
        "device_type": "cuda",
        "backend_options": {},
    }
    base.update(options)
    return host.pm.hook.accelkit_estimate_memory(backend=backend, model_stats=stats, options=base)
