"""Issue 44's reliability fixes on a real S3 server (SeaweedFS on loopback, tests/conftest.py),
each with the twin that shows the test can fail.

- two saves of one name: one commits, the other is told another job writes there, and the
  committed checkpoint is whole (its rank object was not replaced by the loser's);
- a conditional manifest PUT whose answer was lost: the retry finds its own manifest, success;
- a commit that reached its manifest is committed: a failed ``latest`` is followed past;
- bytes a rank fills beyond its own verified share: an object replaced after the agreement
  fails the load (pinned to the version listed, or hashed in the copy), never loads silently;
- ``Accelerator.load`` reads ``latest`` once: weights and ``applied_steps`` of one checkpoint;
- ``accelkit inspect s3://`` names the URL; ``load_pretrained`` records an s3:// source;
- a save's requests do not grow with the number of rotated names before it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accelkit


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ---- two saves of one name ---------------------------------------------------------------------------
def _race(s3, monkeypatch, url: str) -> tuple[Any, Any, BaseException | None]:
    """Save A to ``url``; as A's rank object is about to complete, another job saves B to the
    same name and commits: A's object lands after B's manifest, as a slow upload's does."""
    from accelkit.checkpoint.store import s3_client

    accel = accelkit.get("cpu")
    a, b = _model(1), _model(2)
    real, raced = s3_client.UploadSink.finish, []

    def finish(self: Any, profile: Any) -> None:
        if not raced:
            raced.append(True)
            accel.save(url, {"model": b})  # the other job, whole, in between
        real(self, profile)

    monkeypatch.setattr(s3_client.UploadSink, "finish", finish)
    error = None
    try:
        accel.save(url, {"model": a})
    except accelkit.CheckpointError as err:
        error = err
    monkeypatch.setattr(s3_client.UploadSink, "finish", real)
    return a, b, error


def test_two_saves_of_one_name_one_commits_the_other_is_told(s3, monkeypatch):
    url = s3.url("run/step-1")
    a, b, error = _race(s3, monkeypatch, url)
    assert error is not None and "another job writes here" in str(error), error
    loaded = _model(3)
    accelkit.get("cpu").load(url, {"model": loaded})  # the winner's, whole: checksums pass
    assert _equal(loaded, b) and not _equal(loaded, a)
    assert [k for k in s3.keys("run/step-1") if "rank-" in k] == [
        "run/step-1/rank-00000.safetensors"
    ]  # the loser's object was swept


def test_the_race_tears_the_checkpoint_when_rank_objects_share_a_name(s3, monkeypatch):
    """The twin: with one name for every save's rank object (as before issue 44) the loser's
    object replaces the winner's, and the committed checkpoint no longer loads."""
    from accelkit.checkpoint.store.bucket import BucketStore

    monkeypatch.setattr(
        BucketStore, "rank_file_name", lambda self, rank, save: f"rank-{rank:05d}.safetensors"
    )
    url = s3.url("run/step-1")
    _race(s3, monkeypatch, url)
    with pytest.raises(
        accelkit.CheckpointError, match=r"failed its checksum|missing from the checkpoint"
    ):
        accelkit.get("cpu").load(url, {"model": _model(3)})


# ---- a lost answer ------------------------------------------------------------------------------------
def test_a_manifest_put_whose_answer_was_lost_is_committed(s3, monkeypatch):
    """The conditional PUT lands, its answer is lost, and the retry gets 412 from this save's
    own manifest: the save succeeds and loads."""
    from accelkit.checkpoint.store import s3_client
    from accelkit.checkpoint.store.base import ObjectExists

    real = s3_client.S3Bucket.put

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        real(self, key, data, if_absent=if_absent)
        if if_absent and key.endswith("accelkit.json"):
            raise ObjectExists(f"writing {key}: the object exists already")  # the retry's 412

    monkeypatch.setattr(s3_client.S3Bucket, "put", put)
    model = _model(1)
    accelkit.get("cpu").save(s3.url("run/step-1"), {"model": model})
    monkeypatch.setattr(s3_client.S3Bucket, "put", real)
    loaded = _model(2)
    accelkit.get("cpu").load(s3.url("run"), {"model": loaded})
    assert _equal(loaded, model)


