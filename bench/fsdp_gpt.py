"""accelkit ``fsdp`` against raw FSDP2 on a GPT-2-small-shaped model, in the same process.

Both sides train the same model shape (12 layers, 768 wide, seq 1024, vocab 50304; the GPT
workload of bench/peers.py) in bf16-mixed: FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, AdamW, one optimizer step per batch. The raw side is written by hand with
``fully_shard`` (each block, then the root) and imports nothing from accelkit.

The two runs are interleaved in rounds (the order alternates each round); each round times
``--steps`` steps after ``--warmup`` steps, with one device sync at each end, so the figure is
throughput as a training loop sees it. Reported per configuration (eager, compile): the median
ms/step of each side, the per-round ratio accelkit/raw (median, min, max), tokens/s and MFU
against a measured bf16 peak (``--peak-tflops``; 790 for one H200, as in the peers' table).

Runs on one GPU without a launcher (a process group of one), on several under torchrun, or on
the CPU with small shapes for a smoke run::

    python bench/fsdp_gpt.py --steps 20 --repeats 5 --out result.json
    torchrun --nproc-per-node 8 bench/fsdp_gpt.py --out result.json
    python bench/fsdp_gpt.py --device cpu --layers 2 --width 64 --heads 4 --seq 32 --vocab 512 \\
        --batch 2 --steps 3 --warmup 1 --repeats 2 --configs eager --out /tmp/smoke.json
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
from reference_gpt import GPT, flops_per_token, non_embedding_params


# ---- the workload ---------------------------------------------------------------------------
# ---- the two sides --------------------------------------------------------------------------
def build_raw(args: argparse.Namespace, device: torch.device, compile: bool) -> Any:
    """Raw FSDP2 by hand: build on the device, shard each block then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(args.seed)  # the same initial weights as the accelkit side's device build
    with device:
        model = GPT(args.vocab, args.width, args.layers, args.heads, args.seq)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if compile:
        for block in model.blocks:
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        if args.clip is not None:
            params = [p for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            torch.nn.utils.clip_grads_with_norm_(params, args.clip, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, (model, optimizer)


def build_accelkit(args: argparse.Namespace, device: torch.device, compile: bool) -> Any:
    """The user's side: accelkit.get("fsdp"), meta init, setup(compile=...)."""
    import accelkit

    accel = accelkit.get(
        "fsdp", device=device.type, precision="bf16-mixed", max_grad_norm=args.clip
    )
    torch.manual_seed(args.seed)  # with --no-meta-init: raw's initial weights
    with accel.init_module(empty_init=args.meta_init):
        model = GPT(args.vocab, args.width, args.layers, args.heads, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused)
    model, optimizer = accel.setup(model, optimizer, compile=compile)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        accel.backward(loss)
        accel.step()
        return loss

    return step, (model, optimizer, accel)


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


def run_config(args: argparse.Namespace, device: torch.device, compile: bool) -> dict[str, Any]:
    world = dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    with torch.device("meta"):
        n_params = non_embedding_params(
            GPT(args.vocab, args.width, args.layers, args.heads, args.seq)
        )
    sides = {
        "raw": build_raw(args, device, compile),
        "accelkit": build_accelkit(args, device, compile),
    }
    steps = {name: side[0] for name, side in sides.items()}
    if compile:  # compile both before the first timed round
        for step in steps.values():
            step(x, y)
    seconds: dict[str, list[float]] = {"raw": [], "accelkit": []}
    peak: dict[str, float] = {}
    losses: dict[str, float] = {}
    for round_index in range(args.repeats):
        order = ["raw", "accelkit"] if round_index % 2 == 0 else ["accelkit", "raw"]
        for name in order:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            per_step, losses[name] = timed_block(steps[name], x, y, args, device)
            seconds[name].append(per_step)
            if device.type == "cuda":
                peak[name] = max(
                    peak.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30
                )
    ratios = [a / r for a, r in zip(seconds["accelkit"], seconds["raw"])]
    tokens = args.batch * args.seq * world
    fpt = flops_per_token(n_params, args.layers, args.seq, args.width)
    result: dict[str, Any] = {
        "compile": compile,
        "params": n_params,
        "ratio_accelkit_over_raw": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "all": ratios,
        },
        "last_loss": losses,
    }
    for name in ("raw", "accelkit"):
        med = statistics.median(seconds[name])
        tok_s = tokens / med
        result[name] = {
            "ms_per_step_median": med * 1e3,
            "ms_per_step_all": [s * 1e3 for s in seconds[name]],
            "tokens_per_s": tok_s,
            "mfu_vs_measured_peak": fpt * tok_s / (args.peak_tflops * 1e12 * world),
        }
        if name in peak:
            # both sides' models live in this process, so this includes the other's state
            result[name]["peak_mem_gib_process"] = peak[name]
    del sides, steps
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def join_group(device_arg: str) -> torch.device:
    """A process group of one without a launcher, else the launcher's."""
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29533"),
    ):
        os.environ.setdefault(key, value)
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per round and side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each round")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--configs", default="eager,compile", help="eager, compile, or both")
    p.add_argument("--out", default="-")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--fused", action="store_true", help="fused AdamW on both sides")
    p.add_argument("--clip", type=float, default=None, help="clip the grad norm on both sides")
    p.add_argument(
        "--no-meta-init",
        dest="meta_init",
        action="store_false",
        help="accelkit side builds on the device instead of the meta device",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed before each side's model build (with --no-meta-init both start equal)",
    )
    p.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 ceiling")
    args = p.parse_args()
    device = join_group(args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    record: dict[str, Any] = {
        "bench": "fsdp_gpt",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": dist.get_world_size(),
        "args": vars(args),
        "configs": {},
    }
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if name not in ("eager", "compile"):
            raise SystemExit(f"unknown config {name!r}; use eager and/or compile")
        try:
            record["configs"][name] = run_config(args, device, compile=name == "compile")
        except Exception as err:  # keep the other configuration's figures
            import traceback

            record["configs"][name] = {
                "error": f"{type(err).__name__}: {err}"[:800],
                "trace_tail": traceback.format_exc()[-2000:],
            }
    if dist.get_rank() == 0:
        text = json.dumps(record, indent=1)
        print(text)
        for name, res in record["configs"].items():
            if "error" in res:
                print(f"[{name}] FAILED: {res['error']}", file=sys.stderr)
                continue
            r = res["ratio_accelkit_over_raw"]
            print(
                f"[{name}] accelkit/raw step time: median {r['median']:.4f} "
                f"(min {r['min']:.4f}, max {r['max']:.4f}); raw "
                f"{res['raw']['ms_per_step_median']:.2f} ms, accelkit "
                f"{res['accelkit']['ms_per_step_median']:.2f} ms; accelkit "
                f"{res['accelkit']['tokens_per_s']:.0f} tok/s, MFU "
                f"{res['accelkit']['mfu_vs_measured_peak']:.3f}",
                file=sys.stderr,
            )
        if args.out != "-":
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all("error" not in r for r in record["configs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
