"""A load from object storage downloads only what the rank needs (issue 36), against a real
server (SeaweedFS, tests/conftest.py): each rank fetches the safetensors headers, its share of
the checksums, and the ranges its fill reads, so a rank of a sharded resume moves less than the
whole checkpoint. The bytes are counted on the wire (every ranged GET's body), the loaded state
is compared bit for bit with the raw-PyTorch reference (test_checkpoint_reference, which
imports nothing from accelkit), and a byte flipped where only rank 1 checks fails every rank,
naming the object, with nothing written.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import test_checkpoint_reference as ref
import torch
from staging_leftovers import leftovers

import accelkit
from accelkit.testing import run_ranks

HERE = Path(__file__).parent
#: widths of the Linear stack: ~6 MB of weights, ~19 MB with AdamW's moments (far more than
#: the header a rank always fetches, so a partial download shows)
SIZES = (256, 1024, 1024, 256)
RANK_FILE = "rank-00000.safetensors"


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(SIZES)))


def _step(model: torch.nn.Module, opt: Any, backward: Any) -> None:
    backward(model(torch.randn(4, SIZES[0])).square().mean())
    opt.step()
    opt.zero_grad()


def _save_reference(url: str, out: Path) -> None:
    """Train one step with plain torch, dump the state through the raw path, then save it."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, lambda loss: loss.backward())
    ref.dump(ref.gather_full_state(model, opt), out / "reference")
    accel = accelkit.get("cpu")
    model, opt = accel.setup(model, opt)
    accel.save(url, {"model": model, "optimizer": opt})


