"""One GCS bucket through GCS's own JSON API: a :class:`accelkit.sdk.Bucket`, under which
:class:`accelkit.sdk.BucketStore` runs accelkit's one save and one load.

The client is urllib3, chosen by measurement against google-cloud-storage, requests and httpx
on one server (bench/gcs_clients.py, bench/results/2026-12-05-gcs-client-choice.txt): the
fastest upload, download and small request, and the cheapest import. Every request is retried
with a bounded backoff on a reset, a cut body, a timeout, 408, 429 and 5xx, small or large.

The commit's conditional create is ``ifGenerationMatch=0`` on a multipart upload (the upload
kind whose precondition every GCS server honours); a retry that finds its own write (the answer
was lost) is success. A version is an object's generation: a pinned read asks for that
generation, so an object replaced under a load is refused, never read.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from accelkit.sdk import (
    BucketMissing,
    CheckpointError,
    ObjectExists,
    ObjectMissing,
    StoredObject,
    VersionChanged,
    read_timeout_option,
)

#: attempts per request and the longest wait between two; timeouts (seconds)
ATTEMPTS = 6
MAX_BACKOFF_S = 8.0
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
PART_BYTES = 8 << 20
_RETRIED = {408, 429, 500, 502, 503, 504}
_SET = (
    "Set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file or run `gcloud auth "
    "application-default login` (Application Default Credentials, with google-auth: pip install "
    "'accelkit-gcs[auth]'), or pass storage_options={'token': <bearer token>}; for an emulator "
    "set STORAGE_EMULATOR_HOST or storage_options={'endpoint': <url>} (no credentials)."
)
#: what ``storage_options`` may hold
OPTIONS = ("endpoint", "token", "read_timeout")


class GCSBucket:
    """``gs://<name>``. ``storage_options``: ``endpoint`` (default ``STORAGE_EMULATOR_HOST``,
    else Google's), ``token`` (a bearer token; else Application Default Credentials through
    google-auth, or none for an emulator), ``read_timeout`` (seconds, default 60)."""

    scheme = "gs"
    part_bytes = PART_BYTES

    def __init__(self, name: str, storage_options: dict[str, Any] | None = None) -> None:
        import urllib3

        options = dict(storage_options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise CheckpointError(
                f"storage_options: unknown key(s) {unknown} for gs://; known: {OPTIONS}"
            )
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        endpoint = options.get("endpoint") or emulator or "https://storage.googleapis.com"
        self.endpoint = endpoint.rstrip("/") if "://" in endpoint else "http://" + endpoint
        self.name, self._token, self._credentials = name, options.get("token"), None
        self._anonymous = self._token is None and bool(options.get("endpoint") or emulator)
        read = read_timeout_option(options.get("read_timeout"), READ_TIMEOUT_S)
        timeout = urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=read)
        self.http = urllib3.PoolManager(maxsize=16, timeout=timeout, retries=False)
        self._broken = urllib3.exceptions.HTTPError

    # ---- requests ---------------------------------------------------------------------------------
    def _auth(self) -> dict[str, str]:
        if self._token:
            return {"Authorization": f"Bearer {self._token}"}
        if self._anonymous:
            return {}
        if self._credentials is not None and self._credentials.valid:  # every request but one
            return {"Authorization": f"Bearer {self._credentials.token}"}
        try:
            import google.auth
            import google.auth.exceptions
            import google.auth.transport.requests
        except ImportError as err:
            raise CheckpointError(f"gs://{self.name}: no credentials: {_SET}") from err
        try:
            if self._credentials is None:
                scope = ["https://www.googleapis.com/auth/devstorage.read_write"]
                self._credentials, _ = google.auth.default(scopes=scope)
                self._refresh = google.auth.transport.requests.Request()
            if not self._credentials.valid:
                self._credentials.refresh(self._refresh)
        except google.auth.exceptions.GoogleAuthError as err:  # none found, or no token
            raise CheckpointError(
                f"gs://{self.name}: no usable Google Cloud credentials ({err}). {_SET}"
            ) from err
        return {"Authorization": f"Bearer {self._credentials.token}"}

    def _request(self, method: str, path: str, what: str, ok=(200,), body=None, headers=None):
        """One request, retried; the answer with its body read whole (a cut body is retried).
        ``body`` may be a function giving a fresh body for each attempt."""
        last = ""
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(random.uniform(0, min(MAX_BACKOFF_S, 0.25 * 2**attempt)))
            sent = body() if callable(body) else body
            try:
                answer = self.http.request(
                    method,
                    self.endpoint + path,
                    body=sent,
                    headers={**self._auth(), **(headers or {})},
                )
            except self._broken as err:  # a reset, a cut body, a timeout
                last = f"{type(err).__name__}: {err}"
                continue
            finally:
                if hasattr(sent, "close"):
                    sent.close()
            if answer.status in ok:
                return answer
            last = _message(answer)
            if answer.status == 404:
                raise ObjectMissing(f"{what}: no such object ({last})")
            if answer.status not in _RETRIED:
                hint = {401: "check the credentials", 403: "check the credentials' permissions"}
                raise CheckpointError(f"{what}: {last}. {hint.get(answer.status, '')}".strip())
        raise CheckpointError(
            f"{what}: no answer from the GCS endpoint {self.endpoint} after {ATTEMPTS} attempts "
            f"({last}). Check that the server is up and STORAGE_EMULATOR_HOST or "
            "storage_options['endpoint'] names it."
        )

    def _object(self, key: str) -> str:
        return f"/storage/v1/b/{self.name}/o/{urllib.parse.quote(key, safe='')}"

    def _url(self, key: str) -> str:
        return f"gs://{self.name}/{key}"

    # ---- the Bucket verbs -------------------------------------------------------------------------
    def check(self) -> None:
        try:
            self._request("GET", f"/storage/v1/b/{self.name}", f"using gs://{self.name}")
        except ObjectMissing as err:
            raise BucketMissing(
                f"gs://{self.name}: the bucket {self.name!r} does not exist at {self.endpoint}. "
                "Create it first, or fix the bucket name."
            ) from err

    def head(self, key: str) -> StoredObject | None:
        try:
            answer = self._request("GET", self._object(key), f"reading {self._url(key)}")
        except ObjectMissing:
            return None
        meta = json.loads(answer.data)
        return StoredObject(key, int(meta["size"]), str(meta["generation"]))

    def get(self, key: str) -> tuple[bytes, str]:
        answer = self._request("GET", self._object(key) + "?alt=media", f"reading {self._url(key)}")
        return answer.data, answer.headers.get("x-goog-generation", "")

    def read_into(self, key: str, view: memoryview, offset: int, version: str | None) -> None:
        if not view.nbytes:
            return
        query = "?alt=media" + (f"&generation={version}" if version else "")
        headers = {"Range": f"bytes={offset}-{offset + view.nbytes - 1}"}
        what = f"reading {self._url(key)}"
        try:
            data = self._request(
                "GET", self._object(key) + query, what, (200, 206), None, headers
            ).data
        except ObjectMissing as err:
            if version:
                raise VersionChanged(
                    f"{what}: generation {version} is gone: the object was replaced or deleted "
                    "while it was being read; nothing of the new one was used. Load again."
                ) from err
            raise
        if len(data) != view.nbytes:
            raise CheckpointError(f"{what}: {len(data)} of {view.nbytes} bytes at {offset}")
        view[:] = data

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        boundary = uuid.uuid4().hex
        meta = json.dumps({"name": key}).encode()
        payload = b"".join(
            [
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                meta,
                f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                data,
                f"\r\n--{boundary}--\r\n".encode(),
            ]
        )
        query = (
            f"uploadType=multipart&name={urllib.parse.quote(key, safe='')}"  # named in the URL too
        )
        query += "&ifGenerationMatch=0" if if_absent else ""
        headers = {"Content-Type": f"multipart/related; boundary={boundary}"}
        what = f"writing {self._url(key)}"
        answer = self._request(
            "POST",
            f"/upload/storage/v1/b/{self.name}/o?{query}",
            what,
            (200, 412),
            payload,
            headers,
        )
        if answer.status == 412:  # the store tells its own retried write from another's
            raise ObjectExists(f"{what}: the object exists already")

    def upload(self, key: str, source: Path, pool: ThreadPoolExecutor | None = None) -> None:
        """A local file in one request (retried whole), streamed from the file a block at a
        time: memory stays flat (bench/gcs_upload_memory.py: +0 MiB of peak RSS for 1 GiB)."""
        name = urllib.parse.quote(key, safe="")
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(os.path.getsize(source)),
        }
        self._request(
            "POST",
            f"/upload/storage/v1/b/{self.name}/o?uploadType=media&name={name}",
            f"writing {self._url(key)}",
            body=lambda: open(source, "rb"),  # noqa: SIM115  (closed after each attempt)
            headers=headers,
        )

    def _pages(self, query: dict[str, str]) -> Iterator[dict[str, Any]]:
        token = None
        while True:
            page_query = {**query, "maxResults": "1000", **({"pageToken": token} if token else {})}
            path = f"/storage/v1/b/{self.name}/o?{urllib.parse.urlencode(page_query)}"
            page = json.loads(
                self._request("GET", path, f"listing gs://{self.name}/{query['prefix']}").data
            )
            yield page
            token = page.get("nextPageToken")
            if not token:
                return

    def list(self, prefix: str) -> Iterator[StoredObject]:
        for page in self._pages({"prefix": prefix}):
            for item in page.get("items", []):
                yield StoredObject(item["name"], int(item["size"]), str(item["generation"]))

    def list_dirs(self, prefix: str) -> list[str]:
        names = []
        for page in self._pages({"prefix": prefix, "delimiter": "/"}):
            names += [p[len(prefix) :].rstrip("/") for p in page.get("prefixes", [])]
        return names

    def delete(self, keys: list[str]) -> None:
        for key in keys:  # an absent one (a retried delete found its own) is fine
            self._request(
                "DELETE", self._object(key), f"deleting {self._url(key)}", (200, 204, 404)
            )

    def sink(self, key: str, pool: ThreadPoolExecutor) -> _UploadAtFinish:
        return _UploadAtFinish(self, key)

    def abort_uploads(self, prefix: str, only: Callable[[str], bool] | None = None) -> int:
        return 0  # one request per object: nothing is left half-uploaded


class _UploadAtFinish:
    """A rank file written into a local scratch file, then uploaded in one request when it is
    complete (a Sink): a GCS object is created whole, so nothing is stored if the save fails."""

    work = "pwrite"

    def __init__(self, bucket: GCSBucket, key: str) -> None:
        self.bucket, self.key, self.fd, self.path = bucket, key, -1, Path()

    def open(self, total_bytes: int) -> None:
        self.fd, name = tempfile.mkstemp(prefix="accelkit-gcs-")
        self.path = Path(name)

    def write(self, view: memoryview, offset: int) -> None:
        while view.nbytes:
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    def finish(self, profile: Any) -> None:
        self.bucket.upload(self.key, self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            self.fd = -1


def _message(answer: Any) -> str:
    try:
        detail = json.loads(answer.data).get("error", {}).get("message", "")
    except (ValueError, AttributeError):
        detail = answer.data[:200].decode(errors="replace")
    return f"HTTP {answer.status} {detail}".strip()
