"""``accelkit demo``: train a small model, save, resume in a fresh model, and check the result.

It shows the whole loop in under a minute on two CPU cores: a small MLP learns a fixed random
"teacher" network from generated data; a checkpoint is written part way; a freshly built model,
optimizer, scheduler and dataloader are filled from it with ``accel.load``, and the steps after
it must reproduce the uninterrupted run's losses exactly (same backend, same world size).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

IN_FEATURES = 32
HIDDEN = 128
DATASET_SIZE = 2048
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
MAX_GRAD_NORM = 1.0


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", default="cpu", help="backend name (see `accelkit env`), default cpu"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes to launch on this machine (for ddp, fsdp, ...), default 1",
    )
    parser.add_argument(
        "--precision", default=None, help="32-true, bf16-mixed, 16-mixed, bf16-true or 16-true"
    )
    parser.add_argument(
        "--steps", type=int, default=150, help="optimizer steps before the checkpoint"
    )
    parser.add_argument(
        "--resume-steps", type=int, default=50, help="optimizer steps after the checkpoint"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default=None,
        help="directory for the checkpoint and summary.json (default: a new temporary directory "
        "for this run, printed at the start and in the summary)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1 or args.steps < 1 or args.resume_steps < 0:
        print(
            "accelkit demo: --nproc and --steps must be >= 1, --resume-steps >= 0", file=sys.stderr
        )
        return 2
    launched = "WORLD_SIZE" in os.environ  # a rank of the relaunch below, or under torchrun
    if not launched or os.environ.get("RANK", "0") == "0":
        refusal = refuse(args.backend)
        if refusal:  # said once, before any process is launched
            print(f"accelkit demo: {refusal}", file=sys.stderr)
            return 2
    if args.out is None:
        if launched:  # every rank must write into the same directory
            print("accelkit demo: under a launcher, pass --out DIR", file=sys.stderr)
            return 2
        # a fresh directory per run: a fixed path in /tmp would be shared by every user
        args.out = tempfile.mkdtemp(prefix="accelkit-demo-")
        print(f"accelkit demo: writing to {args.out}", flush=True)
    args.out = str(Path(args.out).resolve())
    if args.nproc > 1 and not launched:
        return _relaunch(args)
    return _worker(args)


def refuse(backend: str) -> str:
    """Why the demo cannot run ``backend`` here ("" when it can): an unknown or uninstalled name,
    a device this machine lacks, or a backend that cannot train the demo's plain MLP. Read from
    what the backend declared at registration, so nothing is launched to find out."""
    from accelkit import registry
    from accelkit.errors import AccelkitError

    try:
        spec = registry.host().resolve(backend)
    except AccelkitError as err:
        return str(err)
    not_runnable = spec.not_runnable_reason()
    if not_runnable:
        return f"backend {backend!r} is installed but cannot run here: it {not_runnable}"
    if spec.models:
        return (
            f"backend {backend!r} trains {spec.models}; the demo's model is a plain "
            "torch.nn.Sequential MLP, so the demo cannot run it"
        )
    return ""


def _relaunch(args: argparse.Namespace) -> int:
    """Start ``args.nproc`` copies of this command under torch.distributed.run."""
    from accelkit.cli.run import launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = ["--nproc-per-node", str(args.nproc), "-m", "accelkit.cli", "demo"]
    argv += ["--backend", args.backend, "--nproc", str(args.nproc), "--seed", str(args.seed)]
    argv += ["--steps", str(args.steps), "--resume-steps", str(args.resume_steps)]
    argv += ["--out", args.out]
    if args.precision:
        argv += ["--precision", args.precision]
    if args.no_progress:
        argv.append("--no-progress")
    return launch(argv)


# ---- the model and the data -------------------------------------------------------------------
def make_model() -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def make_dataset(seed: int) -> Any:
    """Inputs and the outputs of a fixed random teacher network, plus a little noise."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(DATASET_SIZE, IN_FEATURES, generator=gen)
    w1 = torch.randn(IN_FEATURES, 16, generator=gen) / IN_FEATURES**0.5
    w2 = torch.randn(16, 1, generator=gen) / 4.0
    targets = torch.tanh(inputs @ w1) @ w2 + 0.01 * torch.randn(DATASET_SIZE, 1, generator=gen)
    return torch.utils.data.TensorDataset(inputs, targets)


