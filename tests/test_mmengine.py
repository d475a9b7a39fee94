"""The MMEngine adapter against MMEngine itself.

The reference is MMEngine's own Runner, run in a process that imports nothing from accelkit
(``REFERENCE_DRIVER``). The accelkit side runs the same user project (``TOY_PROJECT``: a model,
a dataset, a metric and a hook that records what happened) with the one config change a user
makes: ``runner_type='AccelkitRunner'`` or ``strategy=dict(type='AccelkitStrategy', ...)``.

The end-to-end tests share module fixtures that run every configuration once (about two minutes
on 2 cores), so they are marked ``slow``; the unit tests at the end are fast.

Noise floor: fp32 on this CPU is deterministic; two reference runs of the same config give
bit-identical losses and weights (``test_reference_is_deterministic``), so the comparisons below
are exact (``==``), not within a tolerance.
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

# ---- the user's project (shared by both sides: it is what is being trained, not a helper) -----
TOY_PROJECT = textwrap.dedent(
    '''
    import json, os
    import torch
    from torch import nn
    from mmengine.evaluator import BaseMetric
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, HOOKS, METRICS, MODELS


    @MODELS.register_module(force=True)
    class ToyNet(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

        def forward(self, inputs, labels, mode="tensor"):
            logits = self.net(inputs)
            if mode == "loss":
                return {"loss": nn.functional.cross_entropy(logits, labels)}
            if mode == "predict":
                return list(zip(logits.argmax(-1).tolist(), labels.tolist()))
            return logits


    @DATASETS.register_module(force=True)
    class ToyData(torch.utils.data.Dataset):
        def __init__(self, n=40, seed=0):
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randn(n, 16, generator=g)
            self.y = (self.x @ torch.randn(16, 4, generator=g)).argmax(-1)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return dict(inputs=self.x[i], labels=self.y[i])


    @METRICS.register_module(force=True)
    class ToyAccuracy(BaseMetric):
        def process(self, data_batch, data_samples):
            self.results.extend(float(p == t) for p, t in data_samples)

        def compute_metrics(self, results):
            return dict(acc=sum(results) / len(results))


    @HOOKS.register_module(force=True)
    class RecordHook(Hook):
        """Records losses, lr, grad norm, val metrics and final weights; can stop early."""

        priority = "LOWEST"

        def __init__(self, out, stop_after_epoch=None, export=None):
            self.out, self.stop_after_epoch, self.export = out, stop_after_epoch, export
            self.rec = dict(loss=[], lr=[], grad_norm=[], val=[], iters=[], val_params=[])

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            self.rec["loss"].append(float(outputs["loss"].detach()))
            self.rec["iters"].append(runner.iter)
            self.rec["lr"].append(runner.optim_wrapper.param_groups[0]["lr"])
            norm = runner.message_hub.log_scalars.get("train/grad_norm")
            self.rec["grad_norm"].append(None if norm is None else float(norm.current()))

        def before_val_epoch(self, runner):
            # the weights validation runs with (EMAHook has swapped the averaged ones in)
            self.rec["val_params"].append(self._weights(runner)[1])

        def after_val_epoch(self, runner, metrics=None):
            self.rec["val"].append(dict(metrics or {}))

        @staticmethod
        def _weights(runner):
            # every rank calls state_dict(): a sharded backend gathers the full weights
            state = {k.removeprefix("module."): v for k, v in runner.model.state_dict().items()}
            return state, [x for k in sorted(state) for x in state[k].flatten().tolist()]

        def after_train_epoch(self, runner):
            if self.stop_after_epoch and runner.epoch + 1 >= self.stop_after_epoch:
                runner.train_loop.stop_training = True

        def after_run(self, runner):
            state, self.rec["params"] = self._weights(runner)
            self.rec["epoch"], self.rec["iter"] = runner.epoch, runner.iter
            rank = int(os.environ.get("RANK", 0))
            if self.export and rank == 0:  # a plain state dict, as a user exports weights
                torch.save(state, self.export)
            with open(f"{self.out}.rank{rank}.json", "w") as f:
                json.dump(self.rec, f)


    def toy_cfg(work_dir, record, *, acc=1, clip=None, epochs=2, stop_after_epoch=None,
                resume=False, load_from=None, keep=-1, launcher="none", export=None, save=True,
                ema=False, name="toy"):
        optim_wrapper = dict(
            optimizer=dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=1e-3),
            accumulative_counts=acc)
        if clip is not None:
            optim_wrapper["clip_grad"] = dict(max_norm=clip)
        loader = dict(batch_size=4, collate_fn=dict(type="default_collate"), num_workers=0)
        return dict(
            model=dict(type="ToyNet"),
            work_dir=work_dir,
            experiment_name=name,
            train_dataloader=dict(dataset=dict(type="ToyData", n=40),
                                  sampler=dict(type="DefaultSampler", shuffle=True), **loader),
            val_dataloader=dict(dataset=dict(type="ToyData", n=12, seed=1),
                                sampler=dict(type="DefaultSampler", shuffle=False), **loader),
            val_evaluator=dict(type="ToyAccuracy"),
            val_cfg=dict(),
            train_cfg=dict(by_epoch=True, max_epochs=epochs, val_interval=1),
            optim_wrapper=optim_wrapper,
            param_scheduler=[
                dict(type="LinearLR", start_factor=0.5, by_epoch=False, begin=0, end=5),
                dict(type="MultiStepLR", by_epoch=True, milestones=[1, 2], gamma=0.5),
            ],
            default_hooks=dict(
                checkpoint=dict(type="CheckpointHook", interval=1, max_keep_ckpts=keep)
                if save else None,
                logger=dict(type="LoggerHook", interval=5)),
            custom_hooks=[dict(type="RecordHook", out=record, stop_after_epoch=stop_after_epoch,
                               export=export)]
                         + ([dict(type="EMAHook", momentum=0.2)] if ema else []),
            randomness=dict(seed=7),
            resume=resume,
            load_from=load_from,
            launcher=launcher,
            env_cfg=dict(dist_cfg=dict(backend="gloo")),
            log_level="WARNING",
        )
    '''
)

# ---- the reference: MMEngine's own Runner, nothing from accelkit ----------------------------------
REFERENCE_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    import torch.distributed as dist
    from mm_toy import toy_cfg
    from mmengine.runner import Runner

    for spec in json.loads(sys.argv[1]):
        cfg = toy_cfg(spec["work_dir"], spec["record"], name=spec["name"], **spec["kw"])
        if cfg["launcher"] != "none":
            # MMEngine's init_dist calls torch.cuda.set_device even on a CPU-only torch
            # (mmengine/dist/utils.py:130): join gloo first, and give DDP no device_ids.
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            cfg["model_wrapper_cfg"] = dict(
                type="MMDistributedDataParallel", broadcast_buffers=False, device_ids=None)
        runner = Runner.from_cfg(cfg)
        runner.val() if spec.get("mode") == "val" else runner.train()
    if dist.is_initialized():
        # leave gloo before the interpreter finalizes, and release the GIL for its worker
        # threads' last frees: without this a finished rank may abort at exit
        # ("terminate called without an active exception"; bench/gloo_exit_abort.sh)
        dist.destroy_process_group()
        time.sleep(0.1)
    """
)

