"""The accelkit side of tests/test_export_dcp.py: train the reference workload a few steps on a
backend, save a portable checkpoint, then take one more step on a fixed batch. Rank 0 dumps the
full state at the save and after that step (gathered by raw PyTorch, ``ref.gather_full_state``),
for the raw-DCP reference side to compare against."""

from __future__ import annotations

from pathlib import Path

import test_checkpoint_reference as ref
import torch

SEED, STEPS = 0, 3
WEIGHT_DECAY = 0.1
#: the batch of the step after the save (every rank takes the same one: data-parallel gradients
#: of identical batches average to the one-process gradient exactly at a world size of 2)
NEXT_SAMPLES = (40, 41)


def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
    data = ref.Samples()
    tokens = torch.stack([data[i][0] for i in NEXT_SAMPLES])
    targets = torch.stack([data[i][1] for i in NEXT_SAMPLES])
    return tokens, targets


def train_and_save(out: str, backend: str = "cpu") -> None:
    """Save ``{out}/ck`` after ``STEPS`` steps; rank 0 writes ``{out}/saved`` and
    ``{out}/continued`` (the state one step later)."""
    import torch.distributed as dist

    import accelkit

    options = {"device": "cpu"} if backend in ("ddp", "fsdp") else {}
    accel = accelkit.get(backend, seed=SEED, **options)
    torch.manual_seed(SEED)
    net = ref.Net()
    trainable = [p for p in net.parameters() if p.requires_grad]
    model, opt = accel.setup(
        net, torch.optim.AdamW(trainable, lr=ref.LR, weight_decay=WEIGHT_DECAY)
    )
    data = ref.Samples()
    for step in range(STEPS):
        tokens, targets, _ = data[step * accel.world_size + accel.rank]
        accel.backward(ref.lm_loss(model(tokens[None]), targets[None]))
        accel.step()
    accel.save(f"{out}/ck", {"model": model, "optimizer": opt, "step": STEPS})

    def dump(name: str) -> None:
        gathered = ref.gather_full_state(model, opt.optimizer)
        if accel.rank == 0:
            ref.dump(gathered, Path(out) / name)

    dump("saved")
    tokens, targets = next_batch()
    accel.backward(ref.lm_loss(model(tokens), targets))
    accel.step()
    dump("continued")
    if dist.is_initialized():
        dist.barrier()
    accel.end_training()
