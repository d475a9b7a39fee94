"""Test tools for accelkit and its backend plugins: a multi-rank launcher and the conformance
suite (:mod:`accelkit.testing.conformance`).

``import accelkit`` never imports this package, and this module imports neither torch nor
accelkit: a test collects fast and a raw reference process stays free of accelkit.

Test side::

    from accelkit.testing import run_ranks

    results = run_ranks("my_workers:train", {"steps": 4}, nproc=2)  # one result per rank

Worker side: a module-level function taking ``**kwargs`` and returning something
JSON-serialisable, in a module the test process can import (a test folder is on its
``sys.path`` under pytest). Each rank runs ``accelkit/testing/_rank.py`` by path, which imports
that module from the folder the test process found it in, calls the function, and writes the
result.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["RanksFailed", "free_port", "run_ranks", "spawn_ranks", "worker_env"]

RANK_SCRIPT = Path(__file__).resolve().parent / "_rank.py"
PATH_ENV = "ACCELKIT_TESTING_PATH"  # the same name as in _rank.py (which imports nothing)
#: gloo's exit race (see _rank.py): a finished run whose only fault is this abort at exit
GLOO_EXIT_ABORT = "terminate called without an active exception"
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RanksFailed(AssertionError):
    """A multi-rank run failed; the message holds each rank's stderr tail."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (a launch retries once if another takes it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def end_process_group(process: subprocess.Popen, sig: int, grace: float = 20.0) -> None:
    """Send ``sig`` to a test server's process group; SIGKILL it if still up after ``grace``
    seconds (the S3 and GCS test servers both stop this way)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=20)


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: one thread per process (CI has 2 cores), no inherited rank."""
    env = dict(os.environ)
    for key in _LAUNCH_ENV:
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def _module_folders(target: str, path: Iterable[str | os.PathLike] = ()) -> list[str]:
    """The folders a rank needs on ``sys.path``: ``path``, then the one this process imports
    the target's module from (found without importing it)."""
    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    folders = [str(Path(p).resolve()) for p in path]
    top = module_name.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise ValueError(f"{target}: module {top!r} is not importable from this process")
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        origin = Path(spec.origin)
        root = origin.parent.parent if origin.name == "__init__.py" else origin.parent
        folders.append(str(root))
    elif spec.submodule_search_locations:  # a namespace package
        folders.extend(str(Path(p).parent) for p in spec.submodule_search_locations)
    return list(dict.fromkeys(folders))


def _rank_env(target: str, path: Iterable[str | os.PathLike], extra: dict[str, str] | None):
    env = worker_env(extra)
    env[PATH_ENV] = os.pathsep.join(_module_folders(target, path))
    # a failure shows each rank's stderr tail: each rank's own traceback belongs in it
    env.setdefault("ACCELKIT_EVERY_TRACEBACK", "1")
    return env


def _tail(path: Path, chars: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-chars:] or "(empty)"


def _rank_logs(logdir: Path, nproc: int) -> str:
    """Each rank's stderr tail (``logdir/<rank>/stderr.log``)."""
    parts = []
    for rank in range(nproc):
        stderr = _tail(logdir / str(rank) / "stderr.log", 6000)
        parts.append(f"--- rank {rank} stderr ---\n{stderr}")
    return "\n".join(parts)


def launch_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What ``torchrun --nproc-per-node=N`` gives each of its workers on one node, except the
    agent's store (there is no agent): rank 0 hosts the group's TCPStore, as under ``srun``."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


