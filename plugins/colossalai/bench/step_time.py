"""Step time of accelkit's ColossalAI backends against ColossalAI's Booster used directly, same
process, same model, interleaved repeats (issue 10's goal: ratio <= 1.02). A benchmark, not a
test: it prints and asserts nothing.

    torchrun --nproc-per-node 1 plugins/colossalai/bench/step_time.py --backend colossalai_zero
    torchrun --nproc-per-node 1 plugins/colossalai/bench/step_time.py --backend colossalai_gemini

Each repeat trains STEPS steps raw, then STEPS through accelkit (the order alternates between
repeats), timed with ``torch.cuda.synchronize()`` after warm-up steps. Reports the median
per-step time of each, their ratio (accelkit / raw) and the spread [min, max] of the ratios of
the repeats' pairs. ``--profile`` then says where a difference comes from: each side's host
time per step (enqueueing only), its CUDA kernel time per step (torch.profiler) and the Python
functions with the most own time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

WIDTH, DEPTH, BATCH, SEQ = 1024, 8, 8, 256
PLUGIN_PRECISION = {"bf16-true": "bf16", "16-true": "fp16", "32-true": "fp32"}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block() for _ in range(DEPTH)), torch.nn.Linear(WIDTH, WIDTH))


def raw_runner(backend: str, precision: str, stage: int):
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin

    model = build()
    if backend == "colossalai_gemini":
        from colossalai.nn.optimizer import HybridAdam

        opt = HybridAdam(model.parameters(), lr=1e-4)
        plugin = GeminiPlugin(precision=PLUGIN_PRECISION[precision], max_norm=1.0)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        plugin = LowLevelZeroPlugin(
            stage=stage, precision=PLUGIN_PRECISION[precision], max_norm=1.0
        )
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    low = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        out = model(x.to(low) if low is not None else x)
        loss = F.mse_loss(out.float(), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()

    return step


def accelkit_runner(backend: str, precision: str, stage: int):
    import accelkit

    options = {"stage": stage} if backend == "colossalai_zero" else {}
    accel = accelkit.get(backend, options, precision=precision, max_grad_norm=1.0)
    net = build()
    model, opt = accel.setup(net, torch.optim.Adam(net.parameters(), lr=1e-4))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.mse_loss(model(x), y)
        accel.backward(loss)
        accel.step()
        opt.zero_grad()

    return step


def timed(step, x, y, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def profile(name: str, step, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    """Where one side's step time goes: host enqueue time, kernel time, top Python functions."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    host = []
    for _ in range(steps):
        start = time.perf_counter()
        step(x, y)
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(x, y)
        torch.cuda.synchronize()
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages()) / steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step(x, y)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    print(
        f"[{name}] host {statistics.median(host) * 1e3:.2f} ms/step (enqueue, median), "
        f"CUDA kernels {kernel_us / 1e3:.2f} ms/step"
    )
    print("\n".join(text.getvalue().splitlines()[:30]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="colossalai_zero")
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="say where each side's time goes")
    args = parser.parse_args()
    # accelkit first: its get() joins the process group the raw Booster needs too
    steps = {
        "accelkit": accelkit_runner(args.backend, args.precision, args.stage),
        "raw": raw_runner(args.backend, args.precision, args.stage),
    }
    x = torch.randn(BATCH, SEQ, WIDTH, device="cuda")
    y = torch.randn(BATCH, SEQ, WIDTH, device="cuda")
    for step in steps.values():
        timed(step, x, y, 3)  # warm-up (Gemini JIT-builds its kernels on first use)
    times: dict[str, list[float]] = {"raw": [], "accelkit": []}
    for repeat in range(args.repeats):
        order = ["raw", "accelkit"] if repeat % 2 == 0 else ["accelkit", "raw"]
        for name in order:
            times[name].append(timed(steps[name], x, y, args.steps))
    raw, ours = statistics.median(times["raw"]), statistics.median(times["accelkit"])
    pairs = [a / r for a, r in zip(times["accelkit"], times["raw"])]
    print(
        f"{args.backend} {args.precision}: raw {raw * 1e3:.2f} ms/step, accelkit "
        f"{ours * 1e3:.2f} ms/step, ratio {ours / raw:.4f} "
        f"[{min(pairs):.4f}, {max(pairs):.4f}] ({args.repeats} repeats x {args.steps} steps)"
    )
    print("raw ms:", [round(t * 1e3, 2) for t in times["raw"]])
    print("accelkit ms:", [round(t * 1e3, 2) for t in times["accelkit"]])
    if args.profile:
        for name, step in steps.items():
            profile(name, step, x, y, args.steps)


if __name__ == "__main__":
    main()
