"""A fault-injecting HTTP proxy of our own, between a storage client and a real server.

The object-storage tests need the faults a cluster's network gives a job (connections reset,
responses cut mid-body, 503s, stalls, answers lost after the server acted) at exact requests:
"the second GET of ``latest``", "the conditional PUT of the manifest". :class:`FaultProxy`
listens on a free port of 127.0.0.1, forwards each HTTP/1.1 request of each client connection
to the server, and relays the answer, unless a rule matches the request::

    with FaultProxy(server_port) as proxy:                     # http://127.0.0.1:<port>
        proxy.inject(Status(503), method="GET", path=r"/latest$", nth=1)
        lost = proxy.inject(Lose(), method="PUT", path=r"/accelkit\\.json$")
        ...  # point the client at proxy.url
        assert lost.fired == 1

A rule fires on its ``nth`` matching request and the ``times - 1`` after it (``times=None``:
every one from the ``nth`` on). :meth:`FaultProxy.script` takes a function of each
:class:`Request` instead, for faults a test decides as requests come. Every request is logged
(:attr:`FaultProxy.log`), with the fault it met, so a test can check that its fault happened.

The proxy reads each request whole before forwarding it (it answers ``Expect: 100-continue``
itself) and streams each answer, so a cut can fall anywhere in a large body. Like the rest of
:mod:`accelkit.testing`, it imports neither torch nor accelkit: the standard library only.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Cut",
    "Fault",
    "FaultProxy",
    "Lose",
    "Request",
    "Reset",
    "Rule",
    "Stall",
    "Status",
]

#: bytes relayed per read of an answer's body
CHUNK = 64 << 10
#: seconds the proxy waits for the server (longer than any client's own read timeout)
UPSTREAM_TIMEOUT = 300.0


@dataclass
class Request:
    """One request a client sent through the proxy."""

    method: str
    path: str  # the request target: path and query
    headers: dict[str, str]  # lower-cased names
    body_bytes: int
    connection: int  # which client connection (counted from 1)
    status: int | None = None  # the status the client got, or None
    fault: str | None = None  # the fault it met, as ``repr`` shows it


class Fault:
    """What the proxy does to a request instead of relaying it plainly."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class Reset(Fault):
    """Reset the client's connection (TCP RST) before the request reaches the server."""


class Lose(Fault):
    """Forward the request (the server acts on it), read the whole answer, then reset the
    client's connection: the client never learns what happened."""


class Status(Fault):
    """Answer ``status`` without asking the server (a 503 of an overloaded store)."""

    def __init__(self, status: int = 503, body: bytes = b"", content_type: str = "") -> None:
        self.status = status
        self.body = body
        self.content_type = content_type


class Cut(Fault):
    """Relay the answer's headers and its first ``after`` body bytes, then end the connection:
    a reset (``reset=True``) or an orderly close, as a dying server or middlebox does."""

    def __init__(self, after: int = 0, reset: bool = True) -> None:
        self.after = after
        self.reset = reset


class Stall(Fault):
    """Hold the request ``seconds`` (``None``: until :meth:`FaultProxy.release` or the end of
    the proxy), then go on: before it reaches the server (``after=None``), or inside the
    answer, after its first ``after`` body bytes. ``lose=True`` resets the client's connection
    at the end of the stall instead of going on."""

    def __init__(
        self, seconds: float | None = None, after: int | None = None, lose: bool = False
    ) -> None:
        self.seconds = seconds
        self.after = after
        self.lose = lose


@dataclass
class Rule:
    """A fault for the requests that match ``method`` and ``path`` (a regular expression
    searched in the request target); it fires from the ``nth`` match, ``times`` times."""

    fault: Fault
    method: str | None = None
    path: str | None = None
    nth: int = 1
    times: int | None = 1
    before: Callable[[Request], None] | None = None  # runs when it fires, before the fault
    matched: int = 0
    fired: int = 0
    arrived: threading.Event = field(default_factory=threading.Event)

    def _take(self, request: Request) -> bool:
        if self.method is not None and request.method != self.method.upper():
            return False
        if self.path is not None and not re.search(self.path, request.path):
            return False
        self.matched += 1
        last = None if self.times is None else self.nth + self.times - 1
        if self.matched < self.nth or (last is not None and self.matched > last):
            return False
        self.fired += 1
        return True


class _Closed(Exception):
    """The client closed its connection between requests."""


