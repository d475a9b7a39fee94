"""A fork server for the docs test: one interpreter imports torch and accelkit once, then forks a
child per doc block, which runs the block's script as ``python script.py`` would.

Why: each block in a fresh interpreter spends 1.3 s of 2 on ``import torch, accelkit``; forked,
it starts in milliseconds. The child exits through the interpreter's normal shutdown (threads
joined, atexit handlers, streams flushed; only the teardown of every module is skipped), so
its exit status and output are what ``python script.py`` gives. The server refuses to start (the caller falls back to a fresh interpreter per block) if
importing left a thread running, which a fork would not carry over.

Protocol, one JSON line each way on the server's stdin and stdout: a request
``{"script", "argv", "cwd", "env", "stdout", "stderr"}`` is answered ``{"pid": N}`` at once
and ``{"status": S}`` when the child has ended (S as in ``subprocess``: negative for a signal).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _serve() -> None:
    import threading

    import torch  # noqa: F401

    import accelkit  # noqa: F401  (the point: imported once, before any fork)

    control_in = os.fdopen(os.dup(0), "r", buffering=1)
    control_out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # a stray print can never corrupt the protocol
    if threading.active_count() != 1:
        control_out.write(json.dumps({"refused": "a thread runs after the imports"}) + "\n")
        return
    gc.freeze()  # what was imported stays out of the children's collections (no copy-on-write)
    control_out.write(json.dumps({"ready": True}) + "\n")
    for line in control_in:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            control_in.close()
            control_out.close()
            _become(request)
            return  # unreachable: _become ends in the script's own exit
        control_out.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        control_out.write(json.dumps({"status": code}) + "\n")


def _become(request: dict[str, Any]) -> None:
    """Turn this forked child into ``python script argv...`` run in ``cwd`` with ``env``."""
    import runpy

    os.setsid()  # its own process group, so that a timeout kills what it started too
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script, *request["argv"]]
    sys.path[0] = str(Path(script).parent)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:  # python's own rules for the status of sys.exit(x)
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _exit(code: int) -> None:
    """End as the interpreter's shutdown would, less the teardown of every module (0.4 s with
    torch loaded, and nothing a block's exit status or output depends on): wait for the
    non-daemon threads, run the exit handlers (one may set the status itself), flush."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


class ForkServer:
    """The client side: start the server once, run each block through it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        reply = self._reply(timeout=120)
        if not reply.get("ready"):
            self.close()
            raise RuntimeError(f"the docs fork server did not start: {reply}")

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the docs fork server exited")
        return json.loads(line)

    def run(
        self, script: Path, argv: tuple[str, ...], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        """Run ``script`` as ``python script argv...`` would; TimeoutExpired after ``timeout``."""
        handles = [tempfile.mkstemp(prefix="doc-block-", suffix=f".{n}") for n in ("out", "err")]
        for fd, _ in handles:
            os.close(fd)
        out, err = (Path(name) for _, name in handles)
        request = {
            "script": str(script),
            "argv": list(argv),
            "cwd": str(cwd),
            "env": env,
            "stdout": str(out),
            "stderr": str(err),
        }
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pid = self._reply(timeout=30)["pid"]
        try:
            status = self._reply(timeout=timeout)["status"]
        except TimeoutError:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reply(timeout=30)
            out.unlink()
            err.unlink()
            raise subprocess.TimeoutExpired(str(script), timeout) from None
        stdout = out.read_text(errors="replace")
        stderr = err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        return subprocess.CompletedProcess([sys.executable, str(script)], status, stdout, stderr)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


if __name__ == "__main__":
    _serve()