@dataclass
class Run:
    """One training setup: the accelerator and the objects it returned."""

    accel: Any
    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    losses: list[Any] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "loader": self.loader,
        }


def build(args: argparse.Namespace, dataset: Any, total_steps: int, init_seed: int) -> Run:
    import torch

    import accelkit

    accel = accelkit.get(
        args.backend, precision=args.precision, max_grad_norm=MAX_GRAD_NORM, seed=args.seed
    )
    torch.manual_seed(init_seed)
    with accel.init_module():
        model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    # the loader before the model: a backend that wants the micro-batch size (DeepSpeed's
    # train_micro_batch_size_per_gpu) takes it from the loader, and needs no advice
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)
    )
    model, optimizer = accel.setup(model, optimizer)
    scheduler = accel.setup_scheduler(
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    )
    return Run(accel, model, optimizer, scheduler, loader)


def train(run: Run, steps: int, progress: Any, on_step: Any = None) -> None:
    import torch.nn.functional as F

    def endless():
        while True:
            yield from run.loader

    batches = endless()
    for _ in range(steps):
        inputs, targets = next(batches)
        with run.accel.accumulate(run.model):
            outputs = run.model(inputs)
            with run.accel.autocast():
                loss = F.mse_loss(outputs.float(), targets.float())
            run.accel.backward(loss)
            run.accel.step()
        run.losses.append(loss.detach().float())
        if progress is not None:
            progress.set_postfix(loss=f"{run.losses[-1].item():.4f}", refresh=False)
            progress.update(1)
        if on_step is not None:
            on_step(len(run.losses))
    batches.close()


# ---- the demo ---------------------------------------------------------------------------------
@dataclass
class Summary:
    backend: str
    world_size: int
    device: str
    precision: str
    steps: int
    resume_steps: int
    first_loss: float
    last_loss: float
    loss_went_down: bool
    seconds: float  # setup, training, save and resume
    checkpoint: str | None
    resume: str  # "matches" | "differs" | "unavailable" | "skipped"
    resume_max_abs_diff: float | None = None
    note: str = ""


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from accelkit.errors import AccelkitError

    expected_world = int(os.environ.get("WORLD_SIZE", "1"))
    total = args.steps + args.resume_steps
    dataset = make_dataset(args.seed)
    started = time.perf_counter()
    try:
        first = build(args, dataset, total, init_seed=args.seed)
    except AccelkitError as err:
        print(f"accelkit demo: {err}", file=sys.stderr)
        return 2
    accel = first.accel
    if accel.world_size != expected_world:
        if os.environ.get("RANK", "0") == "0":  # a single-process backend calls every rank 0
            print(
                f"accelkit demo: backend {accel.name!r} runs {accel.world_size} process(es) but "
                f"{expected_world} were launched; with --nproc > 1 choose a distributed backend "
                "(see `accelkit env`)",
                file=sys.stderr,
            )
        return 2
    ckpt = Path(args.out) / f"step-{args.steps:06d}"
    accel.print(
        f"accelkit demo: backend {accel.name} on {accel.world_size} process(es), device "
        f"{accel.device.type}, precision {accel.precision}; checkpoint at step {args.steps}"
    )

    progress = None
    if accel.is_main and not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=total, desc="training", unit="step", dynamic_ncols=True)

    saved: dict[str, Any] = {"ok": False, "error": None}

    def save_at(step: int) -> None:
        if step != args.steps:
            return
        try:
            _remove_old_checkpoint(accel, ckpt)
            accel.save(ckpt, {**first.state(), "step": step})
            saved["ok"] = True
        except ImportError as err:  # a build of accelkit without the checkpoint package
            if not (err.name or "").startswith("accelkit.checkpoint"):
                raise
            saved["error"] = "accelkit.checkpoint is not available in this version"

    train(first, total, progress, on_step=save_at)
    if progress is not None:
        progress.close()

    losses = accel.all_reduce(torch.stack(first.losses), "mean").cpu()
    resume, diff, note = "skipped", None, ""
    if saved["error"]:
        resume, note = "unavailable", saved["error"]
        accel.print(f"checkpoint: unavailable ({saved['error']}); skipping save and resume")
    elif args.resume_steps > 0:
        resume, diff = _resume(args, dataset, total, ckpt, first, progress is not None)

    summary = Summary(
        backend=accel.name,
        world_size=accel.world_size,
        device=str(accel.device.type),
        precision=accel.precision,
        steps=args.steps,
        resume_steps=args.resume_steps,
        first_loss=float(losses[0]),
        last_loss=float(losses[-1]),
        loss_went_down=bool(losses[-1] < losses[0]),
        seconds=round(time.perf_counter() - started, 2),
        checkpoint=str(ckpt) if saved["ok"] else None,
        resume=resume,
        resume_max_abs_diff=diff,
        note=note,
    )
    if accel.is_main:
        _report(summary, Path(args.out))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0 if summary.loss_went_down and resume != "differs" else 1


