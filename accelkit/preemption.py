"""Preemption: stop at a step boundary on a signal, save, exit 0; resume from the latest checkpoint.

A cluster warns a job before it kills it: SLURM sends ``SIGUSR1`` (``--signal=USR1@120``) or
``SIGTERM`` (at ``scancel`` and at the time limit, ``KillWait`` seconds before ``SIGKILL``),
Kubernetes and most cloud spot instances send ``SIGTERM``. The signal may reach one rank or all of
them, at any point of a step. :class:`StopSignal` turns it into a flag that every rank reads at the
same step: ``accel.should_stop`` all-reduces the flag (max over ranks), so if any rank was
signalled, every rank sees ``True`` at the same check and the loop saves the same step everywhere::

    for batch in loader:
        ...
        accel.step()
        if accel.should_stop:                  # one tiny all-reduce per check
            accel.save(f"ckpt/step-{step}", state)
            break                              # the script ends normally: exit status 0

and at the start of the script, ``accel.auto_resume("ckpt", state)`` loads the newest complete
checkpoint there, if there is one.

Handlers are installed the first time the loop asks (``accel.should_stop``) or by
:meth:`Accelerator.stop_on_signals`; until then a signal does what it did before. Once installed,
a signal no longer terminates the process: the loop must check ``should_stop``. A second signal is
also only recorded, so a save already running is not cut short by a later ``SIGTERM``.

``SIGTERM`` means the launcher kills the job soon (torchrun, SLURM and Kubernetes send
``SIGKILL`` 30 s later by default). A process that has not ended ``ACCELKIT_SIGTERM_GRACE_S``
(default 25) seconds after it, because its loop never reached a step boundary (a collective
waiting for a dead rank) or its save is still running, ends itself: one line on stderr naming
the checkpoint not written, if a save was in flight, and exit status 143 (128 + SIGTERM). The
clock runs even while the main thread waits inside a collective, where no Python signal
handler can run: the signal also wakes a watcher thread (``signal.set_wakeup_fd``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from accelkit import distributed
from accelkit.errors import ConfigError

log = logging.getLogger("accelkit")

#: the Accelerator whose loop stops (``Any``: the facade imports this module)
_Accelerator = Any

#: what a cluster sends before it kills a job: SIGTERM (scancel, time limit, Kubernetes, spot
#: instances) and SIGUSR1 (SLURM's configurable warning, ``--signal=USR1@<seconds>``)
DEFAULT_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
#: seconds a process may run on after SIGTERM (``ACCELKIT_SIGTERM_GRACE_S``): below the 30 s after
#: which torchrun, SLURM (KillWait) and Kubernetes send SIGKILL by default
DEFAULT_GRACE_S = 25.0


def grace_s() -> float:
    """``ACCELKIT_SIGTERM_GRACE_S`` (default 25; ``inf``: wait for the launcher's SIGKILL)."""
    raw = os.environ.get("ACCELKIT_SIGTERM_GRACE_S", "").strip()
    if not raw:
        return DEFAULT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"ACCELKIT_SIGTERM_GRACE_S={raw!r}: give a number of seconds > 0, or 'inf' "
            f"(default {DEFAULT_GRACE_S:g})"
        )
    return value


def _as_signal(value: str | int | signal.Signals) -> signal.Signals | None:
    """``"SIGTERM"``, ``"TERM"``, ``15`` or ``signal.SIGTERM`` -> the signal; None where this
    platform lacks it (SIGUSR1 on Windows)."""
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return signal.Signals(value)
        except ValueError as err:
            raise ConfigError(f"{value} is not a signal number") from err
    if isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in signal.Signals.__members__:
            return signal.Signals[name]
        if name in ("SIGUSR1", "SIGUSR2", "SIGHUP"):
            return None  # a POSIX signal this platform does not have
        raise ConfigError(f"unknown signal {value!r}; use a name such as 'SIGTERM' or 'SIGUSR1'")
    raise ConfigError(f"a signal is a name or a number, got {type(value).__name__}")


