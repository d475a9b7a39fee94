"""Where a save's time goes: the phases on the caller's critical path, and the work the writer
threads did beside it.

:func:`last_save` returns the breakdown of this process's last completed save (an asynchronous
save's once it has committed). ``bench/checkpoint_io.py`` prints it; a slow save on a new
machine is diagnosed from it without a profiler. Recording costs two clock reads per phase and
per tensor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

#: the phases of a save, in order (seconds of wall time on the saving thread)
PHASES = (
    "prepare",  # temporary directory, marker, every rank sees it
    "plan",  # classify the state, the backend's fragments, the records
    "stage",  # device-to-host copies into the staging buffer (asynchronous saves: the stall)
    "write",  # the rank file: copies, checksums and writes, overlapped
    "fsync",  # the rank file's data reaches the disk
    "gather",  # every rank's records to rank 0, errors agreed
    "commit",  # extra.json and the manifest, fsync, rename, latest, rotation
)
#: work done on the writer threads, summed over threads (it overlaps the "write" phase)
THREAD_WORK = ("copy", "pwrite", "checksum", "flush")


@dataclass
class SaveProfile:
    """The breakdown of one save on this rank."""

    phases: dict[str, float] = field(default_factory=dict)
    thread_work: dict[str, float] = field(default_factory=dict)
    nbytes: int = 0
    tensors: int = 0
    asynchronous: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - started

    def add_work(self, name: str, seconds: float) -> None:
        """Thread-safe: writer threads add what each tensor cost them."""
        with self._lock:
            self.thread_work[name] = self.thread_work.get(name, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def as_dict(self) -> dict[str, object]:
        return {
            "phases": {k: self.phases.get(k, 0.0) for k in PHASES if k in self.phases},
            "thread_work": dict(self.thread_work),
            "bytes": self.nbytes,
            "tensors": self.tensors,
            "asynchronous": self.asynchronous,
        }

    def summary(self) -> str:
        """One line: each phase's seconds, then the threads' summed work."""
        phases = " ".join(f"{k} {self.phases[k]:.3f}" for k in PHASES if k in self.phases)
        work = " ".join(f"{k} {v:.3f}" for k, v in sorted(self.thread_work.items()))
        return f"{phases} | threads: {work}" if work else phases


_last: SaveProfile | None = None


def record(profile: SaveProfile) -> None:
    """The save that owns ``profile`` has completed."""
    global _last
    _last = profile


def last_save() -> SaveProfile | None:
    """The breakdown of this process's last completed save, or None."""
    return _last
