"""A failed load changes nothing: 60+ damaged or crafted checkpoints on ``cpu`` and on ``ddp``
(2 processes), and (slow tier) the same checkpoints loaded from S3. For every case the load must raise ``CheckpointError`` naming the file and the
tensor or field, and leave model, optimizer, scheduler, loader position, extras and RNG bit for
bit as they were; the good checkpoint (the control) must load and change them."""

from __future__ import annotations

from pathlib import Path

import pytest
from corruption_cases import make_cases, run_case

import accelkit
from accelkit.testing import run_ranks

HERE = Path(__file__).parent
#: the issue asks for at least 60 damaged checkpoints
MIN_CASES = 60


def _check(results: dict[str, dict], where: str) -> None:
    control = results.pop("good")
    assert control["raised"] is None, f"{where}: the good checkpoint failed: {control['message']}"
    assert "model" in control["changed"] and "optimizer" in control["changed"], control
    changed = {n: r["changed"] for n, r in results.items() if r["changed"]}
    print(
        f"\n{where}: {len(results)} damaged checkpoints, {len(results) - len(changed)} refused "
        f"with nothing changed, {len(changed)} changed state"
    )
    assert len(results) >= MIN_CASES
    not_raised = [n for n, r in results.items() if r["raised"] is None]
    assert not not_raised, f"{where}: loaded without an error: {not_raised}"
    wrong_class = {n: r["raised"] for n, r in results.items() if r["raised"] != "CheckpointError"}
    assert not wrong_class, f"{where}: not a CheckpointError: {wrong_class}"
    assert not changed, f"{where}: a failed load changed the live state: {changed}"
    unnamed = {n: r["message"][:300] for n, r in results.items() if not r["named"]}
    assert not unnamed, f"{where}: the message does not name the file and tensor/field: {unnamed}"


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory) -> dict[str, dict]:
    from corruption_cases import build

    root = tmp_path_factory.mktemp("corrupt")
    accel = accelkit.get("cpu", seed=0)
    good = root / "good"
    accel.save(good, build(accel, seed=1, steps=5))
    results = {
        name: run_case(accel, Path(directory), words, seed=2)
        for name, (directory, words) in make_cases(good, root / "cases").items()
    }
    results["good"] = run_case(accel, good, [], seed=2)
    return results


def test_every_failed_load_on_cpu_changes_nothing_and_names_the_problem(cpu_results):
    _check(dict(cpu_results), "cpu")


def test_the_suite_covers_each_kind_of_damage(cpu_results):
    names = " | ".join(cpu_results)
    for kind in ("flip model:param", "flip optimizer:optim:exp_avg", "truncated rank-", "grown",
                 "missing rank-", "redirected", "shape model", "dtype model", "key model",
                 "missing exp_avg", "extra state key", "group lr='x'", "group lr=nan",
                 "scheduler last_epoch", "format_version", "huge shape", "fragment file"):  # fmt: skip
        assert kind in names, f"no {kind!r} case"


@pytest.mark.slow
def test_every_failed_load_on_ddp_changes_nothing_on_any_rank(tmp_path):
    ranks = run_ranks(
        "corruption_cases:ranks_job", {"root": str(tmp_path)}, nproc=2, timeout=600, path=[HERE]
    )
    for rank, results in enumerate(ranks):
        _check(results, f"ddp rank {rank}")


def test_a_checkpoint_of_format_1_0_sha256_still_loads_bit_for_bit():
    """Written by accelkit before XXH3 became the fragments' checksum (format 1.0, SHA-256);
    the expected values were saved beside it with the safetensors library alone."""
    import torch
    from safetensors.torch import load_file

    old = HERE / "data" / "checkpoint-format-1.0"
    expected = load_file(HERE / "data" / "checkpoint-format-1.0-expected.safetensors")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    accel = accelkit.get("cpu", seed=0)
    model, opt = accel.setup(model, opt)
    state = {"model": model, "optimizer": opt, "epoch": 0}
    accel.load(old, state)
    assert state["epoch"] == 3
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[f"model.{key}"]), key
    inner = opt.state_dict()["state"]
    for pid, st in inner.items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(value), expected[f"optimizer.{pid}.{key}"])


def test_a_flipped_byte_in_the_format_1_0_checkpoint_is_still_caught(tmp_path):
    import shutil

    import torch

    damaged = tmp_path / "old"
    shutil.copytree(HERE / "data" / "checkpoint-format-1.0", damaged)
    rank_file = damaged / "rank-00000.safetensors"
    raw = bytearray(rank_file.read_bytes())
    raw[-3] ^= 0x01
    rank_file.write_bytes(bytes(raw))
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    accel = accelkit.get("cpu", seed=0)
    with pytest.raises(accelkit.CheckpointError, match="sha256"):
        accel.load(damaged, {"model": accel.setup(model)})


@pytest.mark.slow
def test_every_failed_load_on_s3_changes_nothing_and_names_the_problem(s3, tmp_path):
    """The same damaged checkpoints, each uploaded to the S3 server as it lies on disk (boto3,
    the reference side) and loaded from there. A case whose damage is a symbolic link (a disk
    thing: an object store has no links) is left out."""
    from corruption_cases import build

    accel = accelkit.get("cpu", seed=0)
    good = tmp_path / "good"
    accel.save(good, build(accel, seed=1, steps=5))
    client = s3.client()
    results = {}
    for name, (directory, words) in {
        **make_cases(good, tmp_path / "cases"),
        "good": (str(good), []),
    }.items():
        files = [p for p in Path(directory).rglob("*") if not p.is_dir()]
        if any(p.is_symlink() for p in files):
            continue
        prefix = f"{s3.prefix}/{Path(directory).name}"
        for path in files:
            if not path.name.startswith("."):
                key = f"{prefix}/{path.relative_to(directory)}"
                client.put_object(Bucket=s3.bucket, Key=key, Body=path.read_bytes())
        results[name] = run_case(accel, s3.url(Path(directory).name), words, seed=2)
    assert len(results) >= MIN_CASES
    _check(results, "s3")
