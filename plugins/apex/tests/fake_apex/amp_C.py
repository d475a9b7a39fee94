"""Stand-in for Apex's compiled ``amp_C`` module (tests only; see README.md)."""

ACCELKIT_FAKE = True
