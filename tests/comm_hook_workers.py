"""Workers of tests/test_ddp_comm_hooks.py: DDP with a communication hook, raw (torch's DDP and
hooks, nothing from accelkit) and through accelkit's ``ddp`` option ``comm_hook``."""

from __future__ import annotations

from typing import Any

import torch

STEPS = 6


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)


def raw(hook: str) -> list[list[float]]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(_net())
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        fn = (
            default_hooks.fp16_compress_hook if hook == "fp16" else default_hooks.bf16_compress_hook
        )
        model.register_comm_hook(None, fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _batch(step, dist.get_rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = [p.detach().reshape(-1).tolist() for p in model.module.parameters()]
    dist.destroy_process_group()
    return out


def ours(
    hook: str, save: str | None = None, load: str | None = None, steps: int = STEPS
) -> dict[str, Any]:
    import accelkit

    accel = accelkit.get("ddp", comm_hook=hook)
    net = _net()
    model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = {"model": model, "optimizer": opt, "step": 0}
    if load:
        accel.load(load, state)
    for step in range(state["step"], steps):
        x, y = _batch(step, accel.rank)
        accel.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if save and step + 1 == STEPS // 2:
            state["step"] = step + 1
            accel.save(save, state)
    out = {
        "params": [p.detach().reshape(-1).tolist() for p in accel.unwrap(model).parameters()],
        "powersgd_iter": getattr(getattr(accel.backend._powersgd, "state", None), "iter", None),
    }
    accel.end_training()
    return out


def bf16_on_gloo() -> dict[str, Any]:
    """Raw torch on gloo: a bf16 all-reduce, then torch's bf16 compression hook."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    summed = torch.full((4,), dist.get_rank() + 1.0, dtype=torch.bfloat16)
    dist.all_reduce(summed)
    model = DistributedDataParallel(_net())
    try:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        refused = None
    except Exception as err:
        refused = f"{type(err).__name__}: {err}"
    dist.destroy_process_group()
    return {"sum": summed.float().tolist(), "dtype": str(summed.dtype), "hook": refused}


def bf16_hook_through_accelkit() -> str | None:
    import accelkit

    try:
        accelkit.get("ddp", comm_hook="bf16", device="cpu")
    except accelkit.ConfigError as err:
        return str(err)
    return None
