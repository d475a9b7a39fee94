"""Options of the ColossalAI backends: the plugins' own arguments, minus what accelkit owns.

accelkit owns precision (``precision=``), clipping (``max_grad_norm=``) and accumulation
(``accumulation_steps=``): the plugin arguments for those (``precision``, ``max_norm``,
``enable_gradient_accumulation``) are set from them and refused in ``plugin_kwargs``. Any other
plugin argument not listed here can be passed through ``plugin_kwargs``; ColossalAI checks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from accelkit.sdk import DistributedOptions, DtypeRow

#: plugin arguments accelkit sets itself
OWNED_KWARGS = frozenset(
    {"precision", "max_norm", "norm_type", "enable_gradient_accumulation", "stage", "zero_stage"}
)


@dataclass
class CommonOptions(DistributedOptions):
    """Every ColossalAI backend's options: ``device`` and ``timeout`` from the base
    (``device="cpu"`` runs on TorchDDP and LowLevelZero only) and the plugin's own arguments."""

    #: further keyword arguments for the ColossalAI plugin's constructor
    plugin_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        owned = sorted(OWNED_KWARGS & set(self.plugin_kwargs))
        if owned:
            raise ValueError(
                f"plugin_kwargs may not set {', '.join(owned)}: accelkit sets them from "
                "precision=, max_grad_norm=, accumulation_steps= and the backend's own options"
            )


@dataclass
class DDPOptions(CommonOptions):
    """TorchDDPPlugin."""

    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclass
class LossScaleOptions:
    """ColossalAI's dynamic loss scaler (16-true only)."""

    #: None: the plugin's own (LowLevelZero 2**32, Gemini and Hybrid 2**16), so that a run
    #: matches the raw Booster with the same settings
    initial_scale: float | None = None
    min_scale: float = 1
    growth_factor: float = 2
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2**32

    def loss_scale_kwargs(self) -> dict[str, Any]:
        scale = {} if self.initial_scale is None else {"initial_scale": self.initial_scale}
        return dict(
            **scale,
            min_scale=self.min_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            max_scale=self.max_scale,
        )


@dataclass
class ZeroOptions(LossScaleOptions, CommonOptions):
    """LowLevelZeroPlugin."""

    stage: Literal[1, 2] = 1
    #: gradients, fp32 master weights and optimizer state in CPU memory
    cpu_offload: bool = False
    #: None: on with CUDA, off on the CPU (it needs CUDA streams)
    overlap_communication: bool | None = None
    reduce_bucket_size_in_m: int = 12
    #: dtype of the gradient reduction; None: the parameters' dtype
    communication_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    master_weights: bool = True


@dataclass
class GeminiOptions(LossScaleOptions, CommonOptions):
    """GeminiPlugin."""

    placement_policy: Literal["static", "auto"] = "static"
    #: static placement: fraction of parameters sharded / offloaded, of optimizer state offloaded
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    #: auto placement
    warmup_non_model_data_ratio: float = 0.8
    steady_cuda_cap_ratio: float = 0.9
    pin_memory: bool = False
    master_weights: bool = True
    search_range_m: int = 32
    hidden_dim: int | None = None
    min_chunk_size_m: float = 32
    tp_size: int = 1
    extra_dp_size: int = 1
    enable_async_reduce: bool = True
    #: Gemini steps only ColossalAI's HybridAdam/CPUAdam/FusedAdam: replace a torch Adam or
    #: AdamW given to setup() by a HybridAdam with the same hyperparameters
    replace_torch_adam: bool = True


@dataclass
class HybridOptions(LossScaleOptions, CommonOptions):
    """HybridParallelPlugin (tensor parallel + ZeRO through Shardformer)."""

    tp_size: int = 1
    #: only 1: pipeline stages are accelkit's ``pp`` (``accelkit.get(..., pp=2, pipeline=...)``)
    pp_size: int = 1
    zero_stage: Literal[0, 1, 2] = 0
    sp_size: int | None = None
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: str | None = None
    enable_all_optimization: bool = False
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    cpu_offload: bool = False
    #: None: on with CUDA, off on the CPU (it needs CUDA streams)
    overlap_communication: bool | None = None
    zero_bucket_size_in_m: int = 12
    communication_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    broadcast_buffers: bool = True
    ddp_bucket_cap_mb: int = 25
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pp_size != 1:
            raise ValueError(
                f"pp_size={self.pp_size}: pipeline stages are accelkit's own option, pp: "
                f"accelkit.get('colossalai_hybrid', pp={self.pp_size}, pipeline=dict(schedule="
                "'1F1B', microbatches=8)), trained with accel.forward_backward(...) (it runs "
                "booster.execute_pipeline)"
            )
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")


# ---- precision tables ------------------------------------------------------------------------
ZERO_DTYPES: dict[str, DtypeRow] = {
    "32-true": DtypeRow("fp32", "fp32", "fp32, sharded copy", "fp32"),
    "bf16-mixed": DtypeRow("fp32", "bf16 (autocast)", "fp32, sharded copy", "fp32"),
    "bf16-true": DtypeRow("bf16", "bf16", "fp32, sharded", "bf16 (communication_dtype)"),
    "16-true": DtypeRow(
        "fp16", "fp16 + dynamic loss scaling", "fp32, sharded", "fp16 (communication_dtype)"
    ),
}
GEMINI_DTYPES: dict[str, DtypeRow] = {
    "bf16-true": DtypeRow("bf16, in chunks", "bf16", "fp32 chunks (master_weights)", "bf16"),
    "16-true": DtypeRow(
        "fp16, in chunks", "fp16 + dynamic loss scaling", "fp32 chunks (master_weights)", "fp16"
    ),
}
HYBRID_DTYPES: dict[str, DtypeRow] = {
    "32-true": DtypeRow("fp32", "fp32", "none (zero_stage 0 only)", "fp32"),
    "bf16-mixed": DtypeRow("fp32", "bf16 (autocast)", "none (zero_stage 0 only)", "fp32"),
    "bf16-true": DtypeRow("bf16", "bf16", "fp32 (sharded with zero_stage 1/2)", "bf16"),
    "16-true": DtypeRow(
        "fp16", "fp16 + dynamic loss scaling", "fp32 (sharded with zero_stage 1/2)", "fp16"
    ),
}

#: accelkit precision string -> (the plugin's ``precision``, autocast dtype name or None)
PLUGIN_PRECISION: dict[str, tuple[str, str | None]] = {
    "32-true": ("fp32", None),
    "bf16-mixed": ("fp32", "bf16"),
    "bf16-true": ("bf16", None),
    "16-true": ("fp16", None),
}
