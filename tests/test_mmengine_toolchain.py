"""The rest of the OpenMMLab toolchain on an accelkit run (issue 37), against MMEngine itself.

An OpenMMLab user does more than train: ``tools/test.py`` (with ``--tta``), the inferencers,
``init_detector``-style loading, ``load_from`` in another config and model publishing all reach
the checkpoint through ``mmengine.runner.load_checkpoint`` / ``CheckpointLoader`` and the model
through ``runner.model``. Each scenario runs twice where it can: with MMEngine's own ``Runner`` or
``FlexibleRunner`` (``REFERENCE_DRIVER``, a process that imports nothing from accelkit) and with
``AccelkitRunner`` / ``AccelkitStrategy`` (``ACCELKIT_DRIVER``); the loading side
(``LOAD_DRIVER``) is a fresh process that only does what a downstream tool does:
``Config.fromfile`` (which runs ``custom_imports``), then MMEngine's own readers.

fp32 on this CPU is deterministic and the adapter reproduces MMEngine's Runner bit for bit
(tests/test_mmengine.py), so comparisons are exact. What differs is listed in docs/mmengine.md
and asserted here as a difference.
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

# ---- the user's project (both sides train it: it is what is tested, not a helper) ------------
PROJECT = textwrap.dedent(
    '''
    import json, os
    import torch
    from torch import nn
    from mmengine.evaluator import BaseMetric
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel, BaseTTAModel
    from mmengine.optim import OptimWrapper
    from mmengine.registry import DATASETS, HOOKS, METRICS, MODELS, OPTIM_WRAPPERS


    @MODELS.register_module(force=True)
    class TinyNet(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

        def forward(self, x, y, mode="tensor"):
            if isinstance(x, (list, tuple)):  # pseudo_collate (a TTA pipeline) leaves lists
                x, y = torch.stack(list(x)), torch.stack(list(y))
            out = self.net(x)
            if mode == "loss":
                return {"loss": nn.functional.cross_entropy(out, y)}
            if mode == "predict":
                return [(p, t) for p, t in zip(out.softmax(-1), y)]
            return out


    @MODELS.register_module(force=True)
    class AverageTTA(BaseTTAModel):
        """Averages the class probabilities of the augmented views of each sample."""

        def merge_preds(self, data_samples_list):
            return [(torch.stack([p for p, _ in views]).mean(0), views[0][1])
                    for views in data_samples_list]


    @DATASETS.register_module(force=True)
    class Blobs(torch.utils.data.Dataset):
        def __init__(self, n=48, seed=0, tta=False):
            g = torch.Generator().manual_seed(seed)
            self.y = torch.randint(0, 3, (n,), generator=g)
            self.x = torch.randn(n, 8, generator=g) + self.y[:, None]
            self.tta = tta

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            if self.tta:  # two views of each sample, as TestTimeAug makes them
                return dict(x=[self.x[i], 0.8 * self.x[i]], y=[self.y[i], self.y[i]])
            return dict(x=self.x[i], y=self.y[i])


    @METRICS.register_module(force=True)
    class Acc(BaseMetric):
        def process(self, data_batch, data_samples):
            self.results.extend(float(p.argmax() == t) for p, t in data_samples)

        def compute_metrics(self, results):
            return dict(acc=sum(results) / len(results))


    @OPTIM_WRAPPERS.register_module(force=True)
    class CountingOptimWrapper(OptimWrapper):
        """A project's own OptimWrapper subclass: an argument of its own and an override."""

        def __init__(self, *args, every=1, **kwargs):
            super().__init__(*args, **kwargs)
            self.every, self.updates = every, 0

        def update_params(self, loss, step_kwargs=None, zero_kwargs=None):
            self.updates += 1
            super().update_params(loss, step_kwargs, zero_kwargs)


    @HOOKS.register_module(force=True)
    class StageRecorder(Hook):
        """Records every hook stage called, losses, learning rates and the final weights."""

        priority = "LOWEST"

        def __init__(self, out):
            self.out = out
            self.rec = dict(stages=[], loss=[], lr=[], hooks=[])
            for stage in Hook.stages:
                setattr(self, stage, self._recorder(stage, getattr(self, stage)))

        def _recorder(self, stage, method):
            def record(runner, *args, **kwargs):
                self.rec["stages"].append(stage)
                return method(runner, *args, **kwargs)
            return record

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            self.rec["loss"].append(float(outputs["loss"]))
            self.rec["lr"].append(runner.optim_wrapper.param_groups[0]["lr"])

        def after_run(self, runner):
            self.rec["hooks"] = [type(h).__name__ for h in runner.hooks]
            self.rec["updates"] = getattr(runner.optim_wrapper, "updates", None)
            state = {k.removeprefix("module."): v.detach().clone()
                     for k, v in runner.model.state_dict().items()}
            rank = int(os.environ.get("RANK", 0))
            if rank == 0:
                torch.save(state, self.out + ".weights.pt")
            with open(f"{self.out}.rank{rank}.json", "w") as f:
                json.dump(self.rec, f)


    def tiny_cfg(work_dir, record, *, epochs=2, ema=False, optim_type=None, save_format=None,
                 keep=-1, load_from=None, resume=False, launcher="none", tta=False,
                 published=None, name="tiny"):
        optim_wrapper = dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9))
        if optim_type is not None:
            optim_wrapper.update(type=optim_type, every=2)
        checkpoint = dict(type="CheckpointHook", interval=1, max_keep_ckpts=keep)
        if save_format is not None:
            checkpoint["save_format"] = save_format
        if published is not None:
            checkpoint.update(save_last=True, published_keys=published)
        loader = dict(batch_size=8, num_workers=0, collate_fn=dict(type="default_collate"))
        test_loader = dict(loader, collate_fn=dict(type="pseudo_collate" if tta else "default_collate"))
        cfg = dict(
            model=dict(type="TinyNet"),
            work_dir=work_dir,
            experiment_name=name,
            train_dataloader=dict(dataset=dict(type="Blobs"),
                                  sampler=dict(type="DefaultSampler", shuffle=True), **loader),
            test_dataloader=dict(dataset=dict(type="Blobs", n=24, seed=1, tta=tta),
                                 sampler=dict(type="DefaultSampler", shuffle=False), **test_loader),
            test_evaluator=dict(type="Acc"),
            test_cfg=dict(),
            train_cfg=dict(by_epoch=True, max_epochs=epochs),
            optim_wrapper=optim_wrapper,
            param_scheduler=[
                dict(type="LinearLR", start_factor=0.5, by_epoch=False, begin=0, end=4),
                dict(type="MultiStepLR", by_epoch=True, milestones=[1], gamma=0.5),
            ],
            default_hooks=dict(checkpoint=checkpoint, logger=dict(type="LoggerHook", interval=2)),
            custom_hooks=[dict(type="StageRecorder", out=record)]
                         + ([dict(type="EMAHook", momentum=0.2)] if ema else []),
            randomness=dict(seed=3),
            load_from=load_from,
            resume=resume,
            launcher=launcher,
            env_cfg=dict(dist_cfg=dict(backend="gloo")),
            log_level="WARNING",
        )
        if tta == "config":  # what tools/test.py --tta builds
            cfg["model"] = dict(type="AverageTTA", module=cfg["model"])
        return cfg
    '''
)

# ---- the reference: MMEngine's own Runner / FlexibleRunner, nothing from accelkit -------------
REFERENCE_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    import torch.distributed as dist
    from mm_tiny import tiny_cfg
    from mmengine.hooks import PrepareTTAHook
    from mmengine.runner import FlexibleRunner, Runner

    for spec in json.loads(sys.argv[1]):
        cfg = tiny_cfg(spec["work_dir"], spec["record"], name=spec["name"], **spec["kw"])
        if cfg["launcher"] != "none":
            # MMEngine's init_dist calls torch.cuda.set_device even on a CPU-only torch
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            cfg["model_wrapper_cfg"] = dict(
                type="MMDistributedDataParallel", broadcast_buffers=False, device_ids=None)
        runner = (FlexibleRunner if spec["runner"] == "flexible" else Runner).from_cfg(cfg)
        if spec["kw"].get("tta") == "hook":
            runner.register_hook(PrepareTTAHook(tta_cfg=dict(type="AverageTTA")))
        result = runner.test() if spec.get("mode") == "test" else runner.train()
        if spec.get("mode") == "test":
            with open(spec["record"] + ".test.json", "w") as f:
                json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.1)
    """
)

# ---- the accelkit side: the same project, the one config change -------------------------------
ACCELKIT_DRIVER = textwrap.dedent(
    """
    import json, sys
    from mm_tiny import tiny_cfg
    import accelkit.integrations.mmengine  # registers AccelkitRunner and AccelkitStrategy
    from mmengine.hooks import PrepareTTAHook
    from mmengine.registry import RUNNERS
    from mmengine.runner import FlexibleRunner

    for spec in json.loads(sys.argv[1]):
        cfg = tiny_cfg(spec["work_dir"], spec["record"], name=spec["name"], **spec["kw"])
        if spec["runner"] == "flexible":
            cfg["strategy"] = dict(type="AccelkitStrategy", **spec["accelkit"])
            cfg["default_hooks"]["checkpoint"]["type"] = "AccelkitCheckpointHook"
            runner = FlexibleRunner.from_cfg(cfg)
        else:
            cfg.update(runner_type="AccelkitRunner", accelkit=spec["accelkit"])
            runner = RUNNERS.build(cfg)
        if spec["kw"].get("tta") == "hook":
            runner.register_hook(PrepareTTAHook(tta_cfg=dict(type="AverageTTA")))
        result = runner.test() if spec.get("mode") == "test" else runner.train()
        if spec.get("mode") == "test":
            with open(spec["record"] + ".test.json", "w") as f:
                json.dump(result, f)
    """
)

# ---- a downstream tool in a fresh process: Config.fromfile, then MMEngine's own readers --------
CONFIG_FILE = textwrap.dedent(
    """
    custom_imports = dict(imports=["mm_tiny", "accelkit.integrations.mmengine"])
    model = dict(type="TinyNet")
    """
)

LOAD_DRIVER = textwrap.dedent(
    """
    import json, sys
    import torch
    from mmengine.config import Config
    from mmengine.registry import MODELS
    from mmengine.runner import load_checkpoint
    from mmengine.runner.checkpoint import _load_checkpoint

    cfg = Config.fromfile(sys.argv[1])      # runs custom_imports, as tools/test.py does
    model = MODELS.build(cfg.model)
    checkpoint = load_checkpoint(model, sys.argv[2], map_location="cpu", strict=True)
    torch.save(dict(model=model.state_dict(), raw=_load_checkpoint(sys.argv[2])), sys.argv[3])
    """
)


def _write_project(root: Path) -> None:
    (root / "mm_tiny.py").write_text(PROJECT)
    (root / "reference_driver.py").write_text(REFERENCE_DRIVER)
    (root / "accelkit_driver.py").write_text(ACCELKIT_DRIVER)
    (root / "load_driver.py").write_text(LOAD_DRIVER)
    (root / "tiny_config.py").write_text(CONFIG_FILE)


def _env(root: Path, **extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), **extra}


def _run(root: Path, driver: str, specs: list[dict], *, nproc: int = 1, env: dict | None = None):
    for spec in specs:
        spec.setdefault("kw", {})
        spec.setdefault("accelkit", {})
        spec.setdefault("runner", "runner")
        spec["work_dir"] = str(root / spec["work_dir"])
        spec["record"] = str(root / spec["name"])
    cmd = [sys.executable, str(root / driver), json.dumps(specs)]
    if nproc > 1:
        from accelkit.distributed import free_port

        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            *cmd[1:],
        ]
    proc = subprocess.run(
        cmd, cwd=root, env=_env(root, **(env or {})), capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise AssertionError(f"{driver} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def _load_in_fresh_process(root: Path, checkpoint: Path, out: str) -> dict:
    """What a downstream tool gets: ``load_checkpoint`` into the config's model, and
    ``_load_checkpoint``'s raw dict."""
    proc = subprocess.run(
        [sys.executable, str(root / "load_driver.py"), "tiny_config.py", str(checkpoint), out],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only: the shared machine can be slow
    )
    if proc.returncode != 0:
        raise AssertionError(f"load failed:\n{proc.stderr[-4000:]}")
    import torch

    return torch.load(root / out, weights_only=False)


def _tiny_net():
    """A module of TinyNet's layout, built in this process."""
    from torch import nn

    class Same(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    return Same()


def _load_here(checkpoint: Path) -> dict:
    """``load_checkpoint`` in this process, the adapter imported (what custom_imports does): the
    fast way for the tests that are not about a fresh process."""
    from mmengine.runner import load_checkpoint
    from mmengine.runner.checkpoint import _load_checkpoint

    import accelkit.integrations.mmengine  # noqa: F401

    model = _tiny_net()
    load_checkpoint(model, str(checkpoint), map_location="cpu", strict=True)
    return dict(model=model.state_dict(), raw=_load_checkpoint(str(checkpoint)))


def _record(root: Path, name: str, rank: int = 0) -> dict:
    return json.loads((root / f"{name}.rank{rank}.json").read_text())


def _weights(root: Path, name: str) -> dict:
    import torch

    return torch.load(root / f"{name}.weights.pt")


def _assert_same_tensors(ours: dict, theirs: dict) -> None:
    import torch

    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


# ---- one cpu run, read back by a fresh process (slow) and in this process ---------------------
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("toolchain_cpu")
    _write_project(root)
    cpu = dict(backend="cpu")
    _run(
        root,
        "accelkit_driver.py",
        [
            dict(name="ak", work_dir="ak", accelkit=cpu, kw=dict(published=["meta", "state_dict"])),
            dict(
                name="ak_pth", work_dir="ak_pth", accelkit=cpu, kw=dict(save_format="pth", keep=1)
            ),
            dict(name="ak_both", work_dir="ak_both", accelkit=cpu, kw=dict(save_format="both")),
        ],
    )
    return root


@pytest.mark.slow  # a fresh interpreter importing MMEngine and accelkit: over 10 s
def test_load_checkpoint_opens_an_accelkit_checkpoint(cpu_run: Path) -> None:
    """``Config.fromfile`` + ``mmengine.runner.load_checkpoint`` in a fresh process: the weights
    are bit-equal to the trained model's, and the dict is MMEngine's layout."""
    root = cpu_run
    checkpoint = root / "ak" / "epoch_2.pth"
    assert (checkpoint / "accelkit.json").is_file()  # a directory, as before
    loaded = _load_in_fresh_process(root, checkpoint, "loaded.pt")
    _assert_same_tensors(loaded["model"], _weights(root, "ak"))
    raw = loaded["raw"]
    assert list(raw)[:2] == ["meta", "state_dict"]
    assert {"optimizer", "param_schedulers", "message_hub"} <= set(raw)
    assert (raw["meta"]["epoch"], raw["meta"]["iter"]) == (2, 12)
    assert sorted(raw["optimizer"]["state"]) == [0, 1, 2, 3]  # torch's numbering


def test_a_flipped_byte_fails_the_load(cpu_run: Path, tmp_path: Path) -> None:
    """The negative twin: one flipped byte in the rank file, and the tool gets an error naming
    the checksum, not wrong weights."""
    import shutil

    damaged = tmp_path / "epoch_2.pth"
    shutil.copytree(cpu_run / "ak" / "epoch_2.pth", damaged)
    manifest = json.loads((damaged / "accelkit.json").read_text())
    (fragment,) = next(
        t["fragments"]
        for t in manifest["tensors"]
        if (t["object"], t["fqn"]) == ("model", "net.2.weight")
    )
    rank_file = damaged / fragment["file"]
    data = bytearray(rank_file.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    data[8 + header_len + header[fragment["key"]]["data_offsets"][0]] ^= 0x40  # one weight's bit
    rank_file.write_bytes(bytes(data))
    from accelkit.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"net\.2\.weight"):
        _load_here(damaged)


def test_a_missing_rank_file_fails_the_load(cpu_run: Path, tmp_path: Path) -> None:
    import shutil

    damaged = tmp_path / "epoch_2.pth"
    shutil.copytree(cpu_run / "ak" / "epoch_2.pth", damaged)
    (damaged / "rank-00000.safetensors").unlink()
    from accelkit.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors"):
        _load_here(damaged)


def test_a_directory_that_is_no_checkpoint_is_named(cpu_run: Path, tmp_path: Path) -> None:
    (tmp_path / "epoch_9.pth").mkdir()
    from accelkit.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"without accelkit\.json"):
        _load_here(tmp_path / "epoch_9.pth")


def test_a_pth_file_still_goes_to_mmengines_loader(cpu_run: Path) -> None:
    """Files keep MMEngine's loader: a plain state dict (tensors only) loads as before."""
    loaded = _load_here(cpu_run / "ak.weights.pt")
    _assert_same_tensors(loaded["model"], _weights(cpu_run, "ak"))


def test_map_location_places_the_tensors_as_torch_load_would(cpu_run: Path) -> None:
    """``map_location`` as ``torch.load`` takes it: a device (``meta`` stands in for an
    accelerator here), a dict mapping ``'cpu'``, a callable, or None (the CPU)."""
    import torch
    from mmengine.runner.checkpoint import _load_checkpoint

    import accelkit.integrations.mmengine  # noqa: F401  what custom_imports does

    path = str(cpu_run / "ak" / "epoch_2.pth")

    def devices(checkpoint: dict) -> set[str]:
        tensors = list(checkpoint["state_dict"].values())
        tensors += [t for s in checkpoint["optimizer"]["state"].values() for t in s.values()]
        return {t.device.type for t in tensors if isinstance(t, torch.Tensor)}

    assert devices(_load_checkpoint(path, map_location=None)) == {"cpu"}
    assert devices(_load_checkpoint(path, map_location="meta")) == {"meta"}
    assert devices(_load_checkpoint(path, map_location=torch.device("meta"))) == {"meta"}
    assert devices(_load_checkpoint(path, map_location={"cpu": "meta"})) == {"meta"}
    assert devices(_load_checkpoint(path, map_location=lambda storage, location: storage)) == {
        "cpu"
    }


def test_pretrained_init_cfg_reaches_the_loader(cpu_run: Path) -> None:
    """``init_cfg=dict(type='Pretrained', checkpoint=...)`` (MMEngine's PretrainedInit) loads an
    accelkit checkpoint directory, as it loads a ``.pth``."""
    import torch
    from mmengine.model.weight_init import PretrainedInit

    import accelkit.integrations.mmengine  # noqa: F401  what custom_imports does

    model = _tiny_net()
    PretrainedInit(checkpoint=str(cpu_run / "ak" / "epoch_2.pth"))(model)
    _assert_same_tensors(model.state_dict(), _weights(cpu_run, "ak"))
    fresh = _tiny_net().state_dict()["net.0.weight"]
    assert not torch.equal(fresh, model.state_dict()["net.0.weight"])


def test_published_model_is_written_and_opens(cpu_run: Path) -> None:
    """``CheckpointHook(published_keys=...)`` reads the last checkpoint through MMEngine's
    loader: it now publishes ``epoch_2-<sha>.pth``, a file any MMEngine opens."""
    (published,) = (cpu_run / "ak").glob("epoch_2-*.pth")
    assert published.is_file()
    loaded = _load_here(published)
    _assert_same_tensors(loaded["model"], _weights(cpu_run, "ak"))
    assert sorted(loaded["raw"]) == ["meta", "state_dict"]


def test_save_format_pth_writes_mmengines_file(cpu_run: Path) -> None:
    """``save_format='pth'``: ``epoch_N.pth`` is the single file MMEngine's Runner writes (no
    directory, no staging left), rotated by ``max_keep_ckpts``, named by ``last_checkpoint``."""
    import torch

    work = cpu_run / "ak_pth"
    assert sorted(p.name for p in work.glob("*.pth")) == ["epoch_2.pth"]
    assert not list(work.glob(".*"))
    assert (work / "last_checkpoint").read_text() == str(work / "epoch_2.pth")
    saved = torch.load(work / "epoch_2.pth", weights_only=False)  # as MMEngine's own tools do
    assert list(saved)[:2] == ["meta", "state_dict"]
    assert {"optimizer", "param_schedulers", "message_hub"} <= set(saved)
    _assert_same_tensors(dict(saved["state_dict"]), _weights(cpu_run, "ak_pth"))


def test_save_format_both_writes_the_directory_and_the_file(cpu_run: Path) -> None:
    import torch

    work = cpu_run / "ak_both"
    for epoch in (1, 2):
        assert (work / f"epoch_{epoch}.pth" / "accelkit.json").is_file()
        assert (work / f"epoch_{epoch}_mmengine.pth").is_file()
    saved = torch.load(work / "epoch_2_mmengine.pth", weights_only=False)
    _assert_same_tensors(dict(saved["state_dict"]), _weights(cpu_run, "ak_both"))
    assert (work / "last_checkpoint").read_text() == str(work / "epoch_2.pth")


def test_a_bad_save_format_is_refused_when_the_runner_is_built(tmp_path: Path) -> None:
    from accelkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"save_format='zip'.*'accelkit'.*'pth'.*'both'"):
        _tiny_runner(
            tmp_path, default_hooks=dict(checkpoint=dict(type="CheckpointHook", save_format="zip"))
        )


class _Net:
    """A one-layer BaseModel, built lazily (MMEngine is imported by the tests that use it)."""

    def __new__(cls):
        from mmengine.model import BaseModel
        from torch import nn

        class Net(BaseModel):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(4, 2)

            def forward(self, x, y, mode="tensor"):
                out = self.net(x)
                return {"loss": nn.functional.cross_entropy(out, y)} if mode == "loss" else [out]

        return Net()


def _tiny_runner(work_dir: Path, runner_class: type | None = None, **kwargs):
    import torch

    if runner_class is None:
        from accelkit.integrations.mmengine import AccelkitRunner

        runner_class = AccelkitRunner
        kwargs.setdefault("accelkit", dict(backend="cpu"))
    settings = dict(
        model=_Net(),
        work_dir=str(work_dir),
        # MMEngine names its logger after the experiment (a timestamp by default): runners built
        # in the same second would share one log file
        experiment_name=f"{work_dir.parent.name}-{work_dir.name}",
        train_dataloader=dict(
            dataset=[dict(x=torch.ones(4), y=0)] * 4,
            batch_size=2,
            sampler=dict(type="DefaultSampler"),
            collate_fn=dict(type="default_collate"),
        ),
        train_cfg=dict(by_epoch=True, max_epochs=1),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        default_hooks=dict(checkpoint=None),
        log_level="WARNING",
    )
    settings.update(kwargs)
    return runner_class(**settings)


def test_runner_model_is_an_nn_module(tmp_path: Path) -> None:
    """As under MMEngine: ``isinstance(runner.model, nn.Module)``, ``.module`` is the user's
    model (parameters named ``module.<name>``, as MMEngine's wrappers name them), and a TTA
    model takes it as its module."""
    from mmengine.model import BaseTTAModel, is_model_wrapper
    from torch import nn

    class Mean(BaseTTAModel):
        def merge_preds(self, data_samples_list):
            return data_samples_list

    runner = _tiny_runner(tmp_path)
    model = runner.model
    runner.train()
    assert isinstance(runner.model, nn.Module) and is_model_wrapper(runner.model)
    assert runner.model.module is model
    assert [n for n, _ in runner.model.named_parameters()] == [
        "module.net.weight",
        "module.net.bias",
    ]
    assert sorted(runner.model.state_dict()) == ["net.bias", "net.weight"]
    tta = Mean(module=runner.model)  # BaseTTAModel refuses anything but an nn.Module or a dict
    assert sorted(tta.state_dict()) == ["module.net.bias", "module.net.weight"]
    runner.model.eval()
    assert not runner.model.training and not model.training


def test_a_run_that_raises_leaves_no_log_forwarder(tmp_path: Path) -> None:
    """A refusal after ``before_run`` (``load_from`` of a pickle without ``trust_pickle``) ends
    the run: accelkit's lines stop going into that run's log, and a runner built after the old
    log was closed and its folder removed neither fails nor writes there."""
    import logging
    import shutil

    import numpy as np
    import torch

    from accelkit.errors import CheckpointError
    from accelkit.integrations.mmengine.hooks import RunnerLogFileHandler

    pickled = tmp_path / "mmengine_style.pth"
    torch.save({"state_dict": _Net().state_dict(), "meta": {"x": np.float64(1.0)}}, pickled)
    first = _tiny_runner(
        tmp_path / "first",
        load_from=str(pickled),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)),
        log_level="INFO",
    )
    with pytest.raises(CheckpointError, match="trust_pickle"):
        first.train()
    accelkit_logger = logging.getLogger("accelkit")
    assert not [h for h in accelkit_logger.handlers if isinstance(h, RunnerLogFileHandler)]
    (log_file,) = (tmp_path / "first").glob("*/*.log")
    for handler in first.logger.handlers:
        handler.close()
    size = log_file.stat().st_size
    accelkit_logger.warning("after the first run")
    assert log_file.stat().st_size == size
    shutil.rmtree(tmp_path / "first")
    second = _tiny_runner(
        tmp_path / "second", default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1))
    )
    second.train()
    assert not (tmp_path / "first").exists()


def test_a_closed_run_log_is_never_reopened(tmp_path: Path) -> None:
    """The negative twin, on the forwarder itself: a forwarder left behind (a FlexibleRunner
    that raised) skips a closed log file instead of reopening it."""
    import logging

    from mmengine.logging import MMLogger

    from accelkit.integrations.mmengine.hooks import RunnerLogFileHandler

    logger = MMLogger.get_instance("closed-log", log_file=str(tmp_path / "run.log"))
    forwarder = RunnerLogFileHandler(logger)
    for handler in logger.handlers:
        handler.close()
    (tmp_path / "run.log").unlink()
    forwarder.handle(logging.makeLogRecord(dict(msg="late line", levelno=logging.WARNING)))
    assert not (tmp_path / "run.log").exists()


# ---- optimizer wrappers as MMEngine builds them (default tier) ---------------------------------
def test_an_optim_wrapper_subclass_runs_on_accelkit(tmp_path: Path) -> None:
    """``optim_wrapper=dict(type=<an OptimWrapper subclass>)``: its own arguments and overrides
    run, and its ``super()`` calls go through accelkit."""
    from mmengine.optim import OptimWrapper

    from accelkit.integrations.mmengine import AccelkitOptimWrapper

    class Counting(OptimWrapper):
        def __init__(self, *args, note="", **kwargs):
            super().__init__(*args, **kwargs)
            self.note, self.updates = note, 0

        def update_params(self, loss, step_kwargs=None, zero_kwargs=None):
            self.updates += 1
            super().update_params(loss, step_kwargs, zero_kwargs)

    runner = _tiny_runner(
        tmp_path, optim_wrapper=dict(type=Counting, note="mine", optimizer=dict(type="SGD", lr=0.1))
    )
    before = runner.model.net.weight.detach().clone()
    runner.train()
    wrapper = runner.optim_wrapper
    assert isinstance(wrapper, Counting) and isinstance(wrapper, AccelkitOptimWrapper)
    assert (wrapper.note, wrapper.updates) == ("mine", 2)
    assert not runner.model.module.net.weight.detach().equal(before)


@pytest.mark.parametrize(
    ("wrapper_type", "words"),
    [
        ("DeepSpeedOptimWrapper", "backend='deepspeed'"),
        ("ApexOptimWrapper", "backend='apex'"),
        ("ColossalAIOptimWrapper", "backend='colossalai_zero'"),
    ],
)
def test_a_wrapper_whose_job_a_backend_does_names_the_backend(
    tmp_path: Path, wrapper_type: str, words: str
) -> None:
    from accelkit.errors import ConfigError

    with pytest.raises(ConfigError, match=f"{wrapper_type}.*{words}.*'OptimWrapper'"):
        _tiny_runner(tmp_path, optim_wrapper=dict(type=wrapper_type, optimizer=dict(type="SGD")))


def test_an_amp_optim_wrapper_subclass_is_refused(tmp_path: Path) -> None:
    from mmengine.optim import AmpOptimWrapper

    from accelkit.errors import ConfigError

    class MyAmp(AmpOptimWrapper):
        pass

    with pytest.raises(ConfigError, match=r"AmpOptimWrapper subclass.*precision"):
        _tiny_runner(tmp_path, optim_wrapper=dict(type=MyAmp, optimizer=dict(type="SGD")))


def test_an_unknown_wrapper_type_raises_mmengines_key_error(tmp_path: Path) -> None:
    from mmengine.registry import OPTIM_WRAPPERS

    from accelkit.errors import ConfigError

    with pytest.raises(KeyError) as theirs:
        OPTIM_WRAPPERS.build(dict(type="NoSuchWrapper"))
    with pytest.raises(KeyError) as ours:
        _tiny_runner(tmp_path, optim_wrapper=dict(type="NoSuchWrapper", optimizer=dict(type="SGD")))
    assert isinstance(ours.value, ConfigError)
    assert str(ours.value) == theirs.value.args[0]


def test_build_optim_wrapper_builds_a_new_wrapper_each_call_as_mmengine(tmp_path: Path) -> None:
    """MMEngine's Runner builds a new wrapper (a new optimizer) at each call; so does the
    adapter. The one ``train()`` uses is set up; a later one for the same model is refused
    when training starts with it, saying what to do."""
    from mmengine.optim import OptimWrapper
    from mmengine.runner import Runner

    from accelkit.errors import UnsupportedError

    cfg = dict(optimizer=dict(type="SGD", lr=0.1))
    theirs = _tiny_runner(tmp_path / "theirs", runner_class=Runner)
    ours = _tiny_runner(tmp_path / "ours")
    for runner in (theirs, ours):
        first, second = runner.build_optim_wrapper(dict(cfg)), runner.build_optim_wrapper(dict(cfg))
        assert isinstance(first, OptimWrapper) and isinstance(second, OptimWrapper)
        assert first is not second and first.optimizer is not second.optimizer
        assert runner.build_optim_wrapper(first) is first
        runner.optim_wrapper = second
        runner.train()
        assert runner.optim_wrapper is second
    third = ours.build_optim_wrapper(dict(cfg))
    ours.optim_wrapper = third
    with pytest.raises(UnsupportedError, match=r"already set up with runner\.optim_wrapper"):
        ours.train()


# ---- test-time augmentation both ways, against plain MMEngine (slow) ----------------------------
@pytest.fixture(scope="module")
def tta_runs(cpu_run: Path) -> Path:
    """Plain MMEngine and accelkit (Runner and FlexibleRunner each) test the same trained
    weights with TTA, config-level (``model = dict(**tta_model, module=model)``, as
    ``tools/test.py --tta`` builds it) and with ``PrepareTTAHook``, and without TTA (so that the
    comparison can tell TTA from none). accelkit loads the run's checkpoint directory, plain
    MMEngine its weights file."""
    import torch

    root = cpu_run
    # MMEngine's FlexibleRunner reads checkpoint['state_dict'] only: the weights in that layout
    torch.save({"state_dict": _weights(root, "ak")}, root / "ak.state.pth")
    weights, directory = str(root / "ak.state.pth"), str(root / "ak" / "epoch_2.pth")
    modes = {"tta_cfg": "config", "tta_hook": "hook", "plain": False}
    _run(
        root,
        "reference_driver.py",
        [
            dict(
                name=f"{prefix}_{m}",
                work_dir=f"{prefix}_{m}",
                kw=dict(load_from=weights, tta=t),
                mode="test",
                runner=runner,
            )
            for m, t in modes.items()
            for prefix, runner in (("ref", "runner"), ("flexref", "flexible"))
        ],
    )
    _run(
        root,
        "accelkit_driver.py",
        [
            dict(
                name=f"{prefix}_{m}",
                work_dir=f"{prefix}_{m}",
                kw=dict(load_from=directory, tta=t),
                mode="test",
                accelkit=dict(backend="cpu"),
                runner=runner,
            )
            for m, t in modes.items()
            for prefix, runner in (("ak", "runner"), ("flexak", "flexible"))
        ],
    )
    return root


def _metric(root: Path, name: str) -> dict:
    return json.loads((root / f"{name}.test.json").read_text())


@pytest.mark.slow  # twelve test runs in four processes
@pytest.mark.parametrize("mode", ["tta_cfg", "tta_hook", "plain"])
@pytest.mark.parametrize(("ours", "theirs"), [("ak", "ref"), ("flexak", "flexref")])
def test_test_time_augmentation_gives_mmengines_metric(
    tta_runs: Path, mode: str, ours: str, theirs: str
) -> None:
    """AccelkitRunner against MMEngine's Runner, FlexibleRunner with AccelkitStrategy against
    FlexibleRunner with its default strategy."""
    assert _metric(tta_runs, f"{ours}_{mode}") == _metric(tta_runs, f"{theirs}_{mode}")


@pytest.mark.slow
def test_the_tta_comparison_can_tell_tta_from_none(tta_runs: Path) -> None:
    """Precondition of the test above: averaging the views changes the metric here."""
    assert _metric(tta_runs, "ref_tta_cfg") == _metric(tta_runs, "ref_tta_hook")
    assert _metric(tta_runs, "ref_tta_cfg") != _metric(tta_runs, "ref_plain")


# ---- the differential tier: each scenario under MMEngine's runners and under accelkit's -------
INFER_DRIVER = textwrap.dedent(
    """
    import json, sys
    import torch
    from mmengine.infer import BaseInferencer

    class TinyInferencer(BaseInferencer):
        def _init_pipeline(self, cfg):
            return lambda sample: sample

        def visualize(self, inputs, preds, **kwargs):
            return None

        def postprocess(self, preds, visualization, return_datasample=False, **kwargs):
            return dict(predictions=[p.tolist() for p, _ in preds])

    inferencer = TinyInferencer(model=sys.argv[1], weights=sys.argv[2], device="cpu")
    g = torch.Generator().manual_seed(5)
    inputs = [dict(x=torch.randn(8, generator=g), y=torch.tensor(0)) for _ in range(6)]
    result = inferencer(inputs, batch_size=3)
    with open(sys.argv[3], "w") as f:
        json.dump(result["predictions"], f)
    """
)

#: keys of the log processor's scalars that measure time, not training
_TIMING = {"time", "data_time", "memory", "eta"}


def _scalars(root: Path, name: str) -> list[dict]:
    (path,) = (root / name).glob("*/vis_data/scalars.json")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in _TIMING} for line in lines]


def _infer(root: Path, checkpoint: Path, out: str, env: dict | None = None) -> list:
    proc = subprocess.run(
        [sys.executable, str(root / "infer_driver.py"), "tiny_config.py", str(checkpoint), out],
        cwd=root,
        env=_env(root, **(env or {})),
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only: the shared machine can be slow
    )
    if proc.returncode != 0:
        raise AssertionError(f"inferencer failed:\n{proc.stderr[-4000:]}")
    return json.loads((root / out).read_text())


@pytest.fixture(scope="module")
def differential(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each scenario under MMEngine's Runner / FlexibleRunner (default strategy) and under
    AccelkitRunner / FlexibleRunner with AccelkitStrategy (cpu), then plain MMEngine resuming
    and testing from the accelkit run's checkpoint directories."""
    root = tmp_path_factory.mktemp("toolchain_differential")
    _write_project(root)
    (root / "infer_driver.py").write_text(INFER_DRIVER)
    scenarios = {
        "plain": {},
        "ema": dict(ema=True),
        "counting": dict(optim_type="CountingOptimWrapper"),
    }
    reference = [dict(name=f"mm_{n}", work_dir=f"mm_{n}", kw=kw) for n, kw in scenarios.items()]
    reference.append(dict(name="mm_flex", work_dir="mm_flex", runner="flexible"))
    _run(root, "reference_driver.py", reference)
    ours = [dict(name=f"ak_{n}", work_dir=f"ak_{n}", kw=kw) for n, kw in scenarios.items()]
    ours.append(dict(name="ak_flex", work_dir="ak_flex", runner="flexible"))
    for spec in ours:
        spec["accelkit"] = dict(backend="cpu")
    _run(root, "accelkit_driver.py", ours)
    # the toolchain: plain MMEngine, the config's custom_imports naming accelkit's adapter
    tools = [
        dict(
            name="mm_resumes_ak",
            work_dir="mm_resumes_ak",
            kw=dict(load_from=str(root / "ak_plain" / "epoch_1.pth"), resume=True),
        ),
        dict(
            name="mm_tests_ak",
            work_dir="mm_tests_ak",
            kw=dict(load_from=str(root / "ak_plain" / "epoch_2.pth")),
            mode="test",
        ),
        dict(
            name="mm_tests_mm",
            work_dir="mm_tests_mm",
            kw=dict(load_from=str(root / "mm_plain" / "epoch_2.pth")),
            mode="test",
        ),
    ]
    (root / "tools_driver.py").write_text(
        "import accelkit.integrations.mmengine  # what the config's custom_imports does\n"
        + REFERENCE_DRIVER
    )
    # MMEngine's own .pth needs this on torch >= 2.6 (its load_from_local calls torch.load
    # with torch's weights_only default); accelkit's directory does not
    _run(root, "tools_driver.py", tools, env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    return root


def _theirs_and_ours(root: Path, scenario: str) -> tuple[dict, dict]:
    """The epoch-2 checkpoint of each side as MMEngine's readers return it."""
    import torch
    from mmengine.runner.checkpoint import _load_checkpoint

    import accelkit.integrations.mmengine  # noqa: F401  registers the loader, as custom_imports

    theirs = torch.load(root / f"mm_{scenario}" / "epoch_2.pth", weights_only=False)
    ours = _load_checkpoint(str(root / f"ak_{scenario}" / "epoch_2.pth"), map_location="cpu")
    return theirs, ours


def _same_nested(ours, theirs, where: str = "") -> None:
    import numpy as np
    import torch

    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert sorted(ours, key=str) == sorted(theirs, key=str), where
        for key in theirs:
            _same_nested(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same_nested(a, b, f"{where}[{i}]")
    elif isinstance(theirs, np.ndarray):
        assert np.array_equal(ours, theirs), where
    else:
        assert ours == theirs, where


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["plain", "ema"])
def test_checkpoint_reads_as_mmengines_own(differential: Path, scenario: str) -> None:
    """``_load_checkpoint`` of accelkit's directory against ``torch.load`` of MMEngine's file of
    the same run: the same keys; weights (and EMA's averaged ones, in MMEngine's swapped
    layout), optimizer state and scheduler states bit-equal; the message hub's training
    scalars equal. ``meta`` differs only in what names the run (``cfg`` text, experiment name,
    time)."""
    theirs, ours = _theirs_and_ours(differential, scenario)
    assert sorted(ours) == sorted(theirs)
    for key in ("state_dict", "optimizer", "param_schedulers", "ema_state_dict"):
        if key in theirs:
            _same_nested(ours[key], theirs[key], key)
    assert ("ema_state_dict" in theirs) == (scenario == "ema")
    meta_keys = set(theirs["meta"]) - {"time", "cfg", "experiment_name"}  # name the run
    assert set(ours["meta"]) == set(theirs["meta"])
    _same_nested({k: ours["meta"][k] for k in meta_keys}, {k: theirs["meta"][k] for k in meta_keys})
    hub_theirs, hub_ours = theirs["message_hub"], ours["message_hub"]
    for name in ("train/loss", "train/lr"):
        _same_nested(hub_ours["log_scalars"][name].data, hub_theirs["log_scalars"][name].data, name)
    assert set(hub_ours["runtime_info"]) == set(hub_theirs["runtime_info"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["plain", "ema", "counting", "flex"])
def test_training_is_the_same_under_both_runners(differential: Path, scenario: str) -> None:
    """Losses, learning rates (the param schedulers), every hook stage in order, the final
    weights and what the log processor wrote, under MMEngine's runner and accelkit's. The hook
    list differs in one documented name: AccelkitCheckpointHook where CheckpointHook was."""
    root = differential
    theirs, ours = _record(root, f"mm_{scenario}"), _record(root, f"ak_{scenario}")
    for key in ("loss", "lr", "stages", "updates"):
        assert ours[key] == theirs[key], key
    renamed = ["AccelkitCheckpointHook" if h == "CheckpointHook" else h for h in theirs["hooks"]]
    assert ours["hooks"] == renamed
    _assert_same_tensors(_weights(root, f"ak_{scenario}"), _weights(root, f"mm_{scenario}"))
    assert _scalars(root, f"ak_{scenario}") == _scalars(root, f"mm_{scenario}")


@pytest.mark.slow
def test_the_comparison_sees_what_it_compares(differential: Path) -> None:
    """Preconditions: the scenarios differ where the tests above say they match."""
    root = differential
    assert _record(root, "mm_counting")["updates"] == 12
    assert _weights(root, "mm_plain") != {}
    assert any(line.get("lr") for line in _scalars(root, "mm_plain"))
    lrs = _record(root, "mm_plain")["lr"]
    assert len(set(lrs)) > 2  # warm-up and a milestone: the schedulers moved the rate
    stages = _record(root, "mm_plain")["stages"]
    assert stages[0] == "before_run" and stages[-1] == "after_run" and "after_train_iter" in stages
    theirs, _ = _theirs_and_ours(root, "ema")
    plain, _ = _theirs_and_ours(root, "plain")
    assert not plain["state_dict"]["net.0.weight"].equal(theirs["state_dict"]["net.0.weight"])


@pytest.mark.slow
def test_plain_mmengine_resumes_an_accelkit_checkpoint(differential: Path) -> None:
    """Plain MMEngine's ``resume`` from AccelkitRunner's epoch-1 directory, without a
    conversion: it continues as the uninterrupted run (optimizer, schedulers, message hub)."""
    root = differential
    resumed = _record(root, "mm_resumes_ak")
    whole = _record(root, "ak_plain")
    assert resumed["loss"] == whole["loss"][len(whole["loss"]) - len(resumed["loss"]) :]
    assert len(resumed["loss"]) == len(whole["loss"]) // 2
    _assert_same_tensors(_weights(root, "mm_resumes_ak"), _weights(root, "ak_plain"))


@pytest.mark.slow
def test_plain_mmengine_tests_from_an_accelkit_checkpoint(differential: Path) -> None:
    """``load_from`` in plain MMEngine's config (``tools/test.py CONFIG CHECKPOINT``): the same
    metric as testing MMEngine's own checkpoint of the same run."""
    root = differential
    assert _metric(root, "mm_tests_ak") == _metric(root, "mm_tests_mm")


@pytest.mark.slow
def test_an_inferencer_loads_the_runs_checkpoint(differential: Path) -> None:
    """An MMEngine ``BaseInferencer`` given the config file and accelkit's checkpoint predicts
    what it predicts from MMEngine's own checkpoint of the same run."""
    root = differential
    ours = _infer(root, root / "ak_plain" / "epoch_2.pth", "ours.json")
    theirs = _infer(
        root,
        root / "mm_plain" / "epoch_2.pth",
        "theirs.json",
        {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
    )
    assert ours == theirs and len(ours) == 6


# ---- checkpoints of several processes, opened by a one-process tool (slow) ----------------------
@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("toolchain_dist")
    _write_project(root)
    specs = [
        dict(name=b, work_dir=b, accelkit=dict(backend=b), kw=dict(launcher="pytorch"))
        for b in ("ddp", "deepspeed_stage_2")
    ]
    _run(root, "accelkit_driver.py", specs, nproc=2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "deepspeed_stage_2"])
def test_a_two_process_checkpoint_opens_in_one_process(
    distributed_runs: Path, backend: str
) -> None:
    """``Config.fromfile`` + ``load_checkpoint`` in one fresh process opens a checkpoint that two
    ranks wrote: the weights are bit-equal to the trained model's."""
    root = distributed_runs
    checkpoint = root / backend / "epoch_2.pth"
    assert (checkpoint / "rank-00001.safetensors").is_file()
    loaded = _load_in_fresh_process(root, checkpoint, f"{backend}.pt")
    _assert_same_tensors(loaded["model"], _weights(root, backend))
    assert loaded["raw"]["meta"]["epoch"] == 2
