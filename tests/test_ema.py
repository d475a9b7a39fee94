"""EMA of the weights: equal to raw PyTorch's EMA (``AveragedModel`` with
``get_ema_multi_avg_fn``), bit for bit in fp32, on one process and on fsdp x2 (each rank averages
its own shard); kept in the portable checkpoint, resumed exactly, loadable at another world size.

References import nothing from accelkit: on one process torch's own ``AveragedModel`` trains
beside a raw loop; on fsdp the reference is a plain-tensor EMA of the gathered weights
(``DTensor.full_tensor``), updated with the documented rule after every step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import accelkit
from accelkit.ema import EMA
from accelkit.errors import CheckpointError, ConfigError, UnsupportedError
from accelkit.testing import run_ranks

SEED = 5
DECAY = 0.9  # small enough that every step moves the average visibly


def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 1, generator=g)) for _ in range(n)]


# ---- raw PyTorch reference ---------------------------------------------------------------------
def reference_ema(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=False)
    averaged.update_parameters(model)  # the first update copies: the average starts here
    for x, y in batches(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        averaged.update_parameters(model)
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in averaged.module.state_dict().items()}, live


# ---- accelkit side ----------------------------------------------------------------------------
def accel_setup(accel):
    model = make_model()
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    return model, opt, EMA(model, DECAY, accelerator=accel)


def train(accel, model, opt, ema, data) -> None:
    for x, y in data:
        accel.backward(torch.nn.functional.mse_loss(model(x), y))
        if accel.step():
            ema.update()


def ema_tensors(ema: EMA) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ema.state_dict().items() if k != "num_updates"}


def test_ema_equals_torch_averaged_model_bit_for_bit_on_one_process():
    expected, expected_live = reference_ema(6)
    accel = accelkit.get("cpu")
    model, opt, ema = accel_setup(accel)
    train(accel, model, opt, ema, batches(6))
    got = ema_tensors(ema)
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert int(ema.num_updates) == 6
    live = model.state_dict()
    assert all(torch.equal(live[k], expected_live[k]) for k in live)  # same trajectory
    # the average is not the model (the comparison above could fail)
    assert not torch.equal(got["0.weight"], live["0.weight"])
    assert torch.equal(got["1.running_mean"], live["1.running_mean"])  # buffers: copied


def test_swap_puts_the_average_in_and_the_live_weights_back_exactly():
    accel = accelkit.get("cpu")
    model, opt, ema = accel_setup(accel)
    train(accel, model, opt, ema, batches(3))
    live = {k: v.clone() for k, v in model.state_dict().items()}
    average = ema_tensors(ema)
    with ema.swap(model):
        assert all(torch.equal(model.state_dict()[k], average[k]) for k in average)
    assert all(torch.equal(model.state_dict()[k], live[k]) for k in live)
    other = make_model()  # another model of the same architecture: matched by name
    ema.copy_to(other)
    assert all(torch.equal(other.state_dict()[k], average[k]) for k in average)


def test_decay_schedule_options_and_errors():
    model = make_model()
    ema = EMA(model, lambda n: min(0.99, (1 + n) / (10 + n)), buffers=None, only_trainable=True)
    assert ema.decay == pytest.approx(0.1)
    ema.update()
    assert ema.decay == pytest.approx(2 / 11)
    assert "1.running_mean" not in ema.state_dict()
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in EMA(model, 0.5, only_trainable=True).state_dict()
    low = EMA(model.to(torch.bfloat16), 0.5, dtype=torch.float32)
    assert low.state_dict()["0.weight"].dtype == torch.float32
    for bad in (1.5, -0.1, True):
        with pytest.raises(ConfigError):
            EMA(model, bad)
    with pytest.raises(ConfigError):
        EMA(model, 0.5, buffers="mean")
    with pytest.raises(UnsupportedError, match="swap"):
        ema(torch.ones(1))


def test_ema_of_tied_weights_keeps_them_tied():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    ema = EMA(model, 0.5)
    assert ema.state_dict()["0.weight"] is not None
    assert ema.get_parameter("0.weight") is ema.get_parameter("1.weight")


# ---- checkpoint ---------------------------------------------------------------------------------
def test_ema_survives_save_and_resume_exactly(tmp_path):
    data = batches(6)
    accel = accelkit.get("cpu")
    model, opt, ema = accel_setup(accel)
    train(accel, model, opt, ema, data)
    whole = ema_tensors(ema)

    first = accelkit.get("cpu")
    model, opt, ema = accel_setup(first)
    train(first, model, opt, ema, data[:3])
    first.save(tmp_path / "step-3", {"model": model, "optimizer": opt, "ema": ema})
    manifest = json.loads((tmp_path / "step-3" / "accelkit.json").read_text())
    ema_entries = {t["fqn"] for t in manifest["tensors"] if t["object"] == "ema"}
    assert ema_entries == set(whole) | {"num_updates"}  # its own tensors, the model's names

    second = accelkit.get("cpu")
    model, opt, ema = accel_setup(second)  # a fresh average: different until loaded
    assert not torch.equal(ema_tensors(ema)["0.weight"], whole["0.weight"])
    second.load(tmp_path / "step-3", {"model": model, "optimizer": opt, "ema": ema})
    assert int(ema.num_updates) == 3
    train(second, model, opt, ema, data[3:])
    resumed = ema_tensors(ema)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def _flip_byte_of(shard, key_prefix: str) -> None:
    """Flip one byte inside the data of the first tensor whose key starts with ``key_prefix``
    (safetensors: 8-byte header length, JSON header, then the data)."""
    raw = bytearray(shard.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    key = next(k for k in header if k.startswith(key_prefix))
    start = 8 + size + header[key]["data_offsets"][0]
    raw[start] ^= 0x01
    shard.write_bytes(bytes(raw))


def test_a_flipped_byte_in_the_ema_fails_the_load(tmp_path):
    """Negative twin of the resume test."""
    accel = accelkit.get("cpu")
    model, opt, ema = accel_setup(accel)
    train(accel, model, opt, ema, batches(2))
    accel.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "ema": ema})
    _flip_byte_of(tmp_path / "ckpt" / "rank-00000.safetensors", "ema/param/0.weight")
    model, opt, ema = accel_setup(accelkit.get("cpu"))
    with pytest.raises(CheckpointError, match=r"(?s)ema.*0\.weight|0\.weight.*ema"):
        accel.load(tmp_path / "ckpt", {"model": model, "optimizer": opt, "ema": ema})


def test_a_checkpoint_without_the_ema_is_refused_under_strict(tmp_path):
    accel = accelkit.get("cpu")
    model, opt, ema = accel_setup(accel)
    accel.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    with pytest.raises(CheckpointError, match="ema"):
        accel.load(tmp_path / "ckpt", {"model": model, "optimizer": opt, "ema": ema})


# ---- fsdp x2, deepspeed_stage_2 x2 -------------------------------------------------------------------
#: DeepSpeed's default 5e8-element gradient bucket is 2 GB; a tiny model needs a tiny one
BACKENDS = {
    "fsdp": {"device": "cpu"},
    "deepspeed_stage_2": {"reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
}


def fsdp_worker(ckpt: str, steps: int, save_at: int, backend: str = "fsdp") -> dict:
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def build():
        accel = accelkit.get(backend, seed=SEED, timeout=60.0, **BACKENDS[backend])
        model = make_model()
        model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        return accel, model, opt, EMA(model, DECAY, accelerator=accel)

    rank = int(os.environ["RANK"])
    rank_data = [(x[rank::2], y[rank::2]) for x, y in batches(steps)]

    # uninterrupted, with the raw reference EMA of the gathered weights beside it
    accel, model, opt, ema = build()
    inner = accel.unwrap(model)  # DeepSpeed's engine names its module's parameters "module.*"
    sharded = [n for n, p in inner.named_parameters() if isinstance(p, DTensor)]
    reference = {n: full(p.detach()).clone() for n, p in inner.named_parameters()}
    for x, y in rank_data:
        accel.backward(torch.nn.functional.mse_loss(model(x), y))
        accel.step()
        ema.update()
        for n, p in inner.named_parameters():
            reference[n].lerp_(full(p.detach()), 1 - DECAY)
    whole = {k: full(v).tolist() for k, v in ema.state_dict().items() if k != "num_updates"}
    matches = {n: torch.equal(torch.tensor(whole[n]), reference[n]) for n in reference}
    local_shapes = {n: list(_local_shape(p)) for n, p in ema.named_parameters()}

    # interrupted at save_at, resumed into fresh objects
    accel, model, opt, ema = build()
    for x, y in rank_data[:save_at]:
        accel.backward(torch.nn.functional.mse_loss(model(x), y))
        accel.step()
        ema.update()
    accel.save(f"{ckpt}/mid", {"model": model, "optimizer": opt, "ema": ema})
    accel, model, opt, ema = build()
    accel.load(f"{ckpt}/mid", {"model": model, "optimizer": opt, "ema": ema})
    for x, y in rank_data[save_at:]:
        accel.backward(torch.nn.functional.mse_loss(model(x), y))
        accel.step()
        ema.update()
    resumed = {k: full(v).tolist() for k, v in ema.state_dict().items() if k != "num_updates"}
    accel.save(f"{ckpt}/end", {"model": model, "ema": ema})
    return {
        "sharded": sharded,
        "matches_reference": matches,
        "local_shapes": local_shapes,
        "whole": whole,
        # parameters; buffers are per rank under fsdp and a checkpoint keeps rank 0's
        "resumed_equal": {n: resumed[n] == whole[n] for n in reference},
        "buffers_resumed_equal": all(resumed[n] == whole[n] for n in whole if n not in reference),
        "num_updates": int(ema.num_updates),
    }


def _local_shape(p: torch.Tensor) -> torch.Size:
    return p.to_local().shape if hasattr(p, "to_local") else p.shape


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ema_fsdp")
    return run_ranks("test_ema:fsdp_worker", {"ckpt": str(ckpt), "steps": 5, "save_at": 2}), ckpt


@pytest.fixture(scope="module")
def deepspeed_ranks(tmp_path_factory):
    if not (
        importlib.util.find_spec("deepspeed") and importlib.util.find_spec("accelkit_deepspeed")
    ):
        pytest.skip("deepspeed or accelkit-deepspeed is not installed")
    ckpt = tmp_path_factory.mktemp("ema_deepspeed")
    kwargs = {"ckpt": str(ckpt), "steps": 5, "save_at": 2, "backend": "deepspeed_stage_2"}
    return run_ranks("test_ema:fsdp_worker", kwargs, timeout=600), ckpt


@pytest.mark.slow
def test_deepspeed_zero2_ema_matches_the_raw_reference_and_resumes_exactly(deepspeed_ranks):
    """ZeRO-2 partitions the optimizer state and gradients, not the weights: each rank averages
    the whole weights it holds, equal to a raw EMA of them, and a resume continues it exactly."""
    ranks, ckpt = deepspeed_ranks
    for rank in ranks:
        assert not rank["sharded"]
        assert all(rank["matches_reference"].values()), rank["matches_reference"]
        assert all(rank["resumed_equal"].values()), rank["resumed_equal"]
        assert rank["num_updates"] == 5
    assert ranks[0]["local_shapes"]["0.weight"] == [8, 5]
    params = list(ranks[0]["matches_reference"])
    assert all(ranks[0]["whole"][n] == ranks[1]["whole"][n] for n in params)
    # the world-2 DeepSpeed checkpoint loads into a one-process EMA on another backend
    accel = accelkit.get("cpu")
    ema = EMA(make_model(), DECAY, accelerator=accel)
    accel.load(ckpt / "end", {"ema": ema}, strict=False)
    got = ema_tensors(ema)
    for name in params:
        assert torch.equal(got[name], torch.tensor(ranks[0]["whole"][name])), name


@pytest.mark.slow
def test_fsdp_ema_matches_the_raw_reference_on_each_shard(fsdp_ranks):
    ranks, _ = fsdp_ranks
    for rank in ranks:
        assert rank["sharded"], "fsdp did not shard the parameters: nothing was tested"
        assert all(rank["matches_reference"].values()), rank["matches_reference"]
    # each rank holds half of the first layer's weight rows (8 rows over 2 ranks)
    assert ranks[0]["local_shapes"]["0.weight"] == [4, 5]
    params = [n for n in ranks[0]["matches_reference"]]
    assert all(ranks[0]["whole"][n] == ranks[1]["whole"][n] for n in params)
    # each rank saw its own data: buffers (BatchNorm statistics, copied) differ per rank
    assert ranks[0]["whole"]["1.running_mean"] != ranks[1]["whole"]["1.running_mean"]


@pytest.mark.slow
def test_fsdp_ema_survives_save_and_resume_exactly(fsdp_ranks):
    ranks, _ = fsdp_ranks
    for rank in ranks:
        assert all(rank["resumed_equal"].values()), rank["resumed_equal"]
    assert ranks[0]["buffers_resumed_equal"]
    assert [r["num_updates"] for r in ranks] == [5, 5]


@pytest.mark.slow
def test_fsdp_ema_checkpoint_loads_at_world_size_one(fsdp_ranks):
    ranks, ckpt = fsdp_ranks
    accel = accelkit.get("cpu")
    ema = EMA(make_model(), DECAY, accelerator=accel)
    accel.load(ckpt / "end", {"ema": ema}, strict=False)  # the model object is not needed
    got = ema_tensors(ema)
    for name, values in ranks[0]["whole"].items():
        assert torch.equal(got[name], torch.tensor(values)), name
    assert int(ema.num_updates) == 5


@pytest.mark.gpu
def test_ema_on_cuda_fsdp_one_rank_matches_a_raw_reference_of_the_gathered_weights():
    """On the GPU machine: fsdp (world 1, DTensor shards on CUDA) under bf16-mixed; the average
    is kept in fp32 (the sharded weights are fp32 there), compared bit for bit."""
    from torch.distributed.tensor import DTensor

    accel = accelkit.get("fsdp", device="cuda", precision="bf16-mixed")
    model = make_model()
    model, _ = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    ema = EMA(model, DECAY, accelerator=accel)
    reference = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    for x, y in batches(4):
        accel.backward(torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()))
        accel.step()
        ema.update()
        for n, p in model.named_parameters():
            reference[n].lerp_(p.detach().full_tensor(), 1 - DECAY)
    for name, value in ema.named_parameters():
        assert isinstance(value, DTensor) and value.device.type == "cuda"
        assert torch.equal(value.full_tensor(), reference[name]), name
