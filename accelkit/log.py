"""Rank-zero logging: accelkit's logger speaks on global rank 0 unless told otherwise."""

from __future__ import annotations

import logging
import os

LOGGER_NAME = "accelkit"


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get("ACCELKIT_LOG_ALL_RANKS", "") not in ("", "0"):
            return True
        return int(os.environ.get("RANK", "0")) == 0


def configure(level: int | str | None = None) -> logging.Logger:
    """Give the ``accelkit`` logger a rank-zero handler once (users may configure their own)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_accelkit", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[accelkit] %(message)s"))
        handler.addFilter(_RankZeroFilter())
        handler._accelkit = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    env_level = os.environ.get("ACCELKIT_LOG_LEVEL")
    logger.setLevel(level or env_level or logging.INFO)
    return logger
