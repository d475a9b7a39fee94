"""``accel.load_pretrained``: a Transformers GPT-2 saved with ``save_pretrained`` in several
shards loads into a set-up model on ``cpu``, ``ddp`` and ``fsdp`` (1 and 2 processes) with the
Transformers model's logits bit for bit; renames, bf16 files and an accelkit checkpoint load too;
a truncated shard, an index naming a missing file, a shape mismatch and a dtype the model cannot
take each fail clearly and leave the model untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.testing import run_ranks

pytest.importorskip("transformers")

from pretrained_workers import load_job, make_config, pretrained

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[str, list]:
    directory = tmp_path_factory.mktemp("gpt2")
    logits = pretrained(str(directory))
    assert len(list(directory.glob("model-*.safetensors"))) > 2  # really sharded
    return str(directory), logits


def test_sharded_safetensors_load_bit_for_bit_on_cpu(source):
    directory, want = source
    assert load_job(directory)["logits"] == want


@pytest.mark.parametrize(
    "backend",
    [pytest.param("ddp", marks=pytest.mark.slow), pytest.param("fsdp", marks=pytest.mark.slow)],
)
def test_two_ranks_load_the_same_weights(source, backend):
    directory, want = source
    options = {"device": "cpu"} if backend == "fsdp" else {}
    ranks = run_ranks(
        "pretrained_workers:load_job",
        {"directory": directory, "backend": backend, "options": options},
        nproc=2,
        timeout=300,
        path=[HERE],
    )
    for result in ranks:
        assert result["logits"] == want


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["colossalai_zero", "fairscale_oss", "fairscale_fsdp_shim"])
def test_zero_style_backends_load_with_their_optimizer_set_up(source, backend):
    """ColossalAI's LowLevelZero and FairScale's OSS and FSDP (its TEST-ONLY CPU shim: FairScale
    FSDP drives CUDA streams) on 2 ranks: the model, set up with its optimizer, gives the
    Transformers model's logits bit for bit after the load."""
    pytest.importorskip(backend.split("_")[0])
    directory, want = source
    shim = (
        str(HERE.parent / "plugins" / "fairscale" / "tests") if backend.endswith("_shim") else None
    )
    ranks = run_ranks(
        "pretrained_workers:load_with_optimizer_job",
        {"directory": directory, "backend": backend.removesuffix("_shim"), "shim_path": shim},
        nproc=2,
        timeout=300,
        path=[HERE],
    )
    for result in ranks:
        assert result["logits"] == want


def test_bf16_files_fill_fp32_weights(tmp_path):
    from transformers import GPT2LMHeadModel

    pretrained(str(tmp_path), dtype=torch.bfloat16)
    accel = accelkit.get("cpu")
    model = accel.setup(GPT2LMHeadModel(make_config()).eval())
    accel.load_pretrained(model, tmp_path)
    torch.manual_seed(0)
    expected = GPT2LMHeadModel(make_config()).to(torch.bfloat16).float()
    for (name, got), (_, want) in zip(model.state_dict().items(), expected.state_dict().items()):
        assert got.dtype == torch.float32 and torch.equal(got, want), name


def test_renames_and_prefixes(source):
    """GPT2Model (no LM head) takes the LM checkpoint's 'transformer.' tensors."""
    from transformers import GPT2Model

    directory, _ = source
    accel = accelkit.get("cpu")
    base = accel.setup(GPT2Model(make_config()))
    with pytest.raises(
        accelkit.CheckpointError, match=r"missing from the checkpoint: .*wte\.weight"
    ):
        accel.load_pretrained(base, directory)
    accel.load_pretrained(base, directory, strip_prefix="transformer.")
    torch.manual_seed(0)
    from transformers import GPT2LMHeadModel

    want = GPT2LMHeadModel(make_config()).transformer.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in base.state_dict().items())
    calls = []
    accel.load_pretrained(
        base, directory, rename=lambda k: calls.append(k) or k.removeprefix("transformer.")
    )
    assert calls  # the callable saw the file's names


def test_an_accelkit_checkpoint_is_a_source_too(source, tmp_path):
    directory, want = source
    from transformers import GPT2LMHeadModel

    accel = accelkit.get("cpu")
    model = accel.setup(GPT2LMHeadModel(make_config()).eval())
    accel.load_pretrained(model, directory)
    accel.save(tmp_path / "ck", {"model": model, "optimizer_free": 1})
    assert load_job(str(tmp_path / "ck"))["logits"] == want


# ---- negative twins: each fails clearly, the model unchanged -------------------------------------
def _fresh():
    from transformers import GPT2LMHeadModel

    accel = accelkit.get("cpu")
    torch.manual_seed(5)
    model = accel.setup(GPT2LMHeadModel(make_config()).eval())
    return accel, model, {k: v.clone() for k, v in model.state_dict().items()}


def _copy(source, tmp_path) -> Path:
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(source[0], target)
    return target


def _shard(directory: Path) -> Path:
    return sorted(directory.glob("model-*.safetensors"))[-1]


def test_a_truncated_shard_fails_naming_it(source, tmp_path):
    directory = _copy(source, tmp_path)
    shard = _shard(directory)
    shard.write_bytes(shard.read_bytes()[:-9])
    accel, model, before = _fresh()
    with pytest.raises(accelkit.CheckpointError, match=shard.name):
        accel.load_pretrained(model, directory)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_index_naming_a_missing_file_fails(source, tmp_path):
    directory = _copy(source, tmp_path)
    shard = _shard(directory)
    shard.unlink()
    accel, model, before = _fresh()
    with pytest.raises(accelkit.CheckpointError, match=f"names {shard.name}, which"):
        accel.load_pretrained(model, directory)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_shape_mismatch_fails_before_anything_is_written(source):
    from transformers import GPT2Config, GPT2LMHeadModel

    accel = accelkit.get("cpu")
    wider = dict(make_config().to_dict(), n_embd=128)
    model = accel.setup(GPT2LMHeadModel(GPT2Config(**wider)).eval())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        accelkit.CheckpointError, match=r"has shape \[128, 64\], the target has \[128, 128\]"
    ):
        accel.load_pretrained(model, source[0])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_dtype_the_model_cannot_take_fails(source, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _copy(source, tmp_path)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name, file = next(iter(index["weight_map"].items()))
    tensors = load_file(directory / file)
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, directory / file, metadata={"format": "pt"})
    accel, model, before = _fresh()
    with pytest.raises(accelkit.CheckpointError, match="holds int32, the target is float32"):
        accel.load_pretrained(model, directory)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_deepspeed_ranks_read_their_partitions(source, backend):
    pytest.importorskip("deepspeed")
    directory, want = source
    ranks = run_ranks(
        "pretrained_workers:load_job",
        {"directory": directory, "backend": backend},
        nproc=2,
        timeout=300,
        path=[HERE],
        env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
    )
    for result in ranks:
        assert result["logits"] == want
