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
did not come. The collectives that follow run on a gloo group of their own
(:func:`commit_group`) whose timeout is the same: they never interleave with the training loop's
collectives, and a rank that dies between the roll call and them fails them in that time too.
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
from accelkit.errors import CheckpointError

#: ``ACCELKIT_COMMIT_TIMEOUT_S``'s default: far below the training group's 1800 s
DEFAULT_TIMEOUT_S = 300.0

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
    return f"accelkit/save/{step}/{count}"


@contextlib.contextmanager
def working(step: str) -> Iterator[None]:
    """Show the ranks waiting at the next roll call of ``step`` that this rank is alive and
    still at work (a heartbeat through the store, every second or so)."""
    if not _multi():
        yield
        return
    store = distributed._store()
    alive = _keys(step, _calls.get(step, 0) + 1) + "/alive"
    stop = threading.Event()
    every = min(1.0, timeout_s() / 4)

    def beat() -> None:
        while not stop.wait(every):
            try:
                store.add(alive, 1)
            except Exception:  # the store is gone: the roll call will say so
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
        with contextlib.suppress(Exception):
            store.delete_key(f"{_keys(step, count - 1)}/{rank}")
            if rank == 0:
                store.delete_key(f"{_keys(step, count - 1)}/n")
                store.delete_key(f"{_keys(step, count - 1)}/alive")


def agree(error: BaseException | None, what: str, group: Any = None) -> None:
    """All ranks (of ``group``) learn whether any rank failed; every rank then raises the same
    error."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages = distributed.all_gather_object(message, group)
    failed = [(r, m) for r, m in enumerate(messages) if m]
    if not failed:
        return
    if error is not None and len(failed) == 1 and isinstance(error, CheckpointError):
        error.agreed = True  # type: ignore[attr-defined]
        raise error
    detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
    agreed = CheckpointError(f"{what} failed: {detail}")
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
