"""The accelkit side of the checkpoint tests: train, save, load, through ``accelkit.get``.

One launch runs a list of jobs in order, in every rank. A job builds its accelerator (DeepSpeed
at a ZeRO stage, ``ddp``, ``fsdp`` or ``cpu``), optionally loads a checkpoint, trains to
``steps`` (saving at ``save_at`` on the way) and returns the global mean loss of each step and
the full state gathered through the *independent* path of dsk_gather.py at the save, right
after the load, and at the end. ``tamper`` and ``convert`` jobs edit or convert a checkpoint on
rank 0 between two jobs.

The workload: 8 samples per step split over the ranks, a model with uneven parameter sizes (so
ZeRO partitions cut parameters in the middle), a frozen layer and a buffer, AdamW, a LambdaLR.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import accelkit

GLOBAL_BATCH = 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 33)
        self.norm = torch.nn.LayerNorm(33)
        self.fc2 = torch.nn.Linear(33, 21)
        self.fc3 = torch.nn.Linear(21, 3)
        self.head = torch.nn.Linear(3, 3)
        self.head.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x)))))
        return self.head(self.fc3(hidden)) * self.scale


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _accelerator(
    backend: str, stage: int | None, precision: str, config: Any, options: dict[str, Any]
) -> Any:
    if backend == "deepspeed":
        return accelkit.get("deepspeed", config, precision=precision, zero_stage=stage, **options)
    if backend in ("ddp", "fsdp"):
        options = {"device": "cpu", **options}
    return accelkit.get(backend, precision=precision, **options)


def _gather(accel: Any, model: Any, opt: Any) -> dict[str, Any]:
    import dsk_gather

    engine = getattr(accel.backend, "engine", None)
    if engine is not None:
        return dsk_gather.deepspeed_state(engine)
    return dsk_gather.torch_state(model, opt.optimizer)


def train(
    name: str,
    backend: str = "deepspeed",
    stage: int | None = None,
    precision: str = "32-true",
    steps: int = 6,
    save_at: int | None = None,
    save_to: str | None = None,
    save_format: str = "portable",
    load_from: str | None = None,
    load_format: str = "portable",
    load_keys: tuple[str, ...] = ("model", "optimizer", "scheduler"),
    strict: bool = True,
    config: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    skew_step: bool = False,
    set_scale: float | None = None,
    constant_lr: bool = False,
    resume_step: int | None = None,
) -> dict[str, Any]:
    accel = _accelerator(backend, stage, precision, config, options or {})
    rank, world = accel.rank, accel.world_size
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.01
    )
    model, opt = accel.setup(model, opt)
    state = {"model": model, "optimizer": opt, "step": 0}
    if not constant_lr:  # dsk_rawckpt's raw DeepSpeed run keeps its learning rate constant
        state["scheduler"] = accel.setup_scheduler(
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
        )
    result: dict[str, Any] = {"losses": [], "world": world}
    engine = getattr(accel.backend, "engine", None)
    if engine is not None:  # which of DeepSpeed's optimizer wrappers this run exercises
        result["wrapper"] = type(engine.optimizer).__name__

    def save(step: int) -> None:
        if skew_step:  # one parameter's torch step behind the others
            inner = opt.optimizer
            first = inner.param_groups[0]["params"][-1]
            inner.state[first]["step"] = inner.state[first]["step"] - 1
        if set_scale is not None:  # a loss scale a fresh engine would not have
            _set_scale(accel.backend.engine, set_scale)
        state["step"] = step
        accel.save(save_to, state, format=save_format)
        result["saved"] = _gather(accel, model, opt)
        result["lr_at_save"] = opt.param_groups[0]["lr"]

    step = 0
    if load_from:
        # resume_step: the checkpoint holds no step counter (raw DeepSpeed's): the job knows it
        keys = (*load_keys, *(("step",) if resume_step is None else ()))
        subset = {k: state[k] for k in keys if k in state}
        trust = {"trust_pickle": True} if load_format == "native" else {}
        began = time.monotonic()
        try:
            accel.load(load_from, subset, strict=strict, format=load_format, **trust)
        except Exception as err:  # the test asserts on the type and message
            result["error"] = f"{type(err).__name__}: {err}"
            result["load_s"] = time.monotonic() - began  # reported, never asserted
            return result
        result["load_s"] = time.monotonic() - began
        step = subset["step"] if resume_step is None else resume_step
        result["loaded"] = _gather(accel, model, opt)
        result["lr_after_load"] = opt.param_groups[0]["lr"]
    if save_at == step and save_to:
        save(step)
    while step < steps:
        x, y = (t.to(accel.device) for t in batch(step, rank, world))
        loss = F.mse_loss(model(x), y)
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        result["losses"].append(float(mean))
        step += 1
        if step == save_at and save_to:
            save(step)
    result["final"] = _gather(accel, model, opt)
    return result


def _set_scale(engine: Any, scale: float) -> None:
    grad_scaler = getattr(engine.optimizer, "torch_autocast_gradscaler", None)
    if grad_scaler is not None:
        grad_scaler.update(new_scale=scale)
    loss_scaler = getattr(engine.optimizer, "loss_scaler", None)
    if loss_scaler is not None and getattr(loss_scaler, "dynamic", False):
        loss_scaler.cur_scale = scale


# ---- editing a checkpoint between jobs (rank 0 edits, everyone waits) -------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rewrite_manifest(path: Path, edit: Any) -> None:
    manifest = json.loads((path / "accelkit.json").read_text())
    edit(manifest)
    manifest.pop("checksum", None)
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["checksum"] = hashlib.sha256(canonical).hexdigest()
    (path / "accelkit.json").write_text(json.dumps(manifest, indent=1))


def tamper(source: str, target: str, how: str) -> dict[str, Any]:
    """A copy of ``source`` with one shard missing, or one fragment's offset moved (its manifest
    checksum recomputed, so the structural check is what catches it)."""
    src, dst = Path(source), Path(target)
    if _rank() == 0:
        shutil.copytree(src, dst)
        if how == "missing_shard":
            (dst / "rank-00001.safetensors").unlink()
        elif how == "missing_deepspeed_rank":  # a raw DeepSpeed checkpoint's last rank file
            for file in dst.rglob("*zero_pp_rank_1_*optim_states.pt"):
                file.unlink()
        elif how == "offset":

            def shift(manifest: dict[str, Any]) -> None:
                for tensor in manifest["tensors"]:
                    if tensor["kind"] == "master" and len(tensor["fragments"]) > 1:
                        tensor["fragments"][1]["flat_offset"] += 1
                        return
                raise AssertionError("no split master to shift")

            _rewrite_manifest(dst, shift)
    _barrier()
    return {}


def convert(source: str, target: str, trust_pickle: bool = True) -> dict[str, Any]:
    """``accelkit convert`` (the CLI) of a raw DeepSpeed checkpoint, on rank 0."""
    import contextlib
    import io

    out: dict[str, Any] = {}
    if _rank() == 0:
        from accelkit.cli import main

        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                out["code"] = main(
                    ["convert", source, target, *(["--trust-pickle"] * trust_pickle)]
                )
        except SystemExit as exit_:
            out["code"] = exit_.code
        out["stderr"] = stderr.getvalue()[-2000:]
    _barrier()
    return out


def jobs(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every job in order; a job that raises is reported and the next one runs."""
    results: dict[str, Any] = {}
    for job in jobs:
        kind = job.pop("job", "train")
        name = job.get("name") or f"{kind}:{job.get('target')}"
        try:
            if kind == "train":
                results[name] = train(**job)
            elif kind == "tamper":
                results[name] = tamper(**job)
            elif kind == "convert":
                results[name] = convert(**job)
            elif kind == "rawds":  # written by raw DeepSpeed, no accelkit
                import dsk_rawckpt

                results[name] = dsk_rawckpt.train_and_save(**job)
        except Exception:
            results[name] = {"crash": traceback.format_exc()[-3000:]}
    return results
