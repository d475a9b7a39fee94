"""S3-compatible object storage (``s3://bucket/prefix``): :class:`S3Bucket`, the few object
operations a checkpoint needs (the :class:`~accelkit.checkpoint.store.base.Bucket` protocol) over
boto3, the optional extra ``accelkit[s3]``.

boto3 was chosen by measurement against obstore, s3fs and the S3 connector for PyTorch on the
same server (docs/checkpoint.md, "Object storage"), and it reads the standard configuration
itself: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``, ``AWS_PROFILE`` and the shared config files. ``storage_options``
overrides them per call. Every request is retried (botocore's standard mode), and so is a body
cut mid-way, which botocore does not retry: a small GET's as a large one's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from accelkit.checkpoint.store.base import (
    BucketMissing,
    ObjectExists,
    ObjectMissing,
    StoredObject,
    VersionChanged,
    read_timeout_option,
)
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

__all__ = ["S3Bucket", "UploadSink", "bucket_for"]

INSTALL_HINT = "pip install 'accelkit[s3]'"
#: multipart part size (larger for objects of over ``MAX_PARTS`` of them) and the parallel
#: requests of one transfer
PART_BYTES = 8 << 20
MAX_PARTS = 10_000
CONCURRENCY = 8
#: attempts per request, the first one included (botocore's standard mode: bounded exponential
#: backoff), and of a body cut mid-way (botocore retries none). Given to botocore as
#: ``total_max_attempts``: its ``max_attempts`` key counts the retries only (5 is 6 requests)
MAX_ATTEMPTS = 6
CONNECT_TIMEOUT = 10
READ_TIMEOUT = 60
#: the first pause before a body is asked for again (doubled each time)
RETRY_PAUSE_S = 0.1

#: the storage_options accelkit understands (besides ``profile``), as boto3 client arguments
_CLIENT_OPTIONS = {
    "endpoint_url": "endpoint_url",
    "aws_access_key_id": "aws_access_key_id",
    "aws_secret_access_key": "aws_secret_access_key",
    "aws_session_token": "aws_session_token",
    "region_name": "region_name",
    # the spellings of s3fs / fsspec and MMEngine's backend_args
    "key": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "token": "aws_session_token",
    "region": "region_name",
    "endpoint": "endpoint_url",
}


def _boto3() -> Any:
    try:
        import boto3
        import botocore
    except ImportError as err:
        raise CheckpointError(
            f"object storage (s3://) needs boto3, which is not installed: {INSTALL_HINT}"
        ) from err
    return boto3, botocore


def part_bytes(size: int) -> int:
    """The part size of a multipart upload of ``size`` bytes: 8 MiB, or whole MiBs enough to stay
    within S3's 10,000 parts (an 80 GB rank file takes 9 MiB parts)."""
    least = -(-size // (MAX_PARTS - 1))
    return max(PART_BYTES, -(-least // (1 << 20)) << 20)


def _receive(body: Any, view: memoryview, done: int) -> int:
    """Read ``body`` into ``view`` from ``done`` until it ends, is cut or fails; the bytes now
    in. Each slice is released at once, even on an error: one a traceback kept would pin the
    load's mapped copy (a BufferError at its close)."""
    try:
        while done < view.nbytes:
            with view[done:] as part:
                n = body.readinto(part)
            if not n:
                break
            done += n
    except Exception as err:
        log.debug("a response body ended after %d bytes: %s", done, err)
    finally:
        body.close()
    return done


class S3Bucket:
    """One bucket of an S3-compatible store: the few operations a checkpoint needs (a
    :class:`~accelkit.checkpoint.store.base.Bucket`)."""

    scheme = "s3"
    part_bytes = PART_BYTES

    def __init__(self, bucket: str, storage_options: dict[str, Any] | None = None) -> None:
        boto3, botocore = _boto3()
        from botocore.config import Config

        options = dict(storage_options or {})
        profile = options.pop("profile", None) or options.pop("profile_name", None)
        read_timeout = read_timeout_option(options.pop("read_timeout", None), READ_TIMEOUT)
        client_args: dict[str, Any] = {}
        for key, value in options.items():
            if key not in _CLIENT_OPTIONS:
                known = ", ".join(sorted({*_CLIENT_OPTIONS, "profile", "read_timeout"}))
                raise CheckpointError(f"storage_options: unknown key {key!r}; known: {known}")
            if value is not None:
                client_args[_CLIENT_OPTIONS[key]] = value
        config = Config(
            retries={"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"},
            connect_timeout=CONNECT_TIMEOUT,
            read_timeout=read_timeout,
            max_pool_connections=2 * CONCURRENCY,
        )
        session = boto3.session.Session(profile_name=profile)
        self.bucket = self.name = bucket
        self.client = session.client("s3", config=config, **client_args)
        self._botocore = botocore

    # ---- errors -------------------------------------------------------------------------------
    def _error(self, err: BaseException, key: str, doing: str) -> CheckpointError:
        """A clear error for a failed request: what, where, and what to do."""
        where = f"s3://{self.bucket}/{key}"
        exceptions = self._botocore.exceptions
        endpoint = self.client.meta.endpoint_url
        if isinstance(err, exceptions.NoCredentialsError):
            return CheckpointError(
                f"{doing} {where}: no S3 credentials found. Set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass storage_options."
            )
        if isinstance(err, (exceptions.EndpointConnectionError, exceptions.ConnectionError)):
            return CheckpointError(
                f"{doing} {where}: cannot reach the S3 endpoint {endpoint} ({err}) after "
                f"{MAX_ATTEMPTS} attempts. Check that the server is up and AWS_ENDPOINT_URL "
                "names it."
            )
        if isinstance(err, exceptions.ClientError):
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return BucketMissing(
                    f"{doing} {where}: the bucket {self.bucket!r} does not exist at {endpoint}. "
                    "Create it first, or fix the bucket name."
                )
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return ObjectMissing(f"{doing} {where}: no such object")
            if code in ("PreconditionFailed", "412") or status == 412:
                return ObjectExists(f"{doing} {where}: the object exists already")
            if (
                code
                in (
                    "AccessDenied",
                    "InvalidAccessKeyId",
                    "SignatureDoesNotMatch",
                    "403",
                    "Forbidden",
                )
                or status == 403
            ):
                return CheckpointError(
                    f"{doing} {where}: access denied by {endpoint} ({code}). Check the "
                    "credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE) and "
                    "their permissions on the bucket."
                )
            if isinstance(status, int) and (status >= 500 or status in (408, 429)):
                return CheckpointError(
                    f"{doing} {where}: {endpoint} answered HTTP {status} ({code}) to all "
                    f"{MAX_ATTEMPTS} attempts. The server is overloaded or failing: retry later."
                )
        if isinstance(err, CheckpointError):
            return err
        return CheckpointError(f"{doing} {where}: {type(err).__name__}: {err}")

    def _call(self, doing: str, key: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as err:
            raise self._error(err, key, doing) from err

    # ---- operations ---------------------------------------------------------------------------
    def head(self, key: str) -> StoredObject | None:
        """The object ``key``, or None where it does not exist."""
        try:
            reply = self._call("reading", key, self.client.head_object, Bucket=self.bucket, Key=key)
        except BucketMissing:
            raise
        except ObjectMissing:
            return None
        return StoredObject(key, reply["ContentLength"], reply.get("ETag", ""))

    def check(self) -> None:
        """Raise a clear error where the bucket does not exist or cannot be reached (a HEAD of
        a missing object cannot tell a missing bucket from a missing key)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as err:
            error = self._error(err, "", "using")
            if isinstance(error, ObjectMissing):
                raise BucketMissing(
                    f"s3://{self.bucket}: the bucket {self.bucket!r} does not exist at "
                    f"{self.client.meta.endpoint_url}. Create it first, or fix the bucket name."
                ) from err
            raise error from err

    def get(self, key: str) -> tuple[bytes, str]:
        """The whole object and its ETag. A body cut mid-way is finished by ranged GETs pinned
        to that ETag, retried as a large object's parts are (:meth:`read_into`)."""
        reply = self._call("reading", key, self.client.get_object, Bucket=self.bucket, Key=key)
        size, version = reply["ContentLength"], reply.get("ETag", "")
        data = bytearray(size)
        with memoryview(data) as view:
            done = _receive(reply["Body"], view, 0)
            if done < size:
                with view[done:] as rest:
                    self.read_into(key, rest, done, version or None)
        return bytes(data), version

    def read_into(
        self, key: str, view: memoryview, offset: int, version: str | None = None
    ) -> None:
        """Fill ``view`` with the object's bytes from ``offset`` (one ranged GET; pinned to
        ``version``, an ETag, with ``If-Match``). A short or broken body is asked for again, up
        to :data:`MAX_ATTEMPTS` times; the bytes already in are kept."""
        done = 0
        for attempt in range(1, MAX_ATTEMPTS + 1):
            if done == view.nbytes:
                return
            if attempt > 1:
                time.sleep(RETRY_PAUSE_S * 2 ** (attempt - 2))
            pinned = {"IfMatch": version} if version else {}
            try:
                reply = self._call(
                    "reading",
                    key,
                    self.client.get_object,
                    Bucket=self.bucket,
                    Key=key,
                    Range=f"bytes={offset + done}-{offset + view.nbytes - 1}",
                    **pinned,
                )
            except ObjectExists as err:  # 412: If-Match failed
                raise VersionChanged(
                    f"reading s3://{self.bucket}/{key}: the object was replaced during the load "
                    f"(it is no longer the version {version} the load checked); load again"
                ) from err
            done = _receive(reply["Body"], view, done)
        if done < view.nbytes:
            raise CheckpointError(
                f"reading s3://{self.bucket}/{key}: {done} of {view.nbytes} bytes at offset "
                f"{offset} after {MAX_ATTEMPTS} attempts (the object is shorter than expected, "
                "or the network keeps cutting the answer)"
            )

    def download(self, key: str, dest: Path, size: int, pool: ThreadPoolExecutor) -> None:
        """The whole object into the local file ``dest``, by parallel ranged GETs."""
        with open(dest, "wb") as f:
            f.truncate(size)
        fd = os.open(dest, os.O_WRONLY)
        try:

            def part(start: int) -> None:
                buffer = bytearray(min(PART_BYTES, size - start))
                self.read_into(key, memoryview(buffer), start)
                os.pwrite(fd, buffer, start)

            for future in [pool.submit(part, s) for s in range(0, size, PART_BYTES)]:
                future.result()
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """One PUT; ``if_absent``: only where no object has the key (``If-None-Match: *``), else
        :class:`ObjectExists`."""
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        self._call(
            "writing", key, self.client.put_object, Bucket=self.bucket, Key=key, Body=data, **extra
        )

    def upload(self, key: str, source: Path, pool: ThreadPoolExecutor) -> None:
        """A local file to ``key``: one PUT when small, else a multipart upload whose parts go
        in parallel; a failed multipart upload is aborted, so it leaves no parts behind."""
        size = source.stat().st_size
        step = part_bytes(size)
        if size <= step:
            self.put(key, source.read_bytes())
            return
        upload_id = self.start_upload(key)
        fd = os.open(source, os.O_RDONLY)
        futures: list[Future] = []
        try:

            def part(number: int) -> dict[str, Any]:
                start = (number - 1) * step
                return self.upload_part(key, upload_id, number, os.pread(fd, step, start))

            count = (size + step - 1) // step
            futures = [pool.submit(part, n) for n in range(1, count + 1)]
            self.complete_upload(key, upload_id, [f.result() for f in futures], size)
        except BaseException:
            for future in futures:
                future.cancel()
            self.abort_upload(key, upload_id)
            raise
        finally:
            os.close(fd)

    def start_upload(self, key: str) -> str:
        """A new multipart upload of ``key``; its id."""
        reply = self._call(
            "writing", key, self.client.create_multipart_upload, Bucket=self.bucket, Key=key
        )
        return reply["UploadId"]

    def upload_part(self, key: str, upload_id: str, number: int, body: Any) -> dict[str, Any]:
        """One part (numbered from 1); what :meth:`complete_upload` needs of it."""
        reply = self._call(
            "writing",
            key,
            self.client.upload_part,
            Bucket=self.bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def complete_upload(
        self, key: str, upload_id: str, parts: list[dict[str, Any]], size: int
    ) -> None:
        """Join the parts into the object ``key`` of ``size`` bytes. A retry whose first try
        completed (its answer lost) finds the upload gone and the object there: success (a
        save's keys are its own, so an object of that size is this upload's)."""
        try:
            self._call(
                "writing",
                key,
                self.client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": sorted(parts, key=lambda p: p["PartNumber"])},
            )
        except ObjectMissing:
            found = self.head(key)
            if found is None or found.size != size:
                raise

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an unfinished upload's parts (best effort: the server may be why it failed; the
        next save's sweep aborts what is left)."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as err:
            log.warning("could not abort the multipart upload of %s: %s", key, err)

    def list(self, prefix: str) -> Iterator[StoredObject]:
        """Every object whose key starts with ``prefix``."""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    yield StoredObject(item["Key"], item["Size"], item.get("ETag", ""))
        except Exception as err:
            raise self._error(err, prefix, "listing") from err

    def list_dirs(self, prefix: str) -> list[str]:
        """The names of the "directories" right below ``prefix`` (which ends with ``/``)."""
        paginator = self.client.get_paginator("list_objects_v2")
        names = []
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                for item in page.get("CommonPrefixes", []):
                    names.append(item["Prefix"][len(prefix) :].rstrip("/"))
        except Exception as err:
            raise self._error(err, prefix, "listing") from err
        return names

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            if batch:
                self._call(
                    "deleting",
                    batch[0]["Key"],
                    self.client.delete_objects,
                    Bucket=self.bucket,
                    Delete={"Objects": batch, "Quiet": True},
                )

    def sink(self, key: str, pool: ThreadPoolExecutor) -> UploadSink:
        """Bytes written at offsets, uploaded part by part as they come (:class:`UploadSink`)."""
        return UploadSink(self, key, pool)

    def abort_uploads(self, prefix: str, only: Callable[[str], bool] | None = None) -> int:
        """Abort the unfinished multipart uploads under ``prefix`` (a killed save's parts);
        ``only(key)``: just those whose key it accepts."""
        try:
            reply = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        except Exception as err:
            log.debug("listing multipart uploads under %s: %s", prefix, err)
            return 0
        count = 0
        for upload in reply.get("Uploads", []):
            if only is not None and not only(upload["Key"]):
                continue
            try:
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
                count += 1
            except Exception as err:
                log.debug("aborting %s: %s", upload["Key"], err)
        return count


class UploadSink:
    """A file's bytes, written at offsets by several threads at once, uploaded as they come: each
    part goes up as soon as all of its bytes are there, while the rest is still being written
    (a :class:`~accelkit.checkpoint.format.safetensors_io.Sink`). Nothing lands on a local disk.

    Memory stays bounded: a writer waits while ``queued`` finished parts wait for the network.
    A failed part fails the next write at once, and :meth:`close` aborts an unfinished upload,
    so a failed save leaves no parts behind."""

    work = "assemble"

    def __init__(
        self, store: S3Bucket, key: str, pool: ThreadPoolExecutor, queued: int = CONCURRENCY
    ) -> None:
        self.store, self.key, self.pool, self.queued = store, key, pool, queued
        self.upload_id: str | None = None
        self.total = self.step = 0
        self.buffers: dict[int, bytearray] = {}
        self.missing: dict[int, int] = {}  # part index -> bytes not yet written
        self.futures: list[Future] = []
        self.waiting = 0  # finished parts not yet sent
        self.error: BaseException | None = None
        self.done = False
        self.cond = threading.Condition()

    def open(self, total_bytes: int) -> None:
        self.total, self.step = total_bytes, part_bytes(total_bytes)
        if total_bytes > self.step:
            self.upload_id = self.store.start_upload(self.key)

    def _size(self, index: int) -> int:
        return min(self.step, self.total - index * self.step)

    def write(self, view: memoryview, offset: int) -> None:
        import numpy

        view = view.cast("B") if view.format != "B" else view
        done = 0
        while done < view.nbytes:
            at = offset + done
            index, within = divmod(at, self.step)
            take = min(view.nbytes - done, self._size(index) - within)
            with self.cond:
                self._raise_failed()
                buffer = self.buffers.get(index)
                if buffer is None:
                    buffer = self.buffers[index] = bytearray(self._size(index))
                    self.missing[index] = len(buffer)
            # numpy's copy releases the GIL (a bytearray's slice assignment holds it): the
            # training loop beside an asynchronous save keeps running
            numpy.frombuffer(buffer, numpy.uint8)[within : within + take] = numpy.frombuffer(
                view[done : done + take], numpy.uint8
            )
            with self.cond:
                self.missing[index] -= take
                if self.missing[index] == 0 and self.upload_id is not None:
                    while self.waiting >= self.queued and self.error is None:
                        self.cond.wait()
                    self._raise_failed()
                    del self.missing[index]
                    self.waiting += 1
                    self.futures.append(
                        self.pool.submit(self._send, index + 1, self.buffers.pop(index))
                    )
            done += take

    def _send(self, number: int, body: bytearray) -> dict[str, Any]:
        try:
            assert self.upload_id is not None
            return self.store.upload_part(self.key, self.upload_id, number, body)
        except BaseException as err:
            with self.cond:
                self.error = self.error or err
            raise
        finally:
            with self.cond:
                self.waiting -= 1
                self.cond.notify_all()

    def _raise_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self, profile: Any) -> None:
        where = f"s3://{self.store.bucket}/{self.key}"
        if self.upload_id is None:  # one part: one PUT
            body = self.buffers.pop(0, bytearray())
            if self.missing.pop(0, 0) or len(body) != self.total:
                raise CheckpointError(f"{where}: bytes were left unwritten; nothing was stored")
            self.store.put(self.key, bytes(body))
            self.done = True
            return
        parts = [future.result() for future in self.futures]
        count = -(-self.total // self.step)
        if len(parts) != count:
            raise CheckpointError(
                f"{where}: {len(parts)} of {count} parts were written; nothing was stored"
            )
        self.store.complete_upload(self.key, self.upload_id, parts, self.total)
        self.done = True

    def close(self) -> None:
        if self.done or self.upload_id is None:
            return
        with self.cond:
            self.error = self.error or CheckpointError("the upload was abandoned")
            self.cond.notify_all()
        for future in self.futures:
            future.cancel()
        for future in self.futures:
            if not future.cancelled():
                try:
                    future.result()
                except BaseException:
                    pass
        self.store.abort_upload(self.key, self.upload_id)


_buckets: dict[tuple[str, tuple], S3Bucket] = {}
_buckets_lock = threading.Lock()


def bucket_for(bucket: str, storage_options: dict[str, Any] | None = None) -> S3Bucket:
    """The client of ``bucket`` (one per bucket, options and environment)."""
    env = tuple(
        os.environ.get(k)
        for k in (
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_PROFILE",
        )
    )
    key = (bucket, tuple(sorted((storage_options or {}).items())) + env)
    with _buckets_lock:
        found = _buckets.get(key)
        if found is None:
            found = _buckets[key] = S3Bucket(bucket, storage_options)
        return found