# ---- the accelkit side: the same project, one config change -------------------------------------
ACCELKIT_DRIVER = textwrap.dedent(
    """
    import json, os, sys, traceback
    from mm_toy import toy_cfg
    import accelkit.integrations.mmengine  # registers AccelkitRunner and AccelkitStrategy
    from mmengine.registry import RUNNERS
    from mmengine.runner import FlexibleRunner

    for spec in json.loads(sys.argv[1]):
        cfg = toy_cfg(spec["work_dir"], spec["record"], name=spec["name"], **spec["kw"])
        try:
            if spec["runner"] == "flexible":
                cfg["strategy"] = dict(type="AccelkitStrategy", **spec["accelkit"])
                cfg["default_hooks"]["checkpoint"]["type"] = "AccelkitCheckpointHook"
                runner = FlexibleRunner.from_cfg(cfg)
            else:
                cfg.update(runner_type="AccelkitRunner", accelkit=spec["accelkit"])
                runner = RUNNERS.build(cfg)
            runner.val() if spec.get("mode") == "val" else runner.train()
        except Exception as err:
            if not spec.get("expect_error"):
                raise
            rank = int(os.environ.get("RANK", 0))
            suffix = ".error.json" if rank == 0 else f".rank{rank}.error.json"
            with open(spec["record"] + suffix, "w") as f:
                json.dump(dict(type=type(err).__name__, message=str(err)), f)
    """
)


def _write_project(root: Path) -> None:
    (root / "mm_toy.py").write_text(TOY_PROJECT)
    (root / "reference_driver.py").write_text(REFERENCE_DRIVER)
    (root / "accelkit_driver.py").write_text(ACCELKIT_DRIVER)


