"""FAKE ``apex.optimizers.FusedAdam`` (tests only): Apex's signature and state layout, with the
update of Apex's ``multi_tensor_adam`` kernel written out on the CPU in fp32."""

from __future__ import annotations

import torch

import apex

ACCELKIT_FAKE = True


class FusedAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
        capturable=False,
        master_weights=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights
        apex.record(
            "FusedAdam",
            kwargs=dict(
                lr=lr,
                bias_correction=bias_correction,
                betas=betas,
                eps=eps,
                adam_w_mode=adam_w_mode,
                weight_decay=weight_decay,
                set_grad_none=set_grad_none,
                capturable=capturable,
                master_weights=master_weights,
            ),
            groups=[{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            params=[[id(p) for p in g["params"]] for g in self.param_groups],
        )

    def zero_grad(self):  # Apex's takes no argument
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
            if not group["params"]:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1  # one step per group
            step = group["step"]
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
            bc2 = 1 - beta2**step if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g, w = p.grad.float(), p.float()
                if not self.adam_w_mode:
                    g = g + decay * w  # L2 regularization (Adam)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode:
                    update = update + decay * w  # decoupled weight decay (AdamW)
                p.copy_(w - lr * update)
        return loss