def _read_head(reader: Any) -> list[bytes] | None:
    """A request's or an answer's start line and header lines; None at a clean end."""
    lines = []
    while True:
        line = reader.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("connection closed inside a message's head")
            return None
        if line in (b"\r\n", b"\n"):
            if not lines:
                continue  # a stray empty line between messages
            return lines
        lines.append(line)


def _headers(lines: list[bytes]) -> dict[str, str]:
    found = {}
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        found[name.strip().lower()] = value.strip()
    return found


def _read_chunked(reader: Any) -> bytes:
    """A chunked body, as it was sent (sizes, chunks and trailers)."""
    raw = bytearray()
    while True:
        size_line = reader.readline(65537)
        if not size_line:
            raise ConnectionError("connection closed inside a chunked body")
        raw += size_line
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the empty line
                trailer = reader.readline(65537)
                if not trailer:
                    raise ConnectionError("connection closed inside a chunked body's trailers")
                raw += trailer
                if trailer in (b"\r\n", b"\n"):
                    return bytes(raw)
        raw += _read_exact(reader, size + 2)


def _read_exact(reader: Any, size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise ConnectionError(f"connection closed after {len(data)} of {size} body bytes")
    return data


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (linger 0), as a crashed peer or a middlebox does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """An HTTP/1.1 proxy on ``127.0.0.1:<free port>`` in front of ``127.0.0.1:upstream_port``,
    one thread per client connection (a context manager: :meth:`start`, :meth:`stop`)."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rules: list[Rule] = []
        self.log: list[Request] = []
        self._script: Callable[[Request], Fault | None] | None = None
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._connections = 0
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- what to do ---------------------------------------------------------------------------
    def inject(
        self,
        fault: Fault,
        *,
        method: str | None = None,
        path: str | None = None,
        nth: int = 1,
        times: int | None = 1,
        before: Callable[[Request], None] | None = None,
    ) -> Rule:
        """Give ``fault`` to the matching requests (see :class:`Rule`); the first rule that
        fires on a request wins. ``before(request)`` runs when it fires, before the fault (to
        replace an object between two requests of a load, say)."""
        if nth < 1 or (times is not None and times < 1):
            raise ValueError(f"nth and times count from 1, got nth={nth}, times={times}")
        rule = Rule(fault, method, path, nth, times, before)
        with self._lock:
            self.rules.append(rule)
        return rule

    def script(self, decide: Callable[[Request], Fault | None] | None) -> None:
        """Ask ``decide(request)`` for each request no rule fired on (None: relay it)."""
        self._script = decide

    def clear(self) -> None:
        """Forget the rules, the script and the log; release the stalls."""
        with self._lock:
            self.rules.clear()
            self.log.clear()
        self._script = None
        self.release()

    def release(self) -> None:
        """End every stall in progress (those with ``seconds=None`` end only so)."""
        self._released.set()
        self._released = threading.Event()

    def requests(self, method: str | None = None, path: str | None = None) -> list[Request]:
        """The logged requests with this method and a target matching ``path``."""
        with self._lock:
            return [
                r
                for r in self.log
                if (method is None or r.method == method.upper())
                and (path is None or re.search(path, r.path))
            ]

    def _decide(self, request: Request) -> tuple[Fault | None, Rule | None]:
        with self._lock:
            self.log.append(request)
            for rule in self.rules:
                if rule._take(request):
                    return rule.fault, rule
        script = self._script
        return (script(request) if script else None), None

    # ---- life ---------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        self.port = listener.getsockname()[1]
        thread = threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Close the listener and every connection, release the stalls, join the threads."""
        self._stopping.set()
        self.release()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._connections += 1
                number = self._connections
                self._sockets.add(client)
                self._threads = [t for t in self._threads if t.is_alive()]
            thread = threading.Thread(
                target=self._serve, args=(client, number), name=f"faultproxy-{number}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    # ---- one client connection ---------------------------------------------------------------
    def _serve(self, client: socket.socket, number: int) -> None:
        upstream: socket.socket | None = None
        client_in = client.makefile("rb", buffering=CHUNK)
        up_in: Any = None
        try:
            while not self._stopping.is_set():
                head = _read_head(client_in)
                if head is None:
                    return
                method, target = head[0].decode("latin-1").split()[:2]
                headers = _headers(head)
                expect = headers.get("expect", "").lower() == "100-continue"
                if expect:  # answer it here: the server gets the request whole
                    head = [h for h in head if not h.lower().startswith(b"expect:")]
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    body = _read_chunked(client_in)
                else:
                    body = _read_exact(client_in, int(headers.get("content-length", "0")))
                request = Request(method.upper(), target, headers, len(body), number)
                fault, rule = self._decide(request)
                if fault is not None:
                    request.fault = repr(fault)
                    if rule is not None:
                        rule.arrived.set()
                        if rule.before is not None:
                            rule.before(request)
                if isinstance(fault, Reset):
                    return _reset(client)
                if isinstance(fault, Status):
                    self._answer(client, request, fault)
                    continue
                if isinstance(fault, Stall) and fault.after is None and not self._stall(fault):
                    return _reset(client)
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=UPSTREAM_TIMEOUT)
                    with self._lock:
                        self._sockets.add(upstream)
                    up_in = upstream.makefile("rb", buffering=CHUNK)
                upstream.sendall(b"".join(head) + b"\r\n" + body)
                keep = self._relay(client, up_in, request, fault)
                if not keep:
                    return
        except (OSError, ConnectionError, ValueError):
            return
        finally:
            with self._lock:
                self._sockets.discard(client)
                if upstream is not None:
                    self._sockets.discard(upstream)
            with contextlib.suppress(OSError):
                client_in.close()
                client.close()
            if upstream is not None:
                with contextlib.suppress(OSError):
                    up_in.close()
                    upstream.close()

    def _stall(self, fault: Stall) -> bool:
        """Wait out a stall; False when its connection is to be dropped after it."""
        released = self._released
        released.wait(fault.seconds)
        return not (fault.lose or self._stopping.is_set())

    def _answer(self, client: socket.socket, request: Request, fault: Status) -> None:
        reason = {503: "Service Unavailable", 500: "Internal Server Error"}.get(fault.status, "X")
        lines = [f"HTTP/1.1 {fault.status} {reason}", f"Content-Length: {len(fault.body)}"]
        if fault.content_type:
            lines.append(f"Content-Type: {fault.content_type}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        request.status = fault.status  # logged before the client can read it
        client.sendall(head + (b"" if request.method == "HEAD" else fault.body))

    def _relay(self, client: socket.socket, up_in: Any, request: Request, fault: Any) -> bool:
        """Relay the server's answer to ``request`` under ``fault``; False when the client's
        connection ends with it."""
        head = _read_head(up_in)
        if head is None:
            raise ConnectionError("the server closed the connection without answering")
        status = int(head[0].split()[1])
        headers = _headers(head)
        request.status = status
        no_body = request.method == "HEAD" or status in (204, 304) or 100 <= status < 200
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = None if no_body or chunked else headers.get("content-length")
        to_close = headers.get("connection", "").lower() == "close"
        if isinstance(fault, Lose):
            if no_body:
                pass
            elif chunked:
                _read_chunked(up_in)
            elif length is not None:
                _read_exact(up_in, int(length))
            else:
                up_in.read()
            _reset(client)
            return False
        client.sendall(b"".join(head) + b"\r\n")
        if no_body:
            return not to_close
        if chunked:  # small answers (listings, errors): relayed whole, cut by the byte
            body = _read_chunked(up_in)
            return self._send_body(client, body, fault) and not to_close
        remaining = int(length) if length is not None else None
        sent = 0
        while remaining is None or remaining > 0:
            want = CHUNK if remaining is None else min(CHUNK, remaining)
            piece = up_in.read1(want) if remaining is None else up_in.read(want)
            if not piece:
                if remaining is None:
                    return False
                raise ConnectionError("the server closed the connection inside a body")
            if remaining is not None:
                remaining -= len(piece)
            if not self._send_body(client, piece, fault, sent):
                if remaining:  # the rest of the answer is dropped with the connection
                    raise ConnectionError("cut")
                return False
            sent += len(piece)
        return not to_close

    def _send_body(self, client: socket.socket, piece: bytes, fault: Any, sent: int = 0) -> bool:
        """Send ``piece`` (the body bytes from ``sent`` on) to the client, applying a cut or a
        mid-body stall that falls inside it; False once the connection is ended."""
        after = getattr(fault, "after", None)
        if (
            not isinstance(fault, (Cut, Stall))
            or after is None
            or not sent <= after < sent + len(piece)
        ):
            client.sendall(piece)
            return True
        client.sendall(piece[: after - sent])
        if isinstance(fault, Cut):
            if fault.reset:
                _reset(client)
            else:
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
            return False
        if not self._stall(fault):
            _reset(client)
            return False
        client.sendall(piece[after - sent :])
        return True


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, every: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()
