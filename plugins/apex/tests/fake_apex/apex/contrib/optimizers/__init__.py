"""FAKE ``apex.contrib.optimizers`` (tests only)."""
