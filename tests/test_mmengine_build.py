"""What the MMEngine adapter builds from a config, against what MMEngine builds from it.

- DDP wraps the model as MMEngine's own DDP does (``broadcast_buffers=False`` unless
  ``model_wrapper_cfg`` says otherwise): BatchNorm statistics and the distributed validation
  metric are MMEngine's (2 gloo processes, plain MMEngine's Runner as the reference).
- Several optimizers (a constructor building an ``OptimWrapperDict``) build accelkit's wrappers;
  what accelkit cannot honour (wrappers that clip differently) is refused before the model is
  built (the training itself: tests/test_mmengine_gan.py).
- An invalid ``optim_wrapper`` raises the exception type plain MMEngine raises for it (and
  accelkit's ``ConfigError``).
- ``AmpOptimWrapper(loss_scale=...)`` sets the fp16 GradScaler, or is refused.

References run in processes that import nothing from accelkit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("mmengine")

# ---- the user's project: MMEngine's tutorial shape (conv net with BatchNorm, tensor metric) ----
PROJECT = textwrap.dedent(
    '''
    import json, os
    import torch
    from torch import nn
    from mmengine.evaluator import BaseMetric
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, HOOKS, METRICS, MODELS


    @MODELS.register_module(force=True)
    class BNConvNet(BaseModel):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
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


    @DATASETS.register_module(force=True)
    class Images(torch.utils.data.Dataset):
        """Each rank's shard has its own brightness: BatchNorm statistics differ per rank."""

        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            self.labels = torch.randint(0, 4, (n,), generator=g)
            shift = torch.arange(n, dtype=torch.float32)[:, None, None, None] % 2
            self.imgs = torch.randn(n, 3, 8, 8, generator=g) + 2.0 * shift
            self.imgs[:, 0] += self.labels[:, None, None]

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return dict(imgs=self.imgs[i], labels=self.labels[i])


    @METRICS.register_module(force=True)
    class Accuracy(BaseMetric):
        """MMEngine's tutorial metric: results and the metric are tensors."""

        def process(self, data_batch, data_samples):
            score, gt = data_samples
            self.results.append({
                "batch_size": len(gt),
                "correct": (score.argmax(dim=1) == gt).sum().cpu(),
                "score": score.max(dim=1).values.sum().cpu(),
            })

        def compute_metrics(self, results):
            total_correct = sum(item["correct"] for item in results)
            total_size = sum(item["batch_size"] for item in results)
            total_score = sum(item["score"] for item in results)
            return dict(accuracy=100 * total_correct / total_size,
                        mean_score=total_score / total_size)


    @HOOKS.register_module(force=True)
    class RecordBN(Hook):
        priority = "LOWEST"

        def __init__(self, out):
            self.out, self.val = out, []

        def after_val_epoch(self, runner, metrics=None):
            self.val.append({k: float(v) for k, v in (metrics or {}).items()})

        def after_run(self, runner):
            model = runner.model
            model = getattr(model, "module", model)
            buffers = {k.removeprefix("module."): v.flatten().tolist()
                       for k, v in model.named_buffers() if "running" in k}
            rank = int(os.environ.get("RANK", 0))
            with open(f"{self.out}.rank{rank}.json", "w") as f:
                json.dump(dict(buffers=buffers, val=self.val), f)


    def bn_cfg(work_dir, record, model_wrapper_cfg=None):
        loader = dict(batch_size=4, num_workers=0, collate_fn=dict(type="default_collate"))
        cfg = dict(
            model=dict(type="BNConvNet"),
            work_dir=work_dir,
            train_dataloader=dict(dataset=dict(type="Images", n=32, seed=0),
                                  sampler=dict(type="DefaultSampler", shuffle=False), **loader),
            val_dataloader=dict(dataset=dict(type="Images", n=16, seed=1),
                                sampler=dict(type="DefaultSampler", shuffle=False), **loader),
            val_evaluator=dict(type="Accuracy"),
            train_cfg=dict(by_epoch=True, max_epochs=2, val_interval=1),
            val_cfg=dict(),
            optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05, momentum=0.9)),
            default_hooks=dict(checkpoint=None, logger=dict(type="LoggerHook", interval=50)),
            custom_hooks=[dict(type="RecordBN", out=record)],
            randomness=dict(seed=3),
            launcher="pytorch",
            env_cfg=dict(dist_cfg=dict(backend="gloo")),
            log_level="WARNING",
        )
        if model_wrapper_cfg is not None:
            cfg["model_wrapper_cfg"] = model_wrapper_cfg
        return cfg
    '''
)

# plain MMEngine. Patched for the CPU only: MMEngine's init_dist calls torch.cuda.set_device
# (join gloo first), and its wrap_model passes device_ids=[LOCAL_RANK], which DDP refuses for a
# CPU module; every other DDP argument (broadcast_buffers included) is MMEngine's own.
REFERENCE = textwrap.dedent(
    """
    import json, sys, time
    import torch.distributed as dist
    from mmengine.model import MMDistributedDataParallel
    from mmengine.runner import Runner
    from bn_project import bn_cfg

    mm_init = MMDistributedDataParallel.__init__

    def cpu_init(self, module, detect_anomalous_params=False, **kwargs):
        kwargs["device_ids"] = None
        mm_init(self, module, detect_anomalous_params, **kwargs)

    MMDistributedDataParallel.__init__ = cpu_init
    dist.init_process_group("gloo")
    for spec in json.loads(sys.argv[1]):
        Runner.from_cfg(bn_cfg(spec["work_dir"], spec["record"], spec["wrapper"])).train()
    dist.destroy_process_group()
    time.sleep(0.1)
    """
)

ADAPTER = textwrap.dedent(
    """
    import json, sys, time
    import torch.distributed as dist
    import accelkit.integrations.mmengine  # noqa: F401
    from mmengine.registry import RUNNERS
    from bn_project import bn_cfg

    for spec in json.loads(sys.argv[1]):
        cfg = bn_cfg(spec["work_dir"], spec["record"], spec["wrapper"])
        cfg.update(runner_type="AccelkitRunner", accelkit=dict(backend="ddp"))
        RUNNERS.build(cfg).train()
    dist.destroy_process_group()
    time.sleep(0.1)
    """
)


def _launch(root: Path, driver: str, specs: list[dict]) -> None:
    from accelkit.distributed import free_port

    for spec in specs:
        spec["work_dir"] = str(root / spec["name"])
        spec["record"] = str(root / spec["name"])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(root / driver),
        json.dumps(specs),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{driver}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def bn_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MMEngine's DDP Runner and AccelkitRunner on ddp, 2 gloo processes each: with MMEngine's
    default wrapping, and with model_wrapper_cfg=dict(broadcast_buffers=True)."""
    root = tmp_path_factory.mktemp("mmengine_bn")
    (root / "bn_project.py").write_text(PROJECT)
    (root / "reference.py").write_text(REFERENCE)
    (root / "adapter.py").write_text(ADAPTER)
    explicit = dict(type="MMDistributedDataParallel", broadcast_buffers=True)
    for side, driver in (("ref", "reference.py"), ("ours", "adapter.py")):
        specs = [
            dict(name=f"{side}_default", wrapper=None),
            dict(name=f"{side}_broadcast", wrapper=explicit),
        ]
        _launch(root, driver, specs)
    return root


def _bn_record(root: Path, name: str, rank: int) -> dict:
    return json.loads((root / f"{name}.rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", "broadcast"])
def test_batchnorm_and_validation_follow_mmengine_ddp(bn_runs: Path, variant: str) -> None:
    ours, ref = (_bn_record(bn_runs, f"{side}_{variant}", 1) for side in ("ours", "ref"))
    assert ours["buffers"] == ref["buffers"]  # bit for bit: the same DDP math
    assert ours["val"] == ref["val"]
    assert len(ref["val"]) == 2
    assert _bn_record(bn_runs, f"ours_{variant}", 0) == _bn_record(bn_runs, f"ref_{variant}", 0)


@pytest.mark.slow
def test_the_bn_comparison_can_tell_the_defaults_apart(bn_runs: Path) -> None:
    """Broadcasting buffers changes rank 1's statistics and the metric: the test above would
    see accelkit's former default (torch's broadcast_buffers=True)."""
    default, broadcast = (_bn_record(bn_runs, f"ref_{v}", 1) for v in ("default", "broadcast"))
    assert default["buffers"] != broadcast["buffers"]
    assert default["val"] != broadcast["val"]


def _adapter(backend: str, **options: object):
    from accelkit.integrations.mmengine._settings import AdapterOptions

    return AdapterOptions.parse(dict(backend=backend, **options), "accelkit")


def test_wrapper_options_follow_mmengine_defaults() -> None:
    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine._settings import mmengine_wrapper_options

    assert mmengine_wrapper_options(_adapter("ddp")) == {"broadcast_buffers": False}
    assert mmengine_wrapper_options(_adapter("ddp"), find_unused_parameters=True) == {
        "broadcast_buffers": False,
        "find_unused_parameters": True,
    }
    # what the user chose wins: the section, or the backend config
    assert mmengine_wrapper_options(_adapter("ddp", broadcast_buffers=True)) == {}
    with_config = _adapter("ddp", config=dict(broadcast_buffers=True))
    assert mmengine_wrapper_options(with_config) == {}
    # an explicit model_wrapper_cfg means what it means in MMEngine (torch's default: True)
    wrapper = dict(type="MMDistributedDataParallel", broadcast_buffers=True, device_ids=[0])
    assert mmengine_wrapper_options(_adapter("ddp"), wrapper) == {"broadcast_buffers": True}
    assert mmengine_wrapper_options(_adapter("ddp"), dict(find_unused_parameters=True)) == {
        "find_unused_parameters": True
    }
    # backends without DDP's options get none
    assert mmengine_wrapper_options(_adapter("cpu")) == {}
    assert mmengine_wrapper_options(_adapter("fsdp")) == {}
    assert mmengine_wrapper_options(_adapter("cpu"), wrapper, distributed=False) == {}
    with pytest.raises(ConfigError, match="backend wraps the model"):
        mmengine_wrapper_options(_adapter("fsdp"), wrapper)
    with pytest.raises(ConfigError, match="backend wraps the model"):
        mmengine_wrapper_options(_adapter("ddp"), dict(detect_anomalous_params=True))
    with pytest.raises(ConfigError, match="disagrees"):
        mmengine_wrapper_options(_adapter("ddp", broadcast_buffers=False), wrapper)


# ---- several optimizers ---------------------------------------------------------------------
GAN_PROJECT = textwrap.dedent(
    """
    import torch
    from torch import nn
    from mmengine.model import BaseModel
    from mmengine.optim import OptimWrapperDict, build_optim_wrapper
    from mmengine.registry import MODELS, OPTIM_WRAPPER_CONSTRUCTORS

    BUILT = []


    @MODELS.register_module(force=True)
    class ToyGAN(BaseModel):
        def __init__(self):
            super().__init__()
            BUILT.append(self)
            self.generator = nn.Linear(4, 4)
            self.discriminator = nn.Linear(4, 1)

        def forward(self, x, mode="tensor"):
            return self.discriminator(self.generator(x))


    @OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
    class MultipleOptimWrapperConstructor:
        '''MMEngine's documented multi-optimizer constructor: one wrapper per sub-module.'''

        def __init__(self, optim_wrapper_cfg, paramwise_cfg=None):
            self.optim_wrapper_cfg = optim_wrapper_cfg

        def __call__(self, model):
            model = getattr(model, "module", model)
            wrappers = {}
            for key, cfg in self.optim_wrapper_cfg.items():
                cfg = cfg.copy()
                wrappers[key] = build_optim_wrapper(getattr(model, key), cfg)
            return OptimWrapperDict(**wrappers)
    """
)


def gan_cfg(work_dir: str, **optim_wrapper: object) -> dict:
    return dict(
        model=dict(type="ToyGAN"),
        work_dir=work_dir,
        train_dataloader=dict(
            dataset=[dict(x=[0.0, 1.0, 2.0, 3.0])] * 4,
            batch_size=2,
            sampler=dict(type="DefaultSampler"),
            collate_fn=dict(type="default_collate"),
        ),
        train_cfg=dict(by_epoch=True, max_epochs=1),
        optim_wrapper=optim_wrapper,
        default_hooks=dict(checkpoint=None),
        log_level="WARNING",
    )


MULTI = dict(
    constructor="MultipleOptimWrapperConstructor",
    generator=dict(optimizer=dict(type="SGD", lr=0.1)),
    discriminator=dict(optimizer=dict(type="SGD", lr=0.1)),
)


@pytest.fixture()
def gan_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "gan_project.py").write_text(GAN_PROJECT)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("gan_project", None)
    import gan_project

    yield gan_project
    sys.modules.pop("gan_project", None)


@pytest.mark.slow  # plain MMEngine's own run, the reference side: 15-30 s
def test_plain_mmengine_builds_the_multi_optimizer_config(tmp_path: Path) -> None:
    """The config is valid MMEngine: its Runner builds an OptimWrapperDict from it."""
    (tmp_path / "gan_project.py").write_text(GAN_PROJECT)
    script = textwrap.dedent(
        f"""
        import gan_project
        from mmengine.runner import Runner
        from test_cfg import gan_cfg, MULTI
        runner = Runner.from_cfg(gan_cfg({str(tmp_path / "ref")!r}, **MULTI))
        wrapper = runner.build_optim_wrapper(runner.optim_wrapper)
        print(type(wrapper).__name__, sorted(wrapper.keys()))
        """
    )
    (tmp_path / "test_cfg.py").write_text("MULTI = " + repr(MULTI) + "\n\n" + _source_of(gan_cfg))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OptimWrapperDict ['discriminator', 'generator']" in proc.stdout


def _source_of(function) -> str:
    import inspect

    return inspect.getsource(function)


def test_several_optimizers_build_accelkit_wrappers(tmp_path: Path, gan_project) -> None:
    from mmengine.optim import OptimWrapperDict
    from mmengine.registry import RUNNERS

    from accelkit.integrations.mmengine import AccelkitOptimWrapper

    cfg = gan_cfg(str(tmp_path / "ours"), **MULTI)
    cfg.update(runner_type="AccelkitRunner", accelkit=dict(backend="cpu"))
    runner = RUNNERS.build(cfg)
    wrapper = runner.build_optim_wrapper(runner.optim_wrapper)
    assert isinstance(wrapper, OptimWrapperDict)
    assert sorted(wrapper.keys()) == ["discriminator", "generator"]
    assert all(type(w) is AccelkitOptimWrapper for w in wrapper.values())


def test_several_optimizers_that_clip_differently_are_refused_before_anything_is_built(
    tmp_path: Path, gan_project
) -> None:
    from mmengine.registry import RUNNERS

    from accelkit.errors import ConfigError

    multi = dict(MULTI, generator=dict(MULTI["generator"], clip_grad=dict(max_norm=1.0)))
    cfg = gan_cfg(str(tmp_path / "ours"), **multi)
    cfg.update(runner_type="AccelkitRunner", accelkit=dict(backend="cpu"))
    with pytest.raises(ConfigError) as caught:
        RUNNERS.build(cfg)
    message = str(caught.value)
    assert "differ in clip_grad max_norm" in message, message
    assert "generator: 1.0" in message and "discriminator: None" in message
    assert gan_project.BUILT == []  # refused before the model was built


def test_a_constructor_that_builds_several_optimizers_is_refused(
    tmp_path: Path, gan_project
) -> None:
    """A constructor with an 'optimizer' key that still returns an OptimWrapperDict."""
    from mmengine.optim import OptimWrapperDict, build_optim_wrapper
    from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS, RUNNERS

    from accelkit.errors import ConfigError

    @OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
    class SameOptimizerTwice:
        def __init__(self, optim_wrapper_cfg, paramwise_cfg=None):
            self.cfg = optim_wrapper_cfg

        def __call__(self, model):
            return OptimWrapperDict(
                generator=build_optim_wrapper(
                    model.generator, dict(optimizer=self.cfg["optimizer"])
                ),
                discriminator=build_optim_wrapper(
                    model.discriminator, dict(optimizer=self.cfg["optimizer"])
                ),
            )

    cfg = gan_cfg(
        str(tmp_path / "twice"),
        constructor="SameOptimizerTwice",
        optimizer=dict(type="SGD", lr=0.1),
    )
    cfg.update(runner_type="AccelkitRunner", accelkit=dict(backend="cpu"))
    runner = RUNNERS.build(cfg)
    with pytest.raises(ConfigError, match=r"built an OptimWrapperDict.*read as one optimizer"):
        runner.train()


# ---- exception types: what plain MMEngine raises ---------------------------------------------
INVALID = {
    "string": "SGD",
    "list": [dict(type="SGD", lr=0.1)],
    "number": 5,
    "clip_grad_unknown_key": dict(
        optimizer=dict(type="SGD", lr=0.1), clip_grad=dict(max_norm=1.0, bogus=1)
    ),
    "loss_scale_bad_string": dict(
        type="AmpOptimWrapper", optimizer=dict(type="SGD", lr=0.1), loss_scale="static"
    ),
    "loss_scale_unknown_key": dict(
        type="AmpOptimWrapper", optimizer=dict(type="SGD", lr=0.1), loss_scale=dict(bogus=1)
    ),
}

# plain MMEngine on the CPU: AmpOptimWrapper asserts a CUDA device before it reads loss_scale;
# the check is patched so that the reference reaches the loss_scale handling (its GradScaler is
# built disabled on the CPU, which does not matter to the exception raised)
EXCEPTIONS_REFERENCE = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    from mmengine.model import BaseModel
    from mmengine.optim.optimizer import amp_optimizer_wrapper
    from mmengine.runner import Runner

    amp_optimizer_wrapper.is_cuda_available = lambda: True


    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 2)

        def forward(self, x, y, mode="tensor"):
            out = self.net(x)
            return {"loss": nn.functional.cross_entropy(out, y)} if mode == "loss" else out


    raised = {}
    for name, optim_wrapper in json.loads(sys.argv[1]).items():
        try:
            Runner(
                model=Net(),
                work_dir=sys.argv[2] + "/" + name,
                train_dataloader=dict(dataset=[dict(x=torch.ones(4), y=0)] * 4, batch_size=2,
                                      sampler=dict(type="DefaultSampler"),
                                      collate_fn=dict(type="default_collate")),
                train_cfg=dict(by_epoch=True, max_epochs=1),
                optim_wrapper=optim_wrapper,
                default_hooks=dict(checkpoint=None),
                log_level="WARNING",
            ).train()
        except Exception as err:
            raised[name] = [type(err).__name__, str(err)]
        else:
            raised[name] = None
    print(json.dumps(raised))
    """
)


