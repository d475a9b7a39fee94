"""``accel.log``: rank 0 writes (CSV, TensorBoard, a plugin's tracker), other ranks do nothing;
throughput and FLOPs helpers against hand-computed figures."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.errors import ConfigError
from accelkit.testing import run_ranks
from accelkit.tracking import (
    Throughput,
    measure_flops,
    peak_flops,
    transformer_flops_per_token,
)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---- two processes --------------------------------------------------------------------------------
def logging_worker(directory: str) -> dict:
    accel = accelkit.get("ddp", timeout=60.0)
    accel.init_trackers(directory, ["csv"], config={"lr": 0.1, "rank_of_writer": accel.rank})
    for step in range(1, 4):
        # each rank logs its own number: the file must hold rank 0's
        accel.log({"value": 100.0 * accel.rank + step, "tensor": torch.tensor(step * 0.5)}, step)
    accel.end_training()
    return {
        "rank": accel.rank,
        "files": sorted(os.listdir(directory)) if Path(directory).exists() else None,
    }


@pytest.mark.slow
def test_csv_logging_writes_only_on_rank_zero(tmp_path):
    ranks = run_ranks("test_tracking:logging_worker", {"directory": str(tmp_path / "run")})
    rows = read_csv(tmp_path / "run" / "metrics.csv")
    assert rows == [
        {"step": str(s), "value": repr(float(s)), "tensor": repr(s * 0.5)} for s in (1, 2, 3)
    ]
    hparams = json.loads((tmp_path / "run" / "hparams.json").read_text())
    assert hparams == {"lr": 0.1, "rank_of_writer": 0}
    assert ranks[0]["files"] == ["hparams.json", "metrics.csv"]


def silent_worker(directory: str) -> dict:
    """Rank 1 gets its own directory: it must stay uncreated."""
    accel = accelkit.get("ddp", timeout=60.0)
    mine = Path(directory) / f"rank{accel.rank}"
    accel.init_trackers(mine, ["csv"])
    accel.log({"x": 1.0}, 1)
    accel.end_training()
    return {"exists": mine.exists()}


@pytest.mark.slow
def test_other_ranks_create_nothing(tmp_path):
    ranks = run_ranks("test_tracking:silent_worker", {"directory": str(tmp_path)})
    assert [r["exists"] for r in ranks] == [True, False]


# ---- one process ----------------------------------------------------------------------------------
def test_csv_widens_for_new_metrics_and_a_resumed_run_appends(tmp_path):
    accel = accelkit.get("cpu")
    accel.init_trackers(tmp_path, ["csv"])
    accel.log({"loss": 1.5}, step=1)
    accel.log({"loss": 1.25, "lr": 0.01}, step=2)  # a new column appears
    accel.log({"lr": 0.02}, step=3)
    accel.end_training()
    assert read_csv(tmp_path / "metrics.csv") == [
        {"step": "1", "loss": "1.5", "lr": ""},
        {"step": "2", "loss": "1.25", "lr": "0.01"},
        {"step": "3", "loss": "", "lr": "0.02"},
    ]
    resumed = accelkit.get("cpu")
    resumed.init_trackers(tmp_path, ["csv"])
    resumed.log({"loss": 0.5}, step=4)
    resumed.end_training()
    rows = read_csv(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"] and rows[-1]["loss"] == "0.5"


def test_step_defaults_to_applied_steps_and_values_are_checked(tmp_path):
    accel = accelkit.get("cpu")
    model = torch.nn.Linear(2, 1)
    model, _ = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accel.init_trackers(tmp_path, ["csv"])
    for _ in range(2):
        accel.backward(model(torch.ones(1, 2)).sum())
        accel.step()
    accel.log({"n": 7})
    assert read_csv(tmp_path / "metrics.csv")[-1] == {"step": "2", "n": "7"}
    with pytest.raises(ConfigError, match="'vec'"):
        accel.log({"vec": torch.ones(3)})
    with pytest.raises(ConfigError, match="'name'"):
        accel.log({"name": "text"})
    with pytest.raises(ConfigError, match="unknown tracker"):
        accel.init_trackers(tmp_path, ["csv", "wandbb"])
    accel.end_training()


def test_log_without_trackers_warns_once(caplog):
    accel = accelkit.get("cpu")
    with caplog.at_level("WARNING", logger="accelkit"):
        accel.log({"x": 1.0}, 1)
        accel.log({"x": 2.0}, 2)
    assert sum("init_trackers" in r.getMessage() for r in caplog.records) == 1


class ListTracker:
    def __init__(self, directory=None, config=None, **kwargs):
        self.rows, self.config, self.kwargs, self.finished = [], config, kwargs, False

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def finish(self):
        self.finished = True


def test_a_plugin_adds_a_tracker_through_the_hook(tmp_path):
    made = []

    class Plugin:
        @accelkit.hookimpl
        def accelkit_loggers(self):
            def factory(directory, config=None, **kwargs):
                made.append(ListTracker(directory, config, **kwargs))
                return made[-1]

            return {"memory": factory}

    accelkit.register_plugin(Plugin(), "memory-tracker")
    accel = accelkit.get("cpu")
    accel.init_trackers(
        tmp_path, ["memory"], config={"a": 1}, tracker_kwargs={"memory": {"project": "p"}}
    )
    accel.log({"loss": torch.tensor(0.25)}, 3)
    accel.end_training()
    assert made[0].rows == [(3, {"loss": 0.25})]
    assert made[0].config == {"a": 1} and made[0].kwargs == {"project": "p"}
    assert made[0].finished


def test_tracker_objects_are_accepted(tmp_path):
    tracker = ListTracker()
    accel = accelkit.get("cpu")
    accel.init_trackers(tmp_path, [tracker])
    accel.log({"a": 1}, 1)
    assert tracker.rows == [(1, {"a": 1})]
    with pytest.raises(ConfigError, match="log"):
        accel.init_trackers(tmp_path, [object()])


def test_tensorboard_scalars_read_back_with_tensorboards_own_reader(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accel = accelkit.get("cpu")
    accel.init_trackers(tmp_path, ["csv", "tensorboard"], config={"lr": 0.1})
    values = [0.75, 0.5, 0.125]
    for step, value in enumerate(values, 1):
        accel.log({"loss": value}, step)
    accel.end_training()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [(e.step, e.value) for e in scalars] == list(enumerate(values, 1))
    assert len(read_csv(tmp_path / "metrics.csv")) == 3


# ---- throughput -------------------------------------------------------------------------------------
def test_throughput_rates_over_the_window():
    now = [0.0]
    meter = Throughput(window=3, world_size=2, peak_flops=1000.0, clock=lambda: now[0])
    assert meter.compute() == {}
    for t, tokens in ((0.0, 999), (1.0, 100), (3.0, 300), (4.0, 50)):
        now[0] = t
        meter.update(samples=tokens // 10, tokens=tokens, flops=tokens * 2.0)
    # window = the last 3 updates (t = 1, 3, 4): the work after the first of them, over 3 s
    out = meter.compute()
    assert out["tokens_per_s_per_device"] == pytest.approx(350 / 3)
    assert out["tokens_per_s"] == pytest.approx(2 * 350 / 3)
    assert out["samples_per_s"] == pytest.approx(2 * 35 / 3)
    assert out["flops_per_s"] == pytest.approx(700 / 3)
    assert out["mfu"] == pytest.approx(700 / 3 / 1000)
    with pytest.raises(ConfigError):
        Throughput(window=1)


def test_flops_helpers():
    # 6 N per token plus 12 L s d
    assert transformer_flops_per_token(1000, layers=2, seq_len=8, hidden=4) == 6000 + 768
    model = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16)
    assert measure_flops(lambda: model(x)) == 2 * 4 * 16 * 8  # one matmul, multiply-add = 2
    # forward + backward: the weight gradient costs a second matmul (x needs no gradient)
    assert measure_flops(lambda: model(x).sum().backward()) == 2 * (2 * 4 * 16 * 8)
    assert peak_flops("cpu") is None


@pytest.mark.gpu
def test_peak_flops_knows_the_gpu_of_the_lab():
    name = torch.cuda.get_device_name()
    value = peak_flops("cuda", torch.bfloat16)
    if any(known in name for known in ("H100", "H200", "A100")):
        assert value is not None and value > 1e14, (name, value)
    else:
        pytest.skip(f"{name} is not in the table")
