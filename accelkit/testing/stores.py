"""Where the store conformance suite keeps its checkpoints: a folder, or a bucket of a real
server behind a :class:`~accelkit.testing.faultproxy.FaultProxy`.

A :class:`Place` gives the suite (:mod:`accelkit.testing.store_contract`) what it needs of a
store without going through accelkit: the URL of a checkpoint, the environment that points a
client (this process's and its worker processes') at the store through the proxy, and raw
reads, writes and deletes of objects straight at the server (the reference side, to flip a
byte or replace an object). It also turns "the PUT of the manifest" into the HTTP request the
store's client makes (:meth:`Place.request`), so one fault case runs on every store.

``disk``: a temporary folder (no proxy: its network faults are skipped). ``s3``: SeaweedFS
(:mod:`accelkit.testing.s3_server`), raw side through boto3. ``gs``: fake-gcs-server
(:mod:`accelkit.testing.gcs_server`), raw side through the JSON API with urllib. Servers are
started once per process and stopped at exit. A third-party store adds its own with
:func:`register_place`.

Imports neither torch nor accelkit.
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import tempfile
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelkit.testing.faultproxy import FaultProxy

__all__ = ["PLACES", "DiskPlace", "GCSPlace", "Place", "S3Place", "open_place", "register_place"]

#: the read timeout (seconds) a stall case asks of a store that has the option
SHORT_READ_TIMEOUT_S = 3.0

_SERVERS: dict[str, Any] = {}


def _server(kind: str, start: Callable[[Path], Any]) -> Any:
    """One server of ``kind`` for this process (restarted if something ended it)."""
    server = _SERVERS.get(kind)
    if server is None:
        folder = Path(tempfile.mkdtemp(prefix=f"accelkit-{kind}-store-"))
        server = _SERVERS[kind] = start(folder)
        atexit.register(shutil.rmtree, folder, True)
    elif not server.alive():
        server.start()
    return server


class Place:
    """A store's place for one test: checkpoint URLs below a prefix of its own."""

    kind = "?"
    #: whether requests pass through :attr:`proxy` (False: the network cases are skipped)
    networked = True
    #: whether a save onto a committed name replaces it (disk swaps the directory); an object
    #: store refuses a committed name, so of two saves of one name only one ever commits
    replaces_committed = False
    #: ``storage_options`` that make the client give up on a silent server within
    #: :data:`SHORT_READ_TIMEOUT_S` (None: the store has no such option; the stall case then
    #: outlasts its default read timeout)
    short_read_timeout: dict[str, float] | None = None

    def __init__(self, name: str) -> None:
        self.prefix = f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)[:60]}-{uuid.uuid4().hex[:8]}"
        self.proxy: FaultProxy | None = None

    def url(self, key: str = "") -> str:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """What a process sets to reach the store through the proxy."""
        return {}

    def read(self, key: str) -> bytes:
        raise NotImplementedError

    def write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def keys(self, under: str = "") -> list[str]:
        """The object keys below ``under`` (relative to this place's prefix), sorted."""
        raise NotImplementedError

    def request(self, op: str, key: str) -> dict[str, str]:
        """``method`` and ``path`` of :meth:`FaultProxy.inject` for the client's request that
        reads (``op="read"``) or writes (``"write"``) the object whose key, below this place's
        prefix, matches the regular expression ``key`` (``/`` between names)."""
        raise NotImplementedError

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()


class DiskPlace(Place):
    kind = "disk"
    replaces_committed = True
    networked = False

    def __init__(self, name: str, root: Path) -> None:
        super().__init__(name)
        self.root = Path(root) / self.prefix
        self.root.mkdir(parents=True)

    def url(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_bytes(data)
        tmp.replace(path)  # a whole object at once, as a store replaces one

    def delete(self, key: str) -> None:
        (self.root / key).unlink()

    def keys(self, under: str = "") -> list[str]:
        base = self.root / under if under else self.root
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(self.root).parts)
        )


