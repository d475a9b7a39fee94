"""FAKE ``apex.optimizers`` (tests only)."""

from apex.optimizers.fused_adam import FusedAdam
from apex.optimizers.fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD"]
