"""FAKE ``apex.contrib`` (tests only)."""
