"""What the three FairScale backends share: the optimizer rebuild, the sharded loss scaler and
the refusals for setup arguments they do not support."""

from __future__ import annotations

from typing import Any

import torch

from accelkit.sdk import ConfigError, MixedPrecision, UnsupportedError


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


def fresh_groups(backend: str, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Copies of the optimizer's param groups (hyperparameters included), refusing one that has
    state: the backend rebuilds the optimizer, and state would not follow."""
    if len(optimizer.state):
        raise ConfigError(
            f"{backend}: the optimizer already has state (it has stepped, or state was loaded). "
            "The backend rebuilds it around FairScale's sharding, and that state would not "
            "follow. Pass a fresh optimizer to setup(), and load state after setup with "
            "accel.load()."
        )
    return [{**group, "params": list(group["params"])} for group in optimizer.param_groups]


def optimizer_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The constructor keywords of ``optimizer``: its ``defaults`` that ``__init__`` accepts.

    ``defaults`` may hold keys the constructor refuses (torch's AdamW keeps
    ``decoupled_weight_decay`` from its Adam base), so they are matched against the signature.
    """
    import inspect

    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}
