"""What DeepSpeed's checkpoint files may hold, for accelkit's restricted unpickler.

DeepSpeed's files are ``torch.save`` pickles. ``trust_pickle=True`` reads them through the SDK's
:func:`~accelkit.sdk.restricted_torch_load` with the list below, never with
``torch.load(weights_only=False)``: a file that names anything else (``os.system``, ``exec``, a
class of the user's) is refused before anything in it is looked up or called.

The list is what DeepSpeed 0.19.8's ``engine.save_checkpoint`` writes, read from real
checkpoints (ZeRO 0, 1, 2 and 3, fp32 and bf16, 2 ranks; ``pickle_globals`` of every file):
tensors in plain containers, plus :data:`CHECKPOINT_CLASSES` and ZeRO-3's flat fp32 partitions,
which are tensors carrying a ``ds_id`` attribute. ``DynamicLossScaler`` (fp16) and
``argparse.Namespace`` (``deepspeed.initialize(args=...)`` stores ``args``) are listed from
DeepSpeed's code, which saves them the same way.
"""

from __future__ import annotations

import os
from typing import Any

from accelkit.sdk import (
    CheckpointError,
    PickleAllowlist,
    StandIn,
    conversion_allowlist,
    restricted_torch_load,
)

#: the classes DeepSpeed's checkpoint files name, besides tensors and containers
CHECKPOINT_CLASSES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # optimizer_state_dict["zero_stage"]
    "deepspeed.utils.tensor_fragment.fragment_address",  # ZeRO-1/2 param_slice_mappings
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # the ZeRO optimizers' loss_scaler
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # ... under fp16
    "argparse.Namespace",  # the engine's args, when deepspeed.initialize got some
)
#: the Python attributes DeepSpeed's tensors carry (ZeRO-3's fp32_flat_groups)
TENSOR_ATTRIBUTES = ("ds_id",)
ZERO_STAGE = CHECKPOINT_CLASSES[0]

#: what to do about a file the list refuses
REFUSED_HINT = (
    "accelkit reads DeepSpeed's pickles with a restricted unpickler, which allows tensors, "
    "plain containers, numpy values and the classes DeepSpeed's checkpoints hold "
    "(ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler, argparse.Namespace), "
    "with or without trust_pickle, and nothing else. If you know where the checkpoint comes "
    "from and what else it holds, load it with DeepSpeed in your own code and save it with "
    "accel.save (the portable format), or convert that"
)


def _stage_number(value: Any) -> int:
    """ZeroStageEnum for the importer: the stage as a number (the file cannot fill an int)."""
    if type(value) is not int or not 0 <= value <= 3:
        raise CheckpointError(f"a DeepSpeed checkpoint's ZeroStageEnum is {value!r}, not 0 to 3")
    return value


def _zero_stage(value: Any) -> Any:
    """ZeroStageEnum for DeepSpeed's own load: the member of that value. The file gets the shared
    member but cannot change it: its class is not on the list, so torch refuses to fill it."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ZeroStageEnum(_stage_number(value))


def import_allowlist() -> PickleAllowlist:
    """For ``accelkit convert``: DeepSpeed's classes as :class:`~accelkit.sdk.StandIn` records
    of their fields (the importer reads fields only, and DeepSpeed need not be installed)."""
    bindings: dict[str, Any] = {name: StandIn for name in CHECKPOINT_CLASSES}
    bindings[ZERO_STAGE] = _stage_number
    return conversion_allowlist().extended(bindings, tensor_attributes=TENSOR_ATTRIBUTES)


def native_allowlist() -> PickleAllowlist:
    """For ``accel.load(..., format="native")``: DeepSpeed's own classes, which its
    ``load_checkpoint`` then uses (each object the file makes is new, except the stage)."""
    import argparse

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    own = (_zero_stage, fragment_address, LossScaler, DynamicLossScaler, argparse.Namespace)
    bindings = dict(zip(CHECKPOINT_CLASSES, own, strict=True))
    return conversion_allowlist().extended(bindings, tensor_attributes=TENSOR_ATTRIBUTES)


def load(
    path: str | os.PathLike,
    allowlist: PickleAllowlist,
    *,
    map_location: Any = "cpu",
    mmap: bool = False,
) -> Any:
    """One DeepSpeed checkpoint file, through the restricted unpickler."""
    return restricted_torch_load(
        path, allowlist, hint=REFUSED_HINT, map_location=map_location, mmap=mmap
    )
