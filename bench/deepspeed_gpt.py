"""accelkit ``deepspeed`` against raw DeepSpeed on a GPT-2-small-shaped model, in the same process.

Both sides train the same model shape (12 layers, 768 wide, seq 1024, vocab 50304; the GPT
workload of bench/peers.py) with torch AdamW (fused on CUDA), one optimizer step per batch,
on the same fixed batch. The raw side is ``deepspeed.initialize`` with a config written out by
hand and the plain ``loss = engine(x, y); engine.backward(loss); engine.step()`` loop; it imports
nothing from accelkit. The accelkit side is the loop of docs/architecture.md on
``accelkit.get("deepspeed", zero_stage=..., precision=...)``. Configurations
``z<stage>:<precision>``: ``bf16-true`` is DeepSpeed's ``bf16`` section (what the raw DeepSpeed
sides of bench/peers.py use), ``bf16-mixed`` its ``torch_autocast`` section.

The sides are interleaved in rounds (the order alternates each round); each round times
``--steps`` steps after ``--warmup`` steps, with one device sync at each end. Reported per
configuration: the median ms/step of each side, the per-round ratio accelkit/raw (median, min,
max), tokens/s, MFU against a measured bf16 peak (``--peak-tflops``), and both sides' last loss
(equal when the two sides do the same work).

``--sweep`` also times raw DeepSpeed with other ZeRO settings against raw DeepSpeed with the
defaults, interleaved the same way (ratio variant/default below 1 is faster): the evidence for
changing accelkit's defaults on one GPU.

    python bench/deepspeed_gpt.py --out result.json                      # z2 and z3, bf16-true
    python bench/deepspeed_gpt.py --configs z2:bf16-true,z2:bf16-mixed --sweep --out r.json
    torchrun --nproc-per-node 8 bench/deepspeed_gpt.py --out result.json
    python bench/deepspeed_gpt.py --device cpu --layers 2 --width 64 --seq 32 --vocab 512 \\
        --heads 4 --batch 2 --steps 3 --warmup 1 --repeats 2 --configs z2:32-true --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from reference_gpt import GPT, flops_per_token, non_embedding_params

#: raw DeepSpeed variants timed by ``--sweep`` against the defaults: name -> zero_optimization keys
SWEEP = {
    2: {
        "overlap_comm": {"overlap_comm": True},
        "no_contiguous_gradients": {"contiguous_gradients": False},
        "reduce_bucket_5e7": {"reduce_bucket_size": 50_000_000},
        "reduce_bucket_2e9": {"reduce_bucket_size": 2_000_000_000},
        "allgather_bucket_2e9": {"allgather_bucket_size": 2_000_000_000},
        "no_reduce_scatter": {"reduce_scatter": False},
    },
    3: {
        "no_overlap_comm": {"overlap_comm": False},
        "persistence_1e6": {"stage3_param_persistence_threshold": 1_000_000},
        "persistence_all": {"stage3_param_persistence_threshold": 10**12},
        "prefetch_5e8": {"stage3_prefetch_bucket_size": 500_000_000},
        "max_live_1e10": {"stage3_max_live_parameters": 10**10},
        "reduce_bucket_5e8": {"reduce_bucket_size": 500_000_000},
    },
}


# ---- the workload ---------------------------------------------------------------------------
def new_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)  # the same initial weights on both sides
    return GPT(args.vocab, args.width, args.layers, args.heads, args.seq)


def optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused)


# ---- the two sides --------------------------------------------------------------------------
def raw_config(args: argparse.Namespace, stage: int, precision: str, zero: dict) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, **zero},
        "steps_per_print": 10**9,
    }
    if precision == "bf16-true":
        config["bf16"] = {"enabled": True}
    elif precision == "bf16-mixed":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    # DeepSpeed clips at 1.0 unless told otherwise; accelkit clips only with max_grad_norm
    config["gradient_clipping"] = args.clip or 0.0
    return config


def build_raw(args: argparse.Namespace, stage: int, precision: str, zero: dict) -> Any:
    import deepspeed

    model = new_model(args)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer(args, model),
        config=raw_config(args, stage, precision, zero),
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine


def build_accelkit(args: argparse.Namespace, stage: int, precision: str) -> Any:
    import accelkit

    accel = accelkit.get(
        "deepspeed",
        zero_stage=stage,
        precision=precision,
        max_grad_norm=args.clip,
        train_micro_batch_size_per_gpu=args.batch,
    )
    model = new_model(args)
    model, opt = accel.setup(model, optimizer(args, model))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    return step, (model, opt, accel)


# ---- timing ---------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_block(step: Any, x: torch.Tensor, y: torch.Tensor, args: Any, device: Any) -> Any:
    """Seconds per step over ``args.steps`` steps (slowest rank), after ``args.warmup``."""
    for _ in range(args.warmup):
        step(x, y)
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(x, y)
    sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) / args.steps, float(loss)


def interleave(sides: dict[str, Any], args: Any, device: torch.device) -> dict[str, Any]:
    """Time each side in alternating order, ``args.repeats`` rounds; per-round ratios."""
    names = list(sides)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, float] = {}
    peak: dict[str, float] = {}
    torch.manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    for round_index in range(args.repeats):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            per_step, losses[name] = timed_block(sides[name], x, y, args, device)
            seconds[name].append(per_step)
            if device.type == "cuda":
                peak[name] = max(
                    peak.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30
                )
    first, second = names
    ratios = [b / a for a, b in zip(seconds[first], seconds[second])]
    return {
        "seconds": seconds,
        "losses": losses,
        "peak": peak,
        f"ratio_{second}_over_{first}": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "all": ratios,
        },
    }


def run_config(args: argparse.Namespace, device: torch.device, stage: int, precision: str) -> dict:
    world = dist.get_world_size()
    with torch.device("meta"):
        model = new_model(args)
        n_params = non_embedding_params(model)  # matmul work: 6 N + attention
    raw_step, raw_keep = build_raw(args, stage, precision, {})
    accel_step, accel_keep = build_accelkit(args, stage, precision)
    timing = interleave({"raw": raw_step, "accelkit": accel_step}, args, device)
    tokens = args.batch * args.seq * world
    fpt = flops_per_token(n_params, args.layers, args.seq, args.width)
    result: dict[str, Any] = {
        "params": n_params,
        "ratio_accelkit_over_raw": timing["ratio_accelkit_over_raw"],
        "last_loss": timing["losses"],
        "accelkit_ds_config": accel_keep[2].backend.ds_config(),
    }
    for name in ("raw", "accelkit"):
        med = statistics.median(timing["seconds"][name])
        tok_s = tokens / med
        result[name] = {
            "ms_per_step_median": med * 1e3,
            "ms_per_step_all": [s * 1e3 for s in timing["seconds"][name]],
            "tokens_per_s": tok_s,
            "mfu_vs_measured_peak": fpt * tok_s / (args.peak_tflops * 1e12 * world),
        }
        if name in timing["peak"]:
            # both sides' engines live in this process, so this includes the other's state
            result[name]["peak_mem_gib_process"] = timing["peak"][name]
    del raw_step, raw_keep, accel_step, accel_keep
    release(device)
    return result


def run_sweep(args: argparse.Namespace, device: torch.device, stage: int, precision: str) -> dict:
    """Raw DeepSpeed with each variant against raw DeepSpeed with the defaults."""
    out: dict[str, Any] = {}
    for name, zero in SWEEP.get(stage, {}).items():
        try:
            default_step, default_keep = build_raw(args, stage, precision, {})
            variant_step, variant_keep = build_raw(args, stage, precision, zero)
            timing = interleave({"default": default_step, "variant": variant_step}, args, device)
            out[name] = {
                "zero_optimization": zero,
                "ratio_variant_over_default": timing["ratio_variant_over_default"],
                "ms_default": statistics.median(timing["seconds"]["default"]) * 1e3,
                "ms_variant": statistics.median(timing["seconds"]["variant"]) * 1e3,
                "last_loss": timing["losses"],
            }
            del default_step, default_keep, variant_step, variant_keep
        except Exception as err:  # keep the other variants' figures
            out[name] = {"error": f"{type(err).__name__}: {err}"[:600]}
        release(device)
    return out


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def join_group(device_arg: str) -> torch.device:
    """A process group of one without a launcher, else the launcher's."""
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29534"),
    ):
        os.environ.setdefault(key, value)
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        dist.init_process_group("gloo")
    import deepspeed

    if device.type == "cpu":  # DeepSpeed's shm op serves its inference all-reduce; 100 s build
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    return device


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs", default="z2:bf16-true,z3:bf16-true", help="z<stage>:<precision>,..."
    )
    p.add_argument("--sweep", action="store_true", help="also time raw DeepSpeed ZeRO variants")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round and side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each round")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--out", default="-")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--no-fused", dest="fused", action="store_false", help="unfused AdamW")
    p.add_argument("--clip", type=float, default=None, help="clip the grad norm on both sides")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 ceiling")
    args = p.parse_args()
    device = join_group(args.device)
    if device.type == "cpu":
        args.fused = False
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    configs = []
    for item in [c.strip() for c in args.configs.split(",") if c.strip()]:
        stage, _, precision = item.partition(":")
        configs.append((int(stage.lstrip("z")), precision or "bf16-true"))
    # DeepSpeed keeps "torch_autocast is on" in module globals: engines that autocast go last,
    # so a raw engine is never built after one (accelkit resets it for its own engines)
    configs.sort(key=lambda c: c[1].endswith("-mixed"))
    import deepspeed

    record: dict[str, Any] = {
        "bench": "deepspeed_gpt",
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": dist.get_world_size(),
        "args": vars(args),
        "configs": {},
        "sweep": {},
    }
    for stage, precision in configs:
        name = f"z{stage}:{precision}"
        try:
            record["configs"][name] = run_config(args, device, stage, precision)
        except Exception as err:  # keep the other configurations' figures
            import traceback

            record["configs"][name] = {
                "error": f"{type(err).__name__}: {err}"[:800],
                "trace_tail": traceback.format_exc()[-2000:],
            }
            release(device)
        if args.sweep:
            record["sweep"][name] = run_sweep(args, device, stage, precision)
    if dist.get_rank() == 0:
        text = json.dumps(record, indent=1)
        print(text)
        for name, res in record["configs"].items():
            if "error" in res:
                print(f"[{name}] FAILED: {res['error']}", file=sys.stderr)
                continue
            r = res["ratio_accelkit_over_raw"]
            print(
                f"[{name}] accelkit/raw DeepSpeed step time: median {r['median']:.4f} "
                f"(min {r['min']:.4f}, max {r['max']:.4f}); raw "
                f"{res['raw']['ms_per_step_median']:.2f} ms, accelkit "
                f"{res['accelkit']['ms_per_step_median']:.2f} ms; accelkit "
                f"{res['accelkit']['tokens_per_s']:.0f} tok/s, MFU "
                f"{res['accelkit']['mfu_vs_measured_peak']:.3f}; last loss {res['last_loss']}",
                file=sys.stderr,
            )
        for name, variants in record["sweep"].items():
            for variant, res in variants.items():
                if "error" in res:
                    print(f"[sweep {name} {variant}] FAILED: {res['error']}", file=sys.stderr)
                    continue
                r = res["ratio_variant_over_default"]
                print(
                    f"[sweep {name} {variant}] variant/default: median {r['median']:.4f} "
                    f"(min {r['min']:.4f}, max {r['max']:.4f}); {res['ms_default']:.2f} -> "
                    f"{res['ms_variant']:.2f} ms",
                    file=sys.stderr,
                )
        if args.out != "-":
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()
    failed = any("error" in r for r in record["configs"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
