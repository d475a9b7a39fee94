"""Raw PyTorch references for the Apex plugin tests: import nothing from accelkit (or apex)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 16


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Two pre-norm blocks, an RMSNorm and a head: every kind of norm the swap touches."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.final = nn.RMSNorm(width, eps=1e-5)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.final(self.blocks(x)))


def make_net(seed: int = 0, width: int = WIDTH) -> Net:
    torch.manual_seed(seed)
    return Net(width)


def batches(
    n: int, seed: int = 1, batch: int = 4, width: int = WIDTH
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g))
        for _ in range(n)
    ]


def param_groups(model: nn.Module, lr: float = 1e-2) -> list[dict]:
    """Two groups: decayed weights, and biases + norms without decay at half the lr."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": lr / 2},
    ]


def train_raw(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data,
    *,
    max_norm: float | None = None,
    accumulation: int = 1,
) -> dict[str, list[float]]:
    """Plain torch: forward, loss / accumulation, backward, [clip], step, zero_grad."""
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0 or i + 1 == len(data):
            if max_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            opt.step()
            opt.zero_grad()  # set_to_none by default; Apex's takes no argument
    return {"losses": losses, "norms": norms}


def train_raw_data_parallel(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    per_rank: list[list[tuple[torch.Tensor, torch.Tensor]]],
    *,
    accumulation: int,
    max_norm: float | None = None,
) -> dict[str, list[float]]:
    """What data parallelism computes, in one process: per window, the gradient averaged over the
    ranks of the sum over micro-batches of grad(loss / accumulation)."""
    world, steps = len(per_rank), len(per_rank[0])
    losses: list[list[float]] = [[] for _ in range(world)]
    norms = []
    for start in range(0, steps, accumulation):
        for rank in range(world):
            for x, y in per_rank[rank][start : start + accumulation]:
                loss = F.mse_loss(model(x), y)
                (loss / (accumulation * world)).backward()
                losses[rank].append(loss.item())
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms}


def train_raw_amp(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data,
    *,
    dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler | None = None,
    max_norm: float | None = None,
    overflow_at: tuple[int, ...] = (),
) -> dict[str, list[float]]:
    """Plain torch on CUDA: autocast to ``dtype`` (None: fp32), GradScaler when given; the loss
    of the steps in ``overflow_at`` is multiplied by inf (the scaler must skip them)."""
    losses, norms, skipped, scales = [], [], [], []
    for i, (x, y) in enumerate(data):
        x, y = x.cuda(), y.cuda()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.mse_loss(model(x).float(), y)
        scaled = loss * float("inf") if i in overflow_at else loss
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        losses.append(loss.item())
        if scaler is not None:
            scaler.unscale_(opt)
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
            scales.append(scaler.get_scale())
        else:
            opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "skipped": skipped, "scales": scales}
