"""Real DeepSpeed checkpoints for the unpickling tests. Imports nothing from accelkit.

Raw ``deepspeed.initialize`` on dsk_rawckpt's workload (uneven parameters, a frozen layer, a
buffer), AdamW, two steps, ``engine.save_checkpoint`` -- once per ZeRO stage and precision in
:data:`VARIANTS` -- and, per variant, the fp32 master weights and the module's weights at the
save as DeepSpeed's own full views give them (dsk_gather.deepspeed_state).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: (ZeRO stage, precision) of every checkpoint written
VARIANTS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]


def save_variants(root: str) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    import dsk_gather
    from dsk_rawckpt import GLOBAL_BATCH, Net, batch

    # the shared-memory op serves DeepSpeed's inference all-reduce only; its JIT build is 100 s
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for stage, precision in VARIANTS:
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,
        }
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        dtype = next(engine.module.parameters()).dtype
        for step in range(2):
            x, y = batch(step, rank, world)
            loss = F.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
        name = f"z{stage}-{precision}"
        engine.save_checkpoint(f"{root}/{name}")
        gathered = dsk_gather.deepspeed_state(engine)
        out[name] = {
            "weights": gathered["weights"],
            "lp": gathered["lp"],
            "wrapper": type(engine.optimizer).__name__,
        }
    return out
