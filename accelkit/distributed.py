"""Process-group plumbing: how we were launched, joining the group, and collectives that work
the same with one process or many."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("accelkit")

DEFAULT_TIMEOUT_S = 1800.0


def is_initialized() -> bool:
    """Whether the default process group exists (False where torch.distributed is absent)."""
    return dist.is_available() and dist.is_initialized()


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: ``gpu-node-[003-004,009],x1`` -> ``gpu-node-003``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        return nodelist
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_env() -> dict[str, str] | None:
    """Map SLURM's variables onto torch's when a script runs under ``srun`` without torchrun."""
    if "SLURM_PROCID" not in os.environ or "RANK" in os.environ:
        return None
    if os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    env = {
        "RANK": os.environ["SLURM_PROCID"],
        "WORLD_SIZE": os.environ.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0"),
    }
    if "MASTER_ADDR" not in os.environ:
        env["MASTER_ADDR"] = first_slurm_host(os.environ.get("SLURM_NODELIST", "127.0.0.1"))
    if "MASTER_PORT" not in os.environ:
        env["MASTER_PORT"] = str(15000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000)
    return env


def launched_world_size() -> int:
    """World size of the launcher that started us (torchrun, SLURM), 1 when none."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    slurm = _slurm_env()
    return int(slurm["WORLD_SIZE"]) if slurm else 1


