"""Start the processes of a run from Python, and let one process go first.

:func:`launch` is for notebooks and for scripts that start their own processes instead of
running under ``torchrun`` or ``srun``::

    def train(lr):
        accel = accelkit.get("ddp")          # joins the group launch() set up
        ...
        return final_loss

    if __name__ == "__main__":
        losses = accelkit.launch(train, 1e-3, nproc=2)   # one result per rank, by rank

:func:`main_process_first` (also :meth:`Accelerator.main_process_first`) runs a block on the
main process before the others, for work that fills a cache the others then read (a download,
a tokenised dataset). The waiting ranks wait on the process group's store, not in a collective,
and accelkit refuses collectives inside the block, so a block that needs every rank (building a
ZeRO-3 model, ``setup``, ``save``) fails at once with an error instead of hanging (accelerate
#3709); a block that takes longer than the group's timeout fails with an error that says so.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from accelkit import distributed
from accelkit.errors import ConfigError, DistributedError

log = logging.getLogger("accelkit")

#: what a launcher sets; launch() refuses to nest inside one
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RankFailedError(DistributedError):
    """A rank started by :func:`launch` raised or exited without a result."""


def _interactive() -> bool:
    """A notebook or a REPL: functions defined there cannot be imported by a spawned child."""
    main = sys.modules.get("__main__")
    return main is None or not hasattr(main, "__file__")


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
    conn: Any,
) -> None:
    os.environ.update(env)
    try:
        result = fn(*args, **kwargs)
    except BaseException as err:  # reported to the parent, which re-raises
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        conn.send(("error", f"{type(err).__name__}: {err}", text))
        conn.close()
        distributed.post_abort(f"raised {type(err).__name__}: {err}")
        raise SystemExit(1) from None
    try:
        conn.send(("ok", result, ""))
    except Exception as err:  # the result does not pickle
        conn.send(("error", f"its result could not be sent back: {err}", ""))
        raise SystemExit(1) from None
    finally:
        conn.close()
    # leave the group here: a forked child ends with os._exit, which runs no atexit handler
    distributed._leave_group_at_exit()


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int | None = None,
    start_method: str | None = None,
    master_port: int | None = None,
    grace_s: float = 30.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` new local processes; their results, by rank.

    Each process gets the environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``accelkit.get("ddp")`` (or any
    distributed backend) inside ``fn`` joins the same group: gloo on the CPU, NCCL on CUDA with
    GPU ``LOCAL_RANK`` per process. ``nproc`` defaults to the number of GPUs (1 without one).

    ``start_method``: ``"fork"`` by default in a notebook or REPL (``fn`` may be defined there;
    CUDA must not be initialised in this process yet), ``"spawn"`` in a script (``fn`` must be
    importable: define it at module level and call launch under ``if __name__ == "__main__"``).

    If a rank raises, the others are given ``grace_s`` seconds to end (their next collective
    fails naming the cause) and are then terminated; :class:`RankFailedError` names the rank and
    carries its traceback. Results travel back pickled.
    """
    nproc = _default_nproc() if nproc is None else nproc
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be an int >= 1, got {nproc!r}")
    present = [k for k in ("RANK", "WORLD_SIZE") if k in os.environ]
    if present or distributed.is_initialized():
        raise ConfigError(
            "accelkit.launch() starts the processes itself, but this process is already one "
            f"rank of a run ({', '.join(present) or 'a process group exists'}); under torchrun "
            "or srun call the function directly instead of through launch()"
        )
    method = start_method or ("fork" if _interactive() else "spawn")
    if method not in multiprocessing.get_all_start_methods():
        raise ConfigError(
            f"start_method {method!r} is not available here; use one of "
            f"{multiprocessing.get_all_start_methods()}"
        )
    if method == "fork":
        import torch

        if torch.cuda.is_initialized():
            raise ConfigError(
                "CUDA is already initialised in this process, and a forked child cannot use it. "
                "Restart the kernel and call accelkit.launch() before anything touches CUDA, or "
                "pass start_method='spawn' with fn defined in an importable module."
            )
    ctx = multiprocessing.get_context(method)
    port = master_port or distributed.free_port()
    procs, conns = [], []
    for rank in range(nproc):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child,
            args=(fn, args, kwargs, env, child_end),
            name=f"accelkit-rank-{rank}",
        )
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    return _collect(procs, conns, grace_s)


