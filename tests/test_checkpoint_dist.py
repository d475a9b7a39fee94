"""The portable checkpoint across processes, backends and world sizes (issue 4;
docs/architecture.md, "The portable checkpoint").

Each launch runs a list of jobs on ``cpu`` x1, ``ddp`` x2 or ``fsdp`` x2 (gloo). A job trains the
workload of ``test_checkpoint_reference`` through accelkit, optionally loading a checkpoint
first and saving one on the way, and dumps the full state gathered through the *independent*
raw path (``get_state_dict(full_state_dict=True)``) at the save, right after the load, and at
the end. The tests compare those dumps bit for bit, and the losses, data order and RNG draws.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import test_checkpoint_reference as ref
import torch

from accelkit.testing import run_ranks

pytestmark = pytest.mark.slow

SEED = 1234
TOTAL, SAVE_AT = 10, 6
#: Loss-curve tolerance (promise c), fixed from the measured floor before asserting. Measured
#: (torch 2.13 CPU, gloo): the uninterrupted fsdp x2 and cpu x1 runs of this workload differ by
#: at most 1.04e-7 relative per step over 10 steps (one fp32 ulp of the loss; reduction order
#: only); fsdp x2 and ddp x2 agree exactly. A cross-backend resume must stay within LOSS_RTOL,
#: ten times that floor, of the uninterrupted run it continues. Measured after resume: fsdp2 ->
#: cpu1 6.8e-8, cpu1 -> fsdp2 1.04e-7, fsdp2 -> ddp2 0; without the optimizer state: 2.1e-2.
MEASURED_FLOOR = 1.1e-7
LOSS_RTOL = 1e-6


def launch_ranks(target: str, kwargs: dict[str, Any], nproc: int = 2) -> list[Any]:
    """``run_ranks``, retried once when the rendezvous port was taken meanwhile (other test
    processes on this machine pick free ports too)."""
    try:
        return run_ranks(target, kwargs, nproc=nproc, timeout=300)
    except AssertionError as err:
        if "EADDRINUSE" not in str(err) and "address already in use" not in str(err):
            raise
        return run_ranks(target, kwargs, nproc=nproc, timeout=300)


def _probe() -> list[float]:
    """One draw from each RNG (moves all of them, as a training step using them would)."""
    import numpy as np

    return [float(torch.rand(())), random.random(), float(np.random.rand())]


def _seed_rank(seed: int) -> None:
    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _job(
    backend: str,
    out: str,
    tag: str,
    save_to: str | None = None,
    load_from: str | None = None,
    load: tuple[str, ...] = ("model", "optimizer", "scheduler", "loader"),
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import accelkit

    options = {"device": "cpu"} if backend in ("ddp", "fsdp") else {}
    accel = accelkit.get(backend, seed=SEED, **options)
    world, rank = accel.world_size, accel.rank
    torch.manual_seed(SEED)
    model = ref.Net()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=ref.LR, weight_decay=0.1)
    model, opt = accel.setup(model, opt)
    sched = accel.setup_scheduler(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30))
    loader = accel.setup_dataloader(
        DataLoader(ref.Samples(), batch_size=ref.GLOBAL_BATCH // world, shuffle=True)
    )
    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader, "step": 0}
    outdir = Path(out)
    _seed_rank(SEED + 1 + rank)  # per-rank streams, so restoring one rank's for all would show

    def dump(name: str) -> None:
        gathered = ref.gather_full_state(model, opt.optimizer)
        if rank == 0:
            ref.dump(gathered, outdir / f"{tag}-{name}")

    result: dict[str, Any] = {"losses": [], "seen": [], "probes": []}
    step = 0
    if load_from:
        subset = {k: v for k, v in state.items() if k in (*load, "step")}
        accel.load(load_from, subset, strict=True)
        step = subset["step"]
        dump("loaded")
        result["probes"].append(_probe())
    while step < TOTAL:
        for tokens, targets, index in loader:
            loss = ref.lm_loss(model(tokens), targets)
            accel.backward(loss)
            accel.step()
            mean = loss.detach().clone()
            seen = index.tolist()
            if world > 1:
                dist.all_reduce(mean)
                mean /= world
                parts: list[Any] = [None] * world
                dist.all_gather_object(parts, seen)
                seen = sorted(i for part in parts for i in part)
            result["losses"].append(float(mean))
            result["seen"].append(sorted(seen))
            step += 1
            if step == SAVE_AT and save_to:
                state["step"] = step
                accel.save(save_to, state)
                dump("saved")
                result["probes"].append(_probe())
            if step >= TOTAL:
                break
    dump("final")
    return result


def jobs_worker(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_job(**job) for job in jobs]


# ---- the runs ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("ckpt-dist")
    out = str(base / "out")
    Path(out).mkdir()
    ck = {name: str(base / name / "step-6") for name in ("fsdp", "ddp", "cpu")}
    results: dict[str, Any] = {"out": Path(out), "ckpt": ck}

    def launch(nproc: int, jobs: list[dict[str, Any]]) -> None:
        per_rank = launch_ranks("test_checkpoint_dist:jobs_worker", {"jobs": jobs}, nproc=nproc)
        for index, job in enumerate(jobs):
            results[job["tag"]] = [rank_results[index] for rank_results in per_rank]

    launch(
        2,
        [
            dict(backend="fsdp", out=out, tag="A", save_to=ck["fsdp"]),
            dict(backend="ddp", out=out, tag="B", save_to=ck["ddp"]),
        ],
    )
    launch(
        1,
        [
            dict(backend="cpu", out=out, tag="C", save_to=ck["cpu"]),
            dict(backend="cpu", out=out, tag="G", load_from=ck["fsdp"]),
            dict(
                backend="cpu",
                out=out,
                tag="G-no-optim",
                load_from=ck["fsdp"],
                load=("model", "scheduler", "loader"),
            ),
        ],
    )
    # resumes first in their process; cross loads after
    launch(
        2,
        [
            dict(backend="fsdp", out=out, tag="D", load_from=ck["fsdp"]),
            dict(backend="ddp", out=out, tag="E", load_from=ck["ddp"]),
            dict(backend="ddp", out=out, tag="H", load_from=ck["fsdp"]),
            dict(backend="fsdp", out=out, tag="I-cpu", load_from=ck["cpu"]),
            dict(backend="fsdp", out=out, tag="I-ddp", load_from=ck["ddp"]),
        ],
    )
    launch(
        1,
        [
            dict(backend="cpu", out=out, tag="F", load_from=ck["cpu"]),
            dict(
                backend="cpu",
                out=out,
                tag="F-no-loader",
                load_from=ck["cpu"],
                load=("model", "optimizer", "scheduler"),
            ),
        ],
    )
    return results


def _state(runs: dict[str, Any], tag: str, when: str) -> dict:
    return ref.undump(runs["out"] / f"{tag}-{when}")


# ---- (a) same backend, same world size: bit-exact -----------------------------------------------
@pytest.mark.parametrize(("uninterrupted", "resumed"), [("A", "D"), ("B", "E"), ("C", "F")])
def test_resume_is_bit_exact(runs, uninterrupted, resumed):
    for rank_a, rank_b in zip(runs[uninterrupted], runs[resumed]):
        assert rank_b["losses"] == rank_a["losses"][SAVE_AT:]
    ref.assert_same_state(_state(runs, uninterrupted, "final"), _state(runs, resumed, "final"))


def test_resume_without_loader_state_is_caught(runs):
    """Negative twin of (a)/(e): the comparison above fails when a piece is not restored."""
    full, partial = runs["C"][0], runs["F-no-loader"][0]
    assert partial["seen"] != full["seen"][SAVE_AT:]
    assert partial["losses"] != full["losses"][SAVE_AT:]


# ---- (b) any backend, any world size: lossless --------------------------------------------------
@pytest.mark.parametrize(
    ("source", "target"),
    [("A", "G"), ("A", "H"), ("C", "I-cpu"), ("B", "I-ddp")],
    ids=["fsdp2->cpu1", "fsdp2->ddp2", "cpu1->fsdp2", "ddp2->fsdp2"],
)
def test_cross_backend_load_is_lossless(runs, source, target):
    ref.assert_same_state(_state(runs, source, "saved"), _state(runs, target, "loaded"))


def test_lossless_check_sees_a_missing_optimizer(runs):
    saved, loaded = _state(runs, "A", "saved"), _state(runs, "G-no-optim", "loaded")
    ref.assert_same_state(saved, loaded, model_only=True)
    with pytest.raises(AssertionError):
        ref.assert_same_state(saved, loaded)


# ---- (c) the loss curve after a cross-backend resume ---------------------------------------------
def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_noise_floor_between_backends_is_what_was_measured(runs):
    floor = _rel(runs["C"][0]["losses"], runs["A"][0]["losses"])
    assert floor <= MEASURED_FLOOR * 4


@pytest.mark.parametrize(("uninterrupted", "resumed"), [("A", "G"), ("C", "I-cpu"), ("A", "H")])
def test_cross_backend_resume_tracks_the_uninterrupted_run(runs, uninterrupted, resumed):
    tail = runs[uninterrupted][0]["losses"][SAVE_AT:]
    assert _rel(runs[resumed][0]["losses"], tail) <= LOSS_RTOL


def test_loss_tolerance_can_fail(runs):
    tail = runs["A"][0]["losses"][SAVE_AT:]
    assert _rel(runs["G-no-optim"][0]["losses"], tail) > LOSS_RTOL


# ---- (d) RNG, (e) data order ----------------------------------------------------------------------
@pytest.mark.parametrize(("uninterrupted", "resumed"), [("A", "D"), ("B", "E"), ("C", "F")])
def test_rng_and_data_order_continue_exactly(runs, uninterrupted, resumed):
    for rank_a, rank_b in zip(runs[uninterrupted], runs[resumed]):
        assert rank_b["probes"] == rank_a["probes"]
        assert rank_b["seen"] == rank_a["seen"][SAVE_AT:]
    # ranks draw different numbers: the per-rank state is not one rank's copied
    if len(runs[uninterrupted]) > 1:
        assert runs[uninterrupted][0]["probes"] != runs[uninterrupted][1]["probes"]


def test_data_order_continues_across_world_sizes(runs):
    assert runs["G"][0]["seen"] == runs["A"][0]["seen"][SAVE_AT:]
    assert runs["I-cpu"][0]["seen"] == runs["C"][0]["seen"][SAVE_AT:]


def test_dist_checkpoints_have_one_file_per_rank(runs):
    import json

    for name, world in (("fsdp", 2), ("ddp", 2), ("cpu", 1)):
        manifest = json.loads((Path(runs["ckpt"][name]) / "accelkit.json").read_text())
        assert manifest["world_size"] == world
        files = sorted(f for f in manifest["files"] if f.endswith(".safetensors"))
        assert files == [f"rank-{r:05d}.safetensors" for r in range(world)]
        model = [t for t in manifest["tensors"] if t["object"] == "model"]
        by_fqn = {t["fqn"]: t for t in model}
        assert "head.weight" not in by_fqn  # tied: stored once ...
        assert by_fqn["embed.weight"]["aliases"] == ["head.weight"]  # ... with its alias
        assert by_fqn["frozen"]["trainable"] is False
        assert "scratch" not in by_fqn  # non-persistent buffer
        optim = {(t["fqn"], t["kind"]) for t in manifest["tensors"] if t["object"] == "optimizer"}
        assert not any(fqn == "frozen" for fqn, _ in optim)
        if world == 2:  # both ranks hold part of the data: the write is parallel
            used = {f["file"] for t in model for f in t["fragments"]}
            assert used == set(files)


def test_dist_checkpoint_negative_twins(runs, tmp_path):
    """A 2-rank checkpoint missing a rank file, or with a flipped byte in it, fails clearly."""
    import accelkit
    from accelkit.checkpoint import load

    src = Path(runs["ckpt"]["fsdp"])

    def fresh() -> dict:
        torch.manual_seed(0)
        return {"model": ref.Net()}

    dropped = tmp_path / "dropped"
    shutil.copytree(src, dropped)
    (dropped / "rank-00001.safetensors").unlink()
    with pytest.raises(accelkit.CheckpointError, match=r"rank-00001\.safetensors.*missing.*model:"):
        load(None, dropped, fresh(), rng=False)

    flipped = tmp_path / "flipped"
    shutil.copytree(src, flipped)
    target = flipped / "rank-00001.safetensors"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x10  # the last tensor's data
    target.write_bytes(bytes(data))
    with pytest.raises(accelkit.CheckpointError, match=r"rank-00001\.safetensors.*checksum"):
        _load_all(flipped)


def _load_all(path: Path) -> None:
    """Load every tensor of the checkpoint (verifying each fragment once)."""
    from accelkit.checkpoint import CheckpointReader

    reader = CheckpointReader(path)
    for entry in reader.entries():
        reader.read(entry)
