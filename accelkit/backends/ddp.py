"""torch DistributedDataParallel: gloo on the CPU, nccl on CUDA."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from accelkit.backend import Capabilities, SetupResult
from accelkit.backends.distributed import DistributedBackend, DistributedOptions
from accelkit.backends.single import SingleDeviceBackend
from accelkit.float8 import Float8Options
from accelkit.precision import NATIVE_PRECISIONS


@dataclass
class DDPOptions(DistributedOptions):
    """Options of ``ddp`` (and of backends built on :class:`DDPBackend`)."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True
    #: gradient communication hook: None, "fp16" / "bf16" (compress to that dtype for the
    #: all-reduce) or "powersgd" (low-rank compression with error feedback; its state is saved)
    comm_hook: Literal["fp16", "bf16", "powersgd"] | None = None
    #: PowerSGD: the rank of the approximation, and the steps of plain all-reduce before it
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.comm_hook not in (None, "fp16", "bf16", "powersgd"):
            raise ValueError(
                f"option 'comm_hook' must be None, 'fp16', 'bf16' or 'powersgd', got {self.comm_hook!r}"
            )
        if self.powersgd_rank < 1 or self.powersgd_start_iter < 0:
            raise ValueError("powersgd_rank must be >= 1 and powersgd_start_iter >= 0")


@dataclass
class TorchDDPOptions(DDPOptions, Float8Options):
    """Options of the torch-native ``ddp``: :class:`DDPOptions` and the ``fp8_*`` options of
    ``precision="fp8-mixed"``. Kept out of :class:`DDPOptions`, which plugin backends built on
    :class:`DDPBackend` extend without offering fp8-mixed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_fp8_options()


class DDPBackend(DistributedBackend, SingleDeviceBackend):
    """One model replica per process; gradients all-reduced in buckets during backward."""

    capabilities = Capabilities(no_sync=True, distributed=True, precisions=NATIVE_PRECISIONS)
    options_class = TorchDDPOptions

    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        compile: bool | dict[str, Any] = False,
        activation_checkpointing: Any = None,
    ) -> SetupResult:
        model = self.prepare_module(model, activation_checkpointing)
        o = self.options
        kwargs: dict[str, Any] = dict(
            find_unused_parameters=o.find_unused_parameters,
            static_graph=o.static_graph,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
        )
        if not o.broadcast_buffers:  # passed only when off: torch >= 2.13 warns on the keyword
            kwargs["broadcast_buffers"] = False
        if o.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = o.bucket_cap_mb
        if self._device.type == "cuda":
            kwargs["device_ids"] = [self._device.index]
        ddp = DistributedDataParallel(model, **kwargs)
        self._register_comm_hook(ddp)
        if compile:
            ddp.compile(**(compile if isinstance(compile, dict) else {}))
        return SetupResult(ddp, optimizers)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return (
            model.no_sync()
            if isinstance(model, DistributedDataParallel)
            else contextlib.nullcontext()
        )

    # ---- communication hooks ----------------------------------------------------------------
    def _register_comm_hook(self, ddp: DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hook = self.options.comm_hook
        if hook is None:
            return
        if hook == "powersgd":
            self._powersgd = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.options.powersgd_rank,
                start_powerSGD_iter=self.options.powersgd_start_iter,
                random_seed=0,
            )
            if self._saved_powersgd is not None:
                self._restore_powersgd(self._saved_powersgd)
            ddp.register_comm_hook(self._powersgd, powerSGD_hook.powerSGD_hook)
        else:
            compress = (
                default_hooks.fp16_compress_hook
                if hook == "fp16"
                else default_hooks.bf16_compress_hook
            )
            ddp.register_comm_hook(None, compress)

    _powersgd: Any = None
    _saved_powersgd: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Adds PowerSGD's step count and its low-rank factors (the same on every rank): a
        resumed run keeps compressing, instead of starting over with plain all-reduces. The
        error-feedback residuals are per rank and are not saved: they restart from zero."""
        state = super().state_dict()
        if self._powersgd is not None:
            p = self._powersgd
            state["powersgd"] = {
                "iter": p.iter,
                "p_memory_dict": {str(k): v for k, v in p.p_memory_dict.items()},
                "q_memory_dict": {str(k): v for k, v in p.q_memory_dict.items()},
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("powersgd")
        if saved is None:
            return
        if self._powersgd is None:  # loaded before setup(): applied when the hook is made
            self._saved_powersgd = saved
            return
        self._restore_powersgd(saved)

    def _restore_powersgd(self, saved: dict[str, Any]) -> None:
        p = self._powersgd
        p.iter = int(saved["iter"])
        device = self._device
        for name in ("p_memory_dict", "q_memory_dict"):
            getattr(p, name).clear()
            getattr(p, name).update({int(k): v.to(device) for k, v in saved[name].items()})
