"""``apex``: one CUDA device, torch autocast + ``GradScaler`` precision (accelkit's own policy),
the optimizer swapped for its fused Apex twin and, optionally, the norms for Apex's fused norms.

Apex's ``amp`` (``opt_level`` O0-O3) was removed from Apex in May 2025; asking for it, as an amp
option or as ``precision="O1"``, is refused with the precision string that gives the same effect
(:func:`amp_removed`).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from accelkit.sdk import (
    NATIVE_DTYPES,
    Capabilities,
    ConfigError,
    DtypeRow,
    SetupResult,
    SingleDeviceBackend,
    check_device_supports,
    compile_in_place,
    load_config_source,
    native_precision,
)
from accelkit_apex import checkpoint
from accelkit_apex.probe import import_apex
from accelkit_apex.swap import NormSwap, fused_twin, swap_norms

log = logging.getLogger("accelkit")

#: the keyword arguments of apex.amp.initialize (Apex <= 25.04)
AMP_OPTIONS = (
    "opt_level",
    "loss_scale",
    "keep_batchnorm_fp32",
    "master_weights",
    "cast_model_type",
    "cast_model_outputs",
    "patch_torch_functions",
    "num_losses",
    "min_loss_scale",
    "max_loss_scale",
    "amp",
)
#: opt_level -> (the precision string with the same effect, what the level meant)
OPT_LEVELS = {
    "O0": ("32-true", "fp32 throughout"),
    "O1": ("16-mixed", "fp32 weights, fp16 autocast, dynamic loss scaling"),
    "O2": (
        "16-mixed",
        "fp16 weights with fp32 master weights and dynamic loss scaling: the same arithmetic "
        "as fp32 weights with fp16 autocast",
    ),
    "O3": ("16-true", "fp16 weights and compute, no master weights"),
}


def amp_removed(backend: str, options: dict[str, Any]) -> str:
    """Why ``opt_level`` / amp options (or an opt level passed as ``precision=``) are refused,
    and what to pass instead."""
    given = ", ".join(f"{k}={options[k]!r}" for k in (*AMP_OPTIONS, "precision") if k in options)
    level = str(options.get("opt_level", options.get("precision", ""))).strip().upper()
    if level in OPT_LEVELS:
        precision, meant = OPT_LEVELS[level]
        instead = f"opt_level {level!r} ({meant}) is precision={precision!r}"
    else:
        instead = (
            "opt_level 'O1' and 'O2' are precision='16-mixed', 'O3' is '16-true', 'O0' is '32-true'"
        )
    return (
        f"backend {backend!r}: {given}: Apex removed apex.amp (and apex.parallel, "
        "apex.fp16_utils) in May 2025 (NVIDIA/apex #1896), so accelkit runs precision through "
        f"torch autocast and torch.amp.GradScaler instead. {instead}; on a GPU with bf16, "
        "precision='bf16-mixed' needs no loss scaling. The loss scale is dynamic "
        "(GradScaler: 2**16 to start, halved on overflow, doubled after 2000 good steps) and "
        "is saved in every checkpoint; batch norms keep fp32 weights under -mixed"
    )


def is_opt_level(precision: Any) -> bool:
    """``"O0"`` ... ``"O3"`` in any case: amp's opt levels, which some users pass as precision."""
    return isinstance(precision, str) and precision.strip().upper() in OPT_LEVELS


def refuse_amp_options(name: str, config: Any, overrides: dict[str, Any]) -> None:
    merged = {**load_config_source(config), **overrides}
    if any(key in merged for key in AMP_OPTIONS):
        raise ConfigError(amp_removed(name, merged))


@dataclass
class ApexOptions:
    #: CUDA device index (default: LOCAL_RANK, else 0)
    device_index: int | None = None
    #: swap torch Adam/AdamW/SGD for apex.optimizers.FusedAdam/FusedSGD at setup
    fused_optimizer: bool = True
    #: swap nn.LayerNorm / nn.RMSNorm for apex.normalization.FusedLayerNorm / FusedRMSNorm
    fused_norm: bool = False