def local_rank() -> int:
    """This process's rank on its node, from torchrun's ``LOCAL_RANK`` or SLURM's ``SLURM_LOCALID``."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return int(os.environ.get("SLURM_LOCALID", "0"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: how long the exit handler releases the GIL for gloo's worker threads (see below)
_GLOO_DRAIN_S = 0.1


def init_process_group(device: torch.device, timeout_s: float | None = None) -> None:
    """Join the default process group (gloo on CPU, nccl on CUDA) if not already in one.

    A single process started without a launcher gets a group of one, so distributed backends
    run unchanged in a notebook. ``timeout_s`` bounds every collective: a rank that dies makes
    the others fail within it instead of hanging.
    """
    if is_initialized():
        if _ATTEMPT[0] is None:  # a group someone else made: accelkit's keys still need an id
            begin_attempt(device)
        return
    slurm = _slurm_env()
    if slurm:
        os.environ.update(slurm)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    backend = {"cuda": "nccl", "cpu": "gloo"}.get(device.type, "gloo")
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    atexit.register(_leave_group_at_exit)
    begin_attempt(device)
    if dist.get_world_size() > 1:
        report_failures_once()
    log.debug(
        "joined process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend
    )


def _leave_group_at_exit() -> None:
    """Destroy the group accelkit joined, and let gloo's worker threads finish, before the
    interpreter starts finalizing.

    A ProcessGroupGloo worker thread drops its last finished work a moment after the caller saw
    it complete. Dropping it frees tensors that have Python objects, which needs the GIL; once the
    interpreter is finalizing, taking the GIL exits the thread through a ``noexcept`` frame and
    the process aborts ("terminate called without an active exception", seen in 1 to 9 of 40
    two-rank gloo runs on torch 2.13 CPU, raw PyTorch included; gdb: ``pt_gloo_runloop`` in
    ``take_gil`` from ``TensorImpl::decref_pyobject``). torchrun then reports a finished run as
    failed. atexit handlers run before finalization begins, so releasing the GIL here for a
    moment lets those threads drop their work safely.
    """
    if is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as err:  # exiting anyway; say why, do not mask the real exit status
            log.debug("destroy_process_group at exit failed: %s", err)
    # drain even when the program left the group itself (the demo does, and so do many training
    # scripts): the worker threads outlive destroy_process_group by the same moment
    time.sleep(_GLOO_DRAIN_S)
    _ATTEMPT[0] = None
    status, still = _EXIT_STATUS
    if status is not None and still():  # the last word: the handlers registered later have run
        logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


#: the status this process ends with, whatever the script returns (None: the script's own), and
#: whether it still holds at exit
_EXIT_STATUS: list[Any] = [None, lambda: True]


def exit_status_at_exit(status: int, still: Any = None) -> None:
    """End this process with ``status`` once the script has finished and the group is left
    (after the atexit handlers registered since joining it: trackers, an asynchronous save),
    if ``still()`` (default: always) says it holds then."""
    _EXIT_STATUS[:] = [status, still or (lambda: True)]
    if not is_initialized():  # no group, so no exit handler of ours was registered yet
        atexit.register(_leave_group_at_exit)


# ---- hangs: name the cause instead of waiting forever ----------------------------------------------
#: set while this rank runs a ``main_process_first`` body, where the ranks are not in step, so a
#: collective would pair with whatever the other ranks do next (accelerate #3709)
_UNSYNCED: list[str] = []
#: calls of each name through :func:`rendezvous` on this rank (ranks count alike)
_ARRIVALS: dict[str, int] = {}
#: where a rank that gave up leaves its reason for the others (read when their collective fails)
ABORT_KEY = "abort"

_CAUSES = (
    "not every rank called it (a collective under `if accel.is_main:` or a rank-dependent "
    "branch), or another rank stopped, stalled or died"
)


def _multi() -> bool:
    return is_initialized() and dist.get_world_size() > 1


# ---- accelkit's keys in the group's store: one namespace per attempt ---------------------------
#: this attempt's id, which rank 0 drew and broadcast when accelkit joined the group (None: not
#: joined through accelkit). The store can outlive the processes: under torchrun's default the
#: rendezvous agent hosts it across worker restarts (pytorch #135712), and accelkit's counters
#: and markers restart at 1 in each attempt; without the id they would meet the last attempt's.
_ATTEMPT: list[str | None] = [None]


def begin_attempt(device: torch.device | None = None) -> str:
    """Draw a new attempt id on rank 0 and give it to every rank (one small broadcast; collective).

    Every key accelkit keeps in the store lives under ``accelkit/<id>/`` (:func:`_store`), so a
    restarted group never reads a marker, counter or abort reason of an earlier attempt."""
    import secrets

    ident = secrets.randbits(62)
    if is_initialized() and dist.get_world_size() > 1:
        on = device if device is not None and device.type == "cuda" else torch.device("cpu")
        if dist.get_backend() == "nccl" and on.type != "cuda":
            on = torch.device("cuda", torch.cuda.current_device())
        box = torch.tensor([ident], dtype=torch.int64, device=on)
        dist.broadcast(box, 0)
        ident = int(box.item())
    _ATTEMPT[0] = f"{ident:016x}"
    return _ATTEMPT[0]


def attempt_prefix() -> str:
    """Where accelkit's keys live in the group's store: ``accelkit/<attempt id>/``."""
    return f"accelkit/{_ATTEMPT[0] or 'no-attempt'}/"


def _raw_store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _store() -> Any:
    """The default group's key-value store (a TCPStore under torchrun, srun and accelkit), seen
    through this attempt's namespace (:func:`begin_attempt`): every accelkit key goes here."""
    return dist.PrefixStore(attempt_prefix(), _raw_store())


def group_timeout_s() -> float:
    """The default group's timeout (its store was built with it)."""
    try:
        return _raw_store().timeout.total_seconds()
    except Exception:  # a group without a store: torch's default
        return DEFAULT_TIMEOUT_S


@contextlib.contextmanager
def unsynced(what: str) -> Iterator[None]:
    """Mark a region where this rank runs alone; accelkit's collectives refuse to run in it."""
    _UNSYNCED.append(what)
    try:
        yield
    finally:
        _UNSYNCED.pop()


def refuse_unsynced(call: str) -> None:
    """Fail at once where a collective would deadlock: inside a ``main_process_first`` body."""
    if _UNSYNCED:
        from accelkit.errors import UnsupportedError

        raise UnsupportedError(
            f"{call} needs every rank at the same time, but this rank is inside "
            f"{_UNSYNCED[-1]}, which the ranks enter one after another: it would wait for the "
            "others forever (accelerate #3709). Call it after the `with` block; keep only "
            "per-process work (downloads, dataset preprocessing, reading files) inside."
        )


