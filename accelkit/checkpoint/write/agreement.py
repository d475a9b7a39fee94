"""How the ranks of one save wait for each other, each wait bounded.

The heart of a save, whatever it writes to (a directory, or object storage):

1. every rank writes (or uploads) its shards, inside :func:`working`;
2. every rank reports: a roll call (:func:`report`), then the records (or errors) go to rank 0;
3. rank 0 writes the manifest and commits, inside :func:`working`; every rank learns the
   outcome through another :func:`report`.

The steps before it (rank 0 prepares the location, every rank plans and snapshots its share)
close the same way. The disk writer's steps are named ``started``, ``prepared``, ``planned``,
``written`` and ``committed``.

A rank that died, or never called ``save()``, must not keep the others waiting for the training
group's timeout (30 minutes by default), and a rank that is still writing a large file to a slow
disk must not be taken for a dead one. So each report opens with a roll call through the process
group's store, which waits as long as the ranks still missing show signs of life (the
:func:`working` heartbeat) and fails :func:`timeout_s` after the last one, naming the ranks that
did not come. A rank that was sending heartbeats and stops (its process died, its node is gone)
is named within :func:`lost_after_s` instead, not at the commit timeout; a slow disk keeps the
heartbeat going (it beats from a thread of its own). The collectives that follow run on a gloo
group of their own (:func:`commit_group`) whose timeout is the same: they never interleave with
the training loop's collectives, and a rank that dies between the roll call and them fails them
in that time too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from accelkit import distributed
from accelkit.checkpoint.read import same_source
from accelkit.errors import CheckpointError, PartialLoadError

#: ``ACCELKIT_COMMIT_TIMEOUT_S``'s default: far below the training group's 1800 s
DEFAULT_TIMEOUT_S = 300.0
#: ``ACCELKIT_HEARTBEAT_LOST_S``'s default: ten missed heartbeats (one a second)
DEFAULT_LOST_AFTER_S = 10.0

_calls: dict[str, int] = {}  # roll calls of each step on this rank (every rank counts alike)
_group: Any = None


def timeout_s() -> float:
    """Seconds a rank waits for a silent peer at each step of a save (``ACCELKIT_COMMIT_TIMEOUT_S``,
    default 300)."""
    raw = os.environ.get("ACCELKIT_COMMIT_TIMEOUT_S", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise CheckpointError(
            f"ACCELKIT_COMMIT_TIMEOUT_S={raw!r}: give a number of seconds > 0 "
            f"(default {DEFAULT_TIMEOUT_S:g})"
        )
    return value


def lost_after_s() -> float:
    """Seconds without a heartbeat after which a rank that was sending them is taken for dead
    at a save's roll call (``ACCELKIT_HEARTBEAT_LOST_S``, default 10)."""
    raw = os.environ.get("ACCELKIT_HEARTBEAT_LOST_S", "").strip()
    if not raw:
        return DEFAULT_LOST_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise CheckpointError(
            f"ACCELKIT_HEARTBEAT_LOST_S={raw!r}: give a number of seconds > 0 "
            f"(default {DEFAULT_LOST_AFTER_S:g})"
        )
    return value


def heartbeat_s() -> float:
    """Seconds between a working rank's heartbeats."""
    return min(1.0, timeout_s() / 4, lost_after_s() / 4)


def _multi() -> bool:
    import torch.distributed as dist

    return distributed.is_initialized() and dist.get_world_size() > 1


def commit_group() -> Any:
    """A gloo group over every rank for a save's collectives, with :func:`timeout_s` as its
    timeout (made once; collective); None with a single process."""
    global _group
    import torch.distributed as dist

    if not _multi():
        return None
    if _group is None:
        timeout = datetime.timedelta(seconds=timeout_s())
        _group = dist.new_group(backend="gloo", timeout=timeout)
    return _group


def _keys(step: str, count: int) -> str:
    return f"save/{step}/{count}"