def _run(root: Path, driver: str, specs: list[dict], *, nproc: int = 1, env: dict | None = None):
    for spec in specs:
        spec.setdefault("kw", {})
        spec.setdefault("accelkit", {})
        spec["work_dir"] = str(root / spec["work_dir"])
        spec["record"] = str(root / spec["name"])
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), **(env or {})}
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
    proc = subprocess.run(cmd, cwd=root, env=full_env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{driver} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def _record(root: Path, name: str, rank: int = 0) -> dict:
    return json.loads((root / f"{name}.rank{rank}.json").read_text())


# Accumulation over 3 with 10 iterations per epoch and 2 epochs: windows straddle the epoch
# boundary and the last window of the run holds 2 micro-batches (MMEngine divides its loss by 2).
PARTIAL = dict(acc=3, clip=0.5, epochs=2)
# Accumulation over 2: windows align with epochs, so a resume after epoch 1 is uninterrupted.
ALIGNED = dict(acc=2, epochs=3)
# MMEngine's EMAHook: averaged weights for validation, in the checkpoint, after a resume
EMA = dict(PARTIAL, ema=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every single-process run, reference and accelkit, each side in one process."""
    root = tmp_path_factory.mktemp("mmengine")
    _write_project(root)
    reference = [
        dict(
            name="ref_partial",
            work_dir="ref_partial",
            kw=dict(PARTIAL, export="ref_partial_weights.pth"),
        ),
        dict(name="ref_partial_again", work_dir="ref_partial_again", kw=PARTIAL),
        dict(name="ref_aligned", work_dir="ref_aligned", kw=ALIGNED),
        # stopped after epoch 1 (mid-window), then MMEngine's own resume
        dict(name="ref_stop", work_dir="ref_resume", kw=dict(PARTIAL, stop_after_epoch=1)),
        dict(name="ref_resumed", work_dir="ref_resume", kw=dict(PARTIAL, resume=True)),
        # with MMEngine's EMAHook: trained, stopped and resumed, and loaded for evaluation
        dict(name="ref_ema", work_dir="ref_ema", kw=EMA),
        dict(name="ref_ema_stop", work_dir="ref_ema_resume", kw=dict(EMA, stop_after_epoch=1)),
        dict(name="ref_ema_resumed", work_dir="ref_ema_resume", kw=dict(EMA, resume=True)),
        dict(
            name="ref_ema_load",
            work_dir="ref_ema_load",
            kw=dict(EMA, load_from=str(root / "ref_ema" / "epoch_2.pth")),
            mode="val",
        ),
    ]
    # MMEngine's own resume needs this on torch >= 2.6 (mmengine/runner/checkpoint.py:347);
    # it is set for the reference process only, never for accelkit's.
    _run(root, "reference_driver.py", reference, env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    mmengine_pth = str(root / "ref_resume" / "epoch_1.pth")
    cpu = dict(backend="cpu")
    accelkit = [
        dict(name="ak_partial", work_dir="ak_partial", runner="runner", accelkit=cpu, kw=PARTIAL),
        dict(name="ak_flex", work_dir="ak_flex", runner="flexible", accelkit=cpu, kw=PARTIAL),
        dict(name="ak_aligned", work_dir="ak_aligned", runner="runner", accelkit=cpu, kw=ALIGNED),
        dict(
            name="ak_stop",
            work_dir="ak_resume",
            runner="runner",
            accelkit=cpu,
            kw=dict(ALIGNED, stop_after_epoch=1, keep=1),
        ),
        dict(
            name="ak_resumed",
            work_dir="ak_resume",
            runner="runner",
            accelkit=cpu,
            kw=dict(ALIGNED, resume=True, keep=1),
        ),
        dict(
            name="ak_stop_mid",
            work_dir="ak_resume_mid",
            runner="runner",
            accelkit=cpu,
            kw=dict(PARTIAL, stop_after_epoch=1),
        ),
        dict(
            name="ak_resumed_mid",
            work_dir="ak_resume_mid",
            runner="runner",
            accelkit=cpu,
            kw=dict(PARTIAL, resume=True),
        ),
        dict(
            name="flex_stop_mid",
            work_dir="flex_resume_mid",
            runner="flexible",
            accelkit=cpu,
            kw=dict(PARTIAL, stop_after_epoch=1),
        ),
        dict(
            name="flex_resumed_mid",
            work_dir="flex_resume_mid",
            runner="flexible",
            accelkit=cpu,
            kw=dict(PARTIAL, resume=True),
        ),
        dict(name="ak_ema", work_dir="ak_ema", runner="runner", accelkit=cpu, kw=EMA),
        dict(
            name="ak_ema_stop",
            work_dir="ak_ema_resume",
            runner="runner",
            accelkit=cpu,
            kw=dict(EMA, stop_after_epoch=1),
        ),
        dict(
            name="ak_ema_resumed",
            work_dir="ak_ema_resume",
            runner="runner",
            accelkit=cpu,
            kw=dict(EMA, resume=True),
        ),
        dict(
            name="ak_ema_load",
            work_dir="ak_ema_load",
            runner="runner",
            accelkit=cpu,
            kw=dict(EMA, load_from=str(root / "ak_ema" / "epoch_2.pth")),
            mode="val",
        ),
        # a plain state dict of tensors needs no trust
        dict(
            name="ak_plain_load",
            work_dir="ak_plain_load",
            runner="runner",
            accelkit=cpu,
            kw=dict(PARTIAL, load_from=str(root / "ref_partial_weights.pth")),
            mode="val",
        ),
        # MMEngine's pickled .pth: refused without trust_pickle, resumed with it
        dict(
            name="ak_untrusted",
            work_dir="ak_untrusted",
            runner="runner",
            accelkit=cpu,
            kw=dict(PARTIAL, resume=True, load_from=mmengine_pth),
            expect_error=True,
        ),
        dict(
            name="ak_from_mmengine",
            work_dir="ak_from_mmengine",
            runner="runner",
            accelkit=dict(cpu, trust_pickle=True),
            kw=dict(PARTIAL, resume=True, load_from=mmengine_pth),
        ),
        dict(
            name="flex_from_mmengine",
            work_dir="flex_from_mmengine",
            runner="flexible",
            accelkit=dict(cpu, trust_pickle=True),
            kw=dict(PARTIAL, resume=True, load_from=mmengine_pth),
        ),
    ]
    _run(root, "accelkit_driver.py", accelkit)
    return root


def _same_run(a: dict, b: dict) -> None:
    for key in ("loss", "lr", "grad_norm", "val", "iters", "params", "val_params"):
        assert a[key] == b[key], f"{key} differs"


@pytest.mark.slow
def test_reference_is_deterministic(runs: Path) -> None:
    """The noise floor: MMEngine's own Runner twice, bit-identical."""
    _same_run(_record(runs, "ref_partial"), _record(runs, "ref_partial_again"))


@pytest.mark.slow
def test_config_exercises_accumulation_and_clipping(runs: Path) -> None:
    """Preconditions, so that the comparisons below can fail."""
    ref = _record(runs, "ref_partial")
    assert len(ref["loss"]) % PARTIAL["acc"] != 0  # a partial last window
    norms = [n for n in ref["grad_norm"] if n is not None]
    assert max(norms) > PARTIAL["clip"]  # clipping is active
    assert len(set(ref["lr"])) > 3  # the per-iteration and per-epoch schedulers move the lr
    assert ref["params"] != _record(runs, "ref_aligned")["params"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ak_partial", "ak_flex"])
def test_same_losses_as_mmengine(runs: Path, name: str) -> None:
    """Runner and FlexibleRunner on accelkit's cpu backend reproduce MMEngine bit for bit:
    accumulation with a partial last window, clip_grad, schedulers, validation."""
    _same_run(_record(runs, name), _record(runs, "ref_partial"))


@pytest.mark.slow
def test_aligned_accumulation_same_as_mmengine(runs: Path) -> None:
    _same_run(_record(runs, "ak_aligned"), _record(runs, "ref_aligned"))


@pytest.mark.slow
def test_resume_continues_the_same_trajectory(runs: Path) -> None:
    full, first, second = (_record(runs, n) for n in ("ak_aligned", "ak_stop", "ak_resumed"))
    assert first["iter"] == 10 and first["iters"] + second["iters"] == full["iters"]
    assert first["loss"] + second["loss"] == full["loss"]
    assert first["lr"] + second["lr"] == full["lr"]
    assert second["params"] == full["params"]


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["ak", "flex"])
def test_resume_mid_window_follows_mmengine(runs: Path, prefix: str) -> None:
    """Resumed at iteration 10 with windows of 3: MMEngine keeps its global window count (the
    first resumed window is short); accelkit follows it exactly."""
    ref = _record(runs, "ref_resumed")
    ours = _record(runs, f"{prefix}_resumed_mid")
    _same_run(ours, ref)
    assert ours["params"] != _record(runs, "ref_partial")["params"]  # the lost micro-batch shows


@pytest.mark.slow
def test_checkpoint_hook_writes_portable_checkpoints(runs: Path) -> None:
    work = runs / "ak_resume"
    # max_keep_ckpts=1: only the last one is left, and it was removed only after epoch_3 existed
    names = sorted(p.name for p in work.glob("epoch_*"))
    assert names == ["epoch_3.pth"]
    ckpt = work / "epoch_3.pth"
    assert (ckpt / "accelkit.json").is_file() and (ckpt / "rank-00000.safetensors").is_file()
    assert (work / "last_checkpoint").read_text().strip() == str(ckpt)
    manifest = json.loads((ckpt / "accelkit.json").read_text())
    assert manifest["step"] == 30 and set(manifest["objects"]) >= {"model", "optimizer"}
    # nothing in it is a pickle
    for path in ckpt.iterdir():
        assert not path.read_bytes().startswith(b"\x80"), path


@pytest.mark.slow
def test_pickled_checkpoint_needs_trust(runs: Path) -> None:
    err = json.loads((runs / "ak_untrusted.error.json").read_text())
    assert err["type"] == "CheckpointError"
    assert "trust_pickle=True" in err["message"] and "HistoryBuffer" in err["message"]
    assert not (runs / "ak_untrusted.rank0.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["ak", "flex"])
def test_resume_from_mmengine_pth(runs: Path, prefix: str) -> None:
    """MMEngine's own epoch_1.pth (pickled, trusted) resumes under accelkit as MMEngine would."""
    _same_run(_record(runs, f"{prefix}_from_mmengine"), _record(runs, "ref_resumed"))


@pytest.mark.slow
def test_load_from_plain_state_dict_needs_no_trust(runs: Path) -> None:
    """A .pth holding only tensors (weights exported for deployment) loads without trust_pickle."""
    loaded, ref = _record(runs, "ak_plain_load"), _record(runs, "ref_partial")
    assert loaded["params"] == ref["params"] and loaded["val"] == ref["val"][-1:]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [("ak_ema", "ref_ema"), ("ak_ema_resumed", "ref_ema_resumed"), ("ak_ema_load", "ref_ema_load")],
)
@pytest.mark.slow
def test_ema_hook_as_in_mmengine(runs: Path, ours: str, theirs: str) -> None:
    """EMAHook: validation on the averaged weights, its state saved and resumed, and load_from
    giving the model the averaged weights, all as with MMEngine's own Runner."""
    _same_run(_record(runs, ours), _record(runs, theirs))


@pytest.mark.slow
def test_ema_changes_what_validation_sees(runs: Path) -> None:
    ema, plain = _record(runs, "ref_ema"), _record(runs, "ref_partial")
    assert ema["params"] == plain["params"]  # the EMA does not touch training
    assert ema["val_params"] != plain["val_params"]  # but validation runs on averaged weights
    assert _record(runs, "ref_ema_load")["params"] == ema["val_params"][-1]


# ---- negative twins of the checkpoint tests ---------------------------------------------------
@pytest.fixture(scope="module")
def broken_runs(runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Resume attempts from damaged copies of ak_resume's checkpoint, in one process."""
    import shutil

    root = tmp_path_factory.mktemp("mmengine_broken")
    _write_project(root)
    for name in ("flipped", "no_manifest"):
        shutil.copytree(runs / "ak_resume", root / name)
        ckpt = root / name / "epoch_3.pth"
        (root / name / "last_checkpoint").write_text(str(ckpt))
    shard = root / "flipped" / "epoch_3.pth" / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor's data
    shard.write_bytes(bytes(data))
    (root / "no_manifest" / "epoch_3.pth" / "accelkit.json").unlink()
    specs = [
        dict(
            name=name,
            work_dir=name,
            runner="runner",
            accelkit=dict(backend="cpu"),
            kw=dict(ALIGNED, resume=True),
            expect_error=True,
        )
        for name in ("flipped", "no_manifest")
    ]
    _run(root, "accelkit_driver.py", specs)
    return root


@pytest.mark.parametrize(
    ("name", "named"), [("flipped", "rank-00000.safetensors"), ("no_manifest", "accelkit.json")]
)
@pytest.mark.slow
def test_resume_from_damaged_checkpoint_fails(broken_runs: Path, name: str, named: str) -> None:
    """Negative twins of the resume test: a flipped bit, a missing manifest."""
    err = json.loads((broken_runs / f"{name}.error.json").read_text())
    assert err["type"] == "CheckpointError", err
    assert named in err["message"]
    assert not (broken_runs / f"{name}.rank0.json").exists()


# ---- two processes ------------------------------------------------------------------------------
DISTRIBUTED = dict(PARTIAL, launcher="pytorch")
# FSDP2 and DeepSpeed ZeRO-2 reduce-scatter gradients and compute the clip norm from shards, so
# their sums run in another order than DDP's all-reduce. Measured against MMEngine's DDP run
# (2 gloo ranks, 20 iterations): losses within 2.4e-7, final weights within 1.5e-8, grad norms
# within 1 fp32 ulp (6e-8). Tolerances: 4x those.
SHARDED_TOL = dict(loss=1e-6, params=6e-8, grad_norm=3e-7)


def _close_run(a: dict, b: dict, tol: dict) -> None:
    for key in ("lr", "val", "iters"):
        assert a[key] == b[key], f"{key} differs"
    for key, limit in tol.items():
        pairs = [(x, y) for x, y in zip(a[key], b[key]) if x is not None or y is not None]
        assert len(pairs) == len([x for x in a[key] if x is not None]), f"{key}: None differs"
        worst = max(abs(x - y) for x, y in pairs)
        assert worst <= limit, f"{key}: differs by {worst:.3g} > {limit:.3g}"


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MMEngine's own DDP Runner, then FlexibleRunner on ddp and AccelkitRunner on ddp and fsdp
    (2 gloo processes each), then the cpu backend (1 process) evaluating the ddp and fsdp
    checkpoints."""
    root = tmp_path_factory.mktemp("mmengine_dist")
    _write_project(root)
    _run(root, "reference_driver.py", [dict(name="ref", work_dir="ref", kw=DISTRIBUTED)], nproc=2)
    # FlexibleRunner first: its strategy joins the process group (gloo, no CUDA call)
    specs = [
        dict(
            name="flex_ddp",
            work_dir="flex_ddp",
            runner="flexible",
            accelkit=dict(backend="ddp"),
            kw=DISTRIBUTED,
        )
    ]
    specs += [
        dict(name=name, work_dir=name, runner="runner", accelkit=dict(backend=name), kw=DISTRIBUTED)
        for name in ("ddp", "fsdp")
    ]
    _run(root, "accelkit_driver.py", specs, nproc=2)
    loads = [
        dict(
            name=f"cpu_from_{name}",
            work_dir=f"cpu_from_{name}",
            runner="runner",
            accelkit=dict(backend="cpu"),
            kw=dict(PARTIAL, load_from=str(root / name / "epoch_2.pth")),
            mode="val",
        )
        for name in ("ddp", "fsdp")
    ]
    _run(root, "accelkit_driver.py", loads)
    return root


@pytest.mark.slow
def test_ddp_two_processes_match_mmengine_ddp(two_process_runs: Path) -> None:
    """accelkit's ddp reproduces MMEngine's DDP Runner bit for bit on each rank (no_sync inside
    accumulation windows, the partial last window, clipping)."""
    root = two_process_runs
    for rank in (0, 1):
        _same_run(_record(root, "ddp", rank), _record(root, "ref", rank))
        _same_run(_record(root, "flex_ddp", rank), _record(root, "ref", rank))
    assert _record(root, "ddp", 0)["loss"] != _record(root, "ddp", 1)["loss"]
    assert (root / "ddp" / "epoch_2.pth" / "rank-00001.safetensors").is_file()


@pytest.mark.slow
def test_fsdp_two_processes_track_mmengine_ddp(two_process_runs: Path) -> None:
    root = two_process_runs
    for rank in (0, 1):
        _close_run(_record(root, "fsdp", rank), _record(root, "ref", rank), SHARDED_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_checkpoint_of_two_ranks_loads_on_one_cpu(two_process_runs: Path, name: str) -> None:
    """load_from a 2-rank ddp/fsdp checkpoint into the cpu backend: the same weights and the same
    validation accuracy as the run that wrote it."""
    root = two_process_runs
    loaded, trained = _record(root, f"cpu_from_{name}"), _record(root, name)
    assert loaded["params"] == trained["params"]
    assert loaded["val"] == trained["val"][-1:]
    assert loaded["loss"] == []


# ---- DeepSpeed under the Runner and FlexibleRunner, and resuming across backends -----------------
# One optimizer step per iteration (5 per epoch and rank), so that a resume after epoch 1 is
# uninterrupted and must continue the run; SGD momentum makes a lost optimizer state show.
RESUMABLE = dict(acc=1, clip=0.5, epochs=2, launcher="pytorch")


def _joined(first: dict, second: dict) -> dict:
    """The record of a run stopped after ``first`` and resumed as ``second``, as one run."""
    joined = {k: first[k] + second[k] for k in ("loss", "lr", "grad_norm", "val", "iters")}
    joined["val_params"] = first["val_params"] + second["val_params"]
    joined["params"] = second["params"]
    return joined


def _ds(stage: int, **extra: object) -> dict:
    return dict(backend="deepspeed", config=dict(zero_stage=stage), **extra)


@pytest.fixture(scope="module")
def deepspeed_runs(two_process_runs: Path) -> Path:
    """2 gloo processes. MMEngine's own DDP Runner (trained; stopped and resumed; its weights
    exported as a plain .pth), then, in one launch: DeepSpeed ZeRO-2/3 under AccelkitRunner and
    ZeRO-2 under FlexibleRunner; a ZeRO-2 run stopped after epoch 1 and resumed by ZeRO-2, by
    ddp and by ZeRO-3; MMEngine's own checkpoint resumed under ZeRO-2; the plain .pth loaded
    under ZeRO-2, ZeRO-3 and fsdp for validation. Then damaged inputs (the negative twins)."""
    pytest.importorskip("accelkit_deepspeed")
    pytest.importorskip("deepspeed")
    root = two_process_runs
    weights = str(root / "ref_rs_weights.pth")
    reference = [
        dict(name="ref_rs", work_dir="ref_rs", kw=dict(RESUMABLE, export=weights)),
        dict(name="ref_rs_stop", work_dir="ref_rs_resume", kw=dict(RESUMABLE, stop_after_epoch=1)),
        dict(name="ref_rs_resumed", work_dir="ref_rs_resume", kw=dict(RESUMABLE, resume=True)),
        dict(name="ref_rs_ema", work_dir="ref_rs_ema", kw=dict(RESUMABLE, ema=True)),
    ]
    # MMEngine's own resume needs this on torch >= 2.6; the reference process only
    _run(
        root,
        "reference_driver.py",
        reference,
        nproc=2,
        env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
    )
    ds2_ckpt = str(root / "ds2_resume" / "epoch_1.pth")
    mmengine_pth = str(root / "ref_rs_resume" / "epoch_1.pth")

    def spec(name: str, accelkit: dict, runner: str = "runner", **kw: object) -> dict:
        return dict(name=name, work_dir=name, runner=runner, accelkit=accelkit, kw=kw)

    def evaluate(name: str, accelkit: dict, load_from: str) -> dict:
        return dict(spec(name, accelkit, **dict(RESUMABLE, load_from=load_from)), mode="val")

    specs = [spec(f"ds{stage}", _ds(stage), **DISTRIBUTED) for stage in (2, 3)]
    specs += [
        spec("ds2_rs", _ds(2), **RESUMABLE),
        spec("flex_ds2_rs", _ds(2), runner="flexible", **RESUMABLE),
        dict(
            spec("ds2_stop", _ds(2), **dict(RESUMABLE, stop_after_epoch=1)), work_dir="ds2_resume"
        ),
        dict(spec("ds2_resumed", _ds(2), **dict(RESUMABLE, resume=True)), work_dir="ds2_resume"),
        spec(
            "ddp_from_ds2", dict(backend="ddp"), **dict(RESUMABLE, resume=True, load_from=ds2_ckpt)
        ),
        spec("ds3_from_ds2", _ds(3), **dict(RESUMABLE, resume=True, load_from=ds2_ckpt)),
        spec(
            "ds2_from_mmengine",
            _ds(2, trust_pickle=True),
            **dict(RESUMABLE, resume=True, load_from=mmengine_pth),
        ),
        evaluate("ds2_plain", _ds(2), weights),
        evaluate("ds3_plain", _ds(3), weights),
        evaluate("fsdp_plain", dict(backend="fsdp"), weights),
        # MMEngine's EMAHook on ZeRO-2 (the whole model on every rank): trained, stopped and
        # resumed, loaded for evaluation
        spec("ds2_ema", _ds(2), **dict(RESUMABLE, ema=True)),
        dict(
            spec("ds2_ema_stop", _ds(2), **dict(RESUMABLE, ema=True, stop_after_epoch=1)),
            work_dir="ds2_ema_resume",
        ),
        dict(
            spec("ds2_ema_resumed", _ds(2), **dict(RESUMABLE, ema=True, resume=True)),
            work_dir="ds2_ema_resume",
        ),
        evaluate("ds2_ema_load", _ds(2), str(root / "ds2_ema" / "epoch_2.pth")),
    ]
    _run(root, "accelkit_driver.py", specs, nproc=2)

    # negative twins: a flipped bit in rank 1's file, a tensor of the wrong shape, a pickle
    # without trust_pickle
    import shutil

    import torch

    shutil.copytree(root / "ds2_resume", root / "ds2_flipped")
    shard = root / "ds2_flipped" / "epoch_1.pth" / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = torch.load(weights, weights_only=True)
    bad["net.0.weight"] = bad["net.0.weight"][:-1].clone()
    torch.save(bad, root / "bad_shape.pth")
    flipped = str(root / "ds2_flipped" / "epoch_1.pth")
    broken = [
        spec("ds2_from_flipped", _ds(2), **dict(RESUMABLE, resume=True, load_from=flipped)),
        evaluate("ds3_bad_shape", _ds(3), str(root / "bad_shape.pth")),
        spec("ds2_untrusted", _ds(2), **dict(RESUMABLE, resume=True, load_from=mmengine_pth)),
        # EMAHook where parameters are partitioned: refused before training
        spec("ds3_ema", _ds(3), **dict(RESUMABLE, ema=True)),
        spec("fsdp_ema", dict(backend="fsdp"), **dict(RESUMABLE, ema=True)),
    ]
    for entry in broken:
        entry["expect_error"] = True
    _run(root, "accelkit_driver.py", broken, nproc=2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_two_processes_track_mmengine_ddp(deepspeed_runs: Path, stage: int) -> None:
    """DeepSpeed ZeRO-2/3 under AccelkitRunner: the setup MMEngine's Runner cannot host."""
    root = deepspeed_runs
    for rank in (0, 1):
        _close_run(_record(root, f"ds{stage}", rank), _record(root, "ref", rank), SHARDED_TOL)
    assert (root / f"ds{stage}" / "epoch_2.pth" / "rank-00001.safetensors").is_file()


@pytest.mark.slow
def test_deepspeed_under_flexible_runner(deepspeed_runs: Path) -> None:
    """FlexibleRunner(strategy=AccelkitStrategy(backend='deepspeed')) trains exactly as
    AccelkitRunner does on the same backend, and tracks MMEngine's DDP Runner."""
    root = deepspeed_runs
    for rank in (0, 1):
        _same_run(_record(root, "flex_ds2_rs", rank), _record(root, "ds2_rs", rank))
        _close_run(_record(root, "ds2_rs", rank), _record(root, "ref_rs", rank), SHARDED_TOL)


@pytest.mark.slow
def test_deepspeed_resume_keeps_optimizer_and_scheduler_state(deepspeed_runs: Path) -> None:
    """mmengine #1408: a ZeRO-2 run stopped after epoch 1 and resumed continues bit for bit
    (momentum buffers, learning-rate schedulers, message hub, RNG, data order)."""
    root = deepspeed_runs
    for rank in (0, 1):
        first, second = _record(root, "ds2_stop", rank), _record(root, "ds2_resumed", rank)
        assert first["iter"] == 5 and second["iters"][0] == 5
        _same_run(_joined(first, second), _record(root, "ds2_rs", rank))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp_from_ds2", "ds3_from_ds2"])
def test_deepspeed_checkpoint_resumes_on_another_backend(deepspeed_runs: Path, name: str) -> None:
    """The gap in the original discussion: trained with DeepSpeed ZeRO-2, resumed with DDP (or
    ZeRO-3); the joined run tracks MMEngine's uninterrupted DDP run."""
    root = deepspeed_runs
    for rank in (0, 1):
        joined = _joined(_record(root, "ds2_stop", rank), _record(root, name, rank))
        _close_run(joined, _record(root, "ref_rs", rank), SHARDED_TOL)


@pytest.mark.slow
def test_mmengine_checkpoint_resumes_under_deepspeed(deepspeed_runs: Path) -> None:
    """MMEngine's own epoch_1.pth (pickled, trusted: weights, SGD state, schedulers) resumed
    under ZeRO-2 tracks MMEngine's own resume; that resume is MMEngine's uninterrupted run."""
    root = deepspeed_runs
    for rank in (0, 1):
        ref = _record(root, "ref_rs", rank)
        ref_joined = _joined(
            _record(root, "ref_rs_stop", rank), _record(root, "ref_rs_resumed", rank)
        )
        _same_run(ref_joined, ref)
        joined = _joined(
            _record(root, "ref_rs_stop", rank), _record(root, "ds2_from_mmengine", rank)
        )
        _close_run(joined, ref, SHARDED_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ds2_plain", "ds3_plain", "fsdp_plain"])
def test_load_from_plain_pth_on_sharded_backends(deepspeed_runs: Path, name: str) -> None:
    """mmengine #1499: load_from a plain .pth of weights under DeepSpeed ZeRO-2/3 (and fsdp):
    every rank evaluates with exactly the exported weights."""
    root = deepspeed_runs
    for rank in (0, 1):
        loaded, ref = _record(root, name, rank), _record(root, "ref_rs", rank)
        assert loaded["params"] == ref["params"]
        assert loaded["val"] == ref["val"][-1:] and loaded["loss"] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "kind", "named"),
    [
        ("ds2_from_flipped", "CheckpointError", "rank-00001.safetensors"),
        ("ds3_bad_shape", "CheckpointError", "shape"),
        ("ds2_untrusted", "CheckpointError", "trust_pickle=True"),
        ("ds3_ema", "UnsupportedError", "partitions the model's parameters"),
        ("fsdp_ema", "UnsupportedError", "partitions the model's parameters"),
    ],
)
def test_deepspeed_loads_refuse_damaged_input(
    deepspeed_runs: Path, name: str, kind: str, named: str
) -> None:
    """Negative twins of the DeepSpeed resume and load_from tests, and EMAHook refused where
    it cannot work (before any training: no record is written)."""
    root = deepspeed_runs
    for suffix in (".error.json", ".rank1.error.json"):
        err = json.loads((root / f"{name}{suffix}").read_text())
        assert err["type"] == kind, err
        assert named in err["message"], err
    assert not (root / f"{name}.rank0.json").exists()


@pytest.mark.slow
def test_ema_hook_under_deepspeed_zero2(deepspeed_runs: Path) -> None:
    """EMAHook on ZeRO-2 tracks MMEngine's DDP Runner with EMAHook (validation on the averaged
    weights); stopped and resumed, it continues bit for bit; load_from its checkpoint gives the
    model the averaged weights, as MMEngine does."""
    root = deepspeed_runs
    for rank in (0, 1):
        ours, ref = _record(root, "ds2_ema", rank), _record(root, "ref_rs_ema", rank)
        _close_run(ours, ref, SHARDED_TOL)
        assert len(ours["val_params"]) == len(ref["val_params"]) == 2
        worst = max(
            abs(x - y) for a, b in zip(ours["val_params"], ref["val_params"]) for x, y in zip(a, b)
        )
        assert worst <= SHARDED_TOL["params"]
        assert ours["val_params"][-1] != ours["params"]  # validation saw the averaged weights
        joined = _joined(
            _record(root, "ds2_ema_stop", rank), _record(root, "ds2_ema_resumed", rank)
        )
        _same_run(joined, ours)
        assert _record(root, "ds2_ema_load", rank)["params"] == ours["val_params"][-1]


# ---- the other plugins under AccelkitRunner -----------------------------------------------------
# MMEngine's own ColossalAIStrategy fails with TorchDDPPlugin ("Model is not boosted"); every
# backend is run here instead. colossalai_ddp is torch DDP underneath (bit for bit); the ZeRO
# and OSS/SDP ones reduce-scatter and shard the clip norm like fsdp (measured: losses within
# 2.4e-7, weights within 1.5e-8, grad norms within 1.2e-7 of MMEngine's DDP: SHARDED_TOL holds).
#: backend name -> (its plugin package, the library it drives); both must be importable to run it
PLUGIN_BACKENDS = {
    "colossalai_ddp": ("accelkit_colossalai", "colossalai"),
    "colossalai_zero": ("accelkit_colossalai", "colossalai"),
    "fairscale_oss": ("accelkit_fairscale", "fairscale"),
    "fairscale_sdp": ("accelkit_fairscale", "fairscale"),
}


def _missing(name: str) -> str | None:
    """The first package of ``name``'s pair that is not installed, or None."""
    import importlib.util

    return next((m for m in PLUGIN_BACKENDS[name] if importlib.util.find_spec(m) is None), None)


@pytest.fixture(scope="module")
def plugin_runs(two_process_runs: Path) -> Path:
    root = two_process_runs
    names = [n for n in PLUGIN_BACKENDS if _missing(n) is None]
    if not names:
        pytest.skip("no ColossalAI or FairScale plugin installed")
    specs = [
        dict(name=name, work_dir=name, runner="runner", accelkit=dict(backend=name), kw=DISTRIBUTED)
        for name in names
    ]
    _run(root, "accelkit_driver.py", specs, nproc=2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLUGIN_BACKENDS))