def post_abort(reason: str) -> None:
    """Leave ``reason`` in the store for the ranks whose collectives fail because of it."""
    if not _multi():
        return
    try:
        store = _store()
        if not store.check([ABORT_KEY]):
            store.set(ABORT_KEY, f"rank {dist.get_rank()}: {reason}")
    except Exception:  # the store may be gone with rank 0
        log.debug("could not post the abort reason", exc_info=True)


def _posted_abort() -> str | None:
    try:
        store = _store()
        if store.check([ABORT_KEY]):
            return store.get(ABORT_KEY).decode(errors="replace")
    except Exception:
        return None
    return None


def rendezvous(what: str, hint: str = "", timeout_s: float | None = None) -> None:
    """Check, through the store and without a collective, that every rank reached ``what``.

    Each rank counts its calls of ``what`` and waits, up to ``timeout_s`` (default: the group's
    timeout), until every rank has made the same call; otherwise it raises
    :class:`~accelkit.errors.DistributedError`
    naming the ranks that did not come. A collective could not name them: it pairs with whatever
    collective the missing ranks run instead, and at best times out saying nothing.
    """
    if not _multi():
        return
    from accelkit.errors import DistributedError

    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    count = _ARRIVALS[what] = _ARRIVALS.get(what, 0) + 1
    keys = [f"arrive/{what}/{count}/{r}" for r in range(world)]
    store.set(keys[rank], "1")
    timeout = group_timeout_s() if timeout_s is None else timeout_s
    limit = (
        f"the process group's timeout of {timeout:.0f} s" if timeout_s is None else f"{timeout:g} s"
    )
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as err:
        try:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
        except Exception:  # rank 0, which holds the store, is gone
            missing = None
        who = "rank 0 (which holds the store)" if missing is None else f"rank(s) {missing}"
        message = (
            f"rank {rank}: {what} (call {count} on this rank) is collective, and {who} did not "
            f"reach it within {limit}. {hint}".strip()
        )
        post_abort(message)
        raise DistributedError(message) from err
    if rank == 0 and count > 1:  # every rank is past the previous call: its keys can go
        for r in range(world):
            with contextlib.suppress(Exception):
                store.delete_key(f"arrive/{what}/{count - 1}/{r}")