class S3Place(Place):
    kind = "s3"
    short_read_timeout = {"read_timeout": SHORT_READ_TIMEOUT_S}

    def __init__(self, name: str) -> None:
        from accelkit.testing.s3_server import LocalS3Server

        super().__init__(name)
        self.server = _server("s3", lambda folder: LocalS3Server(folder, bucket="ckpts").start())
        self.bucket = self.server.bucket
        self.proxy = FaultProxy(self.server.ports["s3.port"]).start()

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}/{key}".rstrip("/")

    def env(self) -> dict[str, str]:
        return {**self.server.env(), "AWS_ENDPOINT_URL": self.proxy.url}

    def _client(self) -> Any:
        import boto3

        env = self.server.env()
        return boto3.client(
            "s3",
            endpoint_url=self.server.endpoint,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def read(self, key: str) -> bytes:
        return (
            self._client().get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()
        )

    def write(self, key: str, data: bytes) -> None:
        self._client().put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def delete(self, key: str) -> None:
        self._client().delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")

    def keys(self, under: str = "") -> list[str]:
        paginator = self._client().get_paginator("list_objects_v2")
        prefix = f"{self.prefix}/{under}".rstrip("/") + "/"
        found = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            found += [item["Key"][len(self.prefix) + 1 :] for item in page.get("Contents", [])]
        return sorted(found)

    def request(self, op: str, key: str) -> dict[str, str]:
        # path style: /<bucket>/<prefix>/<key>[?query]; a part PUT and a completion POST of a
        # multipart upload carry ?partNumber= / ?uploadId=
        path = rf"^/{re.escape(self.bucket)}/{re.escape(self.prefix)}/{key}(\?|$)"
        return {"method": "GET" if op == "read" else "PUT", "path": path}


class GCSPlace(Place):
    kind = "gs"
    short_read_timeout = {"read_timeout": SHORT_READ_TIMEOUT_S}

    def __init__(self, name: str) -> None:
        from accelkit.testing.gcs_server import LocalGCSServer

        super().__init__(name)
        self.server = _server("gs", lambda folder: LocalGCSServer(folder, bucket="ckpts").start())
        self.bucket = self.server.bucket
        self.proxy = FaultProxy(self.server.port).start()

    def url(self, key: str = "") -> str:
        return f"gs://{self.bucket}/{self.prefix}/{key}".rstrip("/")

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.proxy.url}

    def _object(self, key: str) -> str:
        name = urllib.parse.quote(f"{self.prefix}/{key}", safe="")
        return f"{self.server.endpoint}/storage/v1/b/{self.bucket}/o/{name}"

    def _call(self, method: str, url: str, data: bytes | None = None) -> bytes:
        request = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/octet-stream")
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.read()

    def read(self, key: str) -> bytes:
        return self._call("GET", self._object(key) + "?alt=media")

    def write(self, key: str, data: bytes) -> None:
        name = urllib.parse.quote(f"{self.prefix}/{key}", safe="")
        url = f"{self.server.endpoint}/upload/storage/v1/b/{self.bucket}/o?uploadType=media&name={name}"
        self._call("POST", url, data)

    def delete(self, key: str) -> None:
        self._call("DELETE", self._object(key))

    def keys(self, under: str = "") -> list[str]:
        prefix = urllib.parse.quote(f"{self.prefix}/{under}".rstrip("/") + "/", safe="")
        found, token = [], ""
        while True:
            url = f"{self.server.endpoint}/storage/v1/b/{self.bucket}/o?prefix={prefix}{token}"
            listing = json.loads(self._call("GET", url))
            found += [item["name"][len(self.prefix) + 1 :] for item in listing.get("items", [])]
            if not listing.get("nextPageToken"):
                return sorted(found)
            token = f"&pageToken={urllib.parse.quote(listing['nextPageToken'])}"

    def request(self, op: str, key: str) -> dict[str, str]:
        whole = f"{re.escape(self.prefix)}/{key}".replace("/", "%2F")
        if op == "read":  # GET /storage/v1/b/<bucket>/o/<name>?alt=media (ranged or whole)
            return {"method": "GET", "path": rf"^/storage/v1/b/{self.bucket}/o/{whole}\?alt=media"}
        # an upload names its object in the query: /upload/storage/v1/b/<bucket>/o?...name=<name>
        return {
            "method": "POST",
            "path": rf"^/upload/storage/v1/b/{self.bucket}/o\?.*name={whole}(&|$)",
        }


#: how each store kind opens a place: ``name`` (the test's), ``tmp_path``
PLACES: dict[str, Callable[[str, Path], Place]] = {
    "disk": lambda name, tmp: DiskPlace(name, tmp),
    "s3": lambda name, tmp: S3Place(name),
    "gs": lambda name, tmp: GCSPlace(name),
}


def register_place(kind: str, opener: Callable[[str, Path], Place]) -> None:
    """Let the suite run on another store: ``opener(test_name, tmp_path)`` gives its place."""
    PLACES[kind] = opener


def open_place(kind: str, name: str, tmp_path: Path) -> Place:
    if kind not in PLACES:
        raise ValueError(f"no place for store {kind!r}; known: {', '.join(sorted(PLACES))}")
    return PLACES[kind](name, tmp_path)
