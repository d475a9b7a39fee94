"""Which S3 client should accelkit use? Each candidate moves the same bytes to and from the same
server in one run: obstore, boto3, s3fs (fsspec) and the S3 connector for PyTorch.

    .venv/bin/python bench/s3_clients.py                    # starts a local SeaweedFS server
    .venv/bin/python bench/s3_clients.py --endpoint http://host:port --bucket B   # a server of yours

Cases, each repeated ``--repeat`` times (the median is printed, in GB/s of payload):

- ``one``: one object of ``--mib`` MiB from a memory buffer (multipart where the client does it)
  and back into memory (parallel ranged GETs where the client does them);
- ``parallel``: ``--objects`` objects of ``--mib / --objects`` MiB each, one thread per object
  (a rank file per rank, as a multi-rank save on one node makes them).

Every download is compared byte for byte with what was uploaded. The server and the client
share the machine: on a 2-core box the figures are lower bounds of what the client can do.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PART = 8 << 20  # multipart part size for every client that takes one
CONCURRENCY = 8


def _endpoint() -> str:
    return os.environ["AWS_ENDPOINT_URL"]


# ---- clients: upload(key, data) and download(key, size) -> bytes-like --------------------------
class Boto3:
    name = "boto3"

    def __init__(self, bucket: str) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        pool = Config(max_pool_connections=2 * CONCURRENCY)
        self.client = boto3.client("s3", endpoint_url=_endpoint(), config=pool)
        self.transfer = TransferConfig(
            multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY
        )

    def upload(self, key: str, data: memoryview) -> None:
        self.client.upload_fileobj(io.BytesIO(data), self.bucket, key, Config=self.transfer)

    def download(self, key: str, size: int) -> bytes:
        out = bytearray(size)
        view = memoryview(out)

        def part(start: int) -> None:
            end = min(size, start + PART) - 1
            body = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}")
            stream = body["Body"]
            got = start
            while got <= end:
                n = stream.readinto(view[got : end + 1]) if hasattr(stream, "readinto") else 0
                if not n:
                    chunk = stream.read(end + 1 - got)
                    if not chunk:
                        raise OSError("short read")
                    view[got : got + len(chunk)] = chunk
                    n = len(chunk)
                got += n

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(part, range(0, size, PART)))
        return out


class Obstore:
    name = "obstore"

    def __init__(self, bucket: str) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            bucket,
            endpoint=_endpoint(),
            access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
            secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            client_options={"allow_http": True},
        )

    def upload(self, key: str, data: memoryview) -> None:
        import obstore

        obstore.put(self.store, key, data, chunk_size=PART, max_concurrency=CONCURRENCY)

    def download(self, key: str, size: int):
        import obstore

        starts = list(range(0, size, PART))
        ends = [min(size, s + PART) for s in starts]
        parts = obstore.get_ranges(self.store, key, starts=starts, ends=ends)
        out = bytearray(size)
        for start, part in zip(starts, parts):
            out[start : start + len(part)] = memoryview(part)
        return out


class S3fs:
    name = "s3fs"

    def __init__(self, bucket: str) -> None:
        import s3fs

        self.bucket = bucket
        self.fs = s3fs.S3FileSystem(
            endpoint_url=_endpoint(), default_block_size=PART, max_concurrency=CONCURRENCY
        )

    def upload(self, key: str, data: memoryview) -> None:
        with self.fs.open(f"{self.bucket}/{key}", "wb", block_size=PART) as f:
            f.write(data)

    def download(self, key: str, size: int) -> bytes:
        return self.fs.cat_file(f"{self.bucket}/{key}")


class S3Connector:
    name = "s3torchconnector"

    def __init__(self, bucket: str) -> None:
        from s3torchconnector._s3client import S3Client, S3ClientConfig

        self.bucket = bucket
        config = S3ClientConfig(part_size=PART, force_path_style=True)
        self.client = S3Client(
            os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            endpoint=_endpoint(),
            s3client_config=config,
        )

    def upload(self, key: str, data: memoryview) -> None:
        writer = self.client.put_object(self.bucket, key)
        writer.write(data)
        writer.close()

    def download(self, key: str, size: int):
        reader = self.client.get_object(self.bucket, key)
        out = bytearray(size)
        got = reader.readinto(memoryview(out))
        if got != size:
            raise OSError(f"short read: {got} of {size}")
        return out


CLIENTS = {c.name: c for c in (Obstore, Boto3, S3fs, S3Connector)}


def _timed(fn, *args) -> tuple[float, object]:
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def run_client(cls, bucket: str, payload: bytes, objects: int, repeat: int) -> dict:
    client = cls(bucket)
    size = len(payload)
    view = memoryview(payload)
    piece = size // objects
    result: dict[str, list[float]] = {k: [] for k in ("one_up", "one_down", "par_up", "par_down")}

    def parallel(fn, *columns):
        with ThreadPoolExecutor(objects) as pool:
            return list(pool.map(fn, *columns))

    for trial in range(repeat):
        key = f"bench/{cls.name}/{trial}/one"
        result["one_up"].append(size / _timed(client.upload, key, view)[0] / 1e9)
        seconds, got = _timed(client.download, key, size)
        result["one_down"].append(size / seconds / 1e9)
        if bytes(got) != payload:
            raise AssertionError(f"{cls.name}: the download differs from the upload")
        keys = [f"bench/{cls.name}/{trial}/rank-{i}" for i in range(objects)]
        pieces = [view[i * piece : (i + 1) * piece] for i in range(objects)]
        result["par_up"].append(size / _timed(parallel, client.upload, keys, pieces)[0] / 1e9)
        seconds, outs = _timed(parallel, client.download, keys, [piece] * objects)
        result["par_down"].append(size / seconds / 1e9)
        for i, out in enumerate(outs):
            if bytes(out) != bytes(pieces[i]):
                raise AssertionError(f"{cls.name}: object {i} differs from the upload")
    return {k: round(statistics.median(v), 3) for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--objects", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--endpoint", help="an S3 endpoint (default: start a local server)")
    parser.add_argument("--bucket", default="bench")
    args = parser.parse_args()

    server = None
    if args.endpoint is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from accelkit.testing.s3_server import LocalS3Server

        server = LocalS3Server(tempfile.mkdtemp(prefix="s3bench-"), bucket=args.bucket).start()
        os.environ.update(server.env())
    else:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    payload = os.urandom(args.mib << 20)
    print(
        f"# {args.mib} MiB, {args.objects} objects in parallel, median of {args.repeat}; "
        f"GB/s of payload; {os.cpu_count()} CPUs; server {os.environ['AWS_ENDPOINT_URL']}"
    )
    print(f"{'client':<18}{'one up':>9}{'one down':>10}{'par up':>9}{'par down':>10}")
    results = {}
    try:
        for name in args.clients.split(","):
            try:
                row = run_client(CLIENTS[name], args.bucket, payload, args.objects, args.repeat)
            except ImportError as err:
                print(f"{name:<18} not installed ({err})")
                continue
            results[name] = row
            print(
                f"{name:<18}{row['one_up']:>9.3f}{row['one_down']:>10.3f}"
                f"{row['par_up']:>9.3f}{row['par_down']:>10.3f}",
                flush=True,
            )
    finally:
        if server is not None:  # and its data
            server.stop()
            shutil.rmtree(server.directory, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
