"""A checkpoint written by raw DeepSpeed, for ``accelkit convert``. Imports nothing from accelkit.

The same workload as dsk_ckpt.py (written out again here: model with uneven parameter sizes, a
frozen layer and a buffer, 8 samples per step split over the ranks, AdamW at a constant learning
rate), trained with a plain ``deepspeed.initialize`` and its config written by hand, saved with
``engine.save_checkpoint`` at ``save_at``, then trained on to ``steps``. What it returns has the
keys of dsk_ckpt.train's result, so the tests compare an accelkit run resumed from the converted
checkpoint with it: the state gathered at the save through DeepSpeed's own full views
(dsk_gather.py) and the global mean loss of each step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

GLOBAL_BATCH = 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 33)
        self.norm = torch.nn.LayerNorm(33)
        self.fc2 = torch.nn.Linear(33, 21)
        self.fc3 = torch.nn.Linear(21, 3)
        self.head = torch.nn.Linear(3, 3)
        self.head.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x)))))
        return self.head(self.fc3(hidden)) * self.scale


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train_and_save(
    name: str, stage: int, save_to: str, save_at: int = 3, steps: int = 6
) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    import dsk_gather

    # the shared-memory op serves DeepSpeed's inference all-reduce only; its JIT build is 100 s
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
    }
    torch.manual_seed(0)
    model = Net()
    client = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.01
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
    result: dict[str, Any] = {
        "losses": [],
        "world": world,
        "wrapper": type(engine.optimizer).__name__,
    }
    for step in range(steps):
        x, y = batch(step, rank, world)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        result["losses"].append(float(mean / world))
        if step + 1 == save_at:
            engine.save_checkpoint(save_to)
            result["saved"] = dsk_gather.deepspeed_state(engine)
            result["lr_at_save"] = client.param_groups[0]["lr"]
    return result
