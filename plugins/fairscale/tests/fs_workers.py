"""The accelkit side of the FairScale plugin tests: the same workload as the raw reference
(``fairscale_reference.py``), defined again here (the two share no code), trained through
``accelkit.get(...)``. Runs under ``torchrun`` on 2 gloo processes."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

IN, HIDDEN, OUT, DEPTH = 12, 16, 3, 3
SAMPLES, BATCH = 28, 2
SEED, LR = 4321, 0.05


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.blocks = torch.nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.out = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, IN, generator=generator)
    y = torch.randn(SAMPLES, OUT, generator=generator) * 3
    return torch.utils.data.TensorDataset(x, y)


def build(backend: str, *, shim: bool = False, **get_kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """accelerator, model, optimizer, loader (the model built from SEED after get())."""
    if shim:
        import fairscale_cpu_shim

        fairscale_cpu_shim.apply()
    import accelkit

    accel = accelkit.get(backend, **get_kwargs)
    torch.manual_seed(SEED)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accel.setup(model, optimizer)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    return accel, model, optimizer, accel.setup_dataloader(loader)


def train(
    backend: str,
    *,
    accumulation: int = 1,
    max_norm: float | None = None,
    epochs: int = 1,
    precision: str = "32-true",
    options: dict[str, Any] | None = None,
    shim: bool = False,
    track_norm: bool = False,
    use_accumulate: bool = True,
) -> dict[str, Any]:
    accel, model, optimizer, loader = build(
        backend,
        shim=shim,
        precision=precision,
        accumulation_steps=accumulation,
        max_grad_norm=max_norm,
        track_grad_norm=track_norm,
        **(options or {}),
    )
    losses, norms = [], []
    for _ in range(epochs):
        for x, y in loader:
            if use_accumulate:
                with accel.accumulate(model):
                    loss = F.mse_loss(model(x), y)
                    accel.backward(loss)
            else:
                loss = F.mse_loss(model(x), y)
                accel.backward(loss)
            if accel.step() and (max_norm is not None or track_norm):
                norms.append(float(accel.grad_norm))
            losses.append(accel.all_reduce(loss.detach(), "mean").item())
    state = accel.full_state_dict(model)
    return {
        "losses": losses,
        "norms": norms,
        "params": {k: v.detach().float().flatten().tolist() for k, v in state.items()},
        "applied_steps": accel.applied_steps,
        "optimizer_class": type(optimizer.optimizer).__name__,
    }


def suite(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, kwargs in runs.items():
        try:
            results[name] = train(**kwargs)
        except Exception as err:  # reported per run, so one failure names itself
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    results["_rank"] = int(os.environ.get("RANK", "0"))
    return results