#: precision -> dtypes on ``apex`` (the torch-native table, with Apex's optimizer state)
APEX_DTYPES: dict[str, DtypeRow] = {
    "32-true": NATIVE_DTYPES["32-true"],
    "bf16-mixed": DtypeRow(
        "fp32",
        "bf16 (autocast; fused norms take and return bf16)",
        "none (params are fp32)",
        "fp32",
    ),
    "16-mixed": DtypeRow(
        "fp32",
        "fp16 (autocast; fused norms take and return fp16) + dynamic loss scaling",
        "none (params are fp32)",
        "fp32",
    ),
    "bf16-true": DtypeRow(
        "bf16", "bf16", "none (FusedAdam keeps exp_avg/exp_avg_sq in fp32)", "bf16"
    ),
    "16-true": DtypeRow(
        "fp16", "fp16", "none (FusedAdam keeps exp_avg/exp_avg_sq in fp32)", "fp16"
    ),
}


def cuda_device(backend: str, index: int | None) -> torch.device:
    """The CUDA device a backend runs on; a clear error where there is none."""
    from accelkit.sdk import local_rank

    if not torch.cuda.is_available():
        raise ConfigError(
            f"backend {backend!r} needs a CUDA GPU: Apex's fused optimizers and norms run only "
            "as its compiled CUDA kernels (amp_C, fused_layer_norm_cuda; FusedAdam allocates on "
            "'cuda' when it is built), and "
            "torch.cuda.is_available() is False here. On the CPU use 'cpu' with torch's own "
            "optimizer (AdamW(fused=True) is torch's fused kernel on a GPU)"
        )
    index = local_rank() if index is None else index
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"device_index {index} out of range: {torch.cuda.device_count()} CUDA devices"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """``set_to_none`` zeroing for any optimizer (Apex's ``zero_grad()`` takes no argument)."""
    if "set_to_none" in inspect.signature(optimizer.zero_grad).parameters:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


class ApexBackend(SingleDeviceBackend):
    """One CUDA device; the user's optimizer becomes its fused Apex twin at ``setup``."""

    capabilities = Capabilities()
    options_class = ApexOptions
    dtype_table = APEX_DTYPES

    @classmethod
    def parse_config(cls, name: str, config: Any, overrides: dict[str, Any]) -> Any:
        refuse_amp_options(name, config, overrides)
        return super().parse_config(name, config, overrides)

    @classmethod
    def parse_precision(cls, name: str, precision: str | int | None) -> str | None:
        """``precision="O1"`` (amp's opt level) gets amp's refusal, with the string to pass."""
        if is_opt_level(precision):
            raise ConfigError(amp_removed(name, {"precision": precision}))
        return super().parse_precision(name, precision)

    def __init__(self, name: str, options: Any, settings: Any) -> None:
        super().__init__(name, options, settings)
        self.apex: Any = None
        #: what setup() replaced: "AdamW -> FusedAdam", ...
        self.swaps: list[str] = []
        self.norms = NormSwap()

    def _pick_device(self) -> torch.device:
        return cuda_device(self.name, self.options.device_index)

    def launch(self) -> None:
        self._device = self._pick_device()
        self.apex = import_apex(self.name, fused_norm=self.options.fused_norm)
        check_device_supports(self.settings.precision, self._device)
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
        if self.options.fused_norm:
            self.norms = swap_norms(model, self.apex)
        out = []
        for opt in optimizers:
            new = fused_twin(self.name, opt, self.apex) if self.options.fused_optimizer else opt
            if new is not opt:
                self.swaps.append(f"{type(opt).__name__} -> {type(new).__name__}")
            out.append(new)
        if compile:
            compile_in_place(model, compile if isinstance(compile, dict) else None)
        return SetupResult(model, out)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        zero_grad(optimizer)

    # ---- the portable checkpoint: per-group steps <-> torch's per-parameter steps ------------
    def local_fragments(self, state: dict[str, Any]):
        return checkpoint.local_fragments(self, state)

    def load_fragments(self, reader: Any, state: dict[str, Any]) -> None:
        checkpoint.load_fragments(self, reader, state)
