"""FAKE ``apex.optimizers.FusedSGD`` (tests only): Apex's signature, with the update of Apex's
``multi_tensor_sgd`` kernel on the CPU (fp16 and fp32 parameters only, as Apex's)."""

from __future__ import annotations

import torch

import apex

ACCELKIT_FAKE = True


class FusedSGD(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr=0.0,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        wd_after_momentum=False,
        materialize_master_grads=True,
        set_grad_none=False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.set_grad_none = set_grad_none
        apex.record(
            "FusedSGD",
            kwargs=dict(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
                wd_after_momentum=wd_after_momentum,
                set_grad_none=set_grad_none,
            ),
            groups=[{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            params=[[id(p) for p in g["params"]] for g in self.param_groups],
        )

    def zero_grad(self):
        for group in self.param_groups:
            for p in group["params"]:
                if self.set_grad_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            decay, momentum = group["weight_decay"], group["momentum"]
            dampening, nesterov, lr = group["dampening"], group["nesterov"], group["lr"]
            for p in group["params"]:
                if p.grad is None or p.dtype not in (torch.float16, torch.float32):
                    continue  # Apex's kernel launches fp16 and fp32 sets only
                g = p.grad.clone()
                if decay and not self.wd_after_momentum:
                    g.add_(p, alpha=decay)
                if momentum:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        buf = state["momentum_buffer"] = g.clone()  # first run: the gradient
                    else:
                        buf = state["momentum_buffer"]
                        buf.mul_(momentum).add_(g, alpha=1 - dampening)
                    g = g.add(buf, alpha=momentum) if nesterov else buf
                if decay and self.wd_after_momentum:
                    g = g.add(p, alpha=decay)
                p.add_(g, alpha=-lr)
        return loss
