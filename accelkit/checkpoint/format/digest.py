"""Fragment checksums: XXH3-128 by default (several GB/s per core), SHA-256 on request.

Every fragment's record names its algorithm by its key (``"xxh3_128"`` or ``"sha256"``), so a
reader verifies checkpoints of either kind, and those written before XXH3 became the default
(SHA-256) stay readable. XXH3 catches corruption (bit flips, truncation, stale bytes); choose
``checksum="sha256"`` where a cryptographic digest is wanted against deliberate tampering.
The manifest's own checksum and ``extra.json``'s stay SHA-256: they are small.
"""

from __future__ import annotations

import hashlib
from typing import Any

from accelkit.errors import CheckpointError

#: algorithm -> hex digits of its digest
ALGORITHMS = {"xxh3_128": 32, "sha256": 64}
DEFAULT = "xxh3_128"


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise CheckpointError(
            f"checksum={algorithm!r} is not one of {', '.join(sorted(ALGORITHMS))}"
        )
    return algorithm


def hasher(algorithm: str) -> Any:
    """A new incremental hasher (``update``/``hexdigest``) for ``algorithm``."""
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r}")


def digest(algorithm: str, data: Any) -> str:
    """The hex digest of a bytes-like ``data`` (both algorithms release the GIL on large data)."""
    h = hasher(algorithm)
    h.update(data)
    return h.hexdigest()
