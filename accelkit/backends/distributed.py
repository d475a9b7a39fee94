"""The base of every multi-process backend: where it runs, how it joins the process group, and
how long a collective may wait.

Modelled on Lightning Fabric's ``ParallelStrategy``: the subclass says how to wrap the model,
this class owns the launch (device pick, ``init_process_group`` with the ``timeout`` option), so
the device rules and the timeout check are written once for ddp, fsdp and every plugin backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from accelkit import distributed
from accelkit.backend import Backend, Capabilities
from accelkit.backend_specs import device_available
from accelkit.errors import ConfigError
from accelkit.precision import Precision, check_device_supports, native_precision


@dataclass
class ProcessGroupOptions:
    """The option every distributed backend has, validated here once."""

    #: seconds before a collective gives up (a dead rank makes the others fail, not hang)
    timeout: float = distributed.DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"option 'timeout' must be > 0 seconds, got {self.timeout}")


@dataclass
class DistributedOptions(ProcessGroupOptions):
    """``timeout`` plus the device choice of backends that run on the CPU or CUDA."""

    #: "auto" takes CUDA when present, else the CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"


class DistributedBackend(Backend):
    """Several processes, one per device. Subclasses wrap the model; this class launches.

    ``launch`` picks the device (:meth:`pick_device`), refuses a precision the device cannot
    run, joins the process group (:meth:`join_process_group`) and builds the precision policy
    (:meth:`make_precision`). A backend whose library must run between those steps (DeepSpeed,
    ColossalAI) overrides ``launch`` and calls the two helpers itself. Collectives over samples
    run on :meth:`~accelkit.backend.Backend.data_parallel_group`.
    """

    capabilities = Capabilities(distributed=True)
    options_class = DistributedOptions

    def launch(self) -> None:
        self._device = self.pick_device()
        check_device_supports(
            self.settings.precision or "32-true",
            self._device,
            self.options,
            f"backend {self.name!r}",
        )
        self.join_process_group()
        self.precision = self.make_precision()

    def pick_device(self) -> torch.device:
        """This rank's device: ``cuda:LOCAL_RANK`` (made current) when the ``device`` option
        allows CUDA and it is present, else the CPU; ``device='cuda'`` without CUDA is an error.
        """
        want = getattr(self.options, "device", "auto")
        if want == "cuda" and not device_available("cuda"):
            raise ConfigError(
                f"{self.name}: device='cuda' but no CUDA device is available; use device='cpu'"
            )
        if want == "cuda" or (want == "auto" and device_available("cuda")):
            index = distributed.local_rank()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def join_process_group(self) -> None:
        """Join the default group (gloo on the CPU, nccl on CUDA) with the ``timeout`` option."""
        distributed.init_process_group(self._device, self.options.timeout)

    def make_precision(self) -> Precision:
        """The precision policy for ``settings.precision`` on the picked device."""
        return native_precision(
            self.settings.precision or "32-true", self._device.type, self.options
        )