@pytest.fixture(scope="module")
def mmengine_raises(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("mmengine_raises")
    proc = subprocess.run(
        [sys.executable, "-c", EXCEPTIONS_REFERENCE, json.dumps(INVALID), str(root)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_optim_wrapper_raises_what_mmengine_raises(
    tmp_path: Path, mmengine_raises: dict, name: str
) -> None:
    import builtins

    import torch
    from mmengine.model import BaseModel
    from torch import nn

    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine import AccelkitRunner

    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 2)

        def forward(self, x, y, mode="tensor"):
            out = self.net(x)
            return {"loss": nn.functional.cross_entropy(out, y)} if mode == "loss" else out

    expected_type, expected_message = mmengine_raises[name]
    expected = getattr(builtins, expected_type)
    with pytest.raises(ConfigError) as caught:
        AccelkitRunner(
            accelkit=dict(backend="cpu"),
            model=Net(),
            work_dir=str(tmp_path / name),
            train_dataloader=dict(
                dataset=[dict(x=torch.ones(4), y=0)] * 4,
                batch_size=2,
                sampler=dict(type="DefaultSampler"),
                collate_fn=dict(type="default_collate"),
            ),
            train_cfg=dict(by_epoch=True, max_epochs=1),
            optim_wrapper=INVALID[name],
            default_hooks=dict(checkpoint=None),
            log_level="WARNING",
        ).train()
    assert isinstance(caught.value, expected), (type(caught.value).__mro__, expected)
    if expected_message.startswith("optimizer wrapper should be"):
        # Runner.build_optim_wrapper's own words, which users and MMEngine's tests match on
        assert str(caught.value) == expected_message


def test_the_reference_raises_type_errors(mmengine_raises: dict) -> None:
    """What the test above holds the adapter to: plain MMEngine 0.10 raises TypeError for each
    (at ``train()``; the adapter refuses at construction), in Runner.build_optim_wrapper's
    words for a value that is neither a dict nor an OptimWrapper."""
    assert {name: raised[0] for name, raised in mmengine_raises.items()} == {
        name: "TypeError" for name in INVALID
    }
    worded = {
        n for n, raised in mmengine_raises.items() if "should be an OptimWrapper" in raised[1]
    }
    assert worded == {"string", "list", "number"}


# ---- AmpOptimWrapper loss_scale -------------------------------------------------------------
def _amp(**kwargs: object) -> dict:
    return dict(type="AmpOptimWrapper", optimizer=dict(type="SGD", lr=0.1), **kwargs)


@pytest.mark.parametrize(
    ("loss_scale", "scaler", "static"),
    [
        ("dynamic", None, None),
        (512.0, {"init_scale": 512.0}, 512.0),
        (128, {"init_scale": 128.0}, 128.0),
        (
            dict(init_scale=256.0, growth_interval=1, backoff_factor=0.25),
            {"init_scale": 256.0, "growth_interval": 1, "backoff_factor": 0.25},
            None,
        ),
        (dict(growth_factor=4.0, enabled=True), {"growth_factor": 4.0}, None),
    ],
)
def test_loss_scale_maps_onto_grad_scaler_arguments(loss_scale, scaler, static) -> None:
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    cfg, settings = read_optim_wrapper_cfg(_amp(loss_scale=loss_scale))
    assert settings.precision == "16-mixed" and "loss_scale" not in cfg
    assert (settings.grad_scaler, settings.static_loss_scale) == (scaler, static)
    # no loss_scale: MMEngine's default, 'dynamic'
    assert read_optim_wrapper_cfg(_amp())[1].grad_scaler is None


@pytest.mark.parametrize(
    ("loss_scale", "dtype", "message"),
    [
        (-1.0, "float16", "positive"),
        (dict(growth_factor=0.5), "float16", "growth factor"),
        (dict(enabled=False), "float16", "turns fp16 loss scaling off"),
        (512.0, "bfloat16", "bf16-mixed scales no loss"),
    ],
)
def test_bad_loss_scale_is_refused(loss_scale, dtype: str, message: str) -> None:
    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    with pytest.raises(ConfigError, match=message):
        read_optim_wrapper_cfg(_amp(loss_scale=loss_scale, dtype=dtype))


def test_amp_optim_wrapper_on_the_cpu_is_refused_as_mmengine_refuses_it() -> None:
    """``tools/train.py --amp`` on a CPU: MMEngine's AmpOptimWrapper asserts a GPU (NPU, MLU,
    MUSA); accelkit would train fp16 on the CPU, far slower than fp32. Refused when only the
    AmpOptimWrapper asks; runs when the accelkit section asks for the precision itself."""
    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine._bridge import Bridge
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    for dtype, precision in (("float16", "16-mixed"), ("bfloat16", "bf16-mixed")):
        _, settings = read_optim_wrapper_cfg(_amp(dtype=dtype))
        with pytest.raises(ConfigError, match=r"--amp.*MMEngine refuses AmpOptimWrapper"):
            Bridge(_adapter("cpu")).build_accelerator(settings)
        asked = Bridge(_adapter("cpu", precision=precision)).build_accelerator(settings)
        assert asked.precision == precision
    _, plain = read_optim_wrapper_cfg(dict(optimizer=dict(type="SGD", lr=0.1)))
    assert Bridge(_adapter("cpu")).build_accelerator(plain).precision == "32-true"


def _grad_scaler_of(bridge) -> object:
    return bridge.accel.backend.precision.scaler


@pytest.mark.parametrize(
    ("loss_scale", "init", "growth", "backoff", "interval"),
    [
        ("dynamic", 65536.0, 2.0, 0.5, 2000),  # MMEngine's GradScaler() is accelkit's default
        (dict(init_scale=256.0, growth_interval=1), 256.0, 2.0, 0.5, 1),
        (1024.0, 1024.0, 2.0, 0.5, 2000),
    ],
)
def test_the_built_accelerator_scales_as_asked(loss_scale, init, growth, backoff, interval) -> None:
    from accelkit.integrations.mmengine._bridge import Bridge
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    _, settings = read_optim_wrapper_cfg(_amp(loss_scale=loss_scale))
    bridge = Bridge(_adapter("cpu", precision="16-mixed"))  # fp16 on the CPU: asked for
    bridge.build_accelerator(settings)
    scaler = _grad_scaler_of(bridge)
    assert bridge.accel.precision == "16-mixed"
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor()) == (
        init,
        growth,
        backoff,
    )
    assert scaler.get_growth_interval() == interval


def test_a_number_is_a_static_loss_scale_as_in_mmengine() -> None:
    """MMEngine calls ``loss_scaler.update(loss_scale)`` after every step: the scale stays."""
    import torch

    from accelkit.integrations.mmengine._bridge import Bridge
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    _, settings = read_optim_wrapper_cfg(_amp(loss_scale=512.0, clip_grad=dict(max_norm=1e9)))
    bridge = Bridge(_adapter("cpu", precision="16-mixed"))  # fp16 on the CPU: asked for
    accel = bridge.build_accelerator(settings)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scales = []
    for inputs in (torch.ones(2, 4), torch.full((2, 4), float("inf")), torch.ones(2, 4)):
        loss = model(inputs).float().sum()
        accel.backward(loss, model=model)
        accel.step(optimizer)
        accel.zero_grad(optimizer)
        scales.append(_grad_scaler_of(bridge).get_scale())
    assert scales == [512.0, 512.0, 512.0]  # not backed off after the overflow


def test_a_dynamic_dict_scale_grows_as_gradscaler_does() -> None:
    import torch

    from accelkit.integrations.mmengine._bridge import Bridge
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    _, settings = read_optim_wrapper_cfg(_amp(loss_scale=dict(init_scale=8.0, growth_interval=1)))
    bridge = Bridge(_adapter("cpu", precision="16-mixed"))  # fp16 on the CPU: asked for
    accel = bridge.build_accelerator(settings)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        accel.backward(model(torch.ones(2, 4)).float().sum(), model=model)
        accel.step(optimizer)
        accel.zero_grad(optimizer)
    accel.backward(model(torch.ones(2, 4)).float().sum(), model=model)  # applies the last update
    assert _grad_scaler_of(bridge).get_scale() == 64.0


def test_loss_scale_is_refused_where_no_grad_scaler_runs() -> None:
    from accelkit.errors import UnsupportedError
    from accelkit.integrations.mmengine._bridge import apply_loss_scale
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg
    from accelkit.precision import BoundaryCastPrecision

    _, settings = read_optim_wrapper_cfg(_amp(loss_scale=512.0))
    # a backend whose library scales the loss itself (what DeepSpeed's backend holds)
    library_scaled = SimpleNamespace(
        name="deepspeed",
        precision="16-mixed",
        backend=SimpleNamespace(precision=BoundaryCastPrecision("16-mixed")),
    )
    with pytest.raises(UnsupportedError, match="deepspeed: loss_scale"):
        apply_loss_scale(library_scaled, settings)
    _, dynamic = read_optim_wrapper_cfg(_amp(loss_scale="dynamic"))
    apply_loss_scale(library_scaled, dynamic)  # 'dynamic': the library's own dynamic scaling


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_an_amp_dtype_accelkit_does_not_run_is_refused(dtype: str) -> None:
    """MMEngine's AmpOptimWrapper also takes float32/float64 (autocast to that dtype); accelkit
    would have trained it as fp16. Refused, naming the wrapper to use."""
    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    with pytest.raises(ConfigError, match="'OptimWrapper' instead"):
        read_optim_wrapper_cfg(_amp(dtype=dtype))
    for accepted, precision in (("float16", "16-mixed"), ("bfloat16", "bf16-mixed")):
        assert read_optim_wrapper_cfg(_amp(dtype=accepted))[1].precision == precision


def test_clipping_that_only_the_backend_config_asks_for_is_refused() -> None:
    """MMEngine's clip_grad decides clipping: a backend whose own config clips (a native DeepSpeed
    config without gradient_clipping clips at 1.0) is refused unless optim_wrapper agrees."""
    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine._bridge import check_clipping
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    sgd = dict(optimizer=dict(type="SGD", lr=0.1))
    _, no_clip = read_optim_wrapper_cfg(sgd)
    _, clip_at_1 = read_optim_wrapper_cfg(dict(sgd, clip_grad=dict(max_norm=1.0)))
    _, clip_at_2 = read_optim_wrapper_cfg(dict(sgd, clip_grad=dict(max_norm=2.0)))
    clips_at_1 = SimpleNamespace(name="deepspeed", max_grad_norm=1.0)
    with pytest.raises(ConfigError, match=r"optim_wrapper has no clip_grad.*'gradient_clipping'"):
        check_clipping(clips_at_1, no_clip)
    with pytest.raises(ConfigError, match=r"clips at max_norm=2\.0"):
        check_clipping(clips_at_1, clip_at_2)
    check_clipping(clips_at_1, clip_at_1)
    check_clipping(SimpleNamespace(name="deepspeed", max_grad_norm=None), no_clip)


def _eval_runner(runner_class: type, tmp_path: Path, model: object) -> object:
    import torch

    return runner_class(
        model=model,
        work_dir=str(tmp_path),
        val_dataloader=dict(
            dataset=[dict(x=torch.ones(4), y=0)] * 4,
            batch_size=2,
            sampler=dict(type="DefaultSampler", shuffle=False),
            collate_fn=dict(type="default_collate"),
        ),
        val_cfg=dict(),
        val_evaluator=dict(type="ToyLossMetric"),
        default_hooks=dict(checkpoint=None),
        log_level="WARNING",
    )


def test_val_without_training_does_not_initialise_weights_as_in_mmengine(tmp_path: Path) -> None:
    """MMEngine's ``val()`` evaluates the model as built (``init_weights`` runs in ``train()``
    only): a model with a random ``init_cfg`` keeps its weights under both Runners."""
    import functools

    import torch
    from mmengine.evaluator import BaseMetric
    from mmengine.model import BaseModel
    from mmengine.registry import METRICS
    from mmengine.runner import Runner

    from accelkit.integrations.mmengine import AccelkitRunner

    @METRICS.register_module(name="ToyLossMetric", force=True)
    class ToyLossMetric(BaseMetric):
        def process(self, data_batch, data_samples):
            self.results.append(len(data_samples))

        def compute_metrics(self, results):
            return {"sum": sum(results)}

    class Net(BaseModel):
        def __init__(self):
            super().__init__(init_cfg=dict(type="Normal", layer="Linear", std=10.0))
            self.net = torch.nn.Linear(4, 2)

        def forward(self, x, y, mode="tensor"):
            return self.net(x)

    weights = {}
    for name, runner_class in (
        ("mmengine", Runner),
        ("accelkit", functools.partial(AccelkitRunner, accelkit=dict(backend="cpu"))),
    ):
        torch.manual_seed(0)
        model = Net()
        built = model.net.weight.detach().clone()
        _eval_runner(runner_class, tmp_path / name, model).val()
        weights[name] = (built, model.net.weight.detach().clone())
    for name, (built, after) in weights.items():
        assert torch.equal(built, after), f"{name}: val() changed the weights"
    # the check can fail: the init_cfg does change weights when it runs
    torch.manual_seed(0)
    model = Net()
    before = model.net.weight.detach().clone()
    model.init_weights()
    assert not torch.equal(before, model.net.weight)