def _flip_where_only_rank_1_checks(s3, url: str) -> int:
    """Flip a byte of the last fragment in the file, which starts in the second half of the
    bytes: rank 1 of 2 checks it, rank 0 never does. Returns the byte's offset."""
    client, key = s3.client(), s3.rank_key(url.split("/", 3)[3][len(s3.prefix) + 1 :])
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    start, end = max(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert 8 + length + end == len(data) and end - start >= 3
    assert start > (len(data) - 8 - length) // 2, "the fragment is not in rank 1's share"
    offset = len(data) - 3
    data[offset] ^= 0x01
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    return offset


def _counting(patch: Any) -> list[int]:
    """Count the bytes of every ranged GET of a rank file (this process); ``patch`` sets the
    counting method in place (``monkeypatch.setattr`` in a test, ``setattr`` in a rank)."""
    from accelkit.checkpoint.store import s3_client as objectstore

    fetched: list[int] = []
    real = objectstore.S3Bucket.read_into

    def counted(
        self: Any, key: str, view: memoryview, offset: int, version: str | None = None
    ) -> None:
        if key.endswith(".safetensors"):
            fetched.append(view.nbytes)
        real(self, key, view, offset, version)

    patch(objectstore.S3Bucket, "read_into", counted)
    return fetched


def _opened(url: str, rank: int) -> Any:
    """Rank ``rank`` of 2's partial copy of the checkpoint ``url`` (resolved, as a load does)."""
    from accelkit.checkpoint.read import ranged_copy
    from accelkit.checkpoint.store import store_for

    store = store_for(url)
    target = store.resolve(url)
    return ranged_copy.opened(store, target, store.read_manifest(target), rank=rank, world=2)


# ---- in one process: each rank's partial copy -------------------------------------------------------
def test_each_rank_downloads_its_share_and_reads_the_rest_on_demand(s3, tmp_path, monkeypatch):
    """Rank r of 2 downloads the header and its share of the checksums (hashed as they come),
    the two shares apart; any other range it reads arrives when read, and every tensor
    read equals what safetensors itself reads from the object."""
    from safetensors.torch import load as load_safetensors

    from accelkit.checkpoint.read import ranged_copy as remote_load
    from accelkit.checkpoint.read.verify import verify_share

    url = s3.url("run/step-1")
    _save_reference(url, tmp_path)
    key = s3.rank_key("run/step-1")
    raw = load_safetensors(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    total = _rank_file_bytes(s3, url)
    fetched = _counting(monkeypatch.setattr)
    leftovers = _staging_leftovers()
    shares = []
    for rank in (0, 1):
        fetched.clear()
        with _opened(url, rank) as reader:
            verify_share(reader, rank, 2)
            shares.append(sum(fetched))
            assert 0.25 * total < shares[-1] < 0.75 * total, (rank, shares[-1], total)
            for entry in reader.manifest.tensors:
                for frag in entry.fragments:
                    got = reader.read_flat(entry, frag.flat_offset, frag.numel)
                    assert torch.equal(got, raw[frag.key].view(-1)), frag.key
        assert sum(fetched) == total  # each byte fetched once, none twice
        assert _open_copies() == []
    assert sum(shares) <= total + 2 * remote_load.HEADER_BYTES  # the shares do not overlap
    assert _staging_leftovers() == leftovers


def test_a_flipped_byte_fails_the_share_that_holds_it_naming_the_object(s3, tmp_path):
    from accelkit.checkpoint.read.verify import verify_share

    url = s3.url("run/step-1")
    _save_reference(url, tmp_path)
    _flip_where_only_rank_1_checks(s3, url)
    with _opened(url, 0) as reader:
        verify_share(reader, 0, 2)  # rank 0 checks only the first half: it passes
    with (
        pytest.raises(accelkit.CheckpointError) as caught,
        _opened(url, 1) as reader,
    ):
        verify_share(reader, 1, 2)
    message = str(caught.value)
    name = s3.rank_key("run/step-1").rsplit("/", 1)[1]
    assert f"{url}/{name}" in message and "failed its checksum" in message, message
    assert "accelkit-s3-load-" not in message


def test_the_next_load_removes_the_copy_a_killed_load_left(s3, tmp_path, monkeypatch):
    """A load killed mid-way leaves its copy (in memory, by default); the next load on the
    machine removes it: its lock died with its process. A copy still locked (a load running
    elsewhere) or just made stays."""
    from accelkit.checkpoint.read import ranged_copy as remote_load

    staging = tmp_path / "staging"
    monkeypatch.setenv(remote_load.STAGING_ENV, str(staging))
    accel, model = accelkit.get("cpu"), _model()
    accel.save(s3.url("run/step-1"), {"model": model})
    staging.mkdir(exist_ok=True)
    with leftovers(staging, remote_load.PARTIAL_PREFIX, RANK_FILE) as survivors:
        accel.load(s3.url("run"), {"model": _model()})
        assert sorted(p.name for p in staging.iterdir()) == survivors


# ---- the worker (each rank of a 2-process FSDP job) ------------------------------------------------
def test_a_copy_without_room_fails_clearly_and_loads_nothing(s3, tmp_path, monkeypatch):
    """The local copy cannot grow (here a file-size limit, RLIMIT_FSIZE, which refuses the
    copy's writes as a full ``/dev/shm`` does): the load fails naming the object and the
    variable that moves the copy, the model keeps its values, no copy is left, and the same
    load works once there is room."""
    import resource
    import signal

    from accelkit.checkpoint.read import ranged_copy as remote_load

    staging = tmp_path / "staging"
    monkeypatch.setenv(remote_load.STAGING_ENV, str(staging))
    accel, model = accelkit.get("cpu"), _model()
    accel.save(s3.url("run/step-1"), {"model": model})
    target = _model()
    before = [p.detach().clone() for p in target.parameters()]
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error (EFBIG), not a signal
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
        with pytest.raises(accelkit.CheckpointError) as caught:
            accel.load(s3.url("run"), {"model": target})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    message = str(caught.value)
    assert "rank-00000." in message and remote_load.STAGING_ENV in message, message
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))
    assert not list(staging.iterdir())
    accel.load(s3.url("run"), {"model": target})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), target.parameters()))


