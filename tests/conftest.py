"""Shared fixtures of the core tests: every test starts from a clean process state.

accelkit keeps process-wide state on purpose (the plugin host, a process group, environment
variables a launcher would set, the default dtype inside ``init_module``); a test that leaks
any of it into the next one makes both unreliable, so each test gets them reset.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip themselves where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `nox -s gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_process_state():
    """Restore os.environ, the default dtype and the process group; forget the plugin host
    when the test changed it (in-process plugins, plugins disabled)."""
    saved_env = dict(os.environ)
    saved_dtype = torch.get_default_dtype()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    from accelkit import registry

    host = registry._HOST
    if host is not None and (
        any(p.distribution == "(in process)" for p in host.plugins)
        or os.environ.get(registry.DISABLE_ENV) != saved_env.get(registry.DISABLE_ENV)
    ):
        registry.reset()
    torch.set_default_dtype(saved_dtype)
    os.environ.clear()
    os.environ.update(saved_env)


@pytest.fixture
def only_native_plugins(monkeypatch: pytest.MonkeyPatch):
    """A registry that sees accelkit's own entry point only, whatever else is installed here."""
    from accelkit import registry

    real = registry._entry_points

    def native_only():
        return [ep for ep in real() if ep.value == "accelkit.backends"]

    monkeypatch.setattr(registry, "_entry_points", native_only)
    registry.reset()
    yield registry
    registry.reset()  # the next test sees every installed plugin again


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A real S3 server (SeaweedFS ``weed mini``) on loopback for the whole session; a test that
    kills it gets a server of its own (:func:`own_s3_server`)."""
    from accelkit.testing.s3_server import LocalS3Server

    server = LocalS3Server(tmp_path_factory.mktemp("s3"), bucket="ckpts")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """The session's S3 server with its AWS_* variables set for this test, and a prefix of this
    test's own: ``s3.url("run/step-1")`` is ``s3://ckpts/<test>/run/step-1``."""
    if not s3_server.alive():  # something ended it: the next test still gets a server
        s3_server.start()
    return _S3Place(s3_server, monkeypatch, request.node.name)


@pytest.fixture
def own_s3_server(tmp_path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """A server this test may kill and restart (its AWS_* variables set)."""
    from accelkit.testing.s3_server import LocalS3Server

    server = LocalS3Server(tmp_path / "s3", bucket="ckpts")
    server.start()
    yield _S3Place(server, monkeypatch, request.node.name)
    server.kill()


class _S3Place:
    def __init__(self, server, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        import re
        import uuid

        self.server = server
        self.bucket = server.bucket
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        self.prefix = f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}-{uuid.uuid4().hex[:8]}"

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}/{key}".rstrip("/")

    def client(self):
        """A boto3 client of the server (the tests' reference side)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.server.endpoint)

    def keys(self, under: str = "", *, saves: bool = False) -> list[str]:
        """The object keys below ``under`` (relative to this test's prefix), sorted; a rank
        file's name unique to its save (``rank-00000.<save>.safetensors``) is shown as
        ``rank-00000.safetensors`` unless ``saves``."""
        client = self.client()
        start = f"{self.prefix}/{under}".rstrip("/")
        found = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=start
        ):
            found += [o["Key"][len(self.prefix) + 1 :] for o in page.get("Contents", [])]
        if not saves:
            found = [
                re.sub(r"(rank-\d+|extra)\.[0-9a-f]{12}(\.safetensors|\.json)$", r"\1\2", k)
                for k in found
            ]
        return sorted(found)

    def rank_key(self, checkpoint: str, rank: int = 0) -> str:
        """The full key of ``rank``'s file in the checkpoint ``checkpoint`` (relative to this
        test's prefix), whatever its save named it."""
        pattern = re.compile(rf"rank-{rank:05d}(\.[0-9a-f]{{12}})?\.safetensors$")
        names = [k for k in self.keys(checkpoint, saves=True) if pattern.search(k)]
        assert len(names) == 1, names
        return f"{self.prefix}/{names[0]}"
