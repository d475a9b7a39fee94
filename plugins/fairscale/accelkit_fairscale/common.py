"""What the three FairScale backends share: the sharded loss scaler and the refusal of setup
arguments they do not support (the optimizer rebuild is the SDK's ``optimizer_recipe``)."""

from __future__ import annotations

from typing import Any

import torch

from accelkit.sdk import MixedPrecision, UnsupportedError


class ShardedMixedPrecision(MixedPrecision):
    """fp32 weights, autocast compute (or none, where FairScale casts itself), and for fp16 a
    loss scaler that all-reduces its overflow flag, so every rank skips the same steps.

    Needed wherever a rank holds only some of the gradients (ShardedDataParallel, FSDP): a
    plain ``GradScaler`` would let one rank step while another skips, and OSS's step is a
    collective (it broadcasts the updated shards), so the ranks would then hang or diverge.
    """

    def __init__(self, precision: str, device_type: str, *, autocast: bool = True) -> None:
        super().__init__(precision, device_type)
        self.autocast = autocast
        if self.dtype == torch.float16:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device_type)

    def forward_context(self) -> Any:
        if self.autocast:
            return super().forward_context()
        import contextlib

        return contextlib.nullcontext()


def refuse_compile(backend: str, compile: Any) -> None:
    if compile:
        raise UnsupportedError(
            f"{backend}: setup(compile=...) is not supported with FairScale's wrappers (their "
            "gradient hooks are untested under torch.compile); compile the model's blocks "
            "yourself before setup()"
        )
