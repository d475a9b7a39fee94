"""Checkpoints in S3-compatible object storage (issue 36), against a real server: SeaweedFS's
``weed mini`` on loopback (tests/conftest.py). The reference side is boto3 on the same server.

What a user relies on: a save to ``s3://`` round-trips bit for bit and follows ``latest``; a
location without a manifest is never loaded; a checkpoint copied between disk and bucket loads
either way; an unsupported scheme is refused and writes no local folder; the refusal to
overwrite, and ``load_pretrained`` of sharded safetensors; two ranks save, another world size
resumes. What every store must do (a flipped byte, a missing rank object, asynchronous saves
with rotation, network faults, two writers, kills in the commit) is the store suite's,
tests/test_store_contract.py (accelkit.testing.store_contract), run on disk and on S3.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.testing import run_ranks

HERE = Path(__file__).parent


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    accel = accelkit.get("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accel.setup(model, opt)
    sched = accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=2))
    return accel, model, opt, sched


def _train(accel, model, steps: int = 3) -> None:
    for _ in range(steps):
        accel.backward(model(torch.randn(4, 8)).pow(2).mean())
        accel.step()


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(opt.state_dict()["state"].values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"o.{i}.{key}"] = value.detach().clone()
    return out


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture
def saved(s3):
    """A trained cpu state saved at s3://.../run/step-3; returns (url, state snapshot)."""
    accel, model, opt, sched = _setup()
    _train(accel, model)
    url = s3.url("run/step-3")
    accel.save(url, {"model": model, "optimizer": opt, "scheduler": sched, "note": "hi"})
    return url, _snapshot(model, opt), sched.state_dict()


def _fresh():
    accel, model, opt, sched = _setup(seed=1)
    return accel, {"model": model, "optimizer": opt, "scheduler": sched}


def test_round_trip_is_bit_exact_and_follows_latest(s3, saved):
    _, want, sched_state = saved
    assert s3.keys("run") == [
        "run/latest",
        "run/step-3/accelkit.json",
        "run/step-3/extra.json",
        "run/step-3/rank-00000.safetensors",
    ]
    accel, state = _fresh()
    before = _snapshot(state["model"], state["optimizer"])
    unconsumed = accel.load(s3.url("run"), state)  # the prefix: its latest names step-3
    _assert_equal(_snapshot(state["model"], state["optimizer"]), want)
    assert state["scheduler"].state_dict() == sched_state
    assert unconsumed == {"note": "hi"}
    with pytest.raises(AssertionError):  # the comparison can fail: a fresh state differs
        _assert_equal(before, want)


def test_a_save_without_its_manifest_is_never_loaded(s3, saved):
    """An interrupted save (rank files uploaded, no manifest) is invisible to load, latest and
    auto_resume: they take the last committed checkpoint."""
    url, want, _ = saved
    client = s3.client()
    body = client.get_object(Bucket=s3.bucket, Key=s3.rank_key("run/step-3"))
    client.put_object(
        Bucket=s3.bucket,
        Key=f"{s3.prefix}/run/step-9/rank-00000.safetensors",
        Body=body["Body"].read(),
    )
    client.put_object(Bucket=s3.bucket, Key=f"{s3.prefix}/run/latest", Body=b"step-9\n")
    accel, state = _fresh()
    with pytest.raises(
        accelkit.CheckpointError,
        match=r"step-9: neither a checkpoint \(no accelkit.json: a save that did not complete",
    ):
        accel.load(s3.url("run/step-9"), state)
    with pytest.raises(
        accelkit.CheckpointError,
        match=r"latest points at step-9, which is not a committed checkpoint",
    ):
        accel.load(s3.url("run"), state)
    resumed = accel.auto_resume(s3.url("run"), state)
    assert resumed == url
    _assert_equal(_snapshot(state["model"], state["optimizer"]), want)


def test_a_committed_checkpoint_is_never_overwritten(s3, saved):
    url, want, _ = saved
    accel, state = _fresh()
    with pytest.raises(accelkit.CheckpointError, match=r"committed checkpoint already.*new name"):
        accel.save(url, state)
    accel.load(url, state)  # still the first save's
    _assert_equal(_snapshot(state["model"], state["optimizer"]), want)


