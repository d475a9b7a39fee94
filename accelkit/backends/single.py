"""One process on one device: ``cpu``, ``cuda``, ``mps``; and ``auto``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from accelkit import distributed
from accelkit.backend import Backend, Capabilities, SetupResult
from accelkit.backend_specs import device_available
from accelkit.errors import ConfigError
from accelkit.float8 import Float8Options
from accelkit.modules import apply_activation_checkpointing, compile_in_place
from accelkit.precision import NATIVE_PRECISIONS, check_device_supports, native_precision


@dataclass
class SingleDeviceOptions(Float8Options):
    """Options of ``cpu``, ``cuda`` and ``mps``: the device index and the ``fp8_*`` options of
    ``precision="fp8-mixed"`` (:class:`~accelkit.float8.Float8Options`)."""

    #: device index for ``cuda`` (default: LOCAL_RANK, else 0)
    device_index: int | None = None


class SingleDeviceBackend(Backend):
    """Model and optimizer on one device; precision through autocast / GradScaler."""

    capabilities = Capabilities(precisions=NATIVE_PRECISIONS)
    options_class = SingleDeviceOptions

    def launch(self) -> None:
        device_type = self.name
        if not device_available(device_type):
            raise ConfigError(
                f"backend {self.name!r} needs a {device_type.upper()} device, and none is available "
                "here. Use 'cpu' or 'auto'."
            )
        index = self.options.device_index
        if device_type == "cuda":
            index = distributed.local_rank() if index is None else index
            if index >= torch.cuda.device_count():
                raise ConfigError(
                    f"device_index {index} out of range: {torch.cuda.device_count()} CUDA devices"
                )
            torch.cuda.set_device(index)
            self._device = torch.device("cuda", index)
        else:
            self._device = torch.device(device_type)
        check_device_supports(
            self.settings.precision, self._device, self.options, f"backend {self.name!r}"
        )
        self.precision = native_precision(self.settings.precision, self._device.type, self.options)

    def prepare_module(
        self,
        model: torch.nn.Module,
        activation_checkpointing: Any = None,
    ) -> torch.nn.Module:
        """Device, precision and activation checkpointing: what every non-sharded backend does."""
        model = model.to(self.device)
        model = self.precision.convert_module(model)
        if activation_checkpointing:
            apply_activation_checkpointing(model, activation_checkpointing)
        return model

    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        compile: bool | dict[str, Any] = False,
        activation_checkpointing: Any = None,
    ) -> SetupResult:
        model = self.prepare_module(model, activation_checkpointing)
        if compile:
            compile_in_place(model, compile if isinstance(compile, dict) else None)
        return SetupResult(model, optimizers)


class AutoBackend(Backend):
    """Picks ``ddp`` when launched on several processes, else ``cuda``, ``mps`` or ``cpu``."""

    @classmethod
    def select_backend(cls) -> str:
        if distributed.launched_world_size() > 1:
            return "ddp"
        for device_type in ("cuda", "mps"):
            if device_available(device_type):
                return device_type
        return "cpu"
