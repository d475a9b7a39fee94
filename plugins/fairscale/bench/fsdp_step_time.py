"""Step time of accelkit's ``fairscale_fsdp`` against raw FairScale FSDP, same process, same
model, interleaved repeats (issue 8's goal: ratio <= 1.02). A benchmark, not a test: it prints
and asserts nothing.

    torchrun --nproc-per-node 1 plugins/fairscale/bench/fsdp_step_time.py [--precision 16-mixed]

Each repeat trains STEPS steps on raw FairScale, then STEPS on accelkit (order alternating
between repeats), timing with ``torch.cuda.synchronize()`` after warm-up steps. Reports the
median per-step time of each and their ratio (accelkit / raw).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

WIDTH, DEPTH, BATCH, SEQ = 1024, 8, 8, 256


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def raw_runner(precision: str):
    from fairscale.nn import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = Net().cuda()
    mixed = precision == "16-mixed"
    kwargs = dict(mixed_precision=mixed, compute_dtype=torch.float16 if mixed else None)
    for i in range(DEPTH):
        model.blocks[i] = FSDP(model.blocks[i], **kwargs)
    model = FSDP(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = ShardedGradScaler("cuda") if mixed else None

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.mse_loss(model(x).float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            # FairScale 0.4.13 at world size 1 leaves mixed-precision gradients in fp16, which
            # AdamW refuses; cast them as FairScale does at world size > 1 (accelkit does too)
            for p in model.parameters():
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad = p.grad.to(p.dtype)
            scaler.unscale_(opt)
        model.clip_grad_norm_(1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def accel_runner(precision: str):
    import accelkit

    accel = accelkit.get("fairscale_fsdp", precision=precision, max_grad_norm=1.0)
    torch.manual_seed(0)
    model = Net()
    model, _ = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.mse_loss(model(x), y)
        accel.backward(loss)
        accel.step()

    return step


def timed(step, data, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="32-true", choices=["32-true", "16-mixed"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [
        (
            torch.randn(BATCH, SEQ, WIDTH, device="cuda", generator=gen),
            torch.randn(BATCH, SEQ, WIDTH, device="cuda", generator=gen),
        )
        for _ in range(4)
    ]
    raw, ours = raw_runner(args.precision), accel_runner(args.precision)
    for step in (raw, ours):  # warm-up (allocator, cuBLAS handles, loss scale settling)
        timed(step, data, 5)
    raw_times, our_times = [], []
    for repeat in range(args.repeats):
        order = [(raw, raw_times), (ours, our_times)]
        for step, sink in order if repeat % 2 == 0 else reversed(order):
            sink.append(timed(step, data, args.steps))
    r, o = statistics.median(raw_times), statistics.median(our_times)
    if dist.get_rank() == 0:
        print(
            f"precision={args.precision} world={dist.get_world_size()} "
            f"raw FairScale FSDP {r * 1e3:.2f} ms/step, accelkit fairscale_fsdp {o * 1e3:.2f} "
            f"ms/step, ratio {o / r:.4f} (repeats {args.repeats} x {args.steps} steps)"
        )
        print("raw ms:", [round(t * 1e3, 2) for t in raw_times])
        print("accelkit ms:", [round(t * 1e3, 2) for t in our_times])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
