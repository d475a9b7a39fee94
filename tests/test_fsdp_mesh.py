"""N-D parallelism on ``fsdp``: HSDP, tensor parallelism and FSDP2 x TP on 4 CPU processes (gloo),
against a raw-PyTorch reference with the same mesh, plan and FSDP2 units (tests/mesh_workers.py's
``reference`` imports nothing from accelkit); bad meshes and plans fail clearly; a checkpoint
saved on one layout resumes bit for bit on every other, and a damaged one fails.

Tolerance: the measured floor between accelkit and the reference is 1.7e-6 on the weights and
6e-8 on the grad norms (fp32, 3 optimizer steps of accumulation 3 with clipping; the same math
reduced in another order); the assertions allow 1e-5. Against one process training the whole
global batch the floor is 1.4e-5 on the weights (gradients summed over ranks in another order);
that pair allows 1e-4."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.backends.mesh import MeshShape, check_plan, resolve_plan, resolve_shape
from accelkit.testing import run_ranks

HERE = Path(__file__).parent
TOLERANCE = 1e-5
SINGLE_PROCESS_TOLERANCE = 1e-4


# ---- shapes and plans: refused at get() / setup(), naming what to change -----------------------
def test_a_left_out_dimension_is_inferred_from_the_world_size():
    assert resolve_shape(8, 2, None, 2) == MeshShape(2, 2, 2)
    assert resolve_shape(4, None, None, 2) == MeshShape(1, 2, 2)
    assert resolve_shape(4, None, None, None) == MeshShape(1, 4, 1)


@pytest.mark.parametrize(
    ("world", "dims", "message"),
    [
        (4, (3, None, None), "not a multiple of 3"),
        (4, (1, 3, 1), "has 3 ranks, the world has 4"),
        (4, (None, None, 0), "'tp' must be an int >= 1"),
    ],
)
def test_a_mesh_that_does_not_fit_the_world_is_a_clear_error(world, dims, message):
    with pytest.raises(accelkit.ConfigError, match=message):
        resolve_shape(world, *dims)


def test_get_refuses_a_mesh_product_other_than_the_world_size():
    with pytest.raises(accelkit.ConfigError, match="the world has 1"):
        accelkit.get("fsdp", device="cpu", dp_shard=1, tp=2)


def test_a_plan_that_cannot_shard_is_refused_naming_the_module():
    from mesh_workers import TinyGPT
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = TinyGPT()
    plan = resolve_plan(model, "auto")
    assert "blocks.0.attn.q_proj" in plan and "blocks.1.down_proj" in plan
    with pytest.raises(
        accelkit.ConfigError, match=r"blocks\.0\.attn\.q_proj \(32 output features\) 3 ways"
    ):
        check_plan(model, plan, 3)
    with pytest.raises(accelkit.ConfigError, match="matches no module"):
        resolve_plan(model, {"blocks.*.nonexistent": ColwiseParallel()})
    with pytest.raises(accelkit.ConfigError, match="needs a tensor-parallel plan"):
        resolve_plan(model, None)
    with pytest.raises(accelkit.ConfigError, match="num_heads=6, which tp=4"):
        check_plan(_with_heads(model, 6), {"blocks.0.attn.q_proj": ColwiseParallel()}, 4)


def _with_heads(model: torch.nn.Module, heads: int) -> torch.nn.Module:
    model.blocks[0].attn.num_heads = heads
    return model


# ---- training on the mesh against the raw reference ---------------------------------------------
MESHES = {
    "hsdp-2x2": pytest.param((2, 2, 1), marks=pytest.mark.slow),
    "fsdp-x-tp-2x2": pytest.param((1, 2, 2), marks=pytest.mark.slow),
    "tp-2-x-replicate-2": pytest.param((2, 1, 2), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("shape", list(MESHES.values()), ids=list(MESHES))
def test_training_on_the_mesh_matches_raw_pytorch(shape):
    replicate, shard, tp = shape
    kwargs = {"nproc": 4, "timeout": 300, "path": [HERE]}
    ref = run_ranks(
        "mesh_workers:reference", {"replicate": replicate, "shard": shard, "tp": tp}, **kwargs
    )
    options = {"dp_replicate": replicate, "dp_shard": shard, "tp": tp}
    if tp > 1:
        options["tp_plan"] = "auto"
    ours = run_ranks("mesh_workers:accelkit_run", {"options": options}, **kwargs)
    from mesh_workers import max_diff

    for rank, result in enumerate(ours):
        # the dataloader's shard is the data-parallel rank: the tp ranks of a replica share it
        assert result["dp"] == [rank // tp, replicate * shard], (rank, result["dp"])
        assert max(abs(a - b) for a, b in zip(result["losses"], ref[rank]["losses"])) < TOLERANCE
        assert len(result["norms"]) == len(ref[rank]["norms"]) == 3
        assert max(abs(a - b) for a, b in zip(result["norms"], ref[rank]["norms"])) < TOLERANCE
        assert max_diff(result["params"], ref[rank]["params"]) < TOLERANCE
    assert min(ref[0]["norms"]) > 0.05, "the reference never clipped: the check would be blind"
    from mesh_workers import single_process

    one = single_process(replicate * shard)
    assert max(abs(a - b) for a, b in zip(ours[0]["losses"], one["losses"])) < TOLERANCE
    assert max_diff(ours[0]["params"], one["params"]) < SINGLE_PROCESS_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [{"dp_replicate": 1, "dp_shard": 1, "tp": 1}, {"tp": 1, "tp_plan": "auto"}],
    ids=["mesh-1x1x1", "tp-1-with-plan"],
)
def test_gpu_a_one_gpu_mesh_degenerates_to_plain_fsdp(options):
    """On one GPU, a mesh of ones (and tp=1 with a plan) trains like raw fully_shard on a 1-rank
    mesh: same losses, norms and weights within TOLERANCE (deterministic kernels); on the CPU this pair is
    bit-exact."""
    kwargs = {"nproc": 1, "timeout": 300, "path": [HERE], "env": DETERMINISTIC}
    ref = run_ranks(
        "mesh_workers:reference", {"replicate": 1, "shard": 1, "tp": 1, **CUDA}, **kwargs
    )
    ours = run_ranks("mesh_workers:accelkit_run", {"options": options, **CUDA}, **kwargs)
    from mesh_workers import max_diff

    gaps = {
        "losses": max(abs(a - b) for a, b in zip(ours[0]["losses"], ref[0]["losses"])),
        "norms": max(abs(a - b) for a, b in zip(ours[0]["norms"], ref[0]["norms"])),
        "params": max_diff(ours[0]["params"], ref[0]["params"]),
    }
    print(f"one-GPU mesh {options}: {gaps}")
    assert ours[0]["dp"] == [0, 1]
    assert all(gap < TOLERANCE for gap in gaps.values()), gaps
    assert min(ref[0]["norms"]) > 0.05, "the reference never clipped: the check would be blind"


CUDA = {"device": "cuda"}
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


# ---- resume on any layout ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_2d_checkpoint_resumes_bit_for_bit_on_every_layout_and_a_damaged_one_fails(tmp_path):
    from mesh_workers import load_job, max_diff

    kwargs = {"timeout": 300, "path": [HERE]}
    path = str(tmp_path / "ck")
    saved = run_ranks(
        "mesh_workers:save_job",
        {"options": {"dp_shard": 2, "tp": 2, "tp_plan": "auto"}, "path": path},
        nproc=4,
        **kwargs,
    )[0]["params"]
    layouts = [
        ({"dp_replicate": 2, "dp_shard": 2}, 4),
        ({"dp_replicate": 2, "tp": 2, "tp_plan": "auto"}, 4),
        ({"backend": "ddp"}, 2),
    ]
    for options, nproc in layouts:
        got = run_ranks(
            "mesh_workers:load_job", {"options": options, "path": path}, nproc=nproc, **kwargs
        )
        assert max_diff(saved, got[0]["params"]) == 0.0, options
    assert max_diff(saved, load_job({"backend": "cpu"}, path)["params"]) == 0.0
    # the negative twins: a flipped byte, a missing rank file
    flipped = tmp_path / "flipped"
    shutil.copytree(path, flipped)
    rank_file = flipped / "rank-00003.safetensors"
    raw = bytearray(rank_file.read_bytes())
    raw[-5] ^= 0x10
    rank_file.write_bytes(bytes(raw))
    with pytest.raises(accelkit.CheckpointError, match=r"rank-00003\.safetensors"):
        load_job({"backend": "cpu"}, str(flipped))
    missing = tmp_path / "missing"
    shutil.copytree(path, missing)
    (missing / "rank-00002.safetensors").unlink()
    with pytest.raises(accelkit.CheckpointError, match=r"rank-00002\.safetensors: file missing"):
        load_job({"backend": "cpu"}, str(missing))
