"""``accelkit convert CKPT OUT --to hf``: a checkpoint of any backend becomes Hugging Face's
sharded safetensors layout that ``safetensors.torch.load_file`` and ``from_pretrained`` read,
giving the logits of Transformers' own ``save_pretrained``/``from_pretrained`` of the same
weights bit for bit (the reference path imports nothing from accelkit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelkit.testing import run_ranks

pytest.importorskip("transformers")

from pretrained_workers import make_config, tokens, train_and_save

HERE = Path(__file__).parent


def _export(ck: Path, out: Path, *extra: str) -> None:
    config = out.parent / "config"
    make_config().save_pretrained(config)
    cmd = [sys.executable, "-m", "accelkit.cli", "convert", str(ck), str(out), "--to", "hf"]
    result = subprocess.run([*cmd, "--config", str(config), *extra], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def _reference_logits(weights: dict, tmp: Path) -> torch.Tensor:
    """Transformers alone: the trained weights through save_pretrained / from_pretrained."""
    from transformers import GPT2LMHeadModel

    plain = GPT2LMHeadModel(make_config())
    plain.load_state_dict({k: torch.tensor(v) for k, v in weights.items()}, strict=False)
    plain.save_pretrained(tmp / "reference")
    loaded = GPT2LMHeadModel.from_pretrained(tmp / "reference").eval()
    with torch.no_grad():
        return loaded(tokens()).logits


def _exported_logits(out: Path) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        return model(tokens()).logits


def test_a_cpu_checkpoint_exports_in_shards_that_from_pretrained_loads(tmp_path):
    from safetensors.torch import load_file

    weights = train_and_save(str(tmp_path / "ck"))
    out = tmp_path / "hf"
    _export(tmp_path / "ck", out, "--max-shard-size", "100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    for shard in shards:  # plain safetensors, readable without accelkit
        for key, value in load_file(out / shard).items():
            assert torch.equal(value, torch.tensor(weights[key])), key
    assert torch.equal(_exported_logits(out), _reference_logits(weights, tmp_path))


def test_the_export_refuses_a_non_empty_directory(tmp_path):
    train_and_save(str(tmp_path / "ck"), steps=1)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    cmd = [sys.executable, "-m", "accelkit.cli", "convert", str(tmp_path / "ck")]
    result = subprocess.run(
        [*cmd, str(tmp_path / "hf"), "--to", "hf"], capture_output=True, text=True
    )
    assert result.returncode == 1 and "not empty" in result.stderr
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_zero2_on_two_ranks_exports_what_it_trained(tmp_path):
    pytest.importorskip("deepspeed")
    ranks = run_ranks(
        "pretrained_workers:train_and_save",
        {"path": str(tmp_path / "ck"), "backend": "deepspeed_stage_2"},
        nproc=2,
        timeout=300,
        path=[HERE],
        env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
    )
    out = tmp_path / "hf"
    _export(tmp_path / "ck", out, "--max-shard-size", "200KB")
    assert torch.equal(_exported_logits(out), _reference_logits(ranks[0], tmp_path))


def _convert(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelkit.cli", "convert", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_a_transformers_model_exports_with_the_config_its_save_stored(tmp_path):
    """No --config: the save of a Transformers model stored its config, and the export writes
    it, so from_pretrained opens the folder as is."""
    weights = train_and_save(str(tmp_path / "ck"))
    result = _convert(tmp_path / "ck", tmp_path / "hf", "--to", "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: written[k] for k in ("model_type", "n_layer", "n_embd", "vocab_size")} == {
        "model_type": "gpt2",
        **{k: make_config().to_dict()[k] for k in ("n_layer", "n_embd", "vocab_size")},
    }
    assert torch.equal(_exported_logits(tmp_path / "hf"), _reference_logits(weights, tmp_path))


class Head(torch.nn.Module):
    """No Transformers config of its own: the export finds none in the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)


def test_a_model_loaded_with_load_pretrained_exports_the_config_beside_its_source(tmp_path):
    from safetensors.torch import save_file

    import accelkit

    source = tmp_path / "source"
    source.mkdir()
    save_file(
        {"proj.weight": torch.ones(3, 4), "proj.bias": torch.zeros(3)}, source / "model.safetensors"
    )
    (source / "config.json").write_text('{"model_type": "head", "width": 4}')
    accel = accelkit.get("cpu")
    model = accel.setup(Head())
    accel.load_pretrained(model, source)
    accel.save(tmp_path / "ck", {"model": model})
    result = _convert(tmp_path / "ck", tmp_path / "hf", "--to", "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {
        "model_type": "head",
        "width": 4,
    }


def test_an_export_without_a_config_anywhere_is_refused_until_asked_for(tmp_path):
    """The negative twin: no config stored, none beside a source: refused, nothing written;
    --no-config writes the weights alone; --config DIR supplies one."""
    import accelkit

    accel = accelkit.get("cpu")
    accel.save(tmp_path / "ck", {"model": accel.setup(Head())})
    result = _convert(tmp_path / "ck", tmp_path / "hf", "--to", "hf")
    assert result.returncode == 1
    assert "no model config" in result.stderr and "--config DIR" in result.stderr
    assert "--no-config" in result.stderr
    assert not (tmp_path / "hf").exists()

    assert _convert(tmp_path / "ck", tmp_path / "bare", "--to", "hf", "--no-config").returncode == 0
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == ["model.safetensors"]

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text('{"given": true}')
    result = _convert(
        tmp_path / "ck", tmp_path / "given", "--to", "hf", "--config", tmp_path / "cfg"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "given" / "config.json").read_text()) == {"given": True}
