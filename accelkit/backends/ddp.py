"""torch DistributedDataParallel: gloo on the CPU, nccl on CUDA."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from accelkit.backend import Capabilities, SetupResult
from accelkit.backends.distributed import DistributedBackend, DistributedOptions
from accelkit.backends.single import SingleDeviceBackend


@dataclass
class DDPOptions(DistributedOptions):
    """Options of ``ddp`` (and of backends built on :class:`DDPBackend`)."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True


class DDPBackend(DistributedBackend, SingleDeviceBackend):
    """One model replica per process; gradients all-reduced in buckets during backward."""

    capabilities = Capabilities(no_sync=True, distributed=True)
    options_class = DDPOptions

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
        if compile:
            ddp.compile(**(compile if isinstance(compile, dict) else {}))
        return SetupResult(ddp, optimizers)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return (
            model.no_sync()
            if isinstance(model, DistributedDataParallel)
            else contextlib.nullcontext()
        )