class StopSignal:
    """Turns signals into a stop flag that every rank reads the same at the same step.

    ``check_every`` reads out of ``check_every`` do the all-reduce; the others return the last
    agreed value. Ranks stay in step because each rank counts its own reads and the loop reads
    at the same places on every rank.
    """

    def __init__(
        self,
        signals: Iterable[str | int | signal.Signals] = DEFAULT_SIGNALS,
        *,
        check_every: int = 1,
    ) -> None:
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ConfigError(f"check_every must be an int >= 1, got {check_every!r}")
        resolved = [_as_signal(s) for s in signals]
        self.signals: tuple[signal.Signals, ...] = tuple(dict.fromkeys(s for s in resolved if s))
        self.check_every = check_every
        #: the signal this rank received first (None: none yet)
        self.received: signal.Signals | None = None
        #: set by :meth:`request` (a loop's own reason to stop: a time budget, a divergence)
        self.requested = False
        self._previous: dict[signal.Signals, Any] = {}
        self._agreed = False
        self._reads = 0
        self._reported = False
        self._grace: threading.Timer | None = None
        self._arming = threading.Lock()
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None

    # ---- handlers -----------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Install the handlers (main thread only); False where they could not be installed."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "accelkit: signal handlers can only be installed from the main thread; "
                "should_stop reacts to request_stop() only"
            )
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if signal.SIGTERM in self.signals and math.isfinite(grace_s()):
            self._watch_wakeups()
        return True

    def uninstall(self) -> None:
        """Give the signals back to the handlers that were there before."""
        for sig, previous in self._previous.items():
            try:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError):  # not the main thread, or a foreign handler object
                log.debug("could not restore the handler of %s", sig.name)
        self._previous.clear()
        self._disarm()
        if self._wakeup is not None:
            ours, theirs, previous = self._wakeup
            self._wakeup = None
            try:
                current = signal.set_wakeup_fd(previous)
                if current != ours.fileno():  # someone set theirs after ours: keep it
                    signal.set_wakeup_fd(current)
            except ValueError:  # not the main thread
                log.debug("could not restore the signal wakeup descriptor")
            ours.close()
            theirs.close()  # ends the watcher thread

    def _handle(self, signum: int, frame: Any) -> None:
        # keep a signal handler minimal: record, and let the step boundary do the rest
        if self.received is None:
            self.received = signal.Signals(signum)
        if signum == signal.SIGTERM:
            self._arm()

    # ---- SIGTERM's grace period ---------------------------------------------------------------
    def _watch_wakeups(self) -> None:
        """Learn of signals from a thread of our own: Python runs signal handlers in the main
        thread between bytecodes, never while it waits inside a collective."""
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(ours.fileno(), warn_on_full_buffer=False)
        except ValueError:
            ours.close()
            theirs.close()
            return
        self._wakeup = (ours, theirs, previous)
        watcher = threading.Thread(
            target=self._read_wakeups, args=(theirs, previous), name="accelkit-signals", daemon=True
        )
        watcher.start()

    def _read_wakeups(self, theirs: socket.socket, previous: int) -> None:
        while True:
            try:
                data = theirs.recv(64)
            except OSError:
                return
            if not data:
                return
            if previous >= 0:  # whoever watched before us (an asyncio loop) still hears them
                try:
                    os.write(previous, data)
                except OSError:
                    pass
            if signal.SIGTERM in data:
                self._arm()

    def _arm(self) -> None:
        """Start SIGTERM's grace period (once; from the handler or the watcher thread)."""
        with self._arming:
            if self._grace is not None:
                return
            timer = threading.Timer(grace_s(), _end_after_grace, args=(grace_s(),))
            timer.daemon = True
            self._grace = timer
            timer.start()

    def _disarm(self) -> None:
        timer, self._grace = self._grace, None
        if timer is not None:
            timer.cancel()

    def request(self) -> None:
        """Ask every rank to stop at the next check, as a signal on this rank would."""
        self.requested = True

    @property
    def local(self) -> bool:
        """Whether this rank alone wants to stop (no collective)."""
        return self.received is not None or self.requested

    # ---- agreement ----------------------------------------------------------------------------
    def check(self, device: torch.device | str = "cpu") -> bool:
        """True on every rank once any rank was signalled (an all-reduce with several ranks).

        Under an elastic agent with several nodes the same all-reduce also says which nodes were
        signalled; when some were and this one was not, this node goes on without them
        (:func:`continue_without`)."""
        if self._agreed:
            return True
        self._reads += 1
        if (self._reads - 1) % self.check_every:
            return False
        node, nodes = elastic_node() or (0, 0)
        flags = torch.zeros(1 + nodes, dtype=torch.int32)
        flags[0] = 1 if self.local else 0
        if nodes and self.received is not None:  # a signal, not request_stop(): the node leaves
            flags[1 + node] = 1
        wanted = distributed.all_reduce(flags.to(device), "max").cpu()
        if int(wanted[0]) > 0:
            self._agreed = True
            self._report()
            leaving = [n for n in range(nodes) if int(wanted[1 + n]) > 0]
            if leaving and node not in leaving and len(leaving) < nodes:
                continue_without(leaving, self)
        return self._agreed

    def _report(self) -> None:
        if self._reported:
            return
        self._reported = True
        why = (
            f"received {self.received.name}"
            if self.received is not None
            else ("stop requested" if self.requested else "another rank was told to stop")
        )
        rank = torch.distributed.get_rank() if distributed.is_initialized() else 0
        # every rank logs (the rank-zero filter shows rank 0's line): which rank saw what
        log.warning("rank %d: %s; stopping at this step boundary", rank, why)

    def reset(self) -> None:
        """Forget a stop (after the loop handled it, to keep training in the same process)."""
        self.received, self.requested = None, False
        self._agreed, self._reported = False, False
        self._disarm()