def test_a_commit_removes_what_killed_saves_of_its_series_left(s3):
    """A save killed at step-1 left a rank object and an unfinished multipart upload; step-2's
    commit removes both. A later name (another save in flight, step-9) is left alone."""
    client, base = s3.client(), f"{s3.prefix}/run"
    client.put_object(Bucket=s3.bucket, Key=f"{base}/step-1/rank-00000.safetensors", Body=b"x")
    client.create_multipart_upload(Bucket=s3.bucket, Key=f"{base}/step-1/rank-00001.safetensors")
    client.put_object(Bucket=s3.bucket, Key=f"{base}/step-9/rank-00000.safetensors", Body=b"y")
    accel, model, _, _ = _setup()
    accel.save(s3.url("run/step-2"), {"model": model})
    assert [k for k in s3.keys("run") if "/step-2/" not in k] == [
        "run/latest",
        "run/step-9/rank-00000.safetensors",
    ]
    uploads = client.list_multipart_uploads(Bucket=s3.bucket, Prefix=f"{base}/")
    assert not uploads.get("Uploads")


def test_copied_between_disk_and_bucket_loads_either_way(s3, saved, tmp_path):
    _, want, _ = saved
    client = s3.client()
    local = tmp_path / "step-3"
    local.mkdir()
    for key in s3.keys("run/step-3", saves=True):
        client.download_file(s3.bucket, f"{s3.prefix}/{key}", str(local / key.split("/")[-1]))
    accel, state = _fresh()
    accel.load(local, state)  # bucket -> disk
    _assert_equal(_snapshot(state["model"], state["optimizer"]), want)
    for path in local.iterdir():  # disk -> another prefix of the bucket
        client.upload_file(str(path), s3.bucket, f"{s3.prefix}/copy/{path.name}")
    accel, state = _fresh()
    accel.load(s3.url("copy"), state)
    _assert_equal(_snapshot(state["model"], state["optimizer"]), want)


def test_an_unsupported_scheme_is_refused_and_writes_no_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accel, model, _, _ = _setup()
    for url in ("az://container/run/step-1", "hdfs://node/run"):  # gs:// is a plugin's
        with pytest.raises(accelkit.CheckpointError, match=r"scheme .*:// is not supported.*s3://"):
            accel.save(url, {"model": model})
        with pytest.raises(accelkit.CheckpointError, match="is not supported"):
            accel.load(url, {"model": model})
    with pytest.raises(accelkit.CheckpointError, match=r"pathlib.Path, which folds its '//'"):
        accel.save(Path("s3://bucket/run/step-1"), {"model": model})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["s3://", "s3:///run", "s3://b/run/../x", "s3://b/run//x"])