@contextlib.contextmanager
def working(step: str) -> Iterator[None]:
    """Show the ranks waiting at the next roll call of ``step`` that this rank is alive and
    still at work (a heartbeat through the store, every second or so)."""
    if not _multi():
        yield
        return
    import torch.distributed as dist

    store = distributed._store()
    base = _keys(step, _calls.get(step, 0) + 1)
    alive, mine = f"{base}/alive", f"{base}/alive/{dist.get_rank()}"
    stop = threading.Event()
    every = heartbeat_s()

    def beat() -> None:
        while True:
            try:
                store.add(alive, 1)  # a sign of life for the commit timeout
                store.add(mine, 1)  # and whose, for a peer that stops beating
            except Exception:  # the store is gone: the roll call will say so
                return
            if stop.wait(every):
                return

    thread = threading.Thread(target=beat, name="accelkit-save-alive", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def roll_call(step: str, what: str) -> None:
    """Wait until every rank reached this step of the save; raise :class:`CheckpointError`
    naming the ranks that did not, once none of them has shown a sign of life (arrived, or a
    :func:`working` heartbeat) for :func:`timeout_s`."""
    timeout = timeout_s()  # a malformed setting is refused on one process too
    if not _multi():
        return
    import torch.distributed as dist

    store, rank, world = distributed._store(), dist.get_rank(), dist.get_world_size()
    count = _calls[step] = _calls.get(step, 0) + 1
    base = _keys(step, count)
    lost = _LostPeers(store, base, rank, world, f"{what}: ", step)
    try:
        store.set(f"{base}/{rank}", "1")
        arrived = store.add(f"{base}/n", 1)
        seen, last_change, pause = -1, time.monotonic(), 0.002
        while arrived < world:
            time.sleep(pause)
            pause = min(2 * pause, 0.1)
            arrived = store.add(f"{base}/n", 0)
            signs = arrived + store.add(f"{base}/alive", 0)
            now = time.monotonic()
            lost.look(now)
            if signs != seen:
                seen, last_change = signs, now
            elif now - last_change > timeout:
                missing = [r for r in range(world) if not store.check([f"{base}/{r}"])]
                message = (
                    f"{what}: rank(s) {missing} did not reach the '{step}' step of the save "
                    f"within {timeout:.0f} s (ACCELKIT_COMMIT_TIMEOUT_S): dead, stalled, or "
                    "not calling save(), which every rank must call. Nothing was committed; "
                    "earlier checkpoints are intact."
                )
                distributed.post_abort(message)
                raise CheckpointError(message)
    except CheckpointError:
        raise
    except Exception as err:  # the store's host (rank 0, or the launcher) is gone
        raise CheckpointError(
            f"{what}: rank {rank} lost the process group's store at the '{step}' step of the "
            f"save ({type(err).__name__}: {err}); rank 0 (or the launcher holding the store) "
            "is gone. Nothing was committed; earlier checkpoints are intact."
        ) from err
    if count > 1:  # every rank passed the previous save's step: its keys can go
        previous = _keys(step, count - 1)
        with contextlib.suppress(Exception):
            store.delete_key(f"{previous}/{rank}")
            store.delete_key(f"{previous}/alive/{rank}")
            if rank == 0:
                store.delete_key(f"{previous}/n")
                store.delete_key(f"{previous}/alive")
                store.delete_key(f"{previous}/lost")


class _LostPeers:
    """Names a rank whose heartbeats stopped, at most once a heartbeat interval.

    Rank 0 watches every rank still missing; the others watch rank 0 and read what rank 0
    found (``<base>/lost``), so the store answers O(world) reads a second, not O(world^2). A
    rank that never beat (it has not reached the save yet) is left to the commit timeout."""

    def __init__(self, store: Any, base: str, rank: int, world: int, what: str, step: str):
        self.store, self.base, self.rank, self.what, self.step = store, base, rank, what, step
        self.watched = [r for r in range(world) if r != rank] if rank == 0 else [0]
        self.every, self.limit = heartbeat_s(), lost_after_s()
        self.beats: dict[int, tuple[int, float]] = {}
        self.next_look = time.monotonic() + self.every

    def look(self, now: float) -> None:
        if now < self.next_look:
            return
        self.next_look = now + self.every
        store = self.store
        if store.check([f"{self.base}/lost"]):
            raise CheckpointError(store.get(f"{self.base}/lost").decode(errors="replace"))
        gone = []
        for r in self.watched:
            if store.check([f"{self.base}/{r}"]):
                continue  # arrived
            beats = store.add(f"{self.base}/alive/{r}", 0)
            last = self.beats.get(r)
            if last is None or beats != last[0]:
                self.beats[r] = (beats, now)
            elif beats > 0 and now - last[1] > self.limit:
                gone.append(r)
        if gone:
            message = (
                f"{self.what}rank(s) {gone} stopped sending heartbeats at the '{self.step}' step "
                f"of the save (none for {self.limit:g} s, ACCELKIT_HEARTBEAT_LOST_S): the "
                "process died or its node is gone. Nothing was committed; earlier checkpoints "
                "are intact."
            )
            with contextlib.suppress(Exception):
                store.set(f"{self.base}/lost", message)
            distributed.post_abort(message)
            raise CheckpointError(message)


def agree(error: BaseException | None, what: str, group: Any = None) -> None:
    """All ranks (of ``group``) learn whether any rank failed; every rank then raises the same
    error."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages = distributed.all_gather_object(message, group)
    failed = [(r, m) for r, m in enumerate(messages) if isinstance(m, str)]
    if not failed:
        return
    opened = same_source.peers_opened(messages)  # a load's digest check paired with this
    if opened and error is not None:
        refused = same_source.cannot_read(error, opened, what)
        refused.agreed = True  # type: ignore[attr-defined]
        raise refused from error
    if error is not None and len(failed) == 1 and isinstance(error, CheckpointError):
        error.agreed = True  # type: ignore[attr-defined]
        raise error
    detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
    # a load that failed on one rank after it began writing leaves the job's state a mix on
    # every rank (the others' fills went on): every rank says so
    partial = any(m.startswith(f"{PartialLoadError.__name__}:") for _, m in failed)
    agreed = (PartialLoadError if partial else CheckpointError)(f"{what} failed: {detail}")
    agreed.agreed = True  # type: ignore[attr-defined]
    raise agreed from error


def was_agreed(error: BaseException) -> bool:
    """Whether ``error`` came out of :func:`agree` (so every rank of the group raises it now)."""
    return bool(getattr(error, "agreed", False))


def report(step: str, error: BaseException | None, what: str, group: Any) -> None:
    """Every rank reports at ``step``: the roll call, then every rank learns whether any
    failed (:func:`agree`, on ``group``)."""
    roll_call(step, what)
    agree(error, what, group)