# ---- partial preemption: a node leaves an elastic job, the others go on -----------------------
#: the exit status of a process whose node goes on after other nodes were preempted: not 0, so
#: that its elastic agent restarts the workers and meets the remaining nodes at a new rendezvous
#: (75: EX_TEMPFAIL, "try again")
CONTINUE_STATUS = 75


def elastic_node() -> tuple[int, int] | None:
    """(this node's index, number of nodes) under torchrun's elastic agent with several nodes
    (``GROUP_RANK``, ``GROUP_WORLD_SIZE``); None otherwise."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        node, nodes = int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (node, nodes) if nodes > 1 and 0 <= node < nodes else None


def continue_without(leaving: list[int], watcher: StopSignal | None = None) -> None:
    """Other nodes were signalled and leave; this one was not. The loop saves and stops as
    everywhere (the checkpoint has every rank's state), then this process exits with
    :data:`CONTINUE_STATUS` instead of 0: a worker that ends 0 tells its agent the job is done,
    and a survivor would report success with the work undone. The agent restarts its workers
    (one of ``--max-restarts``), they meet at a rendezvous without the leaving nodes, and
    ``auto_resume`` goes on from the checkpoint at the smaller world size. A static job
    (``--nnodes N``) cannot shrink: its rendezvous waits for the lost node, then fails. If this
    process is signalled too before it ends (its node is preempted a moment later), it leaves
    like the others, with the script's own status."""
    rank = torch.distributed.get_rank() if distributed.is_initialized() else 0
    log.warning(
        "rank %d: node(s) %s were signalled and leave the job; this node goes on: after the "
        "save, this process exits with status %d so that its elastic agent starts it again at "
        "a rendezvous without them",
        rank,
        leaving,
        CONTINUE_STATUS,
    )
    distributed.exit_status_at_exit(
        CONTINUE_STATUS, lambda: watcher is None or watcher.received is None
    )


def _end_after_grace(grace: float) -> None:
    """SIGTERM's grace period is over and the process still runs: end it now, before the
    launcher's SIGKILL, saying which checkpoint (if any) was not written."""
    from accelkit.checkpoint.write import background

    saving = background.pending()
    lost = f"; the checkpoint {saving} was not written" if saving is not None else ""
    sys.stderr.write(
        f"accelkit: SIGTERM came {grace:g} s ago and this process has not ended (a collective "
        f"waiting for another rank, or a save still running){lost}; exiting with status "
        f"{128 + signal.SIGTERM} (ACCELKIT_SIGTERM_GRACE_S)\n"
    )
    logging.shutdown()
    sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)


