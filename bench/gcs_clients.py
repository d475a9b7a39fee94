"""Which client should the gs:// store (plugins/gcs) use? Each candidate moves the same bytes to
and from the same GCS JSON-API server in one run, interleaved: google-cloud-storage (the official
client) and thin clients of our own over urllib3, requests and httpx.

    .venv/bin/python bench/gcs_clients.py                  # starts a local fake-gcs-server
    .venv/bin/python bench/gcs_clients.py --mib 128 --repeat 5

Cases, each client once per repeat, clients in a rotating order (the median and the range are
printed, in GB/s of payload, and ms per small operation):

- ``up``: one object of ``--mib`` MiB from memory (the official client's ``upload_from_file``;
  a thin client's one streamed ``uploadType=media`` request);
- ``down``: the same object back into one buffer by parallel 8 MiB ranged GETs, 8 at a time;
- ``small``: a conditional create (``ifGenerationMatch=0``, a multipart upload) and a GET of a
  30-byte object, as a commit's manifest and ``latest`` are; milliseconds per pair;
- ``import``: seconds to import the client in a fresh interpreter (a store imports it lazily,
  but every save and load of a new process pays it once).

Every download is compared with what was uploaded. Server and client share the machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

PART = 8 << 20
CONCURRENCY = 8


def _multipart(name: str, data: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    meta = json.dumps({"name": name}).encode()
    body = b"".join(
        [
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
            meta,
            f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
            data,
            f"\r\n--{boundary}--\r\n".encode(),
        ]
    )
    return body, f"multipart/related; boundary={boundary}"


class Thin:
    """The JSON API by hand: what a 400-line store would do with a plain HTTP library."""

    name = "thin"

    def __init__(self, endpoint: str, bucket: str) -> None:
        self.endpoint, self.bucket = endpoint, bucket

    def _object_url(self, key: str) -> str:
        return f"{self.endpoint}/storage/v1/b/{self.bucket}/o/{urllib.parse.quote(key, safe='')}"

    def _upload_url(self, kind: str, key: str, extra: str = "") -> str:
        name = urllib.parse.quote(key, safe="")
        return f"{self.endpoint}/upload/storage/v1/b/{self.bucket}/o?uploadType={kind}&name={name}{extra}"

    def upload(self, key: str, data: memoryview) -> None:
        status = self.request("POST", self._upload_url("media", key), bytes(data), {})[0]
        assert status == 200, status

    def download(self, key: str, size: int) -> bytearray:
        out = bytearray(size)
        view = memoryview(out)

        def part(start: int) -> None:
            end = min(size, start + PART)
            headers = {"Range": f"bytes={start}-{end - 1}"}
            status, body = self.request("GET", self._object_url(key) + "?alt=media", None, headers)
            assert status == 206, status
            view[start:end] = body

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(part, range(0, size, PART)))
        return out

    def small(self, key: str, data: bytes) -> bytes:
        body, kind = _multipart(key, data)
        url = self._upload_url("multipart", key, "&ifGenerationMatch=0")
        status = self.request("POST", url, body, {"Content-Type": kind})[0]
        assert status == 200, status
        again = self.request("POST", url, body, {"Content-Type": kind})[0]
        assert again == 412, again  # the conditional create refuses the second
        status, got = self.request("GET", self._object_url(key) + "?alt=media", None, {})
        assert status == 200
        return got


class Urllib3(Thin):
    name = "urllib3 (thin)"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import urllib3

        super().__init__(endpoint, bucket)
        self.pool = urllib3.PoolManager(maxsize=2 * CONCURRENCY)

    def request(self, method, url, body, headers):
        reply = self.pool.request(method, url, body=body, headers=headers, preload_content=True)
        return reply.status, reply.data


class Requests(Thin):
    name = "requests (thin)"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import requests

        super().__init__(endpoint, bucket)
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=2 * CONCURRENCY)
        self.session.mount("http://", adapter)

    def request(self, method, url, body, headers):
        reply = self.session.request(method, url, data=body, headers=headers)
        return reply.status_code, reply.content


class Httpx(Thin):
    name = "httpx (thin)"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import httpx

        super().__init__(endpoint, bucket)
        limits = httpx.Limits(max_connections=2 * CONCURRENCY)
        self.client = httpx.Client(limits=limits, timeout=60)

    def request(self, method, url, body, headers):
        reply = self.client.request(method, url, content=body, headers=headers)
        return reply.status_code, reply.content


class Official:
    name = "google-cloud-storage"

    def __init__(self, endpoint: str, bucket: str) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.client = storage.Client(
            project="bench",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": endpoint},
        )
        self.bucket = self.client.bucket(bucket)

    def upload(self, key: str, data: memoryview) -> None:
        self.bucket.blob(key).upload_from_file(io.BytesIO(data), size=len(data))

    def download(self, key: str, size: int) -> bytearray:
        out = bytearray(size)
        view = memoryview(out)
        blob = self.bucket.blob(key)

        def part(start: int) -> None:
            end = min(size, start + PART)
            view[start:end] = blob.download_as_bytes(start=start, end=end - 1, checksum=None)

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(part, range(0, size, PART)))
        return out

    def small(self, key: str, data: bytes) -> bytes:
        from google.api_core.exceptions import PreconditionFailed

        blob = self.bucket.blob(key)
        blob.upload_from_string(data, if_generation_match=0)
        try:
            blob.upload_from_string(data, if_generation_match=0)
        except PreconditionFailed:
            pass
        else:
            raise AssertionError("the conditional create was not refused")
        return self.bucket.blob(key).download_as_bytes()


CLIENTS = {"official": Official, "urllib3": Urllib3, "requests": Requests, "httpx": Httpx}
IMPORTS = {
    "official": "from google.cloud import storage",
    "urllib3": "import urllib3",
    "requests": "import requests",
    "httpx": "import httpx",
}


def import_seconds(name: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        code = (
            f"import time; t = time.perf_counter(); {IMPORTS[name]}; print(time.perf_counter() - t)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        times.append(float(out.stdout))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--small", type=int, default=20, help="small create+get pairs per repeat")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    args = parser.parse_args()
    from accelkit.testing.gcs_server import LocalGCSServer

    names = args.clients.split(",")
    payload = os.urandom(args.mib << 20)
    view = memoryview(payload)
    results: dict[str, dict[str, list[float]]] = {
        n: {"up": [], "down": [], "small": []} for n in names
    }
    with tempfile.TemporaryDirectory() as tmp, LocalGCSServer(tmp, bucket="bench") as server:
        clients = {n: CLIENTS[n](server.endpoint, "bench") for n in names}
        for rep in range(args.repeat):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                client = clients[name]
                key = f"{name}/{rep}/big"
                start = time.perf_counter()
                client.upload(key, view)
                results[name]["up"].append(len(payload) / (time.perf_counter() - start) / 1e9)
                start = time.perf_counter()
                got = client.download(key, len(payload))
                results[name]["down"].append(len(payload) / (time.perf_counter() - start) / 1e9)
                assert bytes(got) == payload, f"{name}: the download differs"
                start = time.perf_counter()
                for i in range(args.small):
                    assert (
                        client.small(f"{name}/{rep}/small-{i}", b"step-12 " * 4) == b"step-12 " * 4
                    )
                results[name]["small"].append((time.perf_counter() - start) / args.small * 1e3)
        imports = {n: import_seconds(n, args.repeat) for n in names}
    print(
        f"# {args.mib} MiB object, {args.repeat} interleaved repeats, median [min-max]; "
        f"{os.cpu_count()} CPUs; fake-gcs-server on loopback (memory backend)"
    )
    print(f"{'client':22} {'up GB/s':>20} {'down GB/s':>20} {'small ms/pair':>20} {'import s':>9}")

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"

    for name in names:
        r = results[name]
        print(
            f"{clients[name].name:22} {cell(r['up']):>20} {cell(r['down']):>20} "
            f"{cell(r['small']):>20} {imports[name]:9.3f}"
        )
    print(json.dumps({"results": results, "imports": imports}))


if __name__ == "__main__":
    main()
