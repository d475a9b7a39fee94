"""Workers of tests/test_ddp_powersgd_resume.py: 50 steps of DDP with torch's PowerSGD hook on a
model whose buckets DDP rebuilds after its first step, raw (torch only) and through accelkit.

The head is registered before the body and runs after it, so the gradients become ready in
another order than DDP's initial bucket assignment: the bucket DDP rebuilds after its first step
holds them in another order, and a resumed model starts in the initial order again. (One bucket:
with several, torch's own PowerSGD hook failed here on gloo with a collective mismatch.)
"""

from __future__ import annotations

from typing import Any

import torch

STEPS, SAVE_AT, START_ITER = 50, 25, 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(48, 8)  # registered first, used last
        self.body = torch.nn.Linear(24, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 24, generator=g), torch.randn(8, 8, generator=g)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _params(module: torch.nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().reshape(-1).tolist() for n, p in module.named_parameters()}


def raw(resume_by_index: bool = False) -> dict[str, Any]:
    """The uninterrupted run with torch's DDP and PowerSGD hook. ``resume_by_index``: after
    ``SAVE_AT`` steps, continue in a new DDP model and optimizer with torch's PowerSGD state
    copied by bucket index (factors, residuals, step count): the resume accelkit must not do."""
    import copy

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def wrap(net: torch.nn.Module) -> tuple[Any, Any]:
        model = DistributedDataParallel(net)
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=1,
            start_powerSGD_iter=START_ITER,
            random_seed=0,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return model, state

    model, state = wrap(Net())
    opt = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        if resume_by_index and step == SAVE_AT:
            weights, moments = copy.deepcopy(model.module.state_dict()), opt.state_dict()
            net = Net()
            net.load_state_dict(weights)
            model, fresh = wrap(net)
            opt = _optimizer(model.parameters())
            opt.load_state_dict(moments)
            fresh.iter = state.iter
            for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
                getattr(fresh, name).update(copy.deepcopy(getattr(state, name)))
            state = fresh
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "params": _params(model.module), "buckets": len(state.error_dict)}
    dist.destroy_process_group()
    return out


def ours(save: str | None = None, load: str | None = None) -> dict[str, Any]:
    """The same run through accelkit's ``ddp`` with ``comm_hook="powersgd"``: whole, saving at
    ``SAVE_AT``, or loading that checkpoint and running the rest."""
    import accelkit

    accel = accelkit.get("ddp", comm_hook="powersgd")
    net = Net()
    model, opt = accel.setup(net, _optimizer(net.parameters()))
    state = {"model": model, "optimizer": opt, "step": 0}
    if load:
        accel.load(load, state)
    losses = []
    for step in range(state["step"], STEPS):
        x, y = _batch(step, accel.rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if save and step + 1 == SAVE_AT:
            state["step"] = step + 1
            accel.save(save, state)
    out = {"losses": losses, "params": _params(accel.unwrap(model))}
    accel.end_training()
    return out
