"""The raw-PyTorch side of tests/test_pipeline.py: imports nothing from accelkit.

- :func:`one_process`: the whole model in one process, the same micro-batches, each micro-batch
  loss divided by micro-batches x accumulation x data-parallel replicas, one optimizer step per
  window (a short last window at the data's end), ``clip_grad_norm_`` over every parameter;
- :func:`raw_pipeline`: torch.distributed.pipelining by hand on a ``(pp, dp)`` or ``(pp, tp)``
  mesh (FSDP2 or a tensor-parallel plan inside each stage), ``scale_grads`` chosen by the caller,
  so a trap's negative twin shows the wrong number.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

D = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(D, 2 * D)
        self.down_proj = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.tanh(self.up_proj(x)))


class Net(nn.Module):
    """embed -> blocks -> head; ``tie`` shares the head's weight with a square embedding."""

    def __init__(self, n_layers: int = 8, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(D if tie else 8, D, bias=False)
        self.layers = nn.ModuleList(MLP() for _ in range(n_layers))
        self.head = nn.Linear(D, D if tie else 4, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def data(n_batches: int, batch: int, tie: bool = False, seed: int = 1) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(seed)
    width_in, width_out = (D, D) if tie else (8, 4)
    return [
        (torch.randn(batch, width_in, generator=g), torch.randn(batch, width_out, generator=g))
        for _ in range(n_batches)
    ]


def _optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def flat(module: nn.Module) -> dict[str, list[float]]:
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().reshape(-1).tolist()
    return out


def one_process(
    *,
    n_batches: int,
    batch: int,
    microbatches: int,
    accumulation: int = 1,
    dp: int = 1,
    optimizer: str = "sgd",
    max_grad_norm: float | None = 1.0,
    n_layers: int = 8,
    tie: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Each dp replica's share of a batch is the rows ``r::dp`` (a strided sampler); the losses
    are replica 0's means per batch."""
    torch.manual_seed(seed)
    model = Net(n_layers, tie)
    opt = _optimizer(model.parameters(), optimizer)
    losses, norms = [], []
    batches = data(n_batches, batch * dp, tie)
    for i, (x, y) in enumerate(batches):
        for r in range(dp):
            xs, ys = x[r::dp], y[r::dp]
            per = []
            for xm, ym in zip(xs.chunk(microbatches), ys.chunk(microbatches)):
                loss = nn.functional.mse_loss(model(xm), ym)
                per.append(loss.detach())
                (loss / (microbatches * accumulation * dp)).backward()
            if r == 0:
                losses.append(float(torch.stack(per).mean()))
        if (i + 1) % accumulation == 0 or i == len(batches) - 1:
            if max_grad_norm is not None:
                norms.append(
                    float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
                )
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "norms": norms, "params": flat(model)}


# ---- a pipeline written with torch alone -------------------------------------------------------
def _keep(model: Net, names: list[str]) -> Net:
    """A deep copy holding only ``names`` (the others deleted, or replaced by Identity)."""
    part = copy.deepcopy(model)
    for i in range(len(part.layers)):
        if f"layers.{i}" not in names:
            del part.layers._modules[str(i)]
    for attr in ("embed", "head"):
        if attr not in names:
            setattr(part, attr, nn.Identity())
    return part


def _stage_names(n_layers: int, stages: int) -> list[list[str]]:
    per = n_layers // stages
    out = [[f"layers.{i}" for i in range(s * per, (s + 1) * per)] for s in range(stages)]
    out[0].insert(0, "embed")
    out[-1].append("head")
    return out


def raw_pipeline(
    *,
    mode: str,
    schedule: str,
    n_batches: int,
    batch: int,
    microbatches: int,
    accumulation: int = 1,
    scale_grads: bool = False,
    reshard_after_forward: bool = False,
    n_layers: int = 8,
) -> dict[str, Any]:
    """torch.distributed.pipelining on a 2 x 2 mesh of 4 gloo processes: ``mode`` ``fsdp``
    (pp x dp_shard) or ``tp`` (pp x tp); ``fsdp_tp``: 2 x 2 x 2 on 8. With ``scale_grads=False`` each micro-batch loss is
    divided by micro-batches x accumulation (x dp through FSDP's mean), else by accumulation
    alone and the schedule scales (the trap). Returns this rank's stage parameters, full."""
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo")
    if mode == "fsdp_tp":  # 8 processes: pp x dp x tp
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        other = "dp"
    else:
        other = "dp" if mode == "fsdp" else "tp"
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", other))
    pp_rank, pp = mesh["pp"].get_local_rank(), 2
    cls = getattr(pipelining, "Schedule" + schedule)
    multi = schedule not in ("GPipe", "1F1B")
    v_shape = schedule in ("ZBVZeroBubble", "DualPipeV")
    stages = pp * (2 if multi else 1)
    ids = (
        (pp_rank, stages - 1 - pp_rank)
        if v_shape
        else tuple(pp_rank + s * pp for s in range(stages // pp))
    )
    torch.manual_seed(0)
    full = Net(n_layers)
    names = _stage_names(n_layers, stages)
    parts = []
    for i in ids:
        part = _keep(full, names[i])
        if mode == "fsdp_tp":
            for block in part.layers:
                parallelize_module(
                    block,
                    mesh["tp"],
                    {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()},
                )
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
            fully_shard(part, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        elif mode == "fsdp":
            for block in part.layers:
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
            fully_shard(part, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        else:
            for block in part.layers:
                parallelize_module(
                    block,
                    mesh["tp"],
                    {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()},
                )
        parts.append(part)
    pstages = [
        pipelining.PipelineStage(m, i, stages, torch.device("cpu"), group=mesh["pp"].get_group())
        for m, i in zip(parts, ids)
    ]
    divisor = accumulation if scale_grads else microbatches * accumulation

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y) / divisor

    kwargs = dict(n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    sched = cls(pstages[0], **kwargs) if len(pstages) == 1 else cls(pstages, **kwargs)
    opt = torch.optim.AdamW([p for m in parts for p in m.parameters()], lr=1e-2)
    dp = 1 if mode == "tp" else 2
    me = mesh["dp"].get_local_rank() if dp > 1 else 0
    first = any(s.is_first for s in pstages)
    last = any(s.is_last for s in pstages)
    for i, (x, y) in enumerate(data(n_batches, batch * dp)):
        xs, ys = x[me::dp], y[me::dp]
        sched.step(
            *((xs,) if first else ()), target=ys if last else None, losses=[] if last else None
        )
        if (i + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad()
    out: dict[str, list[float]] = {}
    for m in parts:
        out.update(flat(m))
    dist.destroy_process_group()
    return {"params": out}
