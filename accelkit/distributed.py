"""Process-group plumbing: how we were launched, joining the group, and collectives that work
the same with one process or many."""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("accelkit")

DEFAULT_TIMEOUT_S = 1800.0


def is_initialized() -> bool:
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
    if not is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as err:  # exiting anyway; say why, do not mask the real exit status
        log.debug("destroy_process_group at exit failed: %s", err)
    time.sleep(_GLOO_DRAIN_S)


def barrier() -> None:
    if is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce a copy of ``tensor`` (``sum``, ``mean``, ``max``, ``min``) and return it."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in (*ops, "mean"):
        raise ValueError(f"all_reduce op must be one of sum, mean, max, min, got {op!r}")
    out = tensor.clone()
    if not is_initialized() or dist.get_world_size() == 1:
        return out
    dist.all_reduce(out, op=ops.get(op, dist.ReduceOp.SUM))
    if op == "mean":
        out = out / dist.get_world_size()
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    if not is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Gather same-shaped tensors from every rank, stacked on a new first dimension."""
    if not is_initialized() or dist.get_world_size() == 1:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)
