"""Run a worker function of this folder on 1 or 2 gloo processes under torchrun; results by rank.

The worker is ``module:function`` (a module in this folder), called with ``**kwargs`` from a JSON
file; each rank writes what it returns (JSON) to ``<outdir>/rank-<r>.json``. DeepSpeed is only
ever imported in these child processes, never in pytest's own.
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


def run_ranks(
    target: str,
    kwargs: dict[str, Any] | None = None,
    *,
    nproc: int = 2,
    timeout: float = 300,
    device: str = "cpu",
) -> list[Any]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        DS_ACCELERATOR=device,
        PYTHONWARNINGS="ignore",
    )
    with tempfile.TemporaryDirectory(prefix="accelkit-ds-") as tmp:
        outdir = Path(tmp)
        (outdir / "kwargs.json").write_text(json.dumps(kwargs or {}))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(HERE / "dsk_launch.py"),
            target,
            str(outdir),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 and "address already in use" in proc.stderr.lower():
            # the free port was taken between our probe and torchrun's bind: once more
            port = next(i for i, arg in enumerate(cmd) if arg.startswith("--master-port="))
            cmd[port] = f"--master-port={free_port()}"
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(
                f"{target} failed on {nproc} processes (exit {proc.returncode})\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
            )
        return [json.loads((outdir / f"rank-{r}.json").read_text()) for r in range(nproc)]


def _main() -> None:
    target, outdir = sys.argv[1], Path(sys.argv[2])
    sys.path.insert(0, str(HERE))
    module_name, _, function_name = target.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(**json.loads((outdir / "kwargs.json").read_text()))
    rank = int(os.environ.get("RANK", "0"))
    (outdir / f"rank-{rank}.json").write_text(json.dumps(result))
    # A raw reference destroys its gloo group itself; gloo's worker threads drop their last work
    # a moment later and abort the process if the interpreter is finalizing by then (see
    # accelkit/distributed.py, _leave_group_at_exit). Release the GIL for them first.
    time.sleep(0.1)


if __name__ == "__main__":
    _main()