def test_a_malformed_s3_url_is_refused(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accel, model, _, _ = _setup()
    with pytest.raises(accelkit.CheckpointError, match=r"not a valid S3 location.*s3://bucket/"):
        accel.save(url, {"model": model})
    assert list(tmp_path.iterdir()) == []


def test_storage_options_override_the_environment(s3, monkeypatch):
    accel, model, _, _ = _setup()
    options = {
        "endpoint_url": os.environ["AWS_ENDPOINT_URL"],
        "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
    }
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(accelkit.CheckpointError, match=r"access denied.*AWS_ACCESS_KEY_ID"):
        accel.save(s3.url("o/step-1"), {"model": model})
    accel.save(s3.url("o/step-1"), {"model": model}, storage_options=options)
    accel.load(s3.url("o"), {"model": model}, storage_options=options)
    with pytest.raises(accelkit.CheckpointError, match="storage_options apply to object storage"):
        accel.save("local-dir", {"model": model}, storage_options=options)


def test_a_missing_bucket_fails_clearly(s3):
    accel, model, _, _ = _setup()
    with pytest.raises(accelkit.CheckpointError, match="bucket 'no-such-bucket' does not exist"):
        accel.save("s3://no-such-bucket/run/step-1", {"model": model})


def test_without_boto3_the_error_says_what_to_install(s3, monkeypatch):
    import sys

    from accelkit.checkpoint.store import s3_client as objectstore

    monkeypatch.setitem(sys.modules, "boto3", None)
    monkeypatch.setattr(objectstore, "_buckets", {})
    accel, model, _, _ = _setup()
    with pytest.raises(accelkit.CheckpointError, match=r"pip install 'accelkit\[s3\]'"):
        accel.save(s3.url("x/step-1"), {"model": model})


# ---- pretrained weights: Hugging Face-style sharded safetensors ------------------------------------
def _upload_shards(s3, prefix: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    torch.manual_seed(3)
    weights = {"0.weight": torch.randn(16, 8), "0.bias": torch.randn(16)}
    weights |= {"2.weight": torch.randn(4, 16), "2.bias": torch.randn(4)}
    shards = {"model-00001-of-00002.safetensors": ["0.weight", "0.bias"]}
    shards["model-00002-of-00002.safetensors"] = ["2.weight", "2.bias"]
    index = {"metadata": {}, "weight_map": {}}
    client = s3.client()
    for name, keys in shards.items():
        save_file({k: weights[k] for k in keys}, tmp_path / name)
        client.upload_file(str(tmp_path / name), s3.bucket, f"{s3.prefix}/{prefix}/{name}")
        index["weight_map"].update(dict.fromkeys(keys, name))
    client.put_object(
        Bucket=s3.bucket,
        Key=f"{s3.prefix}/{prefix}/model.safetensors.index.json",
        Body=json.dumps(index).encode(),
    )
    return weights


def test_load_pretrained_reads_sharded_safetensors_from_s3(s3, tmp_path):
    weights = _upload_shards(s3, "hf", tmp_path)
    accel, model, _, _ = _setup(seed=5)
    accel.load_pretrained(model, s3.url("hf"))
    for key, value in weights.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_load_pretrained_names_a_missing_shard_object(s3, tmp_path):
    _upload_shards(s3, "hf", tmp_path)
    s3.client().delete_object(
        Bucket=s3.bucket, Key=f"{s3.prefix}/hf/model-00002-of-00002.safetensors"
    )
    accel, model, _, _ = _setup(seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        accelkit.CheckpointError, match=r"s3://.*model-00002-of-00002.*does not hold"
    ):
        accel.load_pretrained(model, s3.url("hf"))
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value)


# ---- two ranks ------------------------------------------------------------------------------------
def _launch(jobs: list[dict], nproc: int) -> list:
    try:
        return run_ranks(
            "test_checkpoint_dist:jobs_worker",
            {"jobs": jobs},
            nproc=nproc,
            timeout=300,
            path=[HERE],
        )
    except AssertionError as err:  # the rendezvous port was taken meanwhile: once more
        if "EADDRINUSE" not in str(err) and "address already in use" not in str(err):
            raise
        return run_ranks(
            "test_checkpoint_dist:jobs_worker",
            {"jobs": jobs},
            nproc=nproc,
            timeout=300,
            path=[HERE],
        )


def test_ddp_two_ranks_save_to_s3_and_cpu_resumes(s3, tmp_path):
    """ddp x2 saves at step 6 to s3:// (each rank uploads its own file); one cpu process
    resumes from the prefix (latest) with the saved state bit for bit and the data order
    continuing."""
    import test_checkpoint_dist as dist_test
    import test_checkpoint_reference as ref

    out = tmp_path / "out"
    out.mkdir()
    url = s3.url("ddp/step-6")
    saved = _launch([dict(backend="ddp", out=str(out), tag="B", save_to=url)], 2)
    manifest = json.loads(
        s3.client()
        .get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/ddp/step-6/accelkit.json")["Body"]
        .read()
    )
    ranks = sorted(f for f in manifest["files"] if f.startswith("rank-"))
    assert [re.sub(r"\.[0-9a-f]{12}\.", ".", f) for f in ranks] == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]  # each named for this save (two saves of one name never replace each other's)
    resumed = _launch([dict(backend="cpu", out=str(out), tag="G", load_from=s3.url("ddp"))], 1)
    ref.assert_same_state(ref.undump(out / "B-saved"), ref.undump(out / "G-loaded"))
    assert resumed[0][0]["seen"] == saved[0][0]["seen"][dist_test.SAVE_AT :]


