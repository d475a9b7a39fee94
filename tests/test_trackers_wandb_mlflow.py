"""The ``wandb`` and ``mlflow`` trackers against the real libraries, offline: W&B with
``WANDB_MODE=offline`` (the run's ``.wandb`` record file read back), MLflow with a local file
store (read back with ``MlflowClient``). Only rank 0 logs; a job resumed with ``auto_resume``
continues the run whose id the checkpoint holds; a missing library names the extra to install."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accelkit
from accelkit.errors import PluginMissingError
from accelkit.testing import run_ranks
from accelkit.tracking import Histogram, Image, tracker_state

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None or importlib.util.find_spec("mlflow") is None,
    reason="needs wandb and mlflow-skinny (pip install 'accelkit[test]')",
)
HERE = Path(__file__).parent


def MlflowClient(uri: str) -> Any:  # the library's class, imported when first used
    from mlflow.tracking import MlflowClient as client_class

    return client_class(uri)


def offline_env(root: Path) -> dict[str, str]:
    """What keeps both libraries local and quiet."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root / "wandb-dir"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "MLFLOW_TRACKING_URI": (root / "mlruns").resolve().as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }


@pytest.fixture
def offline(tmp_path, monkeypatch) -> dict[str, str]:
    env = offline_env(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


# ---- reading a W&B offline run back ----------------------------------------------------------------
def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``run-<id>.wandb`` file: a 7-byte header, then 32 KiB blocks of
    chunks (CRC32 4 bytes, length 2, type 1: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # padding to the end of the block
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(wandb_dir: str | Path) -> list[dict[str, Any]]:
    """Each offline run directory: its run id, config and history rows (``_step`` -> values).

    ``run.finish()`` returns once wandb-core has handled the exit record, but the ``.wandb`` file
    is written in full only when wandb-core closes the run's stream, which ``finish`` requests
    without waiting (read right after, the file can still be its 7-byte header). ``wandb.teardown()``
    waits for the service process to exit, so every run file it wrote is complete."""
    import wandb

    wandb.teardown()
    runs = []
    for path in sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")):
        run: dict[str, Any] = {"dir": path.parent, "config": {}, "history": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update(
                    {item.key: json.loads(item.value_json) for item in record.run.config.update}
                )
            elif kind == "config":
                run["config"].update(
                    {item.key: json.loads(item.value_json) for item in record.config.update}
                )
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                run["history"][row["_step"]] = row
        runs.append(run)
    return runs


def mlflow_history(client: Any, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def all_mlflow_runs(client: Any) -> list[Any]:
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids)


# ---- what each backend receives ---------------------------------------------------------------------
def test_wandb_offline_run_holds_scalars_config_images_and_histograms(offline):
    accel = accelkit.get("cpu")
    accel.init_trackers("runs", ["wandb"], config={"lr": 0.1, "model": {"width": 8}})
    accel.log({"loss": torch.tensor(1.5), "lr": 0.1}, step=1)
    accel.log(
        {
            "loss": 1.25,
            "sample": Image(torch.ones(3, 4, 5) * 0.5, caption="grey"),
            "weights": Histogram(torch.arange(100.0), bins=10),
        },
        step=2,
    )
    accel.end_training()

    (run,) = wandb_runs(offline["WANDB_DIR"])
    assert run["config"]["lr"] == 0.1 and run["config"]["model"] == {"width": 8}
    assert run["history"][1]["loss"] == 1.5 and run["history"][1]["lr"] == 0.1
    row = run["history"][2]
    assert row["loss"] == 1.25
    assert row["sample/_type"] == "image-file" and row["sample/caption"] == "grey"
    assert (row["sample/width"], row["sample/height"]) == (5, 4)  # CHW read as 3 channels
    png = run["dir"] / "files" / row["sample/path"]
    from PIL import Image as PILImage

    pixels = PILImage.open(png).convert("RGB").getpixel((0, 0))
    assert pixels == (128, 128, 128)
    assert row["weights/_type"] == "histogram" and row["weights/values"] == [10] * 10
    assert row["weights/bins"][0] == 0.0 and row["weights/bins"][-1] == 99.0


def test_mlflow_file_store_holds_metrics_params_images_and_histograms(offline):
    accel = accelkit.get("cpu")
    accel.init_trackers(
        "runs",
        ["mlflow"],
        config={"lr": 0.1, "model": {"width": 8}},
        tracker_kwargs={"mlflow": {"experiment_name": "demo", "run_name": "first"}},
    )
    run_id = accel._trackers.run_ids()["mlflow"]
    accel.log({"loss": torch.tensor(1.5)}, step=1)
    accel.log(
        {"loss": 1.25, "sample": Image(torch.zeros(4, 5)), "w": Histogram(torch.arange(4.0), 2)},
        step=2,
    )
    accel.end_training()

    client = MlflowClient(offline["MLFLOW_TRACKING_URI"])
    run = client.get_run(run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "demo"
    assert run.data.params == {"lr": "0.1", "model.width": "8"}
    assert mlflow_history(client, run_id, "loss") == [(1, 1.5), (2, 1.25)]
    images = [f.path for f in client.list_artifacts(run_id, "images")]
    assert any(p.startswith("images/sample+step+2+") and p.endswith(".png") for p in images)
    hist = json.loads(
        Path(client.download_artifacts(run_id, "histograms/w/step-2.json")).read_text()
    )
    assert hist == {"step": 2, "counts": [2, 2], "edges": [0.0, 1.5, 3.0]}


def test_without_a_tracker_for_media_they_are_skipped_with_one_warning(offline, caplog, tmp_path):
    accel = accelkit.get("cpu")
    accel.init_trackers(tmp_path / "csv", ["csv"])
    with caplog.at_level("WARNING", logger="accelkit"):
        accel.log({"loss": 1.0, "img": Image(torch.zeros(2, 2))}, step=1)
        accel.log({"loss": 0.5, "img": Image(torch.zeros(2, 2))}, step=2)
    accel.end_training()
    assert sum("does not log images" in r.getMessage() for r in caplog.records) == 1
    assert (tmp_path / "csv" / "metrics.csv").read_text().splitlines() == [
        "step,loss",
        "1,1.0",
        "2,0.5",
    ]


# ---- resume: the checkpoint holds the run id ------------------------------------------------------
def train(accel: Accelerator_t, ckpt: Path, tracker: str, steps: range, stop_at: int) -> dict:
    """Train and log ``steps``; save at ``stop_at``. Resumes from ``ckpt`` when it holds one."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = {"model": model, "opt": opt, "trackers": tracker_state(accel)}
    accel.auto_resume(ckpt, state)
    accel.init_trackers("runs", [tracker], config={"lr": 0.1})
    for step in steps:
        accel.backward(model(torch.ones(2, 4)).square().mean())
        accel.step()
        accel.log({"loss": float(step)}, step=accel.applied_steps)
        if step == stop_at:
            accel.save(ckpt / f"step-{step}", state)
    run_id = accel._trackers.run_ids()[tracker]
    accel.end_training()
    return {"run_id": run_id, "applied": accel.applied_steps}


Accelerator_t = Any


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_auto_resume_continues_the_same_run(offline, tmp_path, tracker):
    ckpt = tmp_path / "ckpt"
    first = train(accelkit.get("cpu"), ckpt, tracker, range(1, 4), stop_at=3)
    second = train(accelkit.get("cpu"), ckpt, tracker, range(4, 6), stop_at=-1)
    assert second["applied"] == 5
    assert second["run_id"] == first["run_id"]
    if tracker == "mlflow":
        client = MlflowClient(offline["MLFLOW_TRACKING_URI"])
        assert [r.info.run_id for r in all_mlflow_runs(client)] == [first["run_id"]]
        expected = [(s, float(s)) for s in range(1, 6)]
        assert mlflow_history(client, first["run_id"], "loss") == expected
    else:  # offline, each part of the run is a directory; `wandb sync` uploads both into it
        runs = wandb_runs(offline["WANDB_DIR"])
        assert [r["id"] for r in runs] == [first["run_id"]] * 2
        assert [sorted(r["history"]) for r in runs] == [[1, 2, 3], [4, 5]]


def test_trackers_built_before_the_resume_move_to_the_saved_run(offline, tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    first = train(accelkit.get("cpu"), ckpt, "mlflow", range(1, 3), stop_at=2)
    accel = accelkit.get("cpu")
    accel.init_trackers("runs", ["mlflow"])  # before auto_resume: a fresh run starts
    net = torch.nn.Linear(4, 1)
    model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = {"model": model, "opt": opt, "trackers": tracker_state(accel)}
    with caplog.at_level("WARNING", logger="accelkit"):
        accel.auto_resume(ckpt, state)
    accel.log({"loss": 3.0}, step=3)
    accel.end_training()
    assert any("auto_resume before init_trackers" in r.getMessage() for r in caplog.records)
    client = MlflowClient(offline["MLFLOW_TRACKING_URI"])
    assert mlflow_history(client, first["run_id"], "loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]


# ---- two processes -------------------------------------------------------------------------------
def ranks_worker(directory: str) -> dict:
    accel = accelkit.get("ddp", timeout=60.0)
    accel.init_trackers(directory, ["wandb", "mlflow"], config={"writer": accel.rank})
    for step in (1, 2):  # each rank logs its own number: the runs must hold rank 0's
        accel.log({"value": 100.0 * accel.rank + step}, step)
    run_ids = accel._trackers.run_ids()
    accel.end_training()
    return {"run_ids": run_ids}


@pytest.mark.slow
def test_only_rank_zero_logs_on_two_processes(tmp_path, offline):
    env = offline
    ranks = run_ranks(
        "test_trackers_wandb_mlflow:ranks_worker",
        {"directory": str(tmp_path / "runs")},
        env=env,
        path=[HERE],
    )
    assert ranks[1]["run_ids"] == {}
    (run,) = wandb_runs(env["WANDB_DIR"])
    assert run["id"] == ranks[0]["run_ids"]["wandb"] and run["config"]["writer"] == 0
    assert {s: row["value"] for s, row in run["history"].items()} == {1: 1.0, 2: 2.0}
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (mlrun,) = all_mlflow_runs(client)
    assert mlrun.info.run_id == ranks[0]["run_ids"]["mlflow"]
    assert mlrun.data.params == {"writer": "0"}
    assert mlflow_history(client, mlrun.info.run_id, "value") == [(1, 1.0), (2, 2.0)]


# ---- without the library --------------------------------------------------------------------------
@pytest.mark.parametrize(("tracker", "module"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_library_names_the_extra(tmp_path, monkeypatch, tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    accel = accelkit.get("cpu")
    with pytest.raises(PluginMissingError, match=rf"pip install 'accelkit\[{tracker}\]'"):
        accel.init_trackers(tmp_path, [tracker])