# ---- a commit that reached its manifest ----------------------------------------------------------------
@pytest.mark.parametrize("where", ["disk", "s3"])
def test_a_failed_latest_after_the_manifest_is_followed_past(s3, tmp_path, monkeypatch, where):
    """``latest`` could not be moved after step-2's manifest: the save still succeeds, and
    load, auto_resume and the next save go on from step-2 (no wedge on a stale latest)."""
    from accelkit.checkpoint.store.bucket import BucketStore
    from accelkit.checkpoint.store.posix import PosixStore

    base = s3.url("run") if where == "s3" else str(tmp_path / "run")
    accel = accelkit.get("cpu")
    first, second = _model(1), _model(2)
    accel.save(f"{base}/step-1", {"model": first, "step": 1})
    store = BucketStore if where == "s3" else PosixStore

    def cut(self: Any, where: str) -> None:
        raise accelkit.CheckpointError("the connection was reset")

    real = store.point_latest
    monkeypatch.setattr(store, "point_latest", cut)
    accel.save(f"{base}/step-2", {"model": second, "step": 2})  # committed: no error
    monkeypatch.setattr(store, "point_latest", real)
    state = {"model": _model(3), "step": 0}
    accel.load(base, state)
    assert state["step"] == 2 and _equal(state["model"], second)
    state = {"model": _model(3), "step": 0}
    resumed = accel.auto_resume(base, state)
    assert str(resumed).endswith("step-2") and state["step"] == 2
    accel.save(f"{base}/step-3", {"model": second, "step": 3})  # and the run goes on
    if where == "s3":  # the twin: step-2 is committed, so a retrained step-2 is refused
        with pytest.raises(accelkit.CheckpointError, match="committed checkpoint already"):
            accel.save(f"{base}/step-2", {"model": second, "step": 2})


# ---- bytes beyond a rank's verified share --------------------------------------------------------------
def _big(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))


def _replace_second_half(s3, checkpoint: str) -> None:
    """Flip a byte near the end of the rank object (rank 1's share of 2) by a new PUT."""
    client, key = s3.client(), s3.rank_key(checkpoint)
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[-5] ^= 0x01
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))


def _last_in_file(reader: Any) -> Any:
    """The tensor whose bytes end the rank file (in rank 1's share of 2, never rank 0's)."""
    ends = {}
    for entry in reader.manifest.tensors:
        for i in range(len(entry.fragments)):
            _, offset, nbytes = reader.fragment_span(entry, i)
            ends[offset + nbytes] = entry
    return ends[max(ends)]


@pytest.mark.parametrize("pinned", [True, False], ids=["version-pinned", "hashed"])
def test_an_object_replaced_after_the_agreement_never_reaches_a_tensor(s3, monkeypatch, pinned):
    """Rank 0 of 2 verified its share; the object is then replaced. Reading a fragment of rank
    1's share (as a resharding fill does) fails: the read is pinned to the version listed at
    the start, and, without the pin, the fragment is hashed in the copy before it is read."""
    from accelkit.checkpoint.read import ranged_copy
    from accelkit.checkpoint.read.verify import verify_share
    from accelkit.checkpoint.store import store_for
    from accelkit.checkpoint.store.bucket import RangedObject

    url = s3.url("run/step-1")
    accelkit.get("cpu").save(url, {"model": _big(1)}, rng=False)
    if not pinned:
        monkeypatch.setattr(
            RangedObject,
            "read_into",
            lambda self, view, offset: self.bucket.read_into(self.key, view, offset, None),
        )
    store = store_for(url)
    with ranged_copy.opened(store, url, store.read_manifest(url), rank=0, world=2) as reader:
        verify_share(reader, 0, 2)
        reader.trust_verified()  # as the load does after the ranks agreed
        entry = _last_in_file(reader)
        _replace_second_half(s3, "run/step-1")
        expected = "replaced during the load" if pinned else "failed its checksum"
        with pytest.raises(accelkit.CheckpointError, match=expected):
            reader.read_flat(entry, 0, entry.numel)


