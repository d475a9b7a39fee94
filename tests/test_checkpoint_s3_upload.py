"""A save to object storage streams its rank file straight into a multipart upload (issue 36):
each part is sent as soon as its bytes are written, with no local copy. Against a real server
(SeaweedFS, tests/conftest.py): the object holds exactly the bytes a save to disk writes, and
the safetensors library (not accelkit) reads the saved values back; a part that fails mid-way
fails the save and leaves no object and no unfinished upload; memory stays bounded while the
network is slower than the writers.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import accelkit
from accelkit.checkpoint.store import s3_client as objectstore

RANK_FILE = "rank-00000.safetensors"
#: float32 sizes whose tensor boundaries fall inside the 8 MiB parts, at odd offsets (~25 MB)
SIZES = (1_500_001, 3, 2_999_999, 1_700_000)


def _model(seed: int = 0) -> torch.nn.ParameterDict:
    torch.manual_seed(seed)
    return torch.nn.ParameterDict(
        {f"p{i}": torch.nn.Parameter(torch.randn(n)) for i, n in enumerate(SIZES)}
    )


def _object(s3, key: str) -> bytes:
    return s3.client().get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{key}")["Body"].read()


def _unfinished(s3) -> list:
    reply = s3.client().list_multipart_uploads(Bucket=s3.bucket, Prefix=s3.prefix)
    return reply.get("Uploads", [])


def test_the_uploaded_rank_file_is_the_file_a_disk_save_writes(s3, tmp_path):
    from safetensors import safe_open

    model = _model()
    accel = accelkit.get("cpu")
    accel.save(str(tmp_path / "step-1"), {"model": model})
    accel.save(s3.url("run/step-1"), {"model": model})
    on_disk = (tmp_path / "step-1" / RANK_FILE).read_bytes()
    uploaded = (
        s3.client().get_object(Bucket=s3.bucket, Key=s3.rank_key("run/step-1"))["Body"].read()
    )
    assert len(uploaded) > 2 * objectstore.PART_BYTES  # several parts, and a short last one
    assert len(uploaded) % objectstore.PART_BYTES
    assert uploaded == on_disk
    # the safetensors library reads every value back: the parameters, stored 1-D
    (tmp_path / "object.safetensors").write_bytes(uploaded)
    with safe_open(str(tmp_path / "object.safetensors"), framework="pt") as f:
        stored = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118 (safe_open is no dict)
    for name, param in model.items():
        matches = [t for t in stored if t.numel() == param.numel() and torch.equal(t, param)]
        assert matches, f"{name} is not in the uploaded file"
    fresh = _model(seed=1)
    accel.load(s3.url("run"), {"model": fresh})
    for name, param in model.items():
        assert torch.equal(fresh[name], param)
    assert not _unfinished(s3)


def test_a_part_that_fails_mid_upload_fails_the_save_and_leaves_nothing(s3, monkeypatch):
    """The negative twin: part 2 of 4 is refused. The save raises, naming the object; the
    upload is aborted (no parts left on the server), no rank file and no manifest exist, and
    ``latest`` still names the last checkpoint, which loads."""
    model, accel = _model(), accelkit.get("cpu")
    accel.save(s3.url("run/step-1"), {"model": model})
    saved = model["p0"].detach().clone()
    real = objectstore.S3Bucket.upload_part

    def refuse_part_two(self, key, upload_id, number, body):
        if number == 2:
            raise accelkit.CheckpointError(f"writing s3://{self.bucket}/{key}: injected refusal")
        return real(self, key, upload_id, number, body)

    monkeypatch.setattr(objectstore.S3Bucket, "upload_part", refuse_part_two)
    with torch.no_grad():
        model["p0"].add_(1.0)
    with pytest.raises(accelkit.CheckpointError, match=r"step-2.*injected refusal"):
        accel.save(s3.url("run/step-2"), {"model": model})
    monkeypatch.setattr(objectstore.S3Bucket, "upload_part", real)
    keys = [o.key for o in objectstore.bucket_for(s3.bucket).list(s3.prefix)]
    assert not [k for k in keys if "/step-2/" in k], keys
    assert not _unfinished(s3)
    fresh = _model(seed=1)
    assert accel.auto_resume(s3.url("run"), {"model": fresh}) == s3.url("run/step-1")
    assert torch.equal(fresh["p0"], saved)


def test_an_upload_left_unfinished_is_aborted(s3):
    """A writer that stops half-way (an error in the state it writes): closing the sink
    aborts the multipart upload; no object appears under the key."""
    store = objectstore.bucket_for(s3.bucket)
    key = f"{s3.prefix}/half"
    payload = bytes(range(256)) * (3 * objectstore.PART_BYTES // 256)
    with ThreadPoolExecutor(4) as pool:
        sink = objectstore.UploadSink(store, key, pool)
        sink.open(len(payload))
        sink.write(memoryview(payload)[: len(payload) // 2], 0)
        sink.close()
    assert not _unfinished(s3)
    assert store.head(key) is None


def test_memory_stays_bounded_while_the_network_is_slower_than_the_writers(s3, monkeypatch):
    """Four threads write 24 parts' bytes as fast as they can while every part takes 50 ms to
    send: no more parts are held than the sink's queue, plus, per writer, the part it fills
    and the part it shares with the next writer's range (filled at both ends, at different
    times). Without the queue's bound all 24 would be. The object is the bytes written."""
    real = objectstore.S3Bucket.upload_part

    def slow(self, key, upload_id, number, body):
        time.sleep(0.05)
        return real(self, key, upload_id, number, body)

    monkeypatch.setattr(objectstore.S3Bucket, "upload_part", slow)
    store = objectstore.bucket_for(s3.bucket)
    key, step, writers = f"{s3.prefix}/bounded", objectstore.PART_BYTES, 4
    payload = torch.randint(0, 256, (24 * step + 12345,), dtype=torch.uint8).numpy().tobytes()
    held, lock = [], threading.Lock()
    with ThreadPoolExecutor(objectstore.CONCURRENCY) as pool:
        sink = objectstore.UploadSink(store, key, pool, queued=4)
        sink.open(len(payload))
        real_write = sink.write

        def write(view, offset):
            real_write(view, offset)
            with lock:
                held.append(len(sink.buffers) + sink.waiting)

        sink.write = write
        quarter = -(-len(payload) // writers)
        chunk = 1 << 20

        def writer(index):  # each thread its own quarter, 1 MiB at a time
            lo, hi = index * quarter, min(len(payload), (index + 1) * quarter)
            for at in range(lo, hi, chunk):
                sink.write(memoryview(payload)[at : min(hi, at + chunk)], at)

        with ThreadPoolExecutor(writers) as threads:
            list(threads.map(writer, range(writers)))
        sink.finish(None)
        sink.close()
    assert max(held) <= 4 + 2 * writers, max(held)
    assert store.get(key)[0] == payload


def test_part_size_keeps_any_rank_file_within_the_parts_s3_allows():
    for size in (0, 1, objectstore.PART_BYTES, 80 << 30, 5 << 40):
        step = objectstore.part_bytes(size)
        assert step >= objectstore.PART_BYTES and step % (1 << 20) == 0
        assert -(-size // step) <= objectstore.MAX_PARTS
    assert objectstore.part_bytes(1 << 30) == objectstore.PART_BYTES


def test_a_save_removes_the_staging_a_killed_asynchronous_save_left(s3, tmp_path, monkeypatch):
    """An asynchronous save stages its rank file locally before the upload; a trainer killed
    then leaves that folder. The next save on the machine removes it (its lock died with its
    process); a folder still locked (a save running elsewhere) or just made stays, and the
    save's own folder is gone when it returns."""
    from staging_leftovers import leftovers

    from accelkit.checkpoint.store import scratch as remote

    root = tmp_path / "staging"
    monkeypatch.setenv(remote.STAGING_ENV, str(root))
    root.mkdir()
    with leftovers(root, remote.SAVE_PREFIX, RANK_FILE) as survivors:
        accel, model = accelkit.get("cpu"), _model()
        accel.save(s3.url("run/step-1"), {"model": model}, asynchronous=True)
        accel.wait_for_save()
        assert sorted(p.name for p in root.iterdir()) == survivors
    fresh = _model(seed=1)
    accel.load(s3.url("run"), {"model": fresh})
    assert all(torch.equal(fresh[k], model[k]) for k in model)
