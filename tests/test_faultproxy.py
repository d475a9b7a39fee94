"""The fault proxy (accelkit.testing.faultproxy) against a real server: SeaweedFS's S3 through
boto3. Each fault is seen by the client as the network would give it, and each test checks the
fault happened (its twin: the same requests without the rule succeed)."""

from __future__ import annotations

import threading
import time

import pytest

from accelkit.testing.faultproxy import Cut, FaultProxy, Lose, Reset, Stall, Status

pytest.importorskip("boto3")


@pytest.fixture
def proxy(s3):
    with FaultProxy(s3.server.ports["s3.port"]) as running:
        yield running


def _client(s3, endpoint: str, attempts: int = 1, read_timeout: float = 30):
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"total_max_attempts": attempts, "mode": "standard"},
        read_timeout=read_timeout,
        connect_timeout=5,
    )
    return boto3.client("s3", endpoint_url=endpoint, config=config)


def _key(s3, name: str) -> str:
    return f"{s3.prefix}/{name}"


def test_requests_pass_through_unchanged_and_are_logged(s3, proxy):
    client = _client(s3, proxy.url)
    data = bytes(range(256)) * 4096  # 1 MiB
    client.put_object(Bucket=s3.bucket, Key=_key(s3, "a"), Body=data)  # sends Expect
    assert client.get_object(Bucket=s3.bucket, Key=_key(s3, "a"))["Body"].read() == data
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=s3.prefix)["Contents"]
    assert [item["Key"] for item in listed] == [_key(s3, "a")]
    assert [(r.method, r.status) for r in proxy.requests(path=s3.prefix)] == [
        ("PUT", 200),
        ("GET", 200),
        ("GET", 200),
    ]


def test_a_multipart_upload_and_ranged_gets_pass_through(s3, proxy):
    client = _client(s3, proxy.url)
    key = _key(s3, "multi")
    parts = [bytes([n]) * (5 << 20) for n in range(3)]
    upload = client.create_multipart_upload(Bucket=s3.bucket, Key=key)["UploadId"]
    etags = [
        client.upload_part(Bucket=s3.bucket, Key=key, UploadId=upload, PartNumber=n + 1, Body=part)[
            "ETag"
        ]
        for n, part in enumerate(parts)
    ]
    client.complete_multipart_upload(
        Bucket=s3.bucket,
        Key=key,
        UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": n + 1, "ETag": e} for n, e in enumerate(etags)]},
    )
    middle = client.get_object(Bucket=s3.bucket, Key=key, Range="bytes=5242878-5242881")
    assert middle["Body"].read() == b"\x00\x00\x01\x01"


def test_a_reset_of_the_nth_match_reaches_the_client_and_a_retry_gets_through(s3, proxy):
    direct = _client(s3, s3.server.endpoint)
    direct.put_object(Bucket=s3.bucket, Key=_key(s3, "latest"), Body=b"step-3")
    rule = proxy.inject(Reset(), method="GET", path=r"/latest$", nth=2)
    client = _client(s3, proxy.url)
    assert client.get_object(Bucket=s3.bucket, Key=_key(s3, "latest"))["Body"].read() == b"step-3"
    with pytest.raises(Exception, match=r"(?i)connection"):  # the 2nd: reset, no retry allowed
        client.get_object(Bucket=s3.bucket, Key=_key(s3, "latest"))
    assert rule.fired == 1 and rule.matched == 2
    retrying = _client(s3, proxy.url, attempts=3)
    rule = proxy.inject(Reset(), method="GET", path=r"/latest$")
    assert retrying.get_object(Bucket=s3.bucket, Key=_key(s3, "latest"))["Body"].read() == b"step-3"
    assert rule.fired == 1


def test_an_injected_503_is_an_answer_the_server_never_saw(s3, proxy):
    rule = proxy.inject(Status(503), method="PUT", path=r"/obj$", times=2)
    client = _client(s3, proxy.url)
    with pytest.raises(Exception, match="503"):
        client.put_object(Bucket=s3.bucket, Key=_key(s3, "obj"), Body=b"x")
    assert (
        _client(s3, s3.server.endpoint)
        .list_objects_v2(Bucket=s3.bucket, Prefix=s3.prefix)
        .get("KeyCount", 0)
        == 0
    )  # never forwarded
    _client(s3, proxy.url, attempts=3).put_object(Bucket=s3.bucket, Key=_key(s3, "obj"), Body=b"x")
    assert rule.fired == 2  # the second 503 was retried past
    assert [r.status for r in proxy.requests("PUT")] == [503, 503, 200]


def test_a_cut_body_fails_the_read_of_a_large_and_of_a_small_object(s3, proxy):
    direct = _client(s3, s3.server.endpoint)
    big = bytes(range(256)) * 8192  # 2 MiB: the cut falls in a later chunk than the first
    direct.put_object(Bucket=s3.bucket, Key=_key(s3, "big"), Body=big)
    direct.put_object(Bucket=s3.bucket, Key=_key(s3, "small"), Body=b"step-12\n")
    proxy.inject(Cut(after=1_500_000), method="GET", path=r"/big$")
    proxy.inject(Cut(after=3, reset=False), method="GET", path=r"/small$")
    client = _client(s3, proxy.url)
    for name in ("big", "small"):
        body = client.get_object(Bucket=s3.bucket, Key=_key(s3, name))["Body"]
        with pytest.raises(Exception) as caught:
            body.read()
        assert "IncompleteRead" in repr(caught.value) or "ResponseStreamingError" in repr(
            caught.value
        )
    assert client.get_object(Bucket=s3.bucket, Key=_key(s3, "big"))["Body"].read() == big


