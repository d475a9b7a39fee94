"""accelkit backends on FairScale 0.4.13. Importing this package does not import fairscale."""

__version__ = "0.1.0"