# ---- the Accelerator's side ----------------------------------------------------------------------
def watcher_of(accel: _Accelerator, *, install: bool = True) -> StopSignal:
    """The accelerator's :class:`StopSignal`, created with the default signals on first use."""
    watcher = accel._stop_signal
    if watcher is None:
        watcher = accel._stop_signal = StopSignal()
    if install and not watcher.installed:
        watcher.install()
    return watcher


def stop_on_signals(
    accel: _Accelerator,
    signals: Iterable[str | int | signal.Signals] | None = None,
    *,
    check_every: int = 1,
) -> StopSignal:
    """Install (or replace) the accelerator's signal handlers; ``signals=()`` installs none."""
    old = accel._stop_signal
    if old is not None:
        old.uninstall()
    watcher = StopSignal(DEFAULT_SIGNALS if signals is None else signals, check_every=check_every)
    if old is not None:  # a stop already on its way is not lost by reconfiguring
        watcher.received, watcher.requested = old.received, old.requested
    watcher.install()
    accel._stop_signal = watcher
    return watcher


def latest_checkpoint(directory: str | Path) -> Any:
    """The newest complete checkpoint under ``directory`` (or ``directory`` itself), or None.

    ``latest`` names it when valid; otherwise (a save killed between its rename and the pointer
    update, a pointer to a deleted directory, or one refused for leading outside ``directory``)
    the complete checkpoint directory with the highest recorded step, then the last name in
    natural order (``step-10`` after ``step-9``); never the newest by a clock, which may have
    been wrong at a save. A checkpoint of ``latest``'s name pattern and a higher step beside
    the one it names wins (a save that committed and was killed before it moved ``latest``).
    Links that lead outside ``directory`` are not considered. Half-written saves never carry a
    checkpoint's name, so they are not seen.
    """
    from accelkit.checkpoint.store import store_for

    store = store_for(directory)
    newest = store.newest(str(directory))
    if newest is None or store.scheme:
        return newest  # object storage: a URL (a prefix without a manifest is never one)
    return Path(newest)


def auto_resume(
    accel: _Accelerator, directory: str | Path, state: dict[str, Any], **load_kwargs: Any
) -> Path | None:
    """Load the newest complete checkpoint under ``directory`` into ``state``; None if none.

    Rank 0 picks the checkpoint and every rank loads that one (ranks never disagree because one
    of them saw a newer directory first). First, every rank checks that it sees ``directory`` as
    rank 0 does (a marker file; object storage needs none), so a directory on each node's own
    disk is refused before training starts, and the load checks that every rank read the same
    manifest (:mod:`accelkit.checkpoint.read.same_source`). Plain values in ``state`` (a step
    counter) are replaced by the saved ones; ``load_kwargs`` go to :meth:`Accelerator.load`.
    """
    from accelkit.checkpoint.read import same_source
    from accelkit.checkpoint.store import is_remote

    same_source.check_shared_directory(directory)  # node-private disks fail now, not at a save
    found = latest_checkpoint(directory) if accel.rank == 0 else None
    chosen = distributed.broadcast_object(None if found is None else str(found), 0)
    if chosen is None:
        log.info("auto_resume: no checkpoint under %s; starting fresh", directory)
        return None
    path: Any = chosen if is_remote(chosen) else Path(chosen)  # a URL stays a URL
    unconsumed = accel.load(path, state, **load_kwargs)
    if unconsumed:
        log.debug("auto_resume: saved but not in state: %s", ", ".join(sorted(unconsumed)))
    log.info("resumed from %s", path)
    return path