def _collect(procs: list[Any], conns: list[Any], grace_s: float) -> list[Any]:
    from multiprocessing.connection import wait

    results: dict[int, Any] = {}
    failures: dict[int, tuple[str, str]] = {}
    pending = dict(enumerate(conns))
    deadline = None
    finished = False
    try:
        while pending:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
            ready = wait(list(pending.values()), timeout=timeout)
            if not ready:  # the grace period after a failure is over
                break
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, value, text = conn.recv()
                except EOFError:  # died without a word (killed, os._exit, a crash)
                    procs[rank].join(5)
                    status, value, text = "error", f"exited with {procs[rank].exitcode}", ""
                del pending[rank]
                if status == "ok":
                    results[rank] = value
                else:
                    failures[rank] = (value, text)  # in the order they failed
                    deadline = deadline or time.monotonic() + grace_s
        finished = not pending
    finally:
        for proc in procs:  # all reported: let them exit; else (a failure, ^C) do not wait long
            proc.join(grace_s if finished and not failures else 1)
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
                failures.setdefault(rank, ("terminated after another rank failed", ""))
        for conn in conns:
            conn.close()
    if failures:
        first = next(iter(failures))  # the first to fail; the others usually failed because of it
        reason, text = failures[first]
        others = ", ".join(
            f"rank {r}: {why}" for r, (why, _) in sorted(failures.items()) if r != first
        )
        raise RankFailedError(
            f"rank {first} of {len(procs)} failed: {reason}"
            + (f" (also {others})" if others else "")
            + (f"\n\n--- rank {first}'s traceback ---\n{text}" if text else "")
        )
    return [results[r] for r in range(len(procs))]


# ---- main process first ----------------------------------------------------------------------
_FIRST_CALLS = [0]


@contextlib.contextmanager
def main_process_first(
    accel: Any = None, *, local: bool = False, timeout_s: float | None = None
) -> Iterator[None]:
    """Run the block on the main process (``local=True``: each node's local main) first, then
    on the others.

    The others wait on the process group's store (no collective), up to ``timeout_s`` (default:
    the group's timeout). Inside the block accelkit's collectives raise at once (they would pair
    with what the other ranks do meanwhile). If the block raises on the main process, the others
    raise too instead of running it. One process, or no group: the block just runs.
    """
    del accel  # the group is the process's; the argument reads well at the call site
    if not distributed._multi():
        with distributed.unsynced("main_process_first()"):
            yield
        return
    import datetime

    import torch.distributed as dist

    store = distributed._store()
    rank = dist.get_rank()
    lrank = distributed.local_rank() if local else rank
    leader = rank - lrank  # global rank of this node's local main (ranks are contiguous per node)
    _FIRST_CALLS[0] += 1
    key = f"main_first/{_FIRST_CALLS[0]}/{leader if local else 0}"
    what = "local_main_process_first()" if local else "main_process_first()"
    first = lrank == 0
    if not first:
        timeout = timeout_s or distributed.group_timeout_s()
        try:
            store.wait([key], datetime.timedelta(seconds=timeout))
        except Exception as err:
            raise DistributedError(
                f"rank {rank}: waited {timeout:.0f} s in {what} for rank {leader} to finish the "
                "block. Either the block takes longer (pass timeout_s=), or rank "
                f"{leader} is stuck in it, often in a collective that needs every rank "
                "(building a sharded model, a library's own barrier): move that out of the block."
            ) from err
        outcome = store.get(key).decode(errors="replace")
        if outcome != "ok":
            raise DistributedError(
                f"rank {rank}: rank {leader} failed inside {what}, so this rank does not run "
                f"the block: {outcome}"
            )
    try:
        with distributed.unsynced(what):
            yield
    except BaseException as err:
        if first:
            store.set(key, f"{type(err).__name__}: {err}"[:2000])
        raise
    if first:
        store.set(key, "ok")
