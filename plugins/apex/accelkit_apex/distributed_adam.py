"""``apex_distributed_adam``: Apex's DistributedFusedAdam (ZeRO-2) on a model not wrapped in DDP.

DistributedFusedAdam shards the optimizer state and the gradients over the data-parallel ranks
and synchronizes gradients itself: hooks on each parameter's gradient accumulator copy the
gradient into a flat bucket and start a reduce-scatter when a bucket is full (overlapped with
the rest of backward). So the model is *not* wrapped (DDP would reduce every gradient a second
time); accelkit maps its loop onto the optimizer's own API:

- accumulation: ``accel.accumulate()`` enters ``optimizer.no_sync()`` on the micro-batches that
  do not close the window (gradients add up in ``param.grad``; the closing backward syncs them);
- clipping and ``accel.grad_norm``: ``optimizer.clip_grad_norm(max_norm)`` / ``grad_norm()``
  (each rank's shard norm, all-reduced: the global norm);
- fp16 (``16-mixed``): torch's ``GradScaler`` scales the loss; the optimizer unscales its own
  buckets (``unscale_grads(grad_scaler=...)``, which also finds an overflow from the global
  norm) and skips the step on an overflow, on every rank alike.

One optimizer per accelerator, a torch ``Adam`` or ``AdamW``: its param groups and
hyperparameters carry over as for the ``apex`` backend. Needs CUDA and NCCL, and Apex built with
``--distributed_adam``. Verified so far on one GPU only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.amp.grad_scaler import OptState
from torch.nn.parallel import DistributedDataParallel

from accelkit.sdk import (
    Capabilities,
    ConfigError,
    DistributedBackend,
    DtypeRow,
    ProcessGroupOptions,
    SetupResult,
    StepResult,
    UnsupportedError,
    check_device_supports,
)
from accelkit_apex import checkpoint
from accelkit_apex.backend import ApexBackend, cuda_device
from accelkit_apex.probe import import_apex
from accelkit_apex.swap import NormSwap, adam_plan, swap_norms

_SYNC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class DistributedAdamOptions(ProcessGroupOptions):
    """``timeout`` (CUDA only, so no ``device``) plus DistributedFusedAdam's own arguments."""

    #: gradient bucket size (DistributedFusedAdam's default: 100)
    bucket_cap_mb: float = 100.0
    #: reduce-scatter buckets during backward, as they fill
    overlap_grad_sync: bool = True
    #: all-gather updated parameters during the next forward (Apex: experimental)
    overlap_param_sync: bool = False
    #: buckets processed at once in the optimizer step
    pipeline_size: int = 2
    #: gradient buckets carved from one persistent buffer
    contiguous_grad_buffer: bool = False
    #: parameters become views into one persistent buffer
    contiguous_param_buffer: bool = False
    #: dtype of the gradient reduce-scatter; "auto": the parameters' dtype
    grad_sync_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    #: swap nn.LayerNorm / nn.RMSNorm for Apex's fused norms (as on ``apex``)
    fused_norm: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"option 'bucket_cap_mb' must be > 0, got {self.bucket_cap_mb}")
        if self.pipeline_size < 1:
            raise ValueError(f"option 'pipeline_size' must be >= 1, got {self.pipeline_size}")


DISTRIBUTED_ADAM_DTYPES: dict[str, DtypeRow] = {
    "32-true": DtypeRow("fp32", "fp32", "fp32 shard (DistributedFusedAdam's store_params)", "fp32"),
    "bf16-mixed": DtypeRow(
        "fp32", "bf16 (autocast)", "fp32 shard (DistributedFusedAdam's store_params)", "fp32"
    ),
    "16-mixed": DtypeRow(
        "fp32",
        "fp16 (autocast) + dynamic loss scaling (overflow from the all-reduced norm)",
        "fp32 shard (DistributedFusedAdam's store_params)",
        "fp32",
    ),
    "bf16-true": DtypeRow(
        "bf16", "bf16", "fp32 shard (DistributedFusedAdam's store_params)", "bf16"
    ),
    "16-true": DtypeRow("fp16", "fp16", "fp32 shard (DistributedFusedAdam's store_params)", "fp16"),
}


