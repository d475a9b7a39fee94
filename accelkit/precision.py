"""Precision policies for backends that let accelkit run precision (the torch-native ones).

Strings follow Lightning Fabric's split between *mixed* (fp32 weights, autocast compute) and
*true* (weights themselves in low precision). Backends that run precision themselves
(``capabilities.controls_precision``) map the same strings onto their own settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from accelkit.errors import ConfigError

#: the precisions every backend maps (``Capabilities.precisions``' default)
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
#: float8 Linear layers through torchao, the rest as bf16-mixed (accelkit.float8); offered by
#: the backends that list it (cpu, cuda, mps refuses it at get(), ddp, fsdp)
FP8_MIXED = "fp8-mixed"
#: what the torch-native backends accept
NATIVE_PRECISIONS: tuple[str, ...] = (*PRECISIONS, FP8_MIXED)
#: every precision string accelkit knows; a backend that does not list one refuses it
KNOWN_PRECISIONS: tuple[str, ...] = NATIVE_PRECISIONS


def precision_options(precision: str) -> type | None:
    """The options class whose fields configure ``precision`` (``Float8Options`` and its
    ``fp8_*`` fields for ``fp8-mixed``), or None where the precision takes no options.

    A backend offers such a precision only if its ``options_class`` extends that class: a
    subclass of a backend that drops the options loses the precision with them
    (``Backend.__init_subclass__``), and the conformance suite fails a backend that lists it
    without them."""
    if precision == FP8_MIXED:
        from accelkit.float8 import Float8Options

        return Float8Options
    return None


#: per precision that takes options, options that differ from their defaults and are valid on
#: every device it runs on: the conformance suite passes them with the precision
PRECISION_EXAMPLE_OPTIONS: dict[str, dict[str, Any]] = {
    FP8_MIXED: {"fp8_recipe": "rowwise", "fp8_min_features": 32, "fp8_skip_head": False},
}


def configurable_precisions(precisions: tuple[str, ...], options_class: Any) -> tuple[str, ...]:
    """Those of ``precisions`` that a backend with ``options_class`` can configure."""
    kept = []
    for precision in precisions:
        needed = precision_options(precision)
        if needed is None or (
            isinstance(options_class, type) and issubclass(options_class, needed)
        ):
            kept.append(precision)
    return tuple(kept)


_ALIASES = {
    "32": "32-true",
    "fp32": "32-true",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    "fp16": "16-mixed",
}


def normalize_precision(
    precision: str | int | None, valid: tuple[str, ...] = KNOWN_PRECISIONS
) -> str | None:
    """Return the canonical precision string, or None; raise ConfigError on anything else,
    listing ``valid`` (a backend passes the precisions it accepts) and their aliases."""
    if precision is None:
        return None
    key = str(precision)
    key = _ALIASES.get(key, key)
    if key not in KNOWN_PRECISIONS:
        aliases = sorted(alias for alias, target in _ALIASES.items() if target in valid)
        raise ConfigError(
            f"unknown precision {precision!r}. Valid precisions: {', '.join(valid)}"
            + (f" (aliases: {', '.join(aliases)})" if aliases else "")
        )
    return key


def low_dtype(precision: str) -> torch.dtype:
    """The 16-bit dtype of a precision string: bfloat16 for ``bf16-*`` and ``fp8-mixed`` (whose
    layers that stay out of float8 run under bf16 autocast), else float16."""
    return torch.bfloat16 if precision.startswith(("bf16", "fp8")) else torch.float16


@dataclass(frozen=True)
class DtypeRow:
    """What a precision string means on one backend (published in docs per backend)."""

    param: str
    compute: str
    master: str
    reduce: str


#: The table of the torch-native backends (cpu/cuda/mps/ddp).
NATIVE_DTYPES: dict[str, DtypeRow] = {
    "32-true": DtypeRow("fp32", "fp32", "none (params are fp32)", "fp32"),
    "bf16-mixed": DtypeRow("fp32", "bf16 (autocast)", "none (params are fp32)", "fp32"),
    "16-mixed": DtypeRow(
        "fp32", "fp16 (autocast) + dynamic loss scaling", "none (params are fp32)", "fp32"
    ),
    "bf16-true": DtypeRow("bf16", "bf16", "none", "bf16"),
    "16-true": DtypeRow("fp16", "fp16", "none", "fp16"),
    "fp8-mixed": DtypeRow(
        "fp32",
        "fp8 for the eligible nn.Linear layers (torchao Float8Linear); bf16 (autocast) elsewhere",
        "none (params are fp32)",
        "fp32",
    ),
}


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in nested containers to ``dtype``; leave the rest alone."""
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if torch.is_floating_point(data) and data.dtype != dtype else data
    if isinstance(data, dict):
        return type(data)((k, cast_floats(v, dtype)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(cast_floats(v, dtype) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(cast_floats(v, dtype) for v in data)
    return data


#: the former private name, kept for code that imported it
_cast_floats = cast_floats


class Precision:
    """Full precision: the base of every policy, and what ``32-true`` is."""

    name = "32-true"
    #: dtype of float inputs and outputs when the model runs in low precision, else None
    input_dtype: torch.dtype | None = None
    scaler: Any = None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def convert_input(self, data: Any) -> Any:
        return data if self.input_dtype is None else cast_floats(data, self.input_dtype)

    def convert_output(self, data: Any) -> Any:
        return data if self.input_dtype is None else cast_floats(data, torch.float32)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before clipping."""

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """0-d tensor > 0 when this step's gradients overflowed (after unscale), else None."""
        return None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        """Adjust the loss scale after a step."""

    def flush_update(self) -> None:
        """Apply a loss-scale update that waited for the other optimizers of the same step."""

    def init_context(self) -> contextlib.AbstractContextManager:
        """Context in which ``init_module()`` builds the model (a ``-true`` policy sets the
        default dtype there); nothing by default."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class MixedPrecision(Precision):
    """fp32 weights, autocast compute; dynamic loss scaling for fp16.

    The scale update after a step waits until every optimizer whose window closed in the same
    ``Accelerator.step()`` has stepped (``flush_update``; at the latest at the next backward or
    ``state_dict``), so each is unscaled by the scale its gradients carry and one overflow backs
    off once -- torch's recipe ``scaler.step(a); scaler.step(b); scaler.update()``.
    """

    #: a class attribute, so subclasses that skip ``__init__`` have it too
    _update_pending = False

    def __init__(self, precision: str, device_type: str) -> None:
        self.name = precision
        self.device_type = device_type
        self.dtype = low_dtype(precision)
        self.scaler = torch.amp.GradScaler(device_type) if self.dtype == torch.float16 else None
        self._unscaled: set[int] = set()

    def forward_context(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def convert_output(self, data: Any) -> Any:
        return cast_floats(data, torch.float32)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss
        self.flush_update()
        return self.scaler.scale(loss)

    def flush_update(self) -> None:
        if self._update_pending:
            self._update_pending = False
            self.scaler.update()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        if self.scaler is None:
            return None
        self.unscale(optimizer)
        per_device = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return sum(v.to(torch.float32) for v in per_device.values())

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self._unscaled.discard(id(optimizer))

    def update(self) -> None:
        if self.scaler is not None:
            self._update_pending = True  # applied by flush_update, see the class doc

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        self.flush_update()
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self._update_pending = False
            self.scaler.load_state_dict(state)


class HalfPrecision(Precision):
    """Weights and compute in bf16/fp16 (``-true``); float inputs are cast, outputs return fp32."""

    def __init__(self, precision: str) -> None:
        self.name = precision
        self.input_dtype = low_dtype(precision)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(self.input_dtype)

    @contextlib.contextmanager
    def init_context(self) -> Iterator[None]:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.input_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


class BoundaryCastPrecision(Precision):
    """For a backend whose library runs precision itself (DeepSpeed's engine, a ColossalAI
    plugin): accelkit only casts what crosses the model's boundary.

    ``-true``: float inputs go in as bf16/fp16 (the library's weights are), outputs come back
    fp32. ``-mixed``: outputs come back fp32; with ``autocast_device`` the forward also runs
    under ``torch.autocast`` (for a library that keeps fp32 and leaves autocast to the caller),
    without it the library autocasts itself.
    """

    def __init__(self, precision: str, autocast_device: str | None = None) -> None:
        self.name = precision
        self.input_dtype = low_dtype(precision) if precision in ("bf16-true", "16-true") else None
        self.autocast_device = autocast_device
        mixed = precision.endswith("-mixed") and autocast_device is not None
        self.autocast_dtype = low_dtype(precision) if mixed else None
        self.cast_output = precision != "32-true"

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast_device, dtype=self.autocast_dtype)

    def convert_output(self, data: Any) -> Any:
        return cast_floats(data, torch.float32) if self.cast_output else data


class Float8MixedPrecision(MixedPrecision):
    """``fp8-mixed``: ``convert_module`` swaps the eligible Linear layers for torchao's
    ``Float8Linear`` (see :mod:`accelkit.float8`); the forward runs under bf16 autocast, so the
    other layers compute as under ``bf16-mixed``. No loss scaling: float8 scales each tensor."""

    def __init__(self, device_type: str, config: Any) -> None:
        super().__init__(FP8_MIXED, device_type)
        self.float8 = config

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from accelkit.float8 import convert_to_float8

        return convert_to_float8(module, self.float8)


def native_precision(precision: str, device_type: str, options: Any = None) -> Precision:
    """The policy the torch-native backends use for ``precision`` on ``device_type``; ``options``
    (the backend's) carry the ``fp8_*`` settings of ``fp8-mixed``."""
    if precision == "32-true":
        return Precision()
    if precision == FP8_MIXED:
        from accelkit.float8 import float8_config

        return Float8MixedPrecision(device_type, float8_config("fp8-mixed", precision, options))
    if precision.endswith("-mixed"):
        return MixedPrecision(precision, device_type)
    return HalfPrecision(precision)


def check_device_supports(
    precision: str, device: torch.device, options: Any = None, owner: str = "backend"
) -> None:
    """Fail at ``get()`` when the device cannot run ``precision`` at all (not inside a kernel);
    ``options`` (the backend's) carry the ``fp8_*`` settings, refused with another precision."""
    if options is not None or precision == FP8_MIXED:
        from accelkit.float8 import check_device_supports_float8, float8_config

        config = float8_config(owner, precision, options)
        if config is not None:
            check_device_supports_float8(device, config.recipe)
    if (
        device.type == "cuda"
        and precision.startswith("bf16")
        and not torch.cuda.is_bf16_supported()
    ):
        raise ConfigError(
            f"precision {precision!r} needs bf16 support, which {torch.cuda.get_device_name(device)} "
            "lacks. Use '16-mixed' or '32-true'."
        )
    if device.type == "mps" and precision.startswith("bf16"):
        try:
            torch.ones(1, dtype=torch.bfloat16, device=device)
        except (RuntimeError, TypeError) as err:
            raise ConfigError(
                f"precision {precision!r} is not available on MPS here: {err}"
            ) from err
