"""torch DistributedDataParallel: gloo on the CPU, nccl on CUDA."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from accelkit import distributed
from accelkit.backend import Capabilities, SetupResult
from accelkit.backends.single import SingleDeviceBackend, device_available
from accelkit.errors import ConfigError
from accelkit.precision import check_device_supports, native_precision


@dataclass
class DDPOptions:
    """Options of ``ddp`` (and of backends built on :class:`DDPBackend`)."""

    #: "auto" takes CUDA when present, else the CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: seconds before a collective gives up (a dead rank makes the others fail, not hang)
    timeout: float = distributed.DEFAULT_TIMEOUT_S
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"option 'timeout' must be > 0 seconds, got {self.timeout}")


class DDPBackend(SingleDeviceBackend):
    """One model replica per process; gradients all-reduced in buckets during backward."""

    capabilities = Capabilities(no_sync=True, distributed=True)
    options_class = DDPOptions

    def launch(self) -> None:
        want = self.options.device
        if want == "cuda" and not device_available("cuda"):
            raise ConfigError(
                "ddp: device='cuda' but no CUDA device is available; use device='cpu'"
            )
        use_cuda = want == "cuda" or (want == "auto" and device_available("cuda"))
        if use_cuda:
            index = distributed.local_rank()
            torch.cuda.set_device(index)
            self._device = torch.device("cuda", index)
        else:
            self._device = torch.device("cpu")
        check_device_supports(self.settings.precision, self._device)
        distributed.init_process_group(self._device, self.options.timeout)
        self.precision = native_precision(self.settings.precision, self._device.type)

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
