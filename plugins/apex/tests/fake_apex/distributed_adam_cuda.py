"""Stand-in for Apex's compiled ``distributed_adam_cuda`` module (tests only; see README.md)."""

ACCELKIT_FAKE = True
