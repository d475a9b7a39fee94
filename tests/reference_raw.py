"""The raw-PyTorch reference that accelkit's numbers are checked against.

It imports only torch and shares no code with accelkit or with the accelkit side of the tests:
the model, the data order, the accumulation rule, clipping, loss scaling and scheduler stepping
are written out here by hand from their documented rules, so a bug in accelkit cannot hide in a
helper both sides use.

Rules reproduced (docs/architecture.md, "Semantics that hold on every backend";
``Accelerator.step`` and ``ResumableSampler`` docstrings):

* data order: ``torch.randperm(n, generator seeded seed + epoch)`` when shuffling, else
  ``arange(n)``; rank ``r`` of ``W`` takes ``order[r::W]`` and batches it consecutively.
* a data-parallel run of ``W`` ranks with per-rank batch ``b`` equals one process on the global
  batch (the ranks' micro-batch ``i`` side by side) with the mean loss: DDP averages gradients.
* accumulation ``N``: every micro-batch loss is divided by ``N``; a window closes after ``N``
  micro-batches or at the last micro-batch of an epoch, so a short last window of ``k``
  contributes ``sum / N``.
* at a window's end: unscale (fp16), clip the total norm to ``max_norm``, step, update the
  loss scale, zero the gradients, and step the LR scheduler unless the step was skipped.

``distributed=True`` runs torch DDP by hand instead (each rank its own shard and loss,
``no_sync`` inside a window): the reference for low precisions, where how the batch is split
across ranks changes the rounding of the gradients and the global-batch run differs at the
precision's own error.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

LOW_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


class RawMLP(torch.nn.Module):
    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(features, hidden)
        self.mid = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).tolist()


def rank_micro_batches(
    n: int, *, seed: int, epoch: int, shuffle: bool, world_size: int, rank: int, batch_size: int
) -> list[list[int]]:
    """Rank ``rank``'s micro-batches: its stride of the epoch's order, batched consecutively."""
    if n % world_size:
        raise ValueError("the reference assumes n divisible by world_size (no sampler padding)")
    mine = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)[rank::world_size]
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


def global_micro_batches(
    n: int, *, seed: int, epoch: int, shuffle: bool, world_size: int, batch_size: int
) -> list[list[int]]:
    """Micro-batch ``i`` of the global run: rank 0's batch ``i``, then rank 1's, ..."""
    per_rank = [
        rank_micro_batches(
            n,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            world_size=world_size,
            rank=r,
            batch_size=batch_size,
        )
        for r in range(world_size)
    ]
    return [[idx for part in parts for idx in part] for parts in zip(*per_rank)]


def train_reference(
    features: torch.Tensor,
    targets: torch.Tensor,
    *,
    hidden: int,
    seed: int,
    epochs: int,
    batch_size: int,
    world_size: int = 1,
    accumulation: int,
    max_norm: float | None,
    lr: float,
    momentum: float,
    step_size: int,
    gamma: float,
    precision: str = "32-true",
    shuffle: bool = True,
    poison_micro: Sequence[int] = (),
    reverse_within_batch: bool = False,
    device: str = "cpu",
    distributed: bool = False,
) -> dict[str, Any]:
    """Train ``RawMLP`` and record what a user would read from accelkit.

    ``poison_micro``: micro-batch indices whose loss is multiplied by inf (fp16 overflow).
    ``reverse_within_batch``: feed each micro-batch in reverse sample order -- the same
    mathematics in another floating-point order, used to measure the noise floor.
    ``distributed``: this process is one rank of torch DDP (joins the default group from the
    launcher's environment if needed); losses are this rank's.
    """
    rank = 0
    if distributed:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = RawMLP(features.shape[1], hidden)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = model.to(device)
    features, targets = features.to(device), targets.to(device)
    kind, _, mode = precision.partition("-")
    low = LOW_DTYPES.get(kind)
    if mode == "true" and low is not None:
        model = model.to(low)
    trained = DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=gamma)
    scaler = torch.amp.GradScaler(torch.device(device).type) if precision == "16-mixed" else None

    losses: list[float] = []
    grad_norms: list[float] = []
    lrs: list[float] = []
    skipped: list[bool] = []
    scales: list[float] = []
    micro = 0
    for epoch in range(epochs):
        order = dict(seed=seed, epoch=epoch, shuffle=shuffle, world_size=world_size)
        if distributed:
            batches = rank_micro_batches(len(features), rank=rank, batch_size=batch_size, **order)
        else:
            batches = global_micro_batches(len(features), batch_size=batch_size, **order)
        in_window = 0
        for position, indices in enumerate(batches):
            if reverse_within_batch:
                indices = indices[::-1]
            x, y = features[indices], targets[indices]
            closes = in_window + 1 == accumulation or position == len(batches) - 1
            sync = contextlib.nullcontext() if closes or not distributed else trained.no_sync()
            with sync:
                if mode == "true" and low is not None:
                    out = trained(x.to(low)).float()
                elif mode == "mixed":
                    with torch.autocast(torch.device(device).type, dtype=low):
                        out = trained(x)
                    out = out.float()
                else:
                    out = trained(x)
                loss = F.mse_loss(out, y)
                if micro in poison_micro:
                    loss = loss * math.inf
                scaled = loss / accumulation
                if scaler is not None:
                    scaled = scaler.scale(scaled)
                scaled.backward()
            losses.append(loss.item())
            micro += 1
            in_window += 1
            if not closes:
                continue
            in_window = 0
            if scaler is not None:
                scaler.unscale_(optimizer)
            if max_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                grad_norms.append(float(norm))
            if scaler is not None:
                scale_before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                was_skipped = scaler.get_scale() < scale_before
                scales.append(scaler.get_scale())
            else:
                optimizer.step()
                was_skipped = False
            optimizer.zero_grad(set_to_none=True)
            if not was_skipped:
                scheduler.step()
            skipped.append(was_skipped)
            lrs.append(optimizer.param_groups[0]["lr"])
    final = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "lrs": lrs,
        "skipped": skipped,
        "scales": scales,
        "initial": initial,
        "final": final,
    }
