"""Per-step overhead of accelkit against raw PyTorch, on the same model, in the same process.

Both sides start from the same weights (one model, deep-copied), see the same batch, and use the
same optimizer (AdamW, fused on CUDA). The raw side is the loop a user would write by hand; the
accelkit side is the full loop of the docs::

    with accel.accumulate(model):
        loss = model(x, y)
        accel.backward(loss)
        accel.step()

The sides are interleaved so that drift of a shared machine hits both alike: each repeat warms
both up (``--warmup`` steps), then times ``--steps`` steps per side in alternating chunks of
``--chunk`` steps (raw, accelkit, accelkit, raw, ...), and takes each side's median time per step
over its chunks. ``torch.cuda.synchronize`` runs only at a chunk's two ends, so a hidden host sync
per step (reading ``grad_norm``, say) shows as a slower accelkit side; for the GPT a chunk is the
whole ``--steps``, so that the GPU queue runs deep. The ratio accelkit/raw is taken per repeat; the report gives the median over
repeats and its spread (min, max).

Examples::

    python bench/overhead.py --device cpu --model mlp --threads 1
    python bench/overhead.py --device cuda --model mlp
    python bench/overhead.py --device cuda --model gpt --precision bf16-mixed --out gpt.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from reference_gpt import GPT, GPT2_SMALL
from torch import nn


# ---- the two workloads (same shapes as bench/peers.py) ----------------------------------------
class MLP(nn.Module):
    """4 x (Linear 256 -> 256, ReLU): so little compute that per-step overhead dominates."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def make_workload(
    name: str, batch: int, device: torch.device, seq: int
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model (built on the CPU, fp32) and one fixed batch on ``device``."""
    gen = torch.Generator().manual_seed(1)
    if name in ("mlp", "null"):
        width = 256 if name == "mlp" else 1
        model = MLP(width=width, depth=4 if name == "mlp" else 1)
        x = torch.randn(batch, width, generator=gen)
        y = torch.randn(batch, width, generator=gen)
    else:
        vocab, width, layers, heads, _ = GPT2_SMALL
        model = GPT(vocab, width, layers, heads, seq)
        x = torch.randint(0, vocab, (batch, seq), generator=gen)
        y = torch.randint(0, vocab, (batch, seq), generator=gen)
    return model, (x.to(device), y.to(device))


# ---- the two sides ----------------------------------------------------------------------------
def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def raw_side(
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    device: torch.device,
    precision: str,
    max_grad_norm: float | None,
) -> tuple[Callable[[], None], nn.Module]:
    """The hand-written loop: autocast, GradScaler for fp16, clip_grad_norm_, step, zero_grad."""
    model = model.to(device)
    opt = make_optimizer(model, device)
    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if low is torch.float16 else None
    params = list(model.parameters())

    def forward() -> torch.Tensor:
        if low is None:
            return model(*batch)
        with torch.autocast(device.type, dtype=low):
            return model(*batch)

    def step() -> None:
        loss = forward()
        if scaler is not None:
            scaler.scale(loss).backward()
            if max_grad_norm is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def accelkit_side(
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    device: torch.device,
    precision: str,
    max_grad_norm: float | None,
) -> tuple[Callable[[], None], nn.Module, Any]:
    """The loop of the docs, through ``accelkit.get(...)`` on the single-device backend."""
    import accelkit

    accel = accelkit.get(device.type, precision=precision, max_grad_norm=max_grad_norm)
    model = model.to(device)  # the optimizer is built on the placed model, as on the raw side
    model, _opt = accel.setup(model, make_optimizer(model, device))

    def step() -> None:
        with accel.accumulate(model):
            loss = model(*batch)
            accel.backward(loss)
            accel.step()

    return step, model, accel


# ---- timing -----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_chunk(
    step: Callable[[], None], device: torch.device, steps: int, clock: Callable[[], float]
) -> float:
    """Seconds per step over ``steps`` steps, synchronizing only before and after them."""
    sync(device)
    start = clock()
    for _ in range(steps):
        step()
    sync(device)
    return (clock() - start) / steps


def time_repeat(
    sides: dict[str, Callable[[], None]], device: torch.device, args: argparse.Namespace, first: str
) -> dict[str, tuple[float, float]]:
    """One repeat: warm both sides up, then alternate timed chunks of ``--chunk`` steps.

    Each side's figure is the median over its chunks of the time per step: chunks of the two
    sides alternate, so both see the same machine, and the median drops a chunk that another
    process preempted. With ``--chunk`` equal to ``--steps`` (the CUDA default) a repeat is one
    block per side. Returns ``{side: (median, fastest chunk)}`` seconds per step.
    """
    order = [first, *(s for s in sides if s != first)]
    for side in order:
        for _ in range(args.warmup):
            sides[side]()
    gc.collect()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    per_chunk: dict[str, list[float]] = {side: [] for side in order}
    for chunk in range(args.steps // args.chunk):
        for side in order if chunk % 2 == 0 else order[::-1]:
            per_chunk[side].append(time_chunk(sides[side], device, args.chunk, clock))
    return {side: (statistics.median(v), min(v)) for side, v in per_chunk.items()}


def max_param_difference(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute weight difference: both sides did the same work if this is ~0."""
    with torch.no_grad():
        return max(
            (pa.float() - pb.float()).abs().max().item()
            for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
        )


VARIANTS = {
    "noclip": "no clip",
    "clip": "clip",
    "aa": "raw vs raw (noise floor)",
}


def run_variant(args: argparse.Namespace, device: torch.device, variant: str) -> dict[str, Any]:
    """Time one variant. ``aa`` puts raw PyTorch on both sides: the method's own noise floor."""
    max_grad_norm = args.max_grad_norm if variant == "clip" else None
    torch.manual_seed(0)
    base, batch = make_workload(args.model, args.batch, device, args.seq)
    raw_step, raw_model = raw_side(
        copy.deepcopy(base), batch, device, args.precision, max_grad_norm
    )
    accel = None
    if variant == "aa":
        acc_step, acc_model = raw_side(
            copy.deepcopy(base), batch, device, args.precision, max_grad_norm
        )
    else:
        acc_step, acc_model, accel = accelkit_side(
            copy.deepcopy(base), batch, device, args.precision, max_grad_norm
        )
    del base
    sides = {"raw": raw_step, "accelkit": acc_step}
    times: dict[str, list[float]] = {"raw": [], "accelkit": []}
    fastest: dict[str, float] = {"raw": math.inf, "accelkit": math.inf}
    for repeat in range(args.repeats):
        measured = time_repeat(sides, device, args, "raw" if repeat % 2 == 0 else "accelkit")
        for side, (median, best) in measured.items():
            times[side].append(median)
            fastest[side] = min(fastest[side], best)
    ratios = [a / r for a, r in zip(times["accelkit"], times["raw"], strict=True)]
    # Read after the timed loops only: reading it inside would add a host sync per step.
    grad_norm = accel.grad_norm if accel is not None else None
    result = {
        "variant": VARIANTS[variant],
        "max_grad_norm": max_grad_norm,
        "raw_ms": [t * 1e3 for t in times["raw"]],
        "accelkit_ms": [t * 1e3 for t in times["accelkit"]],
        "raw_ms_median": statistics.median(times["raw"]) * 1e3,
        "accelkit_ms_median": statistics.median(times["accelkit"]) * 1e3,
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        # contention only ever adds time, so the fastest chunks are the least disturbed
        "ratio_of_fastest_chunks": fastest["accelkit"] / fastest["raw"],
        "max_param_difference": max_param_difference(raw_model, acc_model),
        "last_grad_norm": None if grad_norm is None else float(grad_norm),
    }
    del raw_model, acc_model, accel, sides, raw_step, acc_step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def format_table(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    head = (
        f"model={meta['model']} device={meta['device']} precision={meta['precision']} "
        f"batch={meta['batch']} steps={meta['steps']} chunk={meta['chunk']} warmup={meta['warmup']} "
        f"repeats={meta['repeats']} threads={meta['threads']} clock={meta['clock']}"
    )
    lines = [
        head,
        "",
        "| variant | raw ms/step | accelkit ms/step | difference us/step | "
        "ratio accelkit/raw (median) | ratio min | ratio max | ratio of fastest chunks | "
        "max param diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | {r['raw_ms_median']:.4f} | {r['accelkit_ms_median']:.4f} | "
            f"{(r['accelkit_ms_median'] - r['raw_ms_median']) * 1e3:+.1f} | "
            f"{r['ratio_median']:.3f} | {r['ratio_min']:.3f} | {r['ratio_max']:.3f} | "
            f"{r['ratio_of_fastest_chunks']:.3f} | "
            f"{r['max_param_difference']:.2e} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--model",
        choices=["mlp", "gpt", "null"],
        default="mlp",
        help="null: one Linear(1, 1), so a step is almost only framework work; the difference "
        "in us/step is accelkit's own cost",
    )
    p.add_argument("--precision", default=None, help="default: 32-true (mlp), bf16-mixed (gpt)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before each repeat")
    p.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="steps per timed chunk; the sides alternate chunk by chunk "
        "(default: 10 for mlp and null, --steps for gpt)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved repeats per side (>= 5; 11 mlp, 7 gpt)",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024, help="sequence length (gpt)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="for the 'clip' variant")
    p.add_argument(
        "--variants",
        default="noclip,clip,aa",
        help="comma-separated subset of noclip, clip and aa (raw on both sides: the noise floor)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="'cpu' counts this thread's CPU time only (needs --device cpu --threads 1): "
        "time the process spent preempted by others on a shared machine does not count",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    is_mlp = args.model in ("mlp", "null")
    args.precision = args.precision or ("32-true" if is_mlp else "bf16-mixed")
    if args.precision not in ("32-true", "bf16-mixed", "16-mixed"):
        p.error("--precision: the raw side implements 32-true, bf16-mixed and 16-mixed")
    args.steps = args.steps or (300 if is_mlp else 30)
    args.warmup = args.warmup if args.warmup is not None else (30 if is_mlp else 5)
    # Small chunks pair the two sides tightly in time. The MLP is launch-bound on a GPU, so a sync
    # every 10 steps costs both sides the same little; the GPT's chunk is the whole block.
    args.chunk = args.chunk or (10 if is_mlp else args.steps)
    args.repeats = args.repeats or (11 if is_mlp else 7)
    if args.chunk < 1 or args.steps % args.chunk:
        p.error("--steps must be a multiple of --chunk")
    if args.clock == "cpu" and (args.device != "cpu" or args.threads != 1):
        p.error("--clock cpu needs --device cpu --threads 1 (all work on the timing thread)")
    if args.repeats < 5:
        p.error("--repeats must be >= 5")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here", file=sys.stderr)
        return 2
    import accelkit

    meta = {
        "model": args.model,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "precision": args.precision,
        "batch": args.batch,
        "seq": args.seq if args.model == "gpt" else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "chunk": args.chunk,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "torch": torch.__version__,
        "accelkit": accelkit.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    results = []
    for variant in wanted:
        if variant not in VARIANTS:
            print(
                f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}", file=sys.stderr
            )
            return 2
        results.append(run_variant(args, device, variant))
        if not math.isfinite(results[-1]["ratio_median"]):
            print("non-finite ratio", file=sys.stderr)
            return 1
    print(format_table(meta, results))
    for r in results:
        print(
            f"{r['variant']}: per-repeat ratios "
            + " ".join(f"{x:.3f}" for x in r["ratios"])
            + f"; last grad_norm {r['last_grad_norm']}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
