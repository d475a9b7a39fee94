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