# ---- accelkit convert / inspect ------------------------------------------------------------------
def test_inspect_and_convert_read_and_write_s3(s3, saved, tmp_path):
    from accelkit.cli import main

    url, want, _ = saved
    assert main(["inspect", s3.url("run")]) == 0  # follows latest, verifies every checksum
    assert main(["convert", url, str(tmp_path / "model.pt")]) == 0
    assert main(["convert", url, s3.url("copy/model.pt")]) == 0
    assert s3.keys("copy") == ["copy/model.pt"]
    s3.client().download_file(s3.bucket, f"{s3.prefix}/copy/model.pt", str(tmp_path / "back.pt"))
    for written in (tmp_path / "model.pt", tmp_path / "back.pt"):
        model = torch.load(written, weights_only=True)  # the model state dict
        assert model.keys() == {k[2:] for k in want if k.startswith("m.")}
        for key, value in model.items():
            assert torch.equal(value, want[f"m.{key}"]), key


def test_inspect_names_the_object_that_fails_its_checksum(s3, saved, capsys):
    from accelkit.cli import main

    url, _, _ = saved
    client, key = s3.client(), s3.rank_key("run/step-3")
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[-3] ^= 0x01
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    assert main(["inspect", s3.url("run")]) == 1
    err = capsys.readouterr().err
    assert f"{url}/{key.rsplit('/', 1)[1]}" in err and "FAILED" in err


# ---- slow tier: other backends, faults -------------------------------------------------------------
@pytest.mark.slow
def test_fsdp_two_ranks_save_to_s3_and_ddp_resumes_bit_exact(s3, tmp_path):
    """fsdp x2 saves to s3://; ddp x2 loads the same state bit for bit and continues the loss
    curve within the tolerance of test_checkpoint_dist (same order of reduction: exactly)."""
    import test_checkpoint_dist as dist_test
    import test_checkpoint_reference as ref

    out = tmp_path / "out"
    out.mkdir()
    url = s3.url("fsdp/step-6")
    ranks = _launch(
        [
            dict(backend="fsdp", out=str(out), tag="A", save_to=url),
            dict(backend="ddp", out=str(out), tag="H", load_from=s3.url("fsdp")),
        ],
        2,
    )
    saved, resumed = ranks[0]
    ref.assert_same_state(ref.undump(out / "A-saved"), ref.undump(out / "H-loaded"))
    tail = saved["losses"][dist_test.SAVE_AT :]
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed["losses"], tail)) <= dist_test.LOSS_RTOL


DS_TESTS = HERE.parent / "plugins" / "deepspeed" / "tests"


