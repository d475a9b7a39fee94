"""accelkit backends on NVIDIA Apex. Importing this package does not import apex."""

__version__ = "0.1.0"