def load_worker(url: str, out: str, tag: str) -> dict[str, Any]:
    """fsdp x2 (gloo): train a different model one step, then load ``url`` into it; count the
    bytes of every ranged GET of a rank file; dump the full state (raw path) after the load."""
    fetched = _counting(setattr)
    accel = accelkit.get("fsdp", device="cpu")
    torch.manual_seed(100 + accel.rank)
    model = _model()
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _step(model, opt, accel.backward)
    before = ref.gather_full_state(model, opt.optimizer)
    result: dict[str, Any] = {"error": None}
    try:
        accel.load(url, {"model": model, "optimizer": opt})
    except accelkit.CheckpointError as err:
        result["error"] = str(err)
    after = ref.gather_full_state(model, opt.optimizer)
    if accel.rank == 0:
        ref.dump(before, Path(out) / f"{tag}-before")
        ref.dump(after, Path(out) / f"{tag}-after")
    result["fetched"] = sum(fetched)
    result["open"] = _open_copies()
    return result


def _launch(url: str, out: Path, tag: str) -> list[dict[str, Any]]:
    return run_ranks(
        "test_checkpoint_s3_partial:load_worker",
        {"url": url, "out": str(out), "tag": tag},
        nproc=2,
        timeout=300,
        path=[HERE],
    )


def _staging_leftovers() -> list[str]:
    """The load copies in the places a load may keep one."""
    import tempfile

    roots = {tempfile.gettempdir(), "/dev/shm", os.environ.get("ACCELKIT_S3_STAGING")}
    return sorted(
        str(p)
        for root in roots
        if root and os.path.isdir(root)
        for p in Path(root).glob("accelkit-s3-load-*")
    )


def _open_copies() -> list[str]:
    """The files of a load copy this process still has open, once the copies of the loads
    that returned have given back their memory (a thread of their own does it)."""
    from accelkit.checkpoint.read.ranged_copy import wait_for_release

    wait_for_release()
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "accelkit-s3-load-" in target:
            found.append(target)
    return found


def _rank_file_bytes(s3, url: str) -> int:
    key = s3.rank_key(url.split("/", 3)[3][len(s3.prefix) + 1 :])
    return s3.client().head_object(Bucket=s3.bucket, Key=key)["ContentLength"]


@pytest.mark.slow
def test_two_ranks_each_download_part_of_the_checkpoint_bit_exact(s3, tmp_path):
    url = s3.url("run/step-1")
    _save_reference(url, tmp_path)
    leftovers = _staging_leftovers()
    ranks = _launch(url, tmp_path, "good")
    total = _rank_file_bytes(s3, url)
    for rank, result in enumerate(ranks):
        assert result["error"] is None, result["error"]
        assert 0 < result["fetched"] < 0.85 * total, (rank, result["fetched"], total)
        assert result["open"] == []
    ref.assert_same_state(ref.undump(tmp_path / "reference"), ref.undump(tmp_path / "good-after"))
    with pytest.raises(AssertionError):  # the comparison can fail: the state before differs
        ref.assert_same_state(
            ref.undump(tmp_path / "reference"), ref.undump(tmp_path / "good-before")
        )
    assert _staging_leftovers() == leftovers


@pytest.mark.slow
def test_a_byte_only_rank_1_checks_fails_every_rank_and_writes_nothing(s3, tmp_path):
    url = s3.url("run/step-1")
    _save_reference(url, tmp_path)
    _flip_where_only_rank_1_checks(s3, url)
    ranks = _launch(url, tmp_path, "bad")
    for rank, result in enumerate(ranks):
        error = result["error"]
        assert error is not None, f"rank {rank} loaded a damaged checkpoint"
        assert f"{url}/rank-00000." in error and "failed its checksum" in error, error
        assert "accelkit-s3-load-" not in error, error  # the object, never the temp file
        assert result["open"] == []
    ref.assert_same_state(ref.undump(tmp_path / "bad-before"), ref.undump(tmp_path / "bad-after"))
