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