def test_plugin_backends_track_mmengine_ddp(plugin_runs: Path, name: str) -> None:
    """ColossalAI and FairScale under AccelkitRunner, 2 processes, MMEngine's partial last
    window and clip_grad: they track MMEngine's DDP Runner, and write portable checkpoints."""
    if missing := _missing(name):
        pytest.skip(f"{missing} is not installed (bash scripts/setup.sh installs it)")
    root = plugin_runs
    for rank in (0, 1):
        ours, ref = _record(root, name, rank), _record(root, "ref", rank)
        if name == "colossalai_ddp":
            _same_run(ours, ref)
        else:
            _close_run(ours, ref, SHARDED_TOL)
    assert (root / name / "epoch_2.pth" / "rank-00001.safetensors").is_file()


# ---- translation of MMEngine's config, and the no-pickle codec (in process, fast) ---------------
def test_optim_wrapper_config_maps_onto_accelkit_settings() -> None:
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    cfg, settings = read_optim_wrapper_cfg(
        dict(optimizer=dict(type="SGD", lr=0.1), accumulative_counts=4, clip_grad=dict(max_norm=2))
    )
    assert cfg["type"] == "AccelkitOptimWrapper"
    assert (settings.accumulation_steps, settings.max_grad_norm) == (4, 2.0)
    assert settings.precision is None
    cfg, settings = read_optim_wrapper_cfg(
        dict(type="AmpOptimWrapper", dtype="bfloat16", loss_scale="dynamic", optimizer={})
    )
    assert settings.precision == "bf16-mixed" and "dtype" not in cfg and "loss_scale" not in cfg
    assert read_optim_wrapper_cfg(dict(type="AmpOptimWrapper", optimizer={}))[1].precision == (
        "16-mixed"
    )
    # MMEngine's clip by value becomes accelkit's max_grad_value
    _, settings = read_optim_wrapper_cfg(
        dict(optimizer={}, clip_grad=dict(type="value", clip_value=0.5))
    )
    assert (settings.max_grad_value, settings.max_grad_norm) == (0.5, None)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (dict(optimizer={}, clip_grad=dict(type="value", clip_value=1, x=2)), "clip_value only"),
        (dict(optimizer={}, clip_grad=dict(max_norm=1, norm_type=1)), "L2 norm"),
        (dict(optimizer={}, clip_grad=dict(max_norm=1, error_if_nonfinite=True)), "nonfinite"),
        (dict(type="ApexOptimWrapper", optimizer={}), "drives its own library.*backend='apex'"),
        (
            dict(
                constructor="X",
                gen=dict(optimizer={}, clip_grad=dict(max_norm=1)),
                disc=dict(optimizer={}),
            ),
            "differ in clip_grad max_norm",
        ),
        (
            dict(
                constructor="X",
                gen=dict(type="AmpOptimWrapper", optimizer={}),
                disc=dict(optimizer={}),
            ),
            "differ in AMP",
        ),
    ],
)
def test_unsupported_optim_wrapper_config_is_refused(cfg: dict, message: str) -> None:
    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine._settings import read_optim_wrapper_cfg

    with pytest.raises(ConfigError, match=message):
        read_optim_wrapper_cfg(cfg)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (dict(backend="cpu", accumulation_steps=2), "accumulative_counts"),
        (dict(backend="cpu", max_grad_norm=1.0), "clip_grad"),
        (dict(backend="cpu", seed=1), "randomness"),
    ],
)
def test_accelkit_section_refuses_what_mmengine_configures(section: dict, message: str) -> None:
    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine._settings import AdapterOptions

    with pytest.raises(ConfigError, match=message):
        AdapterOptions.parse(section, "accelkit")