@pytest.mark.slow
def test_zero3_two_ranks_save_to_s3_and_resume_across_backends(s3, monkeypatch):
    """DeepSpeed ZeRO-3 x2 saves to s3://; ddp x2 and ZeRO-3 x2 resume from it, and ZeRO-3 x2
    resumes a ddp x2 checkpoint from s3://: each loaded state equals the saved one bit for
    bit (gathered through DeepSpeed's and torch's own accessors, dsk_gather.py)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("accelkit_deepspeed")
    monkeypatch.syspath_prepend(str(DS_TESTS))  # run_ranks checks the module imports here
    z3, ddp = s3.url("z3/step-3"), s3.url("ddp/step-3")
    jobs = [
        dict(name="z3", stage=3, save_at=3, save_to=z3),
        dict(name="ddp", backend="ddp", save_at=3, save_to=ddp),
        dict(name="ddp<-z3", backend="ddp", load_from=s3.url("z3")),
        dict(name="z3<-z3", stage=3, load_from=z3),
        dict(name="z3<-ddp", stage=3, load_from=ddp),
    ]
    ranks = run_ranks(
        "dsk_ckpt:jobs",
        {"jobs": jobs},
        nproc=2,
        env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
        timeout=900,
        path=[DS_TESTS],
    )
    runs = ranks[0]
    for name, result in runs.items():
        assert "crash" not in result and "error" not in result, (name, result)
    for target, source in (("ddp<-z3", "z3"), ("z3<-z3", "z3"), ("z3<-ddp", "ddp")):
        loaded, saved = runs[target]["loaded"], runs[source]["saved"]
        for key in ("weights", "exp_avg", "exp_avg_sq"):
            assert loaded[key] == saved[key], (target, key)
        assert loaded["steps"] == saved["steps"], target
        assert saved["exp_avg"], "the source had optimizer state to transfer"
    assert runs["z3<-z3"]["losses"] == runs["z3"]["losses"][3:]


def _latest(s3, under: str) -> str | None:
    try:
        body = s3.client().get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{under}/latest")
    except Exception:
        return None
    return body["Body"].read().decode().strip()


def _serving(s3, key: str, timeout: float = 60.0) -> None:
    """Wait until the restarted server serves ``key`` again: ``weed mini`` answers for its
    bucket before its volume server has registered, and a GET in between fails."""
    import time

    client, deadline = s3.client(), time.monotonic() + timeout
    while True:
        try:
            client.get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{key}")["Body"].read()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _kill_server_at_upload(monkeypatch, server) -> list:
    """SIGKILL the server as the first rank file upload begins (a crash mid-save)."""
    from accelkit.checkpoint.write import writer

    real, killed = writer._write_rank_file, []

    def upload(*args, **kwargs):
        if not killed:
            server.kill()
            killed.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "_write_rank_file", upload)
    return killed


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_server_killed_during_a_save(own_s3_server, monkeypatch, asynchronous):
    """The server dies mid-save: the save fails clearly (bounded retries, no hang), nothing is
    committed and ``latest`` still names the last checkpoint; after a restart the next save
    works and loads."""
    s3 = own_s3_server
    accel, model, opt, _ = _setup()
    accel.save(s3.url("run/step-1"), {"model": model, "optimizer": opt})
    want = _snapshot(model, opt)
    _train(accel, model, 1)
    killed = _kill_server_at_upload(monkeypatch, s3.server)
    with pytest.raises(accelkit.CheckpointError, match=r"step-2.*cannot reach the S3 endpoint"):
        accel.save(
            s3.url("run/step-2"), {"model": model, "optimizer": opt}, asynchronous=asynchronous
        )
        if asynchronous:  # the failure surfaces at the next checkpoint call
            accel.load(s3.url("run"), {"model": model, "optimizer": opt})
    assert killed
    monkeypatch.undo()
    for key, value in s3.server.env().items():
        monkeypatch.setenv(key, value)
    s3.server.start()
    _serving(s3, "run/step-1/accelkit.json")  # another object than the one asserted on
    assert _latest(s3, "run") == "step-1"
    assert not [k for k in s3.keys("run") if k.endswith("step-2/accelkit.json")]
    accel2, state = _fresh()
    accel2.load(s3.url("run"), {"model": state["model"], "optimizer": state["optimizer"]})
    _assert_equal(_snapshot(state["model"], state["optimizer"]), want)
    _train(accel, model, 1)
    accel.save(s3.url("run/step-2"), {"model": model, "optimizer": opt})  # cleans what was left
    assert _latest(s3, "run") == "step-2"
    accel2.load(s3.url("run"), {"model": state["model"], "optimizer": state["optimizer"]})
    _assert_equal(_snapshot(state["model"], state["optimizer"]), _snapshot(model, opt))


def trainer_killed_mid_upload(url: str, parts_before_kill: int) -> None:
    """A worker: saves a state of several multipart parts and SIGKILLs itself after uploading
    ``parts_before_kill`` of them (the save never returns)."""
    import signal

    from accelkit.checkpoint.store import s3_client as objectstore

    real, sent = objectstore.S3Bucket._call, []

    def call(self, doing, key, fn, **kwargs):
        if getattr(fn, "__name__", "") == "upload_part":
            if len(sent) >= parts_before_kill:
                os.kill(os.getpid(), signal.SIGKILL)
            sent.append(key)
        return real(self, doing, key, fn, **kwargs)

    objectstore.S3Bucket._call = call
    accel = accelkit.get("cpu")
    torch.manual_seed(9)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights: a multipart upload
    accel.save(url, {"model": model})


@pytest.mark.slow
def test_trainer_killed_mid_upload_leaves_nothing_loadable(s3):
    """A trainer SIGKILLed during its multipart upload: its checkpoint has no manifest, so
    load and auto_resume take the last committed one; the next save to that name removes the
    leftovers (parts, objects) and commits."""
    from accelkit.testing import RanksFailed

    accel, model, opt, _ = _setup()
    accel.save(s3.url("run/step-1"), {"model": model})
    want = _snapshot(model, opt)
    with pytest.raises(RanksFailed):
        run_ranks(
            "test_checkpoint_s3:trainer_killed_mid_upload",
            {"url": s3.url("run/step-2"), "parts_before_kill": 1},
            nproc=1,
            timeout=300,
            path=[HERE],
        )
    client = s3.client()
    uploads = client.list_multipart_uploads(Bucket=s3.bucket, Prefix=f"{s3.prefix}/run/step-2")
    assert uploads.get("Uploads"), "the kill came mid-upload: an unfinished multipart upload"
    assert _latest(s3, "run") == "step-1"
    accel2, state = _fresh()
    assert accel2.auto_resume(s3.url("run"), {"model": state["model"]}) == s3.url("run/step-1")
    assert torch.equal(state["model"][0].weight, want["m.0.weight"])
    accel.save(s3.url("run/step-2"), {"model": model})
    uploads = client.list_multipart_uploads(Bucket=s3.bucket, Prefix=f"{s3.prefix}/run/step-2")
    assert not uploads.get("Uploads")
    assert _latest(s3, "run") == "step-2"


# ---- the documented example ------------------------------------------------------------------------
def test_the_object_storage_example_of_the_docs_runs_against_the_server(s3, capsys):
    """docs/checkpoint.md, "Object storage": the example's checkpoint calls, run as written
    against this suite's server (the page's own run, tests/test_checkpoint_docs.py, starts a
    server of its own in the block before)."""
    import re

    page = (HERE.parent / "docs" / "checkpoint.md").read_text()
    section = page.split("## Object storage (`s3://`)")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    example = next(b for b in blocks if "s3://ckpts/demo-run" in b)
    exec(compile(example, "docs/checkpoint.md[object storage]", "exec"), {"__name__": "docs"})
    assert "committed checkpoint already" in capsys.readouterr().out
    client = s3.client()
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix="demo-run/")
    keys = sorted(o["Key"] for o in listed.get("Contents", []))
    assert "demo-run/latest" in keys
    assert sorted({k.split("/")[1] for k in keys if k.count("/") == 2}) == ["step-2", "step-3"]
    client.delete_objects(Bucket=s3.bucket, Delete={"Objects": [{"Key": k} for k in keys]})


def test_read_timeout_is_a_storage_option_and_a_bad_one_is_refused(s3):
    """``read_timeout`` reaches the client (a stalled GET is retried after it: the store suite's
    stall case); a value that is not a positive number fails before any request, naming it."""
    from accelkit.checkpoint.store.s3_client import bucket_for

    accel, model, _, _ = _setup()
    accel.save(s3.url("t/step-1"), {"model": model}, storage_options={"read_timeout": 2.5})
    accel.load(s3.url("t"), {"model": model}, storage_options={"read_timeout": 2.5})
    bucket = s3.url("t").split("/")[2]
    assert bucket_for(bucket, {"read_timeout": 2.5}).client.meta.config.read_timeout == 2.5
    for bad in (0, -1, "fast", True):
        with pytest.raises(accelkit.CheckpointError, match="read_timeout must be a positive"):
            accel.save(s3.url("t/step-2"), {"model": model}, storage_options={"read_timeout": bad})
    assert s3.keys("t/step-2") == []
