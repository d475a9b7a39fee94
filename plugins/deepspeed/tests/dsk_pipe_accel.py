"""The accelkit side of test_deepspeed_pipeline.py: the same training through
``accelkit.get("deepspeed", pp=2, ...)``, ``accel.forward_backward`` and ``accel.step()``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import accelkit

STEPS = 3
BATCH = 8


class Scaled(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def network() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 12),
        nn.Sequential(Scaled(12), nn.Tanh(), nn.Linear(12, 10)),
        Scaled(10),
        nn.Linear(10, 3),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(900 + step)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)


def train(stage: int, micro: int = 4, save_to: str | None = None, **options: Any) -> dict[str, Any]:
    accel = accelkit.get(
        "deepspeed",
        zero_stage=stage,
        pp=2,
        pipeline=dict(schedule="1F1B", microbatches=micro),
        track_grad_norm=True,
        **options,
    )
    torch.manual_seed(0)
    model = network()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    model, opt = accel.setup(model, opt)
    result: dict[str, Any] = {"losses": [], "norms": []}
    try:
        model(batch(0)[0])
    except Exception as err:  # the test asserts on the message
        result["call_error"] = f"{type(err).__name__}: {err}"
    for step in range(STEPS):
        x, y = batch(step)
        loss = accel.forward_backward(model, x, target=y, loss_fn=nn.functional.mse_loss)
        accel.step()
        result["losses"].append(float(loss))
        result["norms"].append(float(accel.grad_norm))
    inner = accel.unwrap(model)
    result["weights"] = {k: v.flatten().tolist() for k, v in inner.state_dict().items()}
    result["dp"] = [accel.backend.data_parallel_rank, accel.backend.data_parallel_world_size]
    if save_to:
        accel.save(save_to, {"model": model, "optimizer": opt})
        result["saved"] = deepspeed_view(accel.backend.engine, stage)
    return result


def deepspeed_view(engine: Any, stage: int) -> dict[str, list[float]]:
    """This stage's weights and Adam moments through DeepSpeed's own views, by DeepSpeed's
    layer index (``<i>.<key>``; the test maps the index to the unsplit name): each layer's
    ``state_dict`` from ``forward_funcs``, the client optimizer's state (ZeRO-0) or
    ``safe_get_full_optimizer_state`` (ZeRO-1)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    module = engine.module
    out: dict[str, list[float]] = {}
    for local, layer in enumerate(module.forward_funcs):
        index = local + int(module._local_start)
        for key, value in layer.state_dict().items():
            out[f"model/{index}.{key}"] = value.flatten().tolist()
        for key, param in layer.named_parameters():
            for moment in ("exp_avg", "exp_avg_sq"):
                if stage == 0:
                    value = engine.optimizer.state[param][moment]
                else:
                    value = safe_get_full_optimizer_state(param, moment)
                out[f"optimizer/{moment}/{index}.{key}"] = value.flatten().tolist()
    return out