def test_precision_disagreement_is_an_error() -> None:
    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine._settings import (
        AdapterOptions,
        accelerator_kwargs,
        read_optim_wrapper_cfg,
    )

    adapter = AdapterOptions.parse(dict(backend="cpu", precision="16-mixed"), "accelkit")
    _, settings = read_optim_wrapper_cfg(
        dict(type="AmpOptimWrapper", dtype="bfloat16", optimizer={})
    )
    with pytest.raises(ConfigError, match="disagrees"):
        accelerator_kwargs(adapter, settings)


def test_mmengine_state_round_trips_without_pickle() -> None:
    """MMEngine's own state (schedulers' Counters, HistoryBuffers of numpy arrays, tuples) comes
    back type for type from plain JSON."""
    import collections

    import numpy as np
    import torch
    from mmengine.logging import HistoryBuffer

    from accelkit.integrations.mmengine.checkpoint import decode, encode

    buf = HistoryBuffer([1.5, 2.25], [1, 2], max_length=7)
    state = {
        "milestones": collections.Counter({3: 1, 7: 2}),
        "ordered": collections.OrderedDict(b=1, a=(2, 3.5)),
        "int_keys": {1: "x", 2: None},
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "scalar": np.float64(0.1),
        "tensor": torch.tensor([1, 2], dtype=torch.int64),
        "buffer": buf,
        "nested": [{"$looks_like_a_tag": 1}, {4, 5}, float("inf")],
    }
    data = json.loads(json.dumps(encode(state)))
    back = decode(data)
    assert isinstance(back["milestones"], collections.Counter) and back["milestones"] == {
        3: 1,
        7: 2,
    }
    assert isinstance(back["ordered"], collections.OrderedDict)
    assert list(back["ordered"]) == ["b", "a"] and back["ordered"]["a"] == (2, 3.5)
    assert back["int_keys"] == {1: "x", 2: None}
    assert back["array"].dtype == np.float32 and (back["array"] == state["array"]).all()
    assert isinstance(back["scalar"], np.float64) and back["scalar"] == np.float64(0.1)
    assert torch.equal(back["tensor"], state["tensor"])
    assert isinstance(back["buffer"], HistoryBuffer) and back["buffer"].max_length == 7
    assert back["buffer"].data[0].tolist() == [1.5, 2.25] and back["buffer"].current() == 2.25
    assert back["nested"] == [{"$looks_like_a_tag": 1}, {4, 5}, float("inf")]


