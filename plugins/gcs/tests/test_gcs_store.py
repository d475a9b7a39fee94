"""The gs:// store (accelkit-gcs) against a real GCS JSON-API server: fake-gcs-server on
loopback (accelkit.testing.gcs_server), behind the fault proxy. The store suite every store
passes (accelkit.testing.store_contract), then what is the plugin's own: its registration, its
options, the emulator's refusal of a second conditional create (the commit relies on it), a read
pinned to a generation, and the plugin's size and imports."""

from __future__ import annotations

import ast
import tempfile
import uuid
from pathlib import Path

import pytest

from accelkit.testing.store_contract import store_contract

PACKAGE = Path(__file__).resolve().parents[1] / "accelkit_gcs"

TestGCSStore = store_contract("gs")


@pytest.fixture(scope="module")
def server():
    from accelkit.testing.gcs_server import LocalGCSServer

    with LocalGCSServer(tempfile.mkdtemp(), bucket="ckpts") as running:
        yield running


@pytest.fixture
def bucket(server, monkeypatch):
    from accelkit_gcs.bucket import GCSBucket

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
    return GCSBucket("ckpts")


def test_installing_the_distribution_registers_gs(server, monkeypatch):
    from accelkit.sdk import store_for

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
    assert store_for("gs://ckpts/run").scheme == "gs"


def test_an_unknown_storage_option_is_refused_naming_the_known_ones(server):
    import accelkit
    from accelkit.sdk import store_for

    store = store_for("gs://ckpts/run", {"endpoint": server.endpoint, "region": "x"})
    with pytest.raises(accelkit.CheckpointError, match=r"unknown key\(s\) \['region'\].*endpoint"):
        store.is_checkpoint("gs://ckpts/run")


def test_a_read_timeout_that_is_not_a_positive_number_is_refused(server):
    import accelkit
    from accelkit.sdk import store_for

    for bad in (0, "60s"):
        store = store_for("gs://ckpts/run", {"endpoint": server.endpoint, "read_timeout": bad})
        with pytest.raises(accelkit.CheckpointError, match="read_timeout must be a positive"):
            store.is_checkpoint("gs://ckpts/run")
    store = store_for("gs://ckpts/run", {"endpoint": server.endpoint, "read_timeout": 5})
    assert store.is_checkpoint("gs://ckpts/run") is False


def test_a_missing_bucket_fails_clearly(server, monkeypatch):
    import accelkit

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
    accel = accelkit.get("cpu")
    with pytest.raises(accelkit.CheckpointError, match=r"bucket 'nosuch' does not exist"):
        accel.save("gs://nosuch/run/step-1", {"model": __import__("torch").nn.Linear(2, 2)})


def test_the_server_refuses_a_second_conditional_create(bucket):
    from accelkit.sdk import ObjectExists

    key = f"refusal-{uuid.uuid4().hex}/accelkit.json"
    bucket.put(key, b"first", if_absent=True)
    with pytest.raises(ObjectExists):
        bucket.put(key, b"second", if_absent=True)
    assert bucket.get(key)[0] == b"first"
    bucket.put(key, b"third")  # unconditional: replaces
    assert bucket.get(key)[0] == b"third"


def test_a_read_pinned_to_a_generation_refuses_a_replaced_object(bucket):
    from accelkit.sdk import VersionChanged

    key = "pinned/rank-00000.safetensors"
    bucket.put(key, b"a" * 100)
    version = bucket.head(key).version
    view = memoryview(bytearray(10))
    bucket.read_into(key, view, 5, version)
    assert bytes(view) == b"a" * 10
    bucket.put(key, b"b" * 100)
    with pytest.raises(VersionChanged, match="replaced or deleted"):
        bucket.read_into(key, view, 5, version)
    bucket.read_into(key, view, 5, None)  # unpinned: the new one
    assert bytes(view) == b"b" * 10


def test_a_rank_file_is_streamed_from_its_file_never_read_whole(bucket, tmp_path):
    """The upload of a rank file holds a few KiB of it at a time (bench/gcs_upload_memory.py
    measures 1 GiB: +0 MiB of peak RSS). Its twin, the same bytes read first and put, peaks at
    their size at least: the measure sees a file read whole."""
    import os
    import tracemalloc

    size = 16 << 20
    source = tmp_path / "rank.bin"
    source.write_bytes(os.urandom(1 << 20) * (size >> 20))
    peaks = []
    for send in (
        lambda: bucket.upload("streamed/rank.bin", source),
        lambda: bucket.put("whole/rank.bin", source.read_bytes()),
    ):
        tracemalloc.start()
        try:
            send()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[0] < 1 << 20 and peaks[1] >= size, peaks
    assert bucket.head("streamed/rank.bin").size == size
    view = memoryview(bytearray(64))
    bucket.read_into("streamed/rank.bin", view, size - 64, None)
    assert bytes(view) == source.read_bytes()[-64:]


def test_the_plugin_imports_only_the_sdk_of_accelkit_and_stays_small():
    lines = 0
    for path in PACKAGE.glob("*.py"):
        source = path.read_text()
        lines += len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name == "accelkit.sdk" or not name.startswith("accelkit."), (path, name)
                assert name != "accelkit", (path, name)
    assert lines <= 400, f"accelkit_gcs is {lines} lines; the issue allows 400"


@pytest.mark.timeout(60)  # the belt: nothing below may wait on a metadata server
def test_no_credentials_fail_clearly_saying_what_to_set(tmp_path, monkeypatch):
    """No emulator, no token, and Application Default Credentials pointing at a file that is
    not there: the first request fails with a CheckpointError naming what to set, not
    google-auth's own error. Nothing leaves this machine: the missing file fails before any
    request, and the metadata server's address is a closed loopback port, its check off."""
    pytest.importorskip("google.auth")
    import socket

    import accelkit

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{closed.getsockname()[1]}"
    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    monkeypatch.setenv("GCE_METADATA_IP", nowhere)
    monkeypatch.setenv("GCE_METADATA_HOST", nowhere)
    accel = accelkit.get("cpu")
    with pytest.raises(accelkit.CheckpointError) as caught:
        accel.save("gs://ckpts/run/step-1", {"model": __import__("torch").nn.Linear(2, 2)})
    message = str(caught.value)
    assert "gs://ckpts: no usable Google Cloud credentials" in message, message
    assert "no-such-key.json" in message  # google-auth's reason, kept
    for what in ("GOOGLE_APPLICATION_CREDENTIALS", "token", "STORAGE_EMULATOR_HOST", "endpoint"):
        assert what in message, (what, message)
