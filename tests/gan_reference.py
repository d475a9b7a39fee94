"""The GAN of the multi-model tests, and its raw DeepSpeed reference. Imports nothing from accelkit.

:func:`raw_deepspeed_gan` trains the GAN with two ``deepspeed.initialize`` engines, one per
model, written directly against DeepSpeed: the accumulation boundary of each engine is set by
hand before each of its backward passes (``set_gradient_accumulation_boundary``) and
``engine.step()`` runs when that engine's window closes, as DeepSpeed documents for loops that
own their accumulation.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.nn.functional as F

SEED = 7
ACCUM = 2
ITERS = 8  # micro-batches
PER_RANK = 4  # samples per rank and micro-batch


def make_gan() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(SEED)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    disc = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 1)
    )
    return gen, disc


def gan_data(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(ITERS):
        real, z = (
            torch.randn(PER_RANK * world, 4, generator=g) + 1.0,
            torch.randn(PER_RANK * world, 3, generator=g),
        )
        out.append((real[rank::world], z[rank::world]))
    return out


def gan_losses(gen, disc, real, z):
    fake = gen(z)
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    loss_d = F.binary_cross_entropy_with_logits(
        disc(real), ones
    ) + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)
    return fake, ones, loss_d


def make_optimizers(gen, disc) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.01, betas=(0.5, 0.9))
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    return opt_g, opt_d


#: the ZeRO knobs both sides use: small buckets (several reduce buckets even for this model);
#: at ZeRO-3 no parameter is kept whole (DeepSpeed keeps parameters under 1e5 elements
#: unpartitioned by default, which would leave nothing partitioned here)
def zero_options(stage: int) -> dict[str, Any]:
    options: dict[str, Any] = {"reduce_bucket_size": 4096, "allgather_bucket_size": 4096}
    if stage == 3:
        options["stage3_param_persistence_threshold"] = 0
    return options


def _ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, **zero_options(stage)},
        "steps_per_print": 2**62,
        "zero_allow_untested_optimizer": True,
    }


def _full_weights(deepspeed: Any, module: torch.nn.Module) -> dict[str, list]:
    params = list(module.parameters())
    gather = (
        deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        if hasattr(params[0], "ds_id")
        else contextlib.nullcontext()
    )
    with gather:
        return {k: v.detach().clone().tolist() for k, v in module.state_dict().items()}


def raw_deepspeed_gan(stage: int, g_every: int) -> dict[str, Any]:
    """The GAN on two raw DeepSpeed engines, in the processes the test launched (gloo)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    # the shared-memory op serves DeepSpeed's inference all-reduce only; its JIT build is 100 s
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen, disc = make_gan()
    opt_g, opt_d = make_optimizers(gen, disc)
    engine_g, _, _, _ = deepspeed.initialize(model=gen, optimizer=opt_g, config=_ds_config(stage))
    engine_d, _, _, _ = deepspeed.initialize(model=disc, optimizer=opt_d, config=_ds_config(stage))
    seen = {"d": 0, "g": 0}
    applied = {"d": 0, "g": 0}
    losses: dict[str, list[float]] = {"d": [], "g": []}
    for i, (real, z) in enumerate(gan_data(rank, world)):
        closes_d = (seen["d"] + 1) % ACCUM == 0
        engine_d.set_gradient_accumulation_boundary(closes_d)
        fake, ones, loss_d = gan_losses(engine_g, engine_d, real, z)
        engine_d.backward(loss_d)
        seen["d"] += 1
        losses["d"].append(float(loss_d))
        if closes_d:
            engine_d.step()
            applied["d"] += 1
        if i % g_every == g_every - 1:
            closes_g = (seen["g"] + 1) % ACCUM == 0
            engine_g.set_gradient_accumulation_boundary(closes_g)
            disc.requires_grad_(False)  # G's loss must not add to D's open window
            loss_g = F.binary_cross_entropy_with_logits(engine_d(fake), ones)
            engine_g.backward(loss_g)
            disc.requires_grad_(True)
            seen["g"] += 1
            losses["g"].append(float(loss_g))
            if closes_g:
                engine_g.step()
                applied["g"] += 1
    return {
        "applied": applied,
        "losses": losses,
        "gen": _full_weights(deepspeed, gen),
        "disc": _full_weights(deepspeed, disc),
    }