def _collective(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a torch collective; a failure becomes an error that says which one and why."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as err:  # DistBackendError, gloo's timeouts, a peer's closed connection
        from accelkit.errors import DistributedError

        rank = dist.get_rank()
        posted = _posted_abort()
        message = (
            f"rank {rank}: {name} failed ({type(err).__name__}: {str(err).strip()[:300]}). "
            f"It is a collective (process group timeout {group_timeout_s():.0f} s): {_CAUSES}."
        )
        if posted:
            message += f" Another rank gave up first: {posted}"
        raise DistributedError(message) from err


def barrier() -> None:
    refuse_unsynced("barrier")
    if _multi():
        _collective("barrier", dist.barrier)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """All-reduce a copy of ``tensor`` (``sum``, ``mean``, ``max``, ``min``) over ``group``
    (None: every process) and return it."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in (*ops, "mean"):
        raise ValueError(f"all_reduce op must be one of sum, mean, max, min, got {op!r}")
    refuse_unsynced("all_reduce")
    out = tensor.clone()
    if not _multi():
        return out
    _collective("all_reduce", dist.all_reduce, out, op=ops.get(op, dist.ReduceOp.SUM), group=group)
    if op == "mean":
        out = out / dist.get_world_size(group)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    refuse_unsynced("broadcast_object")
    if not _multi():
        return obj
    box = [obj]
    _collective("broadcast", dist.broadcast_object_list, box, src=src)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Gather a picklable object from every rank of ``group`` (None: every process)."""
    refuse_unsynced("all_gather_object")
    if not _multi():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    _collective("all_gather_object", dist.all_gather_object, out, obj, group=group)
    return out


def all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Gather same-shaped tensors from every rank of ``group`` (None: every process), stacked
    on a new first dimension."""
    refuse_unsynced("all_gather")
    if not _multi():
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    _collective("all_gather", dist.all_gather, parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def refuse_different(value: str, what: str, fix: str, error: type[Exception]) -> None:
    """Raise ``error`` on every rank alike when the ranks passed different ``value``s for
    ``what`` (a path built per process: ``tempfile.mkdtemp()``, a timestamp, a PID). One small
    all-gather; a later check would see only its consequence (a directory a rank cannot see)."""
    if not _multi():
        return
    values = all_gather_object(value)
    if len(set(values)) == 1:
        return
    shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values[:4]))
    more = f" (and {len(values) - 4} more ranks)" if len(values) > 4 else ""
    raise_agreed(error(f"the ranks passed different {what}: {shown}{more}. {fix}"))


def raise_agreed(err: BaseException) -> None:
    """Raise ``err``, marked as raised by every rank alike (so one of them reports it)."""
    err.agreed = True  # type: ignore[attr-defined]
    raise err


# ---- one traceback per failed job ------------------------------------------------------------
#: how many ranks have raised out of the script so far (a counter in the group's store)
_FAILED_KEY = "failed"
#: "rank\nsummary" of the rank that reports the failure, set once it has printed
_REPORTED_KEY = "reported"
#: how long a rank that leaves the report to another waits for it before printing its own
REPORT_WAIT_S = 10.0


def report_failures_once() -> None:
    """Make an exception that ends the script print one traceback for the job, not one per rank.

    An error every rank raises alike (accelkit's agreed errors: a save that failed anywhere
    fails everywhere) is printed by rank 0; any other by the first rank that fails. The other
    ranks print nothing when their error reads the same, else one line naming it; a rank whose
    reporter does not confirm within :data:`REPORT_WAIT_S` prints its own traceback. Installed
    when accelkit joins a group of several processes; ``ACCELKIT_EVERY_TRACEBACK=1`` keeps one
    traceback per rank."""
    if os.environ.get("ACCELKIT_EVERY_TRACEBACK") == "1" or getattr(
        sys.excepthook, "_accelkit_once", False
    ):
        return
    previous = sys.excepthook  # torch's, which prefixes each line with [rankN]

    def excepthook(kind: Any, value: BaseException, tb: Any) -> None:
        try:
            rank, summary = dist.get_rank(), _summary(value)
            reporter = _reporter(rank, value)
        except Exception:  # no group or no store any more: every rank reports for itself
            previous(kind, value, tb)
            return
        if reporter:
            previous(kind, value, tb)
            with contextlib.suppress(Exception):
                _store().set(_REPORTED_KEY, f"{rank}\n{summary}")
            return
        first = _reported()
        if first is None:
            previous(kind, value, tb)
            return
        first_rank, _, first_summary = first.partition("\n")
        if first_summary != summary:
            sys.stderr.write(
                f"[rank{rank}]: {summary} (rank {first_rank} failed first: its traceback is "
                "printed; ACCELKIT_EVERY_TRACEBACK=1 prints every rank's)\n"
            )
            sys.stderr.flush()

    excepthook._accelkit_once = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _summary(value: BaseException) -> str:
    lines = str(value).strip().splitlines()
    return f"{type(value).__name__}: {lines[0][:500] if lines else ''}"


def _reporter(rank: int, value: BaseException) -> bool:
    """Whether this rank prints the job's traceback."""
    if getattr(value, "agreed", False):  # raised by every rank alike
        return rank == 0
    return _store().add(_FAILED_KEY, 1) == 1


def _reported() -> str | None:
    """What the reporting rank printed, once it has; None when it did not say in time."""
    store = _store()
    try:
        store.wait([_REPORTED_KEY], datetime.timedelta(seconds=REPORT_WAIT_S))
        return store.get(_REPORTED_KEY).decode(errors="replace")
    except Exception:
        return None
