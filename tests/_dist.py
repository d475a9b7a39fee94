"""Run a test's worker function on 2 gloo processes and bring each rank's result back.

Test side::

    results = run_ranks("test_dataloader:shard_worker", {"n": 10})   # one dict per rank

Worker side: a module-level function in a test module taking ``**kwargs`` and returning
something JSON-serialisable. This file is also the script every rank runs: it imports the
function by ``module:function`` name (the tests folder is its ``sys.path[0]``), calls it, and
writes the result to ``<outdir>/rank-<r>.json``.

:func:`run_ranks` launches through ``python -m torch.distributed.run`` (what users run);
:func:`spawn_ranks` starts the ranks as plain processes with the launcher's environment set by
hand, for tests where torchrun's agent would hide the behaviour (it kills the survivors when
one rank dies).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: one thread per process (2 cores), no inherited rank."""
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def _read_results(outdir: Path, nproc: int) -> list[Any]:
    return [json.loads((outdir / f"rank-{r}.json").read_text()) for r in range(nproc)]


def run_ranks(
    target: str,
    kwargs: dict[str, Any] | None = None,
    *,
    nproc: int = 2,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``module:function(**kwargs)`` on ``nproc`` processes under torchrun; results by rank."""
    with tempfile.TemporaryDirectory(prefix="accelkit-dist-") as tmp:
        outdir = Path(tmp)
        (outdir / "kwargs.json").write_text(json.dumps(kwargs or {}))
        for _attempt in range(2):  # a second try only if another process took the free port
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={nproc}",
                "--master-addr=127.0.0.1",
                f"--master-port={free_port()}",
                str(HERE / "_dist.py"),
                target,
                str(outdir),
            ]
            proc = subprocess.run(
                cmd, env=worker_env(env), capture_output=True, text=True, timeout=timeout
            )
            if "address already in use" not in proc.stderr.lower():
                break
        if proc.returncode != 0:
            raise AssertionError(
                f"{target} failed on {nproc} processes (exit {proc.returncode})\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
            )
        return _read_results(outdir, nproc)


def spawn_ranks(
    target: str,
    kwargs: dict[str, Any],
    outdir: Path,
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    launcher: str = "torchrun",
) -> list[subprocess.Popen]:
    """Start ``nproc`` plain processes with the environment a launcher gives its tasks:
    ``torchrun``'s RANK/WORLD_SIZE/MASTER_*, or ``slurm``'s SLURM_* (``srun`` without torchrun)."""
    (outdir / "kwargs.json").write_text(json.dumps(kwargs))
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        rank_env = worker_env(env)
        for key in [k for k in rank_env if k.startswith("SLURM_")]:
            del rank_env[key]
        if launcher == "slurm":
            rank_env.update(
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank),
                SLURM_NTASKS=str(nproc),
                SLURM_NODELIST="localhost",
                SLURM_JOB_ID="4242",
                SLURM_JOB_NAME="train",
                MASTER_PORT=port,  # SLURM has no port; a job sets one or accelkit derives it
            )
        else:
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "_dist.py"), target, str(outdir)],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _main() -> None:
    target, outdir = sys.argv[1], Path(sys.argv[2])
    module_name, _, function_name = target.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    kwargs = json.loads((outdir / "kwargs.json").read_text())
    result = function(**kwargs)
    rank = int(os.environ.get("RANK", "0"))
    (outdir / f"rank-{rank}.json").write_text(json.dumps(result))
    # A raw reference destroys its gloo group itself; gloo's worker threads drop their last work
    # a moment later and abort the process if the interpreter is finalizing by then (see
    # accelkit/distributed.py, _leave_group_at_exit). Release the GIL for them first.
    time.sleep(0.1)


if __name__ == "__main__":
    _main()