def test_unencodable_state_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from accelkit.integrations.mmengine.checkpoint import encode_lenient

    with caplog.at_level("WARNING", logger="accelkit"):
        out = encode_lenient({"ok": 1, "fn": print}, "meta")
    assert out == {"ok": 1}
    assert "meta.fn" in caplog.text


@pytest.mark.slow  # a fresh interpreter importing MMEngine: 5-13 s
def test_import_accelkit_does_not_import_mmengine() -> None:
    code = (
        "import sys, accelkit; accelkit.get('cpu'); "
        "assert 'mmengine' not in sys.modules; "
        "import accelkit.integrations; assert 'mmengine' not in sys.modules; "
        "import accelkit.integrations.mmengine; assert 'mmengine' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class _Hub:
    def update_info(self, key: str, value: object) -> None:
        pass


class _CrashingRunner:
    """What CheckpointHook touches on a runner; its save writes the directory, or dies midway."""

    def __init__(self, work_dir: Path, crash: bool) -> None:
        self.work_dir, self.crash, self.message_hub = str(work_dir), crash, _Hub()

    def save_checkpoint(self, out_dir: str, filename: str, *args: object, **kwargs: object) -> None:
        if self.crash:
            raise RuntimeError("killed during the save")
        (Path(out_dir) / filename).mkdir()
        (Path(out_dir) / filename / "accelkit.json").write_text("{}")


def _rotate(hook_type: type, work: Path, crash: bool) -> list[str]:
    import collections

    from mmengine.fileio import get_file_backend

    work.mkdir()
    (work / "epoch_1.pth").mkdir()
    (work / "epoch_1.pth" / "accelkit.json").write_text("{}")
    hook = hook_type(interval=1, max_keep_ckpts=1)
    hook.out_dir, hook.file_backend = str(work), get_file_backend(str(work))
    hook.keep_ckpt_ids = collections.deque([1])
    runner = _CrashingRunner(work, crash)
    if crash:
        with pytest.raises(RuntimeError, match="killed"):
            hook._save_checkpoint_with_step(runner, 2, {})
    else:
        hook._save_checkpoint_with_step(runner, 2, {})
    return sorted(p.name for p in work.glob("epoch_*"))


def test_checkpoint_rotation_never_leaves_zero_checkpoints(tmp_path: Path) -> None:
    """max_keep_ckpts=1 and a crash during the save: MMEngine's CheckpointHook has deleted the
    only checkpoint already; AccelkitCheckpointHook deletes it only after the new one exists."""
    from mmengine.hooks import CheckpointHook

    from accelkit.integrations.mmengine import AccelkitCheckpointHook

    assert _rotate(CheckpointHook, tmp_path / "mmengine", crash=True) == []  # the hazard
    assert _rotate(AccelkitCheckpointHook, tmp_path / "crash", crash=True) == ["epoch_1.pth"]
    # its twin: without the crash the old one goes, the new one stays, last_checkpoint points
    assert _rotate(AccelkitCheckpointHook, tmp_path / "ok", crash=False) == ["epoch_2.pth"]
    assert (tmp_path / "ok" / "last_checkpoint").read_text().endswith("epoch_2.pth")