class _RankGroup:
    """``nproc`` rank processes started and watched as torchrun's agent does, without the agent
    (one more Python process with torch imported: about 1.5 s of CPU per launch, much of a short
    test's launch on 2 cores). Each rank runs in a session of its own, its stdout and stderr in
    ``logdir/<rank>/``. When a rank fails, the others get ``grace`` seconds to end by themselves
    (their next collective fails and says why), then SIGTERM, then SIGKILL."""

    def __init__(self, target: str, outdir: Path, logdir: Path, env: dict[str, str], nproc: int):
        self.outdir = outdir
        port, run_id = free_port(), f"accelkit-ranks-{os.getpid()}-{outdir.name}"
        self.procs: list[subprocess.Popen] = []
        for rank in range(nproc):
            folder = logdir / str(rank)
            folder.mkdir(parents=True)
            with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(RANK_SCRIPT), target, str(outdir)],
                        env={**env, **launch_env(rank, nproc, port, run_id)},
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )

    def _running(self) -> bool:
        return any(proc.poll() is None for proc in self.procs)

    def _signal(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    def _failed(self) -> bool:
        """A rank ended non-zero without its result (one that wrote its result and then hit
        gloo's exit race has done its work: GLOO_EXIT_ABORT)."""
        return any(
            proc.returncode not in (None, 0) and not (self.outdir / f"rank-{rank}.json").exists()
            for rank, proc in enumerate(self.procs)
        )

    def _stop(self, grace: float) -> None:
        self._signal(signal.SIGTERM)
        until = time.monotonic() + grace
        while self._running() and time.monotonic() < until:
            time.sleep(0.05)
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float, grace: float = 3.0) -> int:
        """The first non-zero exit status (0 if none). Past ``timeout`` every rank's session is
        killed and TimeoutExpired raised."""
        deadline = time.monotonic() + timeout
        stop_at = None
        try:
            while self._running():
                now = time.monotonic()
                if now > deadline:
                    raise subprocess.TimeoutExpired("ranks", timeout)
                if stop_at is None and self._failed():
                    stop_at = now + grace
                if stop_at is not None and now > stop_at:
                    self._stop(grace)
                    break
                time.sleep(0.02)
        finally:
            if self._running():
                self._signal(signal.SIGKILL)
            for proc in self.procs:
                proc.wait()
        return next((proc.returncode for proc in self.procs if proc.returncode), 0)


def run_ranks(
    target: str,
    kwargs: dict[str, Any] | None = None,
    *,
    nproc: int = 2,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    path: Iterable[str | os.PathLike] = (),
) -> list[Any]:
    """Run ``module:function(**kwargs)`` on ``nproc`` gloo-ready processes, each with the
    environment torchrun gives its workers (:func:`launch_env`); return the results by rank.

    ``env`` adds to the workers' environment; ``path`` adds folders to find the module in
    (besides the one this process finds it in). A failure raises :class:`RanksFailed` with each
    rank's stderr tail; a run past ``timeout`` seconds raises it too.
    """
    rank_env = _rank_env(target, path, env)
    with tempfile.TemporaryDirectory(prefix="accelkit-ranks-") as tmp:
        outdir = Path(tmp)
        (outdir / "kwargs.json").write_text(json.dumps(kwargs or {}))
        for attempt in range(2):  # a second try only if another process took the free port
            logdir = outdir / f"logs-{attempt}"
            group = _RankGroup(target, outdir, logdir, rank_env, nproc)
            try:
                code = group.wait(timeout)
            except subprocess.TimeoutExpired as err:
                raise RanksFailed(
                    f"{target} did not finish on {nproc} processes within {timeout:.0f} s\n"
                    f"{_rank_logs(logdir, nproc)}"
                ) from err
            output = _rank_logs(logdir, nproc)
            if code == 0 or "address already in use" not in output.lower():
                break
            for stale in outdir.glob("rank-*.json"):
                stale.unlink()
        results = [outdir / f"rank-{r}.json" for r in range(nproc)]
        finished = all(result.exists() for result in results)
        # every rank returned and wrote its result; only gloo's exit race aborted a process
        exit_race_only = finished and GLOO_EXIT_ABORT in output
        if code != 0 and not exit_race_only:
            raise RanksFailed(f"{target} failed on {nproc} processes (exit {code})\n{output}")
        return [json.loads(result.read_text()) for result in results]


def spawn_ranks(
    target: str,
    kwargs: dict[str, Any],
    outdir: Path,
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    launcher: str = "torchrun",
    path: Iterable[str | os.PathLike] = (),
) -> list[subprocess.Popen]:
    """Start ``nproc`` plain processes with the environment a launcher gives its tasks:
    ``torchrun``'s RANK/WORLD_SIZE/MASTER_*, or ``slurm``'s SLURM_* (``srun`` without torchrun).

    For tests where torchrun's agent would hide the behaviour (it kills the survivors when one
    rank dies). The caller waits for the processes; each writes ``outdir/rank-<r>.json``.
    """
    if launcher not in ("torchrun", "slurm"):
        raise ValueError(f"launcher must be 'torchrun' or 'slurm', got {launcher!r}")
    (outdir / "kwargs.json").write_text(json.dumps(kwargs))
    port = str(free_port())
    base_env = _rank_env(target, path, env)
    procs = []
    for rank in range(nproc):
        rank_env = {k: v for k, v in base_env.items() if not k.startswith("SLURM_")}
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
                [sys.executable, str(RANK_SCRIPT), target, str(outdir)],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs
