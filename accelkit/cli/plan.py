"""``accelkit plan``: per-GPU memory of every registered backend for a model, and which to pick.

The model is built on the meta device (no memory, no download); each backend estimates its own
memory through the ``accelkit_estimate_memory`` hook. Formulas: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EPILOG = """\
examples:
  accelkit plan --model gpt2-small --gpus 8 --gpu-memory 80GiB --precision bf16-mixed --batch 8
  accelkit plan mypkg.models:build --batch-factory mypkg.models:make_batch --gpus 4 --gpu-memory 24GiB
  accelkit plan --model gpt2-small --gpus 8 --gpu-memory 24GiB --mesh    # which dp x tp fits
  accelkit plan --model gpt2-small --gpus 8 --gpu-memory 24GiB --pp 2     # per pipeline stage

--pp P estimates the backends that run pipelines per stage (the heaviest one), on GPUS/P GPUs
a stage, and stretches the step by the bubble (P-1)/(M+P-1) of M micro-batches (--microbatches,
default 2P); the table's bubble column shows it.

--mesh adds a row per (dp_replicate, dp_shard, tp) mesh of the GPUs, labelled "fsdp mesh RxSxT":
FSDP2 shards over dp_shard (replicated over dp_replicate), and tensor parallelism with
tp_plan="auto" (the Linear layers named like a transformer block's q/k/v, o_proj, up/down,
fc1/fc2, qkv/proj) divides those layers' parameters, gradients and optimizer state, and the
activations between a column-wise and the next row-wise layer, by tp. --batch is per
data-parallel rank: the tp ranks of a replica share it.

Estimates are of torch.cuda.max_memory_allocated per GPU; the CUDA context (~0.5 GiB) and the
caching allocator's slack are what --headroom (default 10%) leaves room for.
"""


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")
    parser.add_argument(
        "--model", default=None, help="gpt2-small, tiny-gpt, mlp, or package.module:factory"
    )
    parser.add_argument("--batch-factory", default=None, help="for your own model (see bench)")
    parser.add_argument(
        "--gpus", type=int, default=None, help="GPUs (default: those present, else 1)"
    )
    parser.add_argument(
        "--gpu-memory",
        default=None,
        help="memory per GPU, e.g. 80GiB (default: GPU 0's, else 80GiB)",
    )
    parser.add_argument("--cpu-memory", default=None, help="host memory, e.g. 512GiB (offload)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch per GPU")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (built-in GPTs)")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        help="adamw (foreach), adamw-fused, sgd-momentum or sgd (default adamw)",
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--headroom", type=float, default=0.1, help="fraction kept free (0.1)")
    parser.add_argument("--backends", default=None, help="only these (comma-separated)")
    parser.add_argument(
        "--mesh",
        action="store_true",
        help="also estimate fsdp on every dp_replicate x dp_shard x tp mesh of --gpus",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: per-stage memory and the bubble, on GPUS/PP GPUs a stage",
    )
    parser.add_argument(
        "--microbatches", type=int, default=None, help="micro-batches per step with --pp (2*pp)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from accelkit.benchmark.memory import GiB, parse_size
    from accelkit.benchmark.planning import PlanRequest, make_plan
    from accelkit.precision import normalize_precision

    model = args.model or args.model_arg
    if not model:
        print(
            "accelkit plan: name a model (--model gpt2-small, or package.module:factory)",
            file=sys.stderr,
        )
        return 2
    try:
        precision = normalize_precision(args.precision)
        gpus, detected = _detect_gpus()
        request = PlanRequest(
            model=model,
            gpus=args.gpus or gpus,
            gpu_memory=parse_size(args.gpu_memory) if args.gpu_memory else (detected or 80 * GiB),
            cpu_memory=parse_size(args.cpu_memory) if args.cpu_memory else _host_memory(),
            precision=precision,
            batch=args.batch,
            seq=args.seq,
            optimizer=args.optimizer,
            activation_checkpointing=args.activation_checkpointing,
            headroom=args.headroom,
            batch_factory=args.batch_factory,
            backends=[b.strip() for b in args.backends.split(",")] if args.backends else None,
            mesh=args.mesh,
            pp=args.pp,
            microbatches=args.microbatches,
        )
        if request.gpus < 1 or not 0 <= request.headroom < 1:
            raise ValueError("--gpus must be >= 1 and --headroom in [0, 1)")
        plan = make_plan(request)
    except Exception as err:
        from accelkit.errors import AccelkitError

        if not isinstance(err, (ValueError, AccelkitError)):
            raise
        print(f"accelkit plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(plan), indent=1))
    else:
        print(render(plan))
    return 0


def _detect_gpus() -> tuple[int, int | None]:
    import torch

    if not torch.cuda.is_available():
        return 1, None
    return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory


def _host_memory() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def to_json(plan: dict[str, Any]) -> dict[str, Any]:
    def candidate(c: Any) -> dict[str, Any]:
        estimate = {k: v for k, v in c.estimate.items() if k != "variants"}
        return {
            "label": c.label,
            "backend": c.backend,
            "options": c.options,
            "fits": c.fits,
            "why_not": c.why_not or None,
            "note": c.note or None,
            "estimate": estimate,
        }

    best = plan["recommendation"]
    return {
        **{k: v for k, v in plan.items() if k not in ("candidates", "recommendation")},
        "candidates": [candidate(c) for c in plan["candidates"]],
        "recommendation": None if best is None else best.label,
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render(plan: dict[str, Any]) -> str:
    req, model = plan["request"], plan["model"]
    lines = [
        f"accelkit plan: {model['name']}, {model['params'] / 1e6:.1f}M parameters "
        f"({model['trainable_params'] / 1e6:.1f}M trainable), micro-batch {req['batch']} per GPU, "
        f"{req['precision']}, {req['optimizer']}"
        + (", activation checkpointing" if req["activation_checkpointing"] else ""),
        f"{req['gpus']} GPU(s) x {req['gpu_memory'] / 2**30:.1f} GiB; usable per GPU "
        f"{plan['budget_per_gpu'] / 2**30:.1f} GiB (headroom {100 * req['headroom']:.0f}%)",
        "",
        "| configuration | GPUs | params | grads | optimizer | master | activations | "
        "peak/GPU GiB | host GiB | fits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    install_notes: list[str] = []  # each install line once, under the table
    for c in plan["candidates"]:
        e = c.estimate
        fits = "yes" if c.fits else f"no: {c.why_not}"
        if c.note:
            need, _, install = c.note.partition(": ")  # planning's "needs <lib>: <install>"
            if need.startswith("needs ") and install:
                note = f"{need}: {install}"
                if note not in install_notes:
                    install_notes.append(note)
                fits += f" ({need}: install [{install_notes.index(note) + 1}])"
            else:
                fits += f" ({c.note})"
        lines.append(
            f"| {c.label} | {e.get('world_size', req['gpus'])} | {_gib(e['params'])} | "
            f"{_gib(e['grads'])} | {_gib(e['optimizer'])} | {_gib(e['master'])} | "
            f"{_gib(e['activations'])} | **{_gib(e['peak'])}** | {_gib(e.get('host', 0))} | {fits} |"
        )
    if install_notes:
        lines.append("")
        lines += [f"[{i}] {note}" for i, note in enumerate(install_notes, 1)]
    lines += ["", f"Recommendation: {plan['reason']}"]
    if plan["no_estimate"]:
        lines.append(
            "No estimate (their plugin does not implement accelkit_estimate_memory): "
            + ", ".join(plan["no_estimate"])
        )
    if plan["failed_estimates"]:
        lines.append("Estimate failed: " + "; ".join(plan["failed_estimates"]))
    if req.get("pp", 1) > 1:
        lines.append(
            f"Pipeline: pp={req['pp']}; memory is the heaviest stage's per GPU; bubble "
            + ", ".join(
                f"{c.label} {100 * c.estimate.get('bubble_fraction', 0):.0f}%"
                for c in plan["candidates"][:1]
            )
            + " of each step (1F1B)."
        )
    lines.append(
        "Columns are GiB per GPU; 'activations' is the traced forward+backward peak (with the "
        "gradients it overlaps and any gathered-parameter working set), so the peak is not the "
        "column sum. Formulas: docs/performance.md."
    )
    return "\n".join(lines)
