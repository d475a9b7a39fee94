"""The accelkit side of the equivalence tests: the loop of docs/architecture.md
("Semantics that hold on every backend") on a ``deepspeed`` backend.

It shares no code with dsk_reference.py (the model and data are written out again here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import accelkit

SAMPLES, BATCH, IN, OUT = 28, 2, 8, 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 24)
        self.fc3 = torch.nn.Linear(24, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def loader(seed: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, IN, generator=gen), torch.randn(SAMPLES, OUT, generator=gen)
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def train(s: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {"zero_stage": s["stage"]}
    if s.get("offload_optimizer"):
        options["offload_optimizer"] = "cpu"
    if s.get("offload_param"):
        options["offload_param"] = "cpu"
    accel = accelkit.get(
        s.get("name", "deepspeed"),
        s.get("config"),
        precision=s["precision"],
        accumulation_steps=s["accumulation"],
        max_grad_norm=s.get("clip"),
        track_grad_norm=True,
        **options,
    )
    torch.manual_seed(s["seed"])
    data = accel.setup_dataloader(loader(s["seed"]))
    if s.get("zero_init"):
        with accel.init_module():
            model = Net()
    else:
        model = Net()
    model, opt = accel.setup(model, optimizer(s["optimizer"], model.parameters()))
    scheduler = accel.setup_scheduler(
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.5 * step))
    )
    assert scheduler is not None
    losses, norms, lrs, skipped, micro_index = [], [], [], [], 0
    for _ in range(s["epochs"]):
        for x, y in data:
            out = model(x)
            assert out.dtype == torch.float32, out.dtype  # outputs come back in fp32
            loss = F.mse_loss(out, y)
            if micro_index == s.get("overflow_at"):
                loss = loss * float("inf")
            accel.backward(loss)
            losses.append(float(loss))
            micro_index += 1
            if opt.step():  # accelkit's step: applies only when the window closes
                norms.append(float(accel.grad_norm))
                skipped.append(accel.step_was_skipped)
                lrs.append(opt.param_groups[0]["lr"])
            opt.zero_grad()
    engine = accel.backend.engine
    full = accel.full_state_dict(model)
    params = {
        n: full[n].float().reshape(-1).tolist() for n, _ in accel.unwrap(model).named_parameters()
    }
    scaler = accel.backend._grad_scaler()
    return {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "skipped": skipped,
        "params": params,
        "scale": None if scaler is None else float(scaler.get_scale()),
        "global_steps": engine.global_steps,
        "applied_steps": accel.applied_steps,
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "engine_optimizer": type(engine.optimizer).__name__,
        "param_dtype": str(next(engine.module.parameters()).dtype),
    }
