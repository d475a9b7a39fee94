"""Test side: launch a worker function on gloo processes with torchrun; results by rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    target: str,
    kwargs: dict[str, Any] | None = None,
    *,
    nproc: int = 2,
    timeout: float = 300,
) -> list[Any]:
    """``module:function(**kwargs)`` on ``nproc`` processes (one thread each); results by rank."""
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="accelkit-cai-") as tmp:
        outdir = Path(tmp)
        (outdir / "kwargs.json").write_text(json.dumps(kwargs or {}))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}",
            str(HERE / "cai_launch.py"),
            target,
            str(outdir),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(
                f"{target} failed on {nproc} processes (exit {proc.returncode})\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
            )
        return [json.loads((outdir / f"rank-{r}.json").read_text()) for r in range(nproc)]
