"""MMEngine checkpoints through the adapter, against plain MMEngine (issue 23, items 2, 5, 9, 10).

The project is shaped like MMEngine's 15-minute tutorial: a conv net with BatchNorm, an
``Accuracy`` metric that returns a tensor, ``CheckpointHook(save_best=...)``, SGD with momentum
and a per-epoch scheduler. The reference is MMEngine's own Runner in a process that imports
nothing from accelkit (``REFERENCE_DRIVER``); the accelkit side runs the same project with
``AccelkitRunner``. fp32 on the CPU is deterministic, so values compare with ``==``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mmengine")

# ---- the user's project, shared by both sides --------------------------------------------------
TUTORIAL_PROJECT = textwrap.dedent(
    '''
    import json, os
    import torch
    from torch import nn
    from mmengine.evaluator import BaseMetric
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, HOOKS, METRICS, MODELS


    @MODELS.register_module(force=True)
    class TutorialNet(BaseModel):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.head = nn.Linear(8, 4)

        def forward(self, imgs, labels, mode="tensor"):
            x = self.head(self.features(imgs))
            if mode == "loss":
                return {"loss": nn.functional.cross_entropy(x, labels)}
            if mode == "predict":
                return x, labels
            return x


    @METRICS.register_module(force=True)
    class Accuracy(BaseMetric):
        """The tutorial's metric: its value is a tensor."""

        def process(self, data_batch, data_samples):
            score, gt = data_samples
            self.results.append(
                {"batch_size": len(gt), "correct": (score.argmax(dim=1) == gt).sum().cpu()})

        def compute_metrics(self, results):
            total_correct = sum(item["correct"] for item in results)
            total_size = sum(item["batch_size"] for item in results)
            return dict(accuracy=100 * total_correct / total_size)


    @DATASETS.register_module(force=True)
    class Patterns(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            patterns = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
            self.labels = torch.randint(0, 4, (n,), generator=g)
            self.imgs = patterns[self.labels] + torch.randn(n, 3, 8, 8, generator=g)

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return dict(imgs=self.imgs[i], labels=self.labels[i])


    @HOOKS.register_module(force=True)
    class RecordHook(Hook):
        """Records losses, lr and final weights; dumps the message hub as training starts
        (after a resume); can stop after an epoch."""

        priority = "LOWEST"

        def __init__(self, out, stop_after_epoch=None):
            self.out, self.stop_after_epoch = out, stop_after_epoch
            self.rec = dict(loss=[], lr=[], iters=[], val=[])

        def before_train(self, runner):
            torch.save(runner.message_hub.state_dict(), self.out + ".hub.pth")

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            self.rec["loss"].append(float(outputs["loss"].detach()))
            self.rec["iters"].append(runner.iter)
            self.rec["lr"].append(runner.optim_wrapper.param_groups[0]["lr"])

        def after_val_epoch(self, runner, metrics=None):
            self.rec["val"].append({k: float(v) for k, v in (metrics or {}).items()})

        def after_train_epoch(self, runner):
            if self.stop_after_epoch and runner.epoch + 1 >= self.stop_after_epoch:
                runner.train_loop.stop_training = True

        def after_run(self, runner):
            model = getattr(runner.model, "module", runner.model)
            state = {k.removeprefix("module."): v for k, v in runner.model.state_dict().items()}
            self.rec["params"] = [x for k in sorted(state) for x in state[k].flatten().tolist()]
            with open(self.out + ".json", "w") as f:
                json.dump(self.rec, f)


    def tutorial_cfg(work_dir, record, *, epochs=3, stop_after_epoch=None, resume=False,
                     load_from=None, log_level="WARNING", name="tutorial"):
        loader = dict(batch_size=8, num_workers=0, collate_fn=dict(type="default_collate"))
        return dict(
            model=dict(type="TutorialNet"),
            work_dir=work_dir,
            experiment_name=name,
            train_dataloader=dict(dataset=dict(type="Patterns", n=32, seed=1),
                                  sampler=dict(type="DefaultSampler", shuffle=True), **loader),
            val_dataloader=dict(dataset=dict(type="Patterns", n=16, seed=2),
                                sampler=dict(type="DefaultSampler", shuffle=False), **loader),
            val_evaluator=dict(type="Accuracy"),
            val_cfg=dict(),
            train_cfg=dict(by_epoch=True, max_epochs=epochs, val_interval=1),
            optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05, momentum=0.9)),
            param_scheduler=dict(type="MultiStepLR", by_epoch=True, milestones=[1, 2], gamma=0.5),
            default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1,
                                               save_best="accuracy", rule="greater")),
            custom_hooks=[dict(type="RecordHook", out=record, stop_after_epoch=stop_after_epoch)],
            randomness=dict(seed=0),
            resume=resume,
            load_from=load_from,
            log_level=log_level,
        )


    def build(runner_class, spec, **extra):
        """A runner as the tutorial builds it (``Runner(**cfg)``); ``save_initial`` saves the
        state before training, as a user may, with MMEngine's arguments for that moment."""
        runner = runner_class(**tutorial_cfg(spec["work_dir"], spec["record"], **spec["kw"]),
                              **extra)
        if spec.get("save_initial"):
            runner.save_checkpoint(spec["work_dir"], "initial.pth", save_optimizer=False,
                                   save_param_scheduler=False)
        runner.train()
    '''
)

# ---- the reference: MMEngine's own Runner, nothing from accelkit --------------------------------
REFERENCE_DRIVER = textwrap.dedent(
    """
    import json, sys
    from mm_tutorial import build
    from mmengine.runner import Runner

    for spec in json.loads(sys.argv[1]):
        build(Runner, spec)
    """
)

# ---- the accelkit side: the same project, one change --------------------------------------------
ACCELKIT_DRIVER = textwrap.dedent(
    """
    import json, sys
    from mm_tutorial import build
    from accelkit.integrations.mmengine import AccelkitRunner

    for spec in json.loads(sys.argv[1]):
        build(AccelkitRunner, spec, accelkit=dict(backend="cpu"))
    """
)

# MMEngine's own resume of its own .pth needs this on torch >= 2.6 (its torch.load of a
# HistoryBuffer); set for the plain-MMEngine process only, never for accelkit's.
MMENGINE_RESUME_ENV = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


def _run(root: Path, driver: str, specs: list[dict], env: dict | None = None) -> None:
    for spec in specs:
        spec.setdefault("kw", {})
        spec["work_dir"] = str(root / spec["work_dir"])
        spec["record"] = str(root / spec["name"])
        spec["kw"].setdefault("name", spec["name"])
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), **(env or {})}
    cmd = [sys.executable, str(root / driver), json.dumps(specs)]
    proc = subprocess.run(cmd, cwd=root, env=full_env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{driver} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _record(root: Path, name: str) -> dict:
    return json.loads((root / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mm_tutorial")
    (root / "mm_tutorial.py").write_text(TUTORIAL_PROJECT)
    (root / "reference_driver.py").write_text(REFERENCE_DRIVER)
    (root / "accelkit_driver.py").write_text(ACCELKIT_DRIVER)
    reference = [
        dict(name="ref", work_dir="ref", save_initial=True),
        dict(
            name="ref_resumed",
            work_dir="ref_resumed",
            kw=dict(resume=True, load_from=str(root / "ref" / "epoch_2.pth")),
        ),
    ]
    _run(root, "reference_driver.py", reference, env=MMENGINE_RESUME_ENV)
    accelkit = [
        # several saves (each epoch, the best, the last again) with a tensor in the message hub
        dict(name="ak", work_dir="ak", kw=dict(log_level="INFO")),
        dict(
            name="ak_resumed",
            work_dir="ak_resumed",
            kw=dict(resume=True, load_from=str(root / "ak" / "epoch_2.pth")),
        ),
        # stopped after 2 of 3 epochs: its epoch_2.pth is exported for plain MMEngine to resume
        dict(name="ak_stop", work_dir="ak_stop", kw=dict(stop_after_epoch=2)),
    ]
    _run(root, "accelkit_driver.py", accelkit)
    return root


# ---- item 2: a tensor in the message hub --------------------------------------------------------
TIMING = ("time", "data_time", "eta")  # wall-clock values: equal in kind, not in value


def _assert_same_hub(ours: dict, theirs: dict, our_root: Path, their_root: Path) -> None:
    """Two MessageHub state dicts hold the same HistoryBuffers and runtime values, type for
    type (tensors as tensors); file paths are compared relative to each run's root."""
    import numpy as np
    import torch
    from mmengine.logging import HistoryBuffer

    assert list(ours["log_scalars"]) == list(theirs["log_scalars"])
    for key, buf in theirs["log_scalars"].items():
        mine = ours["log_scalars"][key]
        assert isinstance(mine, HistoryBuffer) and mine.max_length == buf.max_length, key
        for a, b in (
            (mine._log_history, buf._log_history),
            (mine._count_history, buf._count_history),
        ):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, key
            if not key.endswith(TIMING):
                assert np.array_equal(a, b), key
    assert list(ours["runtime_info"]) == list(theirs["runtime_info"])
    for key, value in theirs["runtime_info"].items():
        mine = ours["runtime_info"][key]
        assert type(mine) is type(value), (key, type(mine), type(value))
        if isinstance(value, torch.Tensor):
            assert mine.dtype == value.dtype and torch.equal(mine, value), key
        elif key == "experiment_name":  # the run's name and start time
            continue
        elif isinstance(value, str):
            assert mine.replace(str(our_root), "") == value.replace(str(their_root), ""), key
        elif key not in TIMING:
            assert mine == value, key
    assert ours["resumed_keys"] == theirs["resumed_keys"]


def _portable_hub(path: Path) -> dict:
    from accelkit.checkpoint.read.reader import CheckpointReader
    from accelkit.integrations.mmengine.checkpoint import mmengine_state

    with CheckpointReader(path) as reader:
        return mmengine_state(reader.extras())["message_hub"]


@pytest.mark.slow
def test_tensor_metric_and_save_best_survive_saves(runs: Path) -> None:
    """The tutorial's tensor accuracy under save_best puts a tensor into the message hub; every
    later save used to fail ("cannot store a HistoryBuffer without pickle"). Now the run saves
    each epoch and the best, stores the message hub as MMEngine does (tensors as tensors,
    HistoryBuffers of numpy arrays, no pickle), and trains as MMEngine trains."""
    import torch

    ours, theirs = _record(runs, "ak"), _record(runs, "ref")
    assert ours["loss"] == theirs["loss"] and ours["val"] == theirs["val"]
    assert ours["params"] == theirs["params"]
    saved = sorted(p.name for p in (runs / "ak").glob("*.pth"))
    assert saved == sorted(p.name for p in (runs / "ref").glob("*.pth") if p.name != "initial.pth")
    for name in ("epoch_2.pth", "epoch_3.pth"):
        hub = _portable_hub(runs / "ak" / name)
        reference = torch.load(runs / "ref" / name, weights_only=False)["message_hub"]
        assert isinstance(reference["runtime_info"]["best_score"], torch.Tensor)  # the hazard
        _assert_same_hub(hub, reference, runs / "ak", runs / "ref")
    assert "pickle" not in (runs / "ak" / "epoch_3.pth" / "extra.json").read_text()


@pytest.mark.slow
def test_resume_restores_the_message_hub_as_mmengine(runs: Path) -> None:
    """Resumed from epoch 2, the message hub is what MMEngine's own resume of its own
    checkpoint of the same run gives, and the third epoch trains the same."""
    import torch

    ours = torch.load(runs / "ak_resumed.hub.pth", weights_only=False)
    theirs = torch.load(runs / "ref_resumed.hub.pth", weights_only=False)
    _assert_same_hub(ours, theirs, runs / "ak", runs / "ref")
    assert isinstance(ours["runtime_info"]["best_score"], torch.Tensor)
    resumed, reference = _record(runs, "ak_resumed"), _record(runs, "ref_resumed")
    assert resumed["loss"] == reference["loss"] and resumed["params"] == reference["params"]
    assert resumed["loss"] == _record(runs, "ref")["loss"][-len(resumed["loss"]) :]


def test_message_hub_with_a_tensor_round_trips(tmp_path: Path) -> None:
    """The fast twin: a tensor that ``save_best`` puts into the message hub, next to its
    HistoryBuffers, is saved and loaded back as a tensor (dtype and value), without pickle."""
    import numpy as np
    import torch
    from mmengine.logging import HistoryBuffer, MessageHub

    import accelkit
    from accelkit.integrations.mmengine import checkpoint as ckpt

    hub = MessageHub("tensor-in-hub")
    for loss in (2.5, 1.25):
        hub.update_scalar("train/loss", loss)
    hub.update_info("best_score", torch.tensor(62.5))
    hub.update_info("keep_ckpt_ids", [1, 2])
    accel = accelkit.get("cpu")
    model = accel.setup(torch.nn.Linear(2, 2))
    ckpt.save(
        accel,
        tmp_path / "c",
        objects={"model": model},
        checkpoint={"meta": {"epoch": 1}, "message_hub": hub.state_dict()},
    )
    back = ckpt.load(accel, tmp_path / "c", objects={"model": model}, strict=True, rng=False)
    restored = MessageHub("restored")
    restored.load_state_dict(back["message_hub"])
    best = restored.get_info("best_score")
    assert isinstance(best, torch.Tensor) and best.dtype == torch.float32 and best.item() == 62.5
    buf = restored.get_scalar("train/loss")
    assert isinstance(buf, HistoryBuffer) and np.array_equal(buf.data[0], [2.5, 1.25])
    assert restored.get_info("keep_ckpt_ids") == [1, 2]


def test_export_holds_what_mmengine_saves(tmp_path: Path) -> None:
    """The fast twin of the resume test: the exported optimizer state is the optimizer's own
    ``state_dict()`` (ids in param-group order, Adam's step and moments), the weights the
    model's, the rest MMEngine's types."""
    import torch
    from mmengine.logging import HistoryBuffer, MessageHub

    import accelkit
    from accelkit.integrations.mmengine import checkpoint as ckpt

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    groups = [
        {"params": list(net[2].parameters()), "lr": 0.01},
        {"params": list(net[0].parameters()) + list(net[1].parameters())},
    ]
    opt = torch.optim.AdamW(groups, lr=0.1, betas=(0.8, 0.9))
    accel = accelkit.get("cpu")
    model, opt = accel.setup(net, opt)
    for _ in range(2):
        accel.backward(model(torch.randn(5, 3)).square().mean())
        opt.step()
        opt.zero_grad()
    hub = MessageHub("export")
    hub.update_scalar("train/loss", 0.5)
    meta = {"epoch": 2, "iter": 2, "seed": 0}
    ckpt.save(
        accel,
        tmp_path / "c",
        objects={"model": model, "optimizer": opt},
        checkpoint={"meta": meta, "message_hub": hub.state_dict()},
    )
    ckpt.export_mmengine(tmp_path / "c", tmp_path / "c.pth")
    exported = torch.load(tmp_path / "c.pth", weights_only=False)
    assert list(exported)[:2] == ["meta", "state_dict"] and exported["meta"] == meta
    expected = accel.unwrap(model).state_dict()
    assert sorted(exported["state_dict"]) == sorted(expected)
    assert all(torch.equal(exported["state_dict"][k], v) for k, v in expected.items())
    theirs, ours = opt.state_dict(), exported["optimizer"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for pid, state in theirs["state"].items():
        assert sorted(ours["state"][pid]) == sorted(state)
        for key, value in state.items():
            assert torch.equal(ours["state"][pid][key], value), (pid, key)
    assert isinstance(exported["message_hub"]["log_scalars"]["train/loss"], HistoryBuffer)


# ---- item 5: save_checkpoint before training ----------------------------------------------------
@pytest.mark.slow
def test_save_checkpoint_before_training(runs: Path) -> None:
    """``runner.save_checkpoint(...)`` before ``train()`` saves the initial weights, meta and
    message hub, as MMEngine's does (with its arguments for that moment: no optimizer or
    scheduler exists yet), and training then runs as MMEngine's."""
    import torch

    from accelkit.checkpoint.read.reader import CheckpointReader
    from accelkit.integrations.mmengine.checkpoint import mmengine_state

    root = runs
    _run(
        root,
        "accelkit_driver.py",
        [dict(name="ak_initial", work_dir="ak_initial", save_initial=True)],
    )
    theirs = torch.load(root / "ref" / "initial.pth", weights_only=False)
    with CheckpointReader(root / "ak_initial" / "initial.pth") as reader:
        weights = {e.fqn: reader.read(e) for e in reader.entries("model")}
        ours = mmengine_state(reader.extras())
    assert sorted(weights) == sorted(theirs["state_dict"])
    assert all(torch.equal(weights[k], v) for k, v in theirs["state_dict"].items())
    assert {k: ours["meta"][k] for k in ("epoch", "iter")} == {"epoch": 1, "iter": 0}
    assert {k: theirs["meta"][k] for k in ("epoch", "iter")} == {"epoch": 1, "iter": 0}
    assert _record(root, "ak_initial")["loss"] == _record(root, "ref")["loss"]


# ---- item 9: accelkit's log lines in MMEngine's log file ----------------------------------------
@pytest.mark.slow
def test_accelkit_log_lines_reach_the_runner_log_file(runs: Path) -> None:
    """ "[accelkit] saved ..." went to the console only; the runner's log file has it too."""
    (log_file,) = (runs / "ak").glob("*/*.log")
    text = log_file.read_text()
    assert f"saved {runs / 'ak' / 'epoch_1.pth'}" in text
    assert f"saved {runs / 'ak' / 'best_accuracy_epoch_1.pth'}" in text
    assert "AccelkitCheckpointHook: MMEngine's CheckpointHook" in text  # it says what it is
    assert f"- accelkit - INFO - saved {runs / 'ak' / 'epoch_3.pth'}" in text  # MMEngine's format


def test_log_forwarding_ends_with_the_run(tmp_path: Path) -> None:
    import logging

    from mmengine.logging import MMLogger

    from accelkit.integrations.mmengine import AccelkitCheckpointHook
    from accelkit.integrations.mmengine.hooks import RunnerLogFileHandler

    class Runner:
        logger = MMLogger.get_instance(
            "forwarding-test", log_file=str(tmp_path / "run.log"), log_level="INFO"
        )

    hook, runner = AccelkitCheckpointHook(interval=1), Runner()
    accelkit_logger = logging.getLogger("accelkit")
    hook.before_run(runner)
    accelkit_logger.warning("during the run")
    hook.after_run(runner)
    accelkit_logger.warning("after the run")
    assert not [h for h in accelkit_logger.handlers if isinstance(h, RunnerLogFileHandler)]
    text = (tmp_path / "run.log").read_text()
    assert "during the run" in text and "after the run" not in text


# ---- item 10: accelkit convert --to mmengine ----------------------------------------------------
@pytest.mark.slow
def test_convert_to_mmengine_resumes_in_plain_mmengine(runs: Path) -> None:
    """``accelkit convert DIR out.pth --to mmengine``: plain MMEngine's Runner resumes the
    .pth (weights, SGD momentum, scheduler, message hub, epoch/iter) and trains the third epoch
    exactly as the unbroken run did."""
    import torch

    out = runs / "exported" / "epoch_2.pth"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelkit.cli",
            "convert",
            str(runs / "ak_stop" / "epoch_2.pth"),
            str(out),
            "--to",
            "mmengine",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = torch.load(out, weights_only=False)
    assert {"meta", "state_dict", "optimizer", "param_schedulers", "message_hub"} <= set(exported)
    assert exported["optimizer"]["state"] and exported["meta"]["epoch"] == 2
    spec = dict(
        name="plain_from_accelkit",
        work_dir="plain_from_accelkit",
        kw=dict(resume=True, load_from=str(out)),
    )
    _run(runs, "reference_driver.py", [spec], env=MMENGINE_RESUME_ENV)
    resumed = _record(runs, "plain_from_accelkit")
    for unbroken in (_record(runs, "ak"), _record(runs, "ref")):
        tail = len(resumed["loss"])
        assert tail == 4 and resumed["iters"] == unbroken["iters"][-tail:]
        assert resumed["loss"] == unbroken["loss"][-tail:]
        assert resumed["lr"] == unbroken["lr"][-tail:]
        assert resumed["params"] == unbroken["params"]


def test_convert_to_mmengine_refuses_other_checkpoints(tmp_path: Path) -> None:
    import torch

    import accelkit
    from accelkit.checkpoint.formats.convert import convert
    from accelkit.errors import CheckpointError

    accel = accelkit.get("cpu")
    model = accel.setup(torch.nn.Linear(2, 2))
    accel.save(tmp_path / "plain", {"model": model})
    with pytest.raises(CheckpointError, match="not a checkpoint of accelkit's MMEngine adapter"):
        convert(tmp_path / "plain", tmp_path / "out.pth", to="mmengine")
    with pytest.raises(CheckpointError, match="--format do not apply"):
        convert(tmp_path / "plain", tmp_path / "out.pth", to="mmengine", fmt="pt")
