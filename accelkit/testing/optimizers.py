"""Optimizers the conformance suite trains with, beside a workload's own.

:class:`TallyMomentum` keeps non-tensor values in its per-parameter state, as many custom
optimizers do (a step count as an ``int``, a running sum as a ``float``): the portable
checkpoint writes those as JSON, not as tensors, and a backend that shards optimizer state must
save every rank's. It imports nothing of accelkit, so the raw reference trains with it too.
"""

from __future__ import annotations

from typing import Any

import torch


class TallyMomentum(torch.optim.Optimizer):
    """SGD with momentum that also counts, per parameter, the steps it took (``int``) and the
    learning rates it applied (``float``). Its update is elementwise, so a backend that steps
    flat partitions of the parameters computes the same values."""

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["velocity"] = torch.zeros_like(param)
                    state["taken"] = 0
                    state["lr_total"] = 0.0
                state["velocity"].mul_(group["momentum"]).add_(param.grad)
                param.add_(state["velocity"], alpha=-group["lr"])
                state["taken"] += 1
                state["lr_total"] += group["lr"]
        return loss


def build(kind: str, params: Any) -> torch.optim.Optimizer:
    """The suite's optimizers by name: ``"tally"`` (:class:`TallyMomentum`) and
    ``"sgd-momentum"`` (torch's SGD with momentum: the foreign checkpoint a trained Adam must
    refuse)."""
    if kind == "tally":
        return TallyMomentum(params, lr=1e-2)
    if kind == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    raise ValueError(f"unknown optimizer {kind!r}: 'tally' or 'sgd-momentum'")


def state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{parameter name: {key: value}}`` of a torch optimizer stepping ``model``'s parameters:
    tensors as flat lists of floats, other values as they are."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    for param, values in optimizer.state.items():
        out[names[id(param)]] = {
            key: (
                value.detach().float().reshape(-1).cpu().tolist()
                if isinstance(value, torch.Tensor)
                else value
            )
            for key, value in values.items()
        }
    return out