class DistributedAdamBackend(DistributedBackend, ApexBackend):
    """ZeRO-2 through Apex's DistributedFusedAdam; the model stays unwrapped."""

    capabilities = Capabilities(
        # one DistributedFusedAdam per Accelerator
        several_optimizers=False,
        no_sync=True,
        sharded=True,
        distributed=True,
        compile=False,
    )
    options_class = DistributedAdamOptions
    dtype_table = DISTRIBUTED_ADAM_DTYPES

    def __init__(self, name: str, options: Any, settings: Any) -> None:
        super().__init__(name, options, settings)
        self._optimizers: list[Any] = []
        self._dfa_class: Any = None

    def _pick_device(self) -> torch.device:
        return cuda_device(self.name, None)

    def launch(self) -> None:
        self._device = self._pick_device()
        self.apex = import_apex(
            self.name, fused_norm=self.options.fused_norm, distributed_adam=True
        )
        from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

        self._dfa_class = DistributedFusedAdam
        check_device_supports(self.settings.precision, self._device)
        self.join_process_group()
        self.precision = self.make_precision()

    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        compile: bool | dict[str, Any] = False,
        activation_checkpointing: Any = None,
    ) -> SetupResult:
        if compile:
            raise UnsupportedError(
                f"{self.name}: setup(compile=...) is not supported: DistributedFusedAdam hooks "
                "each parameter's gradient accumulator, which a compiled backward bypasses"
            )
        if isinstance(model, DistributedDataParallel):
            raise ConfigError(
                f"{self.name}: pass the model unwrapped; DistributedFusedAdam synchronizes the "
                "gradients itself, so DDP would reduce them twice"
            )
        if len(optimizers) != 1 or self._optimizers:
            raise ConfigError(
                f"{self.name}: one optimizer per accelerator (got {len(optimizers)}"
                + (", and one is set up already" if self._optimizers else "")
                + "): DistributedFusedAdam synchronizes the gradients of the parameters it holds"
            )
        opt = optimizers[0]
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ConfigError(
                f"{self.name}: DistributedFusedAdam replaces a torch.optim.Adam or AdamW, not "
                f"{type(opt).__module__}.{type(opt).__name__}. For other optimizers use 'apex', "
                "'ddp' or 'fsdp'"
            )
        if opt.state:
            raise ConfigError(
                f"{self.name}: the optimizer passed to setup() already has state (it was "
                "stepped); call setup() before training and restore state with accel.load()"
            )
        plan = adam_plan(self.name, opt)
        model = self.prepare_module(model, activation_checkpointing)
        self.norms = swap_norms(model, self.apex) if self.options.fused_norm else NormSwap()
        dtypes = {p.dtype for group in plan.groups for p in group["params"]}
        if len(dtypes) != 1:
            raise ConfigError(
                f"{self.name}: the optimizer's parameters mix dtypes {sorted(map(str, dtypes))}; "
                "DistributedFusedAdam buckets one parameter dtype here"
            )
        param_dtype = dtypes.pop()
        sync = self.options.grad_sync_dtype
        new = self._dfa_class(
            plan.groups,
            adam_w_mode=plan.adam_w_mode,
            dtype=torch.float32,
            grad_sync_dtype=param_dtype if sync == "auto" else _SYNC_DTYPES[sync],
            param_sync_dtype=param_dtype,
            device="cuda" if self._device.type == "cuda" else self._device,
            overlap_grad_sync=self.options.overlap_grad_sync,
            overlap_param_sync=self.options.overlap_param_sync,
            bucket_cap_mb=self.options.bucket_cap_mb,
            pipeline_size=self.options.pipeline_size,
            contiguous_grad_buffer=self.options.contiguous_grad_buffer,
            contiguous_param_buffer=self.options.contiguous_param_buffer,
            **plan.defaults,
        )
        # the buckets in the order backward produces gradients (the last layers first)
        new.init_params(reversed(list(new.parameters())))
        checkpoint.check_flat_layout(new)
        self.swaps.append(f"{type(opt).__name__} -> {type(new).__name__}")
        self._optimizers.append(new)
        return SetupResult(model, [new])

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return self._optimizers[0].no_sync() if self._optimizers else contextlib.nullcontext()

    # ---- the step: DistributedFusedAdam's own unscale, norm and clip ----------------------------
    def _unscale(self, optimizer: Any) -> None:
        scaler = self.precision.scaler
        if scaler is None:
            return
        stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
        if stage is OptState.READY:
            optimizer.unscale_grads(grad_scaler=scaler)

    def grad_norm(self, model: Any, optimizer: Any, max_norm: float | None) -> torch.Tensor:
        if max_norm is None:
            return optimizer.grad_norm()
        return optimizer.clip_grad_norm(max_norm)

    def clip_grad_norm(self, model: Any, optimizer: Any, max_norm: float) -> torch.Tensor:
        self._unscale(optimizer)
        return optimizer.clip_grad_norm(max_norm)

    def optimizer_step(
        self,
        model: torch.nn.Module | None,
        optimizer: Any,
        *,
        max_grad_norm: float | None,
        track_grad_norm: bool,
    ) -> StepResult:
        scaler = self.precision.scaler
        self._unscale(optimizer)
        norm = None
        if max_grad_norm is not None or track_grad_norm:
            norm = self.grad_norm(model, optimizer, max_grad_norm)
        found_inf = None
        if scaler is not None:
            per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            found_inf = sum(v.to(torch.float32) for v in per_device.values())
            optimizer.step(grad_scaler=scaler)  # skips the update itself on an overflow
            self.precision.update()
        else:
            optimizer.step()
        if found_inf is not None and norm is not None:
            norm = torch.where(found_inf > 0, torch.full_like(norm, math.inf), norm)
        return StepResult(norm, found_inf)

    # ---- the portable checkpoint ----------------------------------------------------------------
    def local_fragments(self, state: dict[str, Any]):
        return checkpoint.distributed_adam_fragments(self, state)

    def load_fragments(self, reader: Any, state: dict[str, Any]) -> None:
        checkpoint.load_distributed_adam_fragments(self, reader, state)
