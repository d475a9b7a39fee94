"""``accelkit convert`` of a checkpoint raw DeepSpeed's ``PipelineEngine`` wrote (issue 48).

Raw DeepSpeed (dsk_pipe_raw.py, no accelkit) trains a 7-layer ``PipelineModule`` on 2 stages
of 2 gloo processes at ZeRO-0 and ZeRO-1 and saves; each stage also writes what it gathered
through DeepSpeed's own views. The converted checkpoint is loaded by the ``cpu`` backend into
the unsplit model, an ``nn.Sequential`` of the same layers written out again here, and that
plain module's tensors and its torch AdamW's state must equal DeepSpeed's bit for bit. Before
this importer, the conversion wrote 0 tensors and reported success.

Negative twins: a layer file removed (a layer with parameters) fails the conversion naming the
file, and nothing is written; the function layer's missing index (no file by design) does not.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deepspeed_training import CPU_ENV
from torch import nn

import accelkit
from accelkit.testing import run_ranks

pytestmark = pytest.mark.slow


class Scaled(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class Halve(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


def unsplit() -> nn.Sequential:
    """The pipeline's layers as one module: layer ``i`` is child ``i``, as in PipelineModule."""
    return nn.Sequential(
        nn.Linear(6, 12),
        Scaled(12),
        nn.Tanh(),
        Halve(),
        nn.Linear(12, 10),
        Scaled(10),
        nn.Linear(10, 3),
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    base = tmp_path_factory.mktemp("ds-pipe")
    out = {}
    for stage in (0, 1):
        save_to = str(base / f"pipe-z{stage}")
        ranks = run_ranks(
            "dsk_pipe_raw:train_and_save",
            {"stage": stage, "save_to": save_to},
            nproc=2,
            env=CPU_ENV,
            timeout=900,
        )
        gathered: dict[str, torch.Tensor] = {}
        for rank in range(2):
            gathered.update(torch.load(f"{save_to}.rank{rank}.pt"))
        out[stage] = {"path": Path(save_to), "ranks": ranks, "gathered": gathered}
    return out


def _convert(src: Path, dst: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from accelkit.cli import main

    code = main(["convert", str(src), str(dst), "--trust-pickle"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("stage", [0, 1])
def test_a_raw_deepspeed_pipeline_checkpoint_converts_bit_equal(written, stage, tmp_path, capsys):
    source = written[stage]
    assert source["ranks"][0]["layers"] == [0, 4] and source["ranks"][1]["layers"] == [4, 7]
    code, err = _convert(source["path"], tmp_path / "portable", capsys)
    assert code == 0, err
    accel = accelkit.get("cpu")
    model = unsplit()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    model, opt = accel.setup(model, opt)
    accel.load(tmp_path / "portable", {"model": model, "optimizer": opt})
    expected = source["gathered"]
    loaded = {f"model/{k}": v for k, v in accel.unwrap(model).state_dict().items()}
    inner = opt.optimizer
    for name, param in accel.unwrap(model).named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            loaded[f"optimizer/{key}/{name}"] = inner.state[param][key]
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    # the function layer (index 3) has no parameters, and no file: nothing is missing
    assert not any(k.startswith("model/3.") for k in loaded)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_missing_layer_file_fails_the_conversion(written, stage, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(written[stage]["path"], broken)
    (broken / "final" / "layer_04-model_states.pt").unlink()
    code, err = _convert(broken, tmp_path / "portable", capsys)
    assert code != 0
    assert "layer" in err and "missing" in err, err
    if stage == 1:  # ZeRO-1 names what the stage trained; ZeRO-0 counts the stages' parameters
        assert "layer_04-model_states.pt is missing" in err, err
    assert not (tmp_path / "portable").exists()
