"""A pipeline checkpoint written by raw DeepSpeed (``PipelineModule`` + ``train_batch``), for
``accelkit convert``, and raw DeepSpeed's own pipeline losses. Imports nothing from accelkit.

The layers (``specs``): a Linear, a block with a persistent buffer, a parameter-free Tanh, a
function layer (no ``state_dict``, so no layer file: the gap the importer must tell from a
missing file), two blocks and a head of uneven sizes, so that a ZeRO-1 stage's flat partition
holds parameters of several shapes. ``train_and_save`` trains ``steps`` ``train_batch`` calls
of ``MICRO`` micro-batches, saves with ``save_checkpoint`` and writes, beside the checkpoint,
what it gathered through DeepSpeed's own views: every layer's ``state_dict`` under
``PipelineModule``'s names and each trained parameter's optimizer state
(``safe_get_full_optimizer_state`` under ZeRO-1, the torch optimizer's ``state`` under ZeRO-0).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MICRO = 4
MICRO_BATCH = 2


class Scaled(nn.Module):
    """A Linear followed by a fixed per-feature scale (a persistent buffer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def _halve(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


def specs() -> list[Any]:
    from deepspeed.pipe import LayerSpec

    return [
        LayerSpec(nn.Linear, 6, 12),
        LayerSpec(Scaled, 12),
        LayerSpec(nn.Tanh),
        _halve,
        LayerSpec(nn.Linear, 12, 10),
        LayerSpec(Scaled, 10),
        LayerSpec(nn.Linear, 10, 3),
    ]


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(500 + step)
    return [
        (torch.randn(MICRO_BATCH, 6, generator=gen), torch.randn(MICRO_BATCH, 3, generator=gen))
        for _ in range(MICRO)
    ]


def train_and_save(stage: int, save_to: str, steps: int = 2) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import safe_get_full_optimizer_state

    # the shared-memory op serves DeepSpeed's inference all-reduce only; its JIT build is 100 s
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    module = PipelineModule(
        layers=specs(), num_stages=world, loss_fn=nn.MSELoss(), partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": MICRO,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**62,
    }
    client = torch.optim.AdamW(module.parameters(), lr=0.02, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=client, config=config)
    losses = [float(engine.train_batch(iter(micro_batches(step)))) for step in range(steps)]
    engine.save_checkpoint(save_to, tag="final")
    state: dict[str, torch.Tensor] = {}
    for local, layer in enumerate(module.forward_funcs):
        if hasattr(layer, "state_dict"):
            index = local + module._local_start
            for key, value in layer.state_dict().items():
                state[f"model/{index}.{key}"] = value.detach().clone()
    for name, param in module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            if stage == 0:
                value = client.state[param][key]
            else:
                value = safe_get_full_optimizer_state(param, key)
            state[f"optimizer/{key}/{name}"] = value.detach().clone()
    torch.save(state, f"{save_to}.rank{dist.get_rank()}.pt")
    return {"losses": losses, "layers": [int(module._local_start), int(module._local_stop)]}


# ---- the training reference for accelkit's deepspeed pp (test_deepspeed_pipeline.py) ----------
STEPS = 3
BATCH = 8


def network() -> nn.Sequential:
    """The same network dsk_pipe_accel builds, written out again: a nested Sequential whose
    layers, flattened, are DeepSpeed's layers 0..5."""
    return nn.Sequential(
        nn.Linear(6, 12),
        nn.Sequential(Scaled(12), nn.Tanh(), nn.Linear(12, 10)),
        Scaled(10),
        nn.Linear(10, 3),
    )


def flat_layers(net: nn.Sequential) -> list[nn.Module]:
    return [net[0], net[1][0], net[1][1], net[1][2], net[2], net[3]]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(900 + step)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)


def train_pipeline(stage: int, micro: int = MICRO) -> dict[str, Any]:
    """Raw DeepSpeed: PipelineModule over the network's layers (``partition_method
    ="parameters"``), ``train_batch`` over each batch cut into ``micro`` pieces, AdamW."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.pipe import PipelineModule

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = network()
    module = PipelineModule(
        layers=flat_layers(net),
        num_stages=dist.get_world_size(),
        loss_fn=nn.MSELoss(),
        partition_method="parameters",
    )
    config = {
        "train_micro_batch_size_per_gpu": BATCH // micro,
        "gradient_accumulation_steps": micro,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**62,
    }
    client = torch.optim.AdamW(module.parameters(), lr=0.02, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=client, config=config)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        losses.append(float(engine.train_batch(iter(zip(x.chunk(micro), y.chunk(micro))))))
    weights = {}
    for local, layer in enumerate(module.forward_funcs):
        for key, value in layer.state_dict().items():
            weights[f"{local + int(module._local_start)}.{key}"] = value.flatten().tolist()
    return {
        "losses": losses,
        "weights": weights,
        "layers": [int(module._local_start), int(module._local_stop)],
    }