def test_an_unchanged_object_fills_beyond_the_share(s3):
    """The twin: nothing replaced, the same reads succeed and equal the saved tensor."""
    from accelkit.checkpoint.read import ranged_copy
    from accelkit.checkpoint.read.verify import verify_share
    from accelkit.checkpoint.store import store_for

    url, model = s3.url("run/step-1"), _big(1)
    accelkit.get("cpu").save(url, {"model": model}, rng=False)
    store = store_for(url)
    with ranged_copy.opened(store, url, store.read_manifest(url), rank=0, world=2) as reader:
        verify_share(reader, 0, 2)
        reader.trust_verified()
        entry = _last_in_file(reader)
        got = reader.read_flat(entry, 0, entry.numel)
    saved = dict(model.named_parameters())[entry.fqn]
    assert torch.equal(got, saved.detach().reshape(-1))


# ---- the facade ------------------------------------------------------------------------------------------
def test_accelerator_load_takes_weights_and_step_count_from_one_checkpoint(tmp_path, monkeypatch):
    """Another job commits step-2 and moves ``latest`` while step-1 loads: the model and
    ``applied_steps`` are both step-1's (``latest`` resolved once, its manifest read once)."""
    import accelkit.checkpoint as ckpt

    accel = accelkit.get("cpu")
    first, second = accel.setup(_model(1)), accel.setup(_model(2))
    accel._applied_steps = 1
    accel.save(tmp_path / "step-1", {"model": first})
    other = accelkit.get("cpu")
    other._applied_steps = 2
    real = ckpt._load_from

    def moving(backend: Any, reader: Any, state: Any, **kwargs: Any) -> Any:
        if not (tmp_path / "step-2").exists():
            other.save(tmp_path / "step-2", {"model": second})  # latest -> step-2, mid-load
        return real(backend, reader, state, **kwargs)

    monkeypatch.setattr(ckpt, "_load_from", moving)
    fresh = accelkit.get("cpu")
    target = fresh.setup(_model(3))
    fresh.load(tmp_path, {"model": target})
    assert _equal(target, first) and fresh.applied_steps == 1
    monkeypatch.setattr(ckpt, "_load_from", real)
    fresh.load(tmp_path, {"model": target})  # the twin: latest now names step-2
    assert _equal(target, second) and fresh.applied_steps == 2


def test_inspect_prints_the_url_and_load_pretrained_records_it(s3, capsys):
    from accelkit.checkpoint.shards.fragments import PRETRAINED_FROM
    from accelkit.cli import main

    url = s3.url("run/step-1")
    accelkit.get("cpu").save(url, {"model": _model(1)})
    assert main(["inspect", s3.url("run"), "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint  {url}\n" in out and "accelkit-s3-load-" not in out, out
    accel = accelkit.get("cpu")
    model = accel.setup(_model(2))
    accel.load_pretrained(model, url, storage_options={})
    assert model.__dict__[PRETRAINED_FROM] == url
    assert _equal(model, _model(1))


def test_a_save_does_not_ask_about_every_rotated_name(s3, monkeypatch):
    """After 2 or 6 rotated saves, the next save sends the same number of requests."""
    from accelkit.checkpoint.store import s3_client

    accel, model = accelkit.get("cpu"), _model(1)
    real, calls = s3_client.S3Bucket._call, []

    def counted(self: Any, doing: str, key: str, fn: Any, **kwargs: Any) -> Any:
        calls.append(getattr(fn, "__name__", "?"))
        return real(self, doing, key, fn, **kwargs)

    counts = []
    for run, saves in (("a", 2), ("b", 6)):
        for step in range(1, saves + 1):
            accel.save(s3.url(f"{run}/step-{step}"), {"model": model}, keep_last=1)
        monkeypatch.setattr(s3_client.S3Bucket, "_call", counted)
        calls.clear()
        accel.save(s3.url(f"{run}/step-{saves + 1}"), {"model": model}, keep_last=1)
        counts.append(len(calls))
        monkeypatch.setattr(s3_client.S3Bucket, "_call", real)
    assert counts[0] == counts[1], counts
