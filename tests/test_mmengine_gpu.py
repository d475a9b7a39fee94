"""MMEngine's ``AmpOptimWrapper`` on a GPU: the adapter against plain MMEngine (issue 23).

The project is shaped like MMEngine's 15-minute tutorial (a BatchNorm CNN on CIFAR-10-shaped
images, SGD with momentum, the classic ``Runner``), trained 20 iterations over two epochs with
``optim_wrapper=dict(type='AmpOptimWrapper', dtype='bfloat16' | 'float16', ...)``:

- the reference is plain MMEngine on ``cuda``, in a process that imports nothing from accelkit
  (``REFERENCE_DRIVER``);
- ``AccelkitRunner`` on the ``cuda`` backend runs the same math (autocast, and for fp16 torch's
  GradScaler with MMEngine's settings; MMEngine's bf16 GradScaler multiplies the loss by a power
  of two and divides the gradients by it again, which is exact), so it must equal the reference
  bit for bit: losses, learning rates, gradient norms, fp16 loss scales, final weights and
  BatchNorm statistics, for ``loss_scale='dynamic'``, a number and a dict;
- ``AccelkitRunner`` on ``deepspeed_stage_2`` (one process) does other math: flat fp32
  partitions, DeepSpeed's own overflow check and GradScaler, and DeepSpeed's ``torch_autocast``
  reduces the gradients of Linear and Conv layers in the autocast dtype (on one process without
  accumulation that rounds nothing: those gradients are already bf16/fp16 values, autocast's
  backward of the low-precision weight copy). It must stay within a floor measured in the same
  run: no farther from MMEngine's AMP run than MMEngine's AMP run is from MMEngine's fp32 run (the
  rounding of the autocast itself), and the report says whether it is bit for bit. Measured in a
  CPU dry run (bf16 on both sides, DeepSpeed's CPU accelerator): floor 7.0e-4 in the losses and
  5.2e-3 in the weights; ZeRO-2 was bit for bit, with and without ``lower_precision_safe_modules``.

Noise floor: cuDNN may pick backward algorithms that add in a varying order; the project sets
``torch.backends.cudnn.deterministic`` (on both sides), and the reference runs twice and must
repeat itself bit for bit (``test_reference_repeats_itself``).

Each side runs its configurations in one process; a configuration that raises is recorded and
the others still run (a GPU run is scarce). What was measured (per pair: steps, max abs loss and
weight difference, loss scales) is appended as JSON lines to
``$ACCELKIT_GPU_REPORT/mmengine-amp-gpu.jsonl`` when that variable names a folder. Run with::

    ACCELKIT_GPU_REPORT=/some/dir python3 -m pytest -q -m gpu -o addopts="" tests/test_mmengine_gpu.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

# ---- the user's project, shared by both sides ---------------------------------------------------
PROJECT = textwrap.dedent(
    '''
    import json
    import torch
    from torch import nn
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, HOOKS, MODELS

    # cuDNN's default backward algorithms may add in a varying order; this makes two runs of
    # the same config comparable bit for bit (both sides set it: it is part of the project)
    torch.backends.cudnn.deterministic = True


    @MODELS.register_module(force=True)
    class SmallBNNet(BaseModel):
        """The tutorial's ResNet, shrunk: conv, BatchNorm, ReLU; global mean; linear head."""

        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(128),
                nn.ReLU())
            self.head = nn.Linear(128, 10)

        def forward(self, imgs, labels, mode="tensor"):
            logits = self.head(self.backbone(imgs).mean(dim=(2, 3)))
            if mode == "loss":
                return {"loss": nn.functional.cross_entropy(logits, labels)}
            if mode == "predict":
                return logits, labels
            return logits


    @DATASETS.register_module(force=True)
    class RandomCifar(torch.utils.data.Dataset):
        """CIFAR-10-shaped images whose class is one of ten fixed patterns plus noise."""

        def __init__(self, n=320, seed=0):
            g = torch.Generator().manual_seed(seed)
            patterns = torch.randn(10, 3, 32, 32, generator=g)
            self.labels = torch.randint(0, 10, (n,), generator=g)
            self.imgs = patterns[self.labels] + torch.randn(n, 3, 32, 32, generator=g)

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return dict(imgs=self.imgs[i], labels=self.labels[i])


    def mmengine_loss_scale(runner):
        """The fp16 loss scale of plain MMEngine's AmpOptimWrapper, None without one."""
        scaler = getattr(runner.optim_wrapper, "loss_scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        return float(scaler.get_scale())


    @HOOKS.register_module(force=True)
    class AmpRecord(Hook):
        """Per iteration: loss, lr, grad norm, loss scale; the weights before and after."""

        priority = "LOWEST"
        #: how the loss scale is read (the accelkit driver replaces it)
        read_scale = staticmethod(mmengine_loss_scale)

        def __init__(self, out):
            self.out = out
            self.rec = dict(loss=[], lr=[], grad_norm=[], scale=[])

        @staticmethod
        def _state(runner):
            state = runner.model.state_dict()
            return {k.removeprefix("module."): v.detach().cpu().clone() for k, v in state.items()}

        def before_train(self, runner):
            torch.save(self._state(runner), f"{self.out}.initial.pt")

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            self.rec["loss"].append(float(outputs["loss"].detach()))
            self.rec["lr"].append(runner.optim_wrapper.param_groups[0]["lr"])
            norm = runner.message_hub.log_scalars.get("train/grad_norm")
            self.rec["grad_norm"].append(None if norm is None else float(norm.current()))
            self.rec["scale"].append(type(self).read_scale(runner))

        def after_run(self, runner):
            torch.save(self._state(runner), f"{self.out}.final.pt")
            with open(f"{self.out}.json", "w") as f:
                json.dump(self.rec, f)


    def optim_wrapper(dtype=None, loss_scale=None, clip=None, acc=1):
        """SGD with momentum (the tutorial's optimizer); AmpOptimWrapper unless dtype is None."""
        cfg = dict(optimizer=dict(type="SGD", lr=0.05, momentum=0.9, weight_decay=5e-4),
                   accumulative_counts=acc)
        if dtype is not None:
            cfg.update(type="AmpOptimWrapper", dtype=dtype)
        if loss_scale is not None:
            cfg["loss_scale"] = loss_scale
        if clip is not None:
            cfg["clip_grad"] = dict(max_norm=clip)
        return cfg


    def amp_cfg(work_dir, record, name, optim):
        """20 iterations: 320 images, batch 32, two epochs (the sampler reshuffles between)."""
        loader = dict(batch_size=32, num_workers=0, collate_fn=dict(type="default_collate"))
        return dict(
            model=dict(type="SmallBNNet"),
            work_dir=work_dir,
            experiment_name=name,
            train_dataloader=dict(dataset=dict(type="RandomCifar", n=320),
                                  sampler=dict(type="DefaultSampler", shuffle=True), **loader),
            train_cfg=dict(by_epoch=True, max_epochs=2),
            optim_wrapper=optim_wrapper(**optim),
            param_scheduler=dict(type="LinearLR", start_factor=0.25, by_epoch=False, begin=0,
                                 end=5),
            default_hooks=dict(checkpoint=None, logger=dict(type="LoggerHook", interval=100)),
            custom_hooks=[dict(type="AmpRecord", out=record)],
            randomness=dict(seed=0),
            log_level="WARNING",
        )
    '''
)

# every configuration runs inside this guard: one that raises is recorded, the next still runs
_RUN_SPECS = textwrap.dedent(
    """
    import json, os, sys, time, traceback

    def run_specs(train):
        for spec in json.loads(sys.argv[1]):
            start = time.perf_counter()
            try:
                train(spec)
            except Exception as err:
                error = dict(type=type(err).__name__, message=str(err),
                             traceback=traceback.format_exc()[-4000:])
                with open(spec["record"] + ".error.json", "w") as f:
                    json.dump(error, f)
            with open(spec["record"] + ".seconds", "w") as f:
                f.write(str(round(time.perf_counter() - start, 2)))
    """
)

# ---- the reference: plain MMEngine on cuda, nothing from accelkit ------------------------------
REFERENCE_DRIVER = _RUN_SPECS + textwrap.dedent(
    """
    from amp_project import amp_cfg
    from mmengine.runner import Runner

    def train(spec):
        Runner.from_cfg(amp_cfg(spec["work_dir"], spec["record"], spec["name"], spec["optim"])).train()

    run_specs(train)
    """
)

# ---- the accelkit side: the same project, one config change ------------------------------------
ACCELKIT_DRIVER = _RUN_SPECS + textwrap.dedent(
    """
    from amp_project import AmpRecord, amp_cfg
    import accelkit.integrations.mmengine  # registers AccelkitRunner
    from mmengine.registry import RUNNERS

    def accelkit_loss_scale(runner):
        # a diagnostic, read through the backend: AccelkitOptimWrapper has no loss_scaler
        backend = runner.accelerator.backend
        if hasattr(backend, "_grad_scaler"):  # DeepSpeed's torch_autocast GradScaler
            scaler = backend._grad_scaler()
        else:
            backend.precision.flush_update()  # accelkit applies a step's update at the next one
            scaler = backend.precision.scaler
        return None if scaler is None else float(scaler.get_scale())

    AmpRecord.read_scale = staticmethod(accelkit_loss_scale)

    def train(spec):
        cfg = amp_cfg(spec["work_dir"], spec["record"], spec["name"], spec["optim"])
        cfg.update(runner_type="AccelkitRunner", accelkit=spec["accelkit"])
        RUNNERS.build(cfg).train()

    run_specs(train)
    """
)

#: at this loss scale every step of this project overflows in fp16 (the logits' gradient, up to
#: 1/32, times 2**24 is beyond fp16's 65504): a static scale skips every step, a dynamic one
#: backs off until the gradients fit
HUGE_SCALE = 2.0**24
#: name -> AmpOptimWrapper settings (``optim_wrapper`` in the project); the same on both sides
AMP = {
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "fp16_clip_acc": dict(dtype="float16", clip=0.5, acc=2),
    "fp16_static": dict(dtype="float16", loss_scale=HUGE_SCALE),
    "fp16_dict": dict(dtype="float16", loss_scale=dict(init_scale=HUGE_SCALE, growth_interval=3)),
}
#: DeepSpeed's torch_autocast without the Linear/Conv gradients reduced in the autocast dtype;
#: a native DeepSpeed config clips at 1.0 unless it says otherwise, MMEngine's config does not clip
FP32_GRADIENTS = dict(torch_autocast=dict(lower_precision_safe_modules=[]), gradient_clipping=0.0)
DEEPSPEED = "deepspeed_stage_2"
REPORT_FILE = "mmengine-amp-gpu.jsonl"
SUBPROCESS_TIMEOUT_S = 180


def report(test: str, **figures: Any) -> None:
    """Print what a test measured, and append it to $ACCELKIT_GPU_REPORT/mmengine-amp-gpu.jsonl."""
    entry = {"test": test, **figures}
    print(json.dumps(entry, default=str))
    folder = os.environ.get("ACCELKIT_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / REPORT_FILE, "a") as out:
            out.write(json.dumps(entry, default=str) + "\n")


def run_side(root: Path, driver: str, specs: list[dict], label: str) -> None:
    """Run ``specs`` one after another in one process of ``driver``; its output goes to
    ``<label>.log`` (and into $ACCELKIT_GPU_REPORT as ``mmengine-amp-<label>.log``)."""
    for spec in specs:
        spec.setdefault("accelkit", {})
        spec["work_dir"] = str(root / spec["name"])
        spec["record"] = str(root / spec["name"])
    # prepend: on the GPU machine PYTHONPATH holds the site where mmengine and accelkit live
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(root / driver), json.dumps(specs)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    log = proc.stdout + proc.stderr
    (root / f"{label}.log").write_text(log)
    if folder := os.environ.get("ACCELKIT_GPU_REPORT"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"mmengine-amp-{label}.log").write_text(log)
    if proc.returncode != 0:
        raise AssertionError(f"{driver} ({label}) exited {proc.returncode}:\n{log[-6000:]}")


def _missing(*modules: str) -> str | None:
    return next((m for m in modules if importlib.util.find_spec(m) is None), None)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if missing := _missing("mmengine"):
        pytest.skip(f"{missing} is not installed (bench/gpu_suite.sh installs it from .whl/)")
    folder = tmp_path_factory.mktemp("mmengine_amp")
    (folder / "amp_project.py").write_text(PROJECT)
    (folder / "reference_driver.py").write_text(REFERENCE_DRIVER)
    (folder / "accelkit_driver.py").write_text(ACCELKIT_DRIVER)
    return folder


def reference_specs() -> list[dict]:
    specs = [dict(name=f"ref_{name}", optim=optim) for name, optim in AMP.items()]
    specs += [
        dict(name="ref_bf16_again", optim=AMP["bf16"]),
        dict(name="ref_fp16_again", optim=AMP["fp16"]),
        # OptimWrapper, fp32 as MMEngine runs it by default (cuDNN may convolve in TF32):
        # its distance from the AMP runs is the floor for DeepSpeed
        dict(name="ref_fp32", optim={}),
    ]
    return specs


def cuda_specs() -> list[dict]:
    cuda = dict(backend="cuda")
    specs = [dict(name=f"cuda_{name}", optim=optim, accelkit=cuda) for name, optim in AMP.items()]
    # negative twin: accelkit's bf16-mixed scales no loss, a loss_scale there is refused
    specs.append(
        dict(
            name="cuda_bf16_loss_scale",
            optim=dict(dtype="bfloat16", loss_scale=512.0),
            accelkit=cuda,
        )
    )
    return specs


def deepspeed_specs() -> list[dict]:
    default = dict(backend=DEEPSPEED)
    fp32_grads = dict(backend=DEEPSPEED, config=FP32_GRADIENTS)
    return [
        dict(name="ds_bf16", optim=AMP["bf16"], accelkit=default),
        dict(name="ds_fp16", optim=AMP["fp16"], accelkit=default),
        dict(name="ds_bf16_fp32_grads", optim=AMP["bf16"], accelkit=fp32_grads),
        dict(name="ds_fp16_fp32_grads", optim=AMP["fp16"], accelkit=fp32_grads),
        # negative twin: DeepSpeed scales the loss itself, a number is refused
        dict(name="ds_fp16_static", optim=AMP["fp16_static"], accelkit=default),
    ]


@pytest.fixture(scope="module")
def reference_runs(root: Path) -> Path:
    run_side(root, "reference_driver.py", reference_specs(), "reference")
    return root


@pytest.fixture(scope="module")
def cuda_runs(reference_runs: Path) -> Path:
    run_side(reference_runs, "accelkit_driver.py", cuda_specs(), "cuda")
    return reference_runs


@pytest.fixture(scope="module")
def deepspeed_runs(reference_runs: Path) -> Path:
    if missing := _missing("accelkit_deepspeed", "deepspeed"):
        pytest.skip(f"{missing} is not installed")
    run_side(reference_runs, "accelkit_driver.py", deepspeed_specs(), "deepspeed")
    return reference_runs


# ---- reading and comparing runs -----------------------------------------------------------------
def error_of(root: Path, name: str) -> dict | None:
    path = root / f"{name}.error.json"
    return json.loads(path.read_text()) if path.exists() else None


def record(root: Path, name: str) -> dict:
    """The run's per-iteration record and weights; fails with the run's error if it raised."""
    if err := error_of(root, name):
        pytest.fail(f"{name} raised {err['type']}: {err['message']}\n{err['traceback']}")
    rec = json.loads((root / f"{name}.json").read_text())
    for when in ("initial", "final"):
        rec[when] = torch.load(root / f"{name}.{when}.pt", weights_only=True)
    seconds = root / f"{name}.seconds"
    rec["seconds"] = float(seconds.read_text()) if seconds.exists() else None
    return rec


def max_weight_difference(a: dict, b: dict) -> float:
    """Largest absolute difference over every parameter and buffer (BatchNorm statistics)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def differences(ours: dict, ref: dict) -> dict[str, Any]:
    """What a report and a tolerance need: steps, max abs loss and weight differences."""
    assert len(ours["loss"]) == len(ref["loss"]), (len(ours["loss"]), len(ref["loss"]))
    return {
        "steps": len(ref["loss"]),
        "loss_max_abs": max(abs(x - y) for x, y in zip(ours["loss"], ref["loss"])),
        "weights_max_abs": max_weight_difference(ours["final"], ref["final"]),
        "bit_for_bit": same_run(ours, ref, scales=False) == [],
    }


def grad_norms_agree(ours: list, ref: list) -> bool:
    """Equal, except on an fp16 step skipped for overflow, where accelkit logs ``inf`` and
    MMEngine what ``clip_grad_norm_`` returns for the overflowed gradients (inf or nan)."""
    if len(ours) != len(ref):
        return False
    for x, y in zip(ours, ref):
        if json.dumps(x) == json.dumps(y):
            continue
        if y is None or math.isfinite(y) or x != math.inf:
            return False
    return True


def same_run(ours: dict, ref: dict, *, scales: bool = True) -> list[str]:
    """What differs between two runs (empty: bit for bit); scales only where both have them.
    Values compare through their JSON text: exact for floats, and a NaN equals a NaN."""
    keys = ["loss", "lr"] + (["scale"] if scales else [])
    problems = [f"{key} differs" for key in keys if json.dumps(ours[key]) != json.dumps(ref[key])]
    if not grad_norms_agree(ours["grad_norm"], ref["grad_norm"]):
        problems.append("grad_norm differs")
    bad = [k for k in ref["final"] if not torch.equal(ours["final"][k], ref["final"][k])]
    if bad:
        problems.append(f"final weights differ: {bad[:5]}")
    return problems


def params_unchanged(rec: dict) -> bool:
    """Whether no optimizer step was applied (BatchNorm statistics move in every forward)."""
    return all(
        torch.equal(rec["initial"][k], rec["final"][k])
        for k in rec["final"]
        if "running" not in k and "num_batches" not in k
    )


# ---- plain MMEngine: the floor and the preconditions --------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_reference_repeats_itself(reference_runs: Path, dtype: str) -> None:
    """The noise floor of the bit-for-bit comparisons: plain MMEngine twice, identical."""
    first, again = (
        record(reference_runs, f"ref_{dtype}"),
        record(reference_runs, f"ref_{dtype}_again"),
    )
    report(
        f"reference repeats itself [{dtype}]", **differences(again, first), seconds=first["seconds"]
    )
    assert same_run(again, first) == []


def test_the_comparisons_can_tell_precisions_apart(reference_runs: Path) -> None:
    """Negative twin of the comparisons below: bf16, fp16 and fp32 training differ, and each
    trains (the loss falls), so equal records mean the same math, not no math."""
    runs = {name: record(reference_runs, f"ref_{name}") for name in ("bf16", "fp16", "fp32")}
    for a, b in (("bf16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32")):
        assert runs[a]["loss"][1:] != runs[b]["loss"][1:], f"{a} and {b} train alike"
        assert max_weight_difference(runs[a]["final"], runs[b]["final"]) > 0
    for name, run in runs.items():
        assert len(run["loss"]) == 20, name
        assert sum(run["loss"][-4:]) < sum(run["loss"][:4]), f"{name} does not train"
    assert runs["bf16"]["scale"] == [65536.0] * 20  # MMEngine's GradScaler runs under bf16 too


def test_the_loss_scales_behave_differently_in_mmengine(reference_runs: Path) -> None:
    """Preconditions of the loss_scale comparisons: a static 2**24 skips every step (the
    weights never move); a dict with the same init_scale backs off, then trains."""
    static = record(reference_runs, "ref_fp16_static")
    assert static["scale"] == [HUGE_SCALE] * 20
    assert params_unchanged(static)
    dynamic = record(reference_runs, "ref_fp16_dict")
    assert min(dynamic["scale"]) < HUGE_SCALE and not params_unchanged(dynamic)
    default = record(reference_runs, "ref_fp16")
    assert default["scale"][0] == 65536.0 and not params_unchanged(default)


# ---- accelkit's cuda backend: the same math, bit for bit ---------------------------------------
@pytest.mark.parametrize("name", list(AMP))
def test_cuda_backend_equals_mmengine_amp(cuda_runs: Path, name: str) -> None:
    """AccelkitRunner(cuda) with MMEngine's AmpOptimWrapper config: losses, lrs, grad norms,
    fp16 loss scales (dynamic, a number, a dict) and final weights of MMEngine's own run."""
    ours, ref = record(cuda_runs, f"cuda_{name}"), record(cuda_runs, f"ref_{name}")
    scales = AMP[name]["dtype"] == "float16"  # accelkit's bf16-mixed runs no GradScaler
    report(
        f"cuda vs MMEngine [{name}]",
        **differences(ours, ref),
        scales=ours["scale"] == ref["scale"] if scales else "bf16: none on accelkit's side",
        seconds=ours["seconds"],
    )
    assert same_run(ours, ref, scales=scales) == []
    if not scales:
        assert ours["scale"] == [None] * len(ref["loss"])


def test_a_loss_scale_under_bf16_is_refused(cuda_runs: Path) -> None:
    """Negative twin of the loss_scale comparisons: accelkit's bf16-mixed scales no loss, so a
    loss_scale with dtype='bfloat16' (which MMEngine accepts) is refused, not ignored."""
    err = error_of(cuda_runs, "cuda_bf16_loss_scale")
    assert err is not None and err["type"] == "ConfigError", err
    assert "bf16-mixed scales no loss" in err["message"]


# ---- DeepSpeed ZeRO-2 on one GPU: within the floor of autocast's own rounding -------------------
@pytest.mark.parametrize("name", ["ds_bf16", "ds_fp16", "ds_bf16_fp32_grads", "ds_fp16_fp32_grads"])
def test_deepspeed_stage_2_tracks_mmengine_amp(deepspeed_runs: Path, name: str) -> None:
    """Within the floor |MMEngine AMP - MMEngine fp32| of the same run, in the losses and in
    the final weights: DeepSpeed rounds no more than the autocast it runs does."""
    dtype = "bf16" if "bf16" in name else "fp16"
    ours, ref = record(deepspeed_runs, name), record(deepspeed_runs, f"ref_{dtype}")
    floor = differences(record(deepspeed_runs, "ref_fp32"), ref)
    measured = differences(ours, ref)
    report(
        f"{DEEPSPEED} vs MMEngine [{name}]",
        **measured,
        floor_loss_max_abs=floor["loss_max_abs"],
        floor_weights_max_abs=floor["weights_max_abs"],
        scales=ours["scale"],
        mmengine_scales=ref["scale"],
        seconds=ours["seconds"],
    )
    assert ours["lr"] == ref["lr"]
    assert all(math.isfinite(x) for x in ours["loss"])
    assert measured["loss_max_abs"] <= floor["loss_max_abs"], (measured, floor)
    assert measured["weights_max_abs"] <= floor["weights_max_abs"], (measured, floor)


def test_deepspeed_refuses_a_static_loss_scale(deepspeed_runs: Path) -> None:
    """DeepSpeed scales the loss itself: loss_scale=<number> is refused, not ignored."""
    err = error_of(deepspeed_runs, "ds_fp16_static")
    assert err is not None and err["type"] == "UnsupportedError", err
    assert "deepspeed: loss_scale" in err["message"]
    assert not (deepspeed_runs / "ds_fp16_static.json").exists()