def test_a_stall_past_the_clients_timeout_times_out_and_a_short_one_only_delays(s3, proxy):
    direct = _client(s3, s3.server.endpoint)
    direct.put_object(Bucket=s3.bucket, Key=_key(s3, "obj"), Body=b"abc" * 1000)
    proxy.inject(Stall(seconds=30), method="GET", path=r"/obj$")
    impatient = _client(s3, proxy.url, read_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
        impatient.get_object(Bucket=s3.bucket, Key=_key(s3, "obj"))
    assert time.monotonic() - started < 25  # the client gave up, not the stall
    proxy.release()
    proxy.inject(Stall(seconds=0.3, after=100), method="GET", path=r"/obj$")
    got = _client(s3, proxy.url).get_object(Bucket=s3.bucket, Key=_key(s3, "obj"))
    assert got["Body"].read() == b"abc" * 1000


def test_a_stall_until_released_holds_the_request(s3, proxy):
    direct = _client(s3, s3.server.endpoint)
    direct.put_object(Bucket=s3.bucket, Key=_key(s3, "obj"), Body=b"held")
    rule = proxy.inject(Stall(), method="GET", path=r"/obj$")
    answer = {}
    client = _client(s3, proxy.url)
    reader = threading.Thread(
        target=lambda: answer.update(
            body=client.get_object(Bucket=s3.bucket, Key=_key(s3, "obj"))["Body"].read()
        )
    )
    reader.start()
    assert rule.arrived.wait(30)
    time.sleep(0.3)
    assert not answer  # still held
    proxy.release()
    reader.join(30)
    assert answer == {"body": b"held"}


def test_a_lost_answer_leaves_the_write_done_and_the_client_uninformed(s3, proxy):
    rule = proxy.inject(Lose(), method="PUT", path=r"/manifest$")
    client = _client(s3, proxy.url)
    with pytest.raises(Exception, match=r"(?i)connection"):
        client.put_object(Bucket=s3.bucket, Key=_key(s3, "manifest"), Body=b"{}", IfNoneMatch="*")
    assert rule.fired == 1 and proxy.requests("PUT")[0].status == 200
    direct = _client(s3, s3.server.endpoint)
    assert direct.get_object(Bucket=s3.bucket, Key=_key(s3, "manifest"))["Body"].read() == b"{}"
    # the retry a client would make now finds its own write: 412
    with pytest.raises(Exception, match=r"PreconditionFailed|412"):
        client.put_object(Bucket=s3.bucket, Key=_key(s3, "manifest"), Body=b"{}", IfNoneMatch="*")


def test_a_script_decides_per_request_and_before_runs_between_requests(s3, proxy):
    direct = _client(s3, s3.server.endpoint)
    direct.put_object(Bucket=s3.bucket, Key=_key(s3, "obj"), Body=b"old")
    seen = []

    def decide(request):
        seen.append((request.method, request.headers.get("range")))
        return Status(503) if request.headers.get("range") == "bytes=0-0" else None

    proxy.script(decide)
    client = _client(s3, proxy.url)
    with pytest.raises(Exception, match="503"):
        client.get_object(Bucket=s3.bucket, Key=_key(s3, "obj"), Range="bytes=0-0")
    assert client.get_object(Bucket=s3.bucket, Key=_key(s3, "obj"))["Body"].read() == b"old"
    assert seen == [("GET", "bytes=0-0"), ("GET", None)]
    proxy.clear()

    def replace(_request):
        direct.put_object(Bucket=s3.bucket, Key=_key(s3, "obj"), Body=b"new")

    proxy.inject(Status(503), method="GET", path=r"/obj$", before=replace)
    with pytest.raises(Exception, match="503"):
        client.get_object(Bucket=s3.bucket, Key=_key(s3, "obj"))
    assert client.get_object(Bucket=s3.bucket, Key=_key(s3, "obj"))["Body"].read() == b"new"


def test_bad_rule_counts_are_refused(proxy):
    with pytest.raises(ValueError, match="count from 1"):
        proxy.inject(Reset(), nth=0)


def test_accelkit_s3_makes_as_many_requests_as_its_error_says(s3, proxy, monkeypatch):
    """A request answered 503 every time: accelkit's S3 client gives up after MAX_ATTEMPTS
    requests in all, the first included, and its error says that number (botocore's own
    ``max_attempts`` key counts retries only, one fewer than the requests). Botocore's waits
    between attempts are shortened; the retries themselves are botocore's."""
    import botocore.retries.standard

    import accelkit
    from accelkit.checkpoint.store.s3_client import MAX_ATTEMPTS, S3Bucket

    monkeypatch.setattr(
        botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, ctx: 0.01
    )
    bucket = S3Bucket(s3.bucket, {"endpoint_url": proxy.url})
    key = _key(s3, "always-503")
    rule = proxy.inject(Status(503), method="GET", path=rf"/{key}$", times=None)
    with pytest.raises(accelkit.CheckpointError, match=rf"HTTP 503 .* all {MAX_ATTEMPTS} attempts"):
        bucket.get(key)
    assert rule.fired == len(proxy.requests("GET", rf"/{key}$")) == MAX_ATTEMPTS
