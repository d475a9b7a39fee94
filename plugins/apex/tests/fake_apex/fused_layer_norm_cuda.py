"""Stand-in for Apex's compiled ``fused_layer_norm_cuda`` module (tests only; see README.md)."""

ACCELKIT_FAKE = True
