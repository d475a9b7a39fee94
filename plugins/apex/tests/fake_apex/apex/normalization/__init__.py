"""FAKE ``apex.normalization`` (tests only)."""

from apex.normalization.fused_layer_norm import FusedLayerNorm, FusedRMSNorm

__all__ = ["FusedLayerNorm", "FusedRMSNorm"]