def _remove_old_checkpoint(accel: Any, path: Path) -> None:
    """A previous demo's checkpoint at the same path (only ever one written by the demo)."""
    import shutil

    if accel.is_main and (path / "accelkit.json").is_file():
        shutil.rmtree(path)
    accel.barrier()


def _resume(
    args: argparse.Namespace,
    dataset: Any,
    total: int,
    ckpt: Path,
    first: Run,
    show: bool,
    load: bool = True,
) -> tuple[str, float]:
    """Fresh accelerator, model (other initial weights), optimizer, scheduler and loader; load
    the checkpoint and train the remaining steps; compare with the uninterrupted run.

    ``load=False`` skips the load: the tests' proof that the comparison can fail."""
    import torch

    second = build(args, dataset, total, init_seed=args.seed + 1)
    if load:
        second.accel.load(ckpt, second.state())
    progress = None
    if show:
        from tqdm.auto import tqdm

        progress = tqdm(total=args.resume_steps, desc="resumed ", unit="step", dynamic_ncols=True)
    train(second, args.resume_steps, progress)
    if progress is not None:
        progress.close()
    resumed = torch.stack(second.losses)
    reference = torch.stack(first.losses[args.steps :])
    diff = (resumed - reference).abs().max().reshape(1)
    diff = float(second.accel.all_reduce(diff, "max")[0])
    return ("matches" if diff == 0.0 else "differs"), diff


def _report(summary: Summary, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    total = summary.steps + summary.resume_steps
    lines = [
        "",
        "accelkit demo summary",
        f"  backend     {summary.backend} ({summary.world_size} process(es), {summary.device})",
        f"  precision   {summary.precision}",
        f"  loss        {summary.first_loss:.4f} (step 1) -> {summary.last_loss:.4f} (step {total})"
        + ("" if summary.loss_went_down else "  NOT DECREASING"),
        f"  time        {summary.seconds:.1f} s for {total} steps, save and resume included",
        f"  checkpoint  {summary.checkpoint or 'not written'}",
    ]
    if summary.resume == "matches":
        lines.append(
            f"  resume: matches uninterrupted run ({summary.resume_steps} steps after step "
            f"{summary.steps}, losses bit-identical)"
        )
    elif summary.resume == "differs":
        lines.append(
            f"  resume: DIFFERS from uninterrupted run (max |loss difference| "
            f"{summary.resume_max_abs_diff:.3g})"
        )
    else:
        lines.append(f"  resume: {summary.resume}" + (f" ({summary.note})" if summary.note else ""))
    lines.append(f"  summary     {out / 'summary.json'}")
    print("\n".join(lines), flush=True)
