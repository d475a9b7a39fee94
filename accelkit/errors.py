"""Errors that tell the user what to do next.

Every error accelkit raises on bad input derives from :class:`AccelkitError`, and also from the
builtin exception a Python user would expect (``ValueError`` for a bad value, ``ImportError`` for
a missing library), so existing ``except`` clauses keep working.
"""

from __future__ import annotations


class AccelkitError(Exception):
    """Base class of every accelkit error."""


class BackendNotFoundError(AccelkitError, ValueError):
    """The backend name is not registered."""


class PluginMissingError(AccelkitError, ImportError):
    """The backend is known but its plugin or library is not installed, or failed to load."""


class ConfigError(AccelkitError, ValueError):
    """A configuration key or value is wrong."""


class UnsupportedError(AccelkitError, RuntimeError):
    """The backend cannot do what was asked (see its ``capabilities``)."""


class CheckpointError(AccelkitError, RuntimeError):
    """A checkpoint is missing, incomplete, tampered with, or does not fit the target."""


class PartialLoadError(CheckpointError):
    """A load failed after it began writing (an I/O error mid-read): the objects hold a mix of
    old and loaded values and must not be trained. Every other load error changes nothing."""


class DistributedError(AccelkitError, RuntimeError):
    """A collective could not complete: a rank skipped it, stalled, or died."""
