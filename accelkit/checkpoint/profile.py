"""Where a save's or a load's time goes: the phases on the caller's critical path, and the work
the writer threads did beside it.

:func:`last_save` returns the breakdown of this process's last completed save (an asynchronous
save's once it has committed), :func:`last_load` the last load's. ``bench/checkpoint_io.py``
prints them; a slow save on a new machine is diagnosed from them without a profiler. Recording
costs two clock reads per phase and per tensor.
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
#: the phases of a load (the validate phase's checks, then the commit's writes)
LOAD_PHASES = (
    "open",  # the manifest, every file present with its recorded size
    "headers",  # every fragment's key, dtype, shape and range against its file's header
    "verify",  # every checksum (this rank's share), then every rank agrees
    "check",  # the backend's check_load: keys, shapes, optimizer groups
    "sections",  # scheduler, stateful, extras, backend and RNG sections decoded
    "fill",  # the backend's load_fragments: bytes into the live tensors
    "restore",  # schedulers, statefuls, extras, backend state, RNG
)


@dataclass
class SaveProfile:
    """The breakdown of one save on this rank."""

    phases: dict[str, float] = field(default_factory=dict)
    thread_work: dict[str, float] = field(default_factory=dict)
    nbytes: int = 0
    tensors: int = 0
    asynchronous: bool = False
    #: who wrote the rank file: "threads" (of this process) or "process" (the writer process
    #: of an asynchronous save, :mod:`accelkit.checkpoint.write.write_process`)
    writer: str = "threads"
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

    def _ordered(self) -> dict[str, float]:
        order = {name: i for i, name in enumerate((*PHASES, *LOAD_PHASES))}
        return dict(sorted(self.phases.items(), key=lambda kv: order.get(kv[0], len(order))))

    def as_dict(self) -> dict[str, object]:
        return {
            "phases": self._ordered(),
            "thread_work": dict(self.thread_work),
            "bytes": self.nbytes,
            "tensors": self.tensors,
            "asynchronous": self.asynchronous,
            "writer": self.writer,
        }

    def summary(self) -> str:
        """One line: each phase's seconds, then the threads' summed work."""
        phases = " ".join(f"{k} {v:.3f}" for k, v in self._ordered().items())
        work = " ".join(f"{k} {v:.3f}" for k, v in sorted(self.thread_work.items()))
        return f"{phases} | {self.writer}: {work}" if work else phases


_last: dict[str, SaveProfile] = {}


def record(profile: SaveProfile, what: str = "save") -> None:
    """The save (or load) that owns ``profile`` has completed."""
    _last[what] = profile


def last_save() -> SaveProfile | None:
    """The breakdown of this process's last completed save, or None."""
    return _last.get("save")


def last_load() -> SaveProfile | None:
    """The breakdown of this process's last completed load, or None."""
    return _last.get("load")
