"""ColossalAI's Booster plugins behind accelkit's backend protocol.

How accelkit's loop maps onto the Booster (the same for the four backends):

* ``accelkit.get(...)`` joins the process group (gloo on the CPU, nccl on CUDA), builds the
  ColossalAI plugin from the options and accelkit's settings, and a ``Booster`` around it.
  ColossalAI's own ``launch`` is not called: it would re-seed every process.
* ``accel.setup(model, opt)`` -> ``booster.boost(model, opt)``; the optimizer handed back is the
  torch optimizer inside ColossalAI's wrapper (LR schedulers work on it). Schedulers are never
  given to the Booster: accelkit steps them once per applied step.
* ``accel.backward(loss)`` -> ``booster.backward(loss, optimizer)`` after accelkit divided the
  loss by ``accumulation_steps`` (ColossalAI does not). ZeRO reduces gradients here.
* ``accel.step()`` every micro-batch; at the window's close ``optimizer.step()`` (ColossalAI
  unscales, clips to ``max_norm`` = ``max_grad_norm`` and steps) and ``zero_grad()``.
* ``accel.accumulate(model)`` skips gradient sync through ``booster.no_sync`` where the plugin
  supports it (TorchDDP, LowLevelZero stage 1, Hybrid without ZeRO-2); elsewhere gradients are
  reduced every micro-batch and accelkit logs that once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, ClassVar

import torch

from accelkit.sdk import (
    NATIVE_DTYPES,
    PRECISIONS,
    Backend,
    BoundaryCastPrecision,
    Capabilities,
    ConfigError,
    DistributedBackend,
    Precision,
    Settings,
    SetupResult,
    StepResult,
    UnsupportedError,
    apply_activation_checkpointing,
    check_device_supports,
    native_precision,
)
from accelkit_colossalai import options as opts

log = logging.getLogger("accelkit")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ColossalAIBackend(DistributedBackend):
    """What the four ColossalAI backends share. Subclasses build their plugin."""

    capabilities = Capabilities(
        # one model per Booster: its parts cannot each be set up with an optimizer
        several_optimizers=False,
        controls_precision=True,
        controls_device=True,
        distributed=True,
        compile=False,
    )
    options_class: ClassVar[type] = opts.CommonOptions
    #: the device types the plugin runs on (Gemini needs CUDA)
    devices: ClassVar[tuple[str, ...]] = ("cuda", "cpu")

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def resolve_settings(cls, name: str, options: Any, settings: Settings) -> Settings:
        settings = super().resolve_settings(name, options, settings)
        cls.check_settings(name, options, settings)
        return settings

    @classmethod
    def check_settings(cls, name: str, options: Any, settings: Settings) -> None:
        """Refuse combinations the plugin cannot run, before anything is built."""

    def __init__(self, name: str, options: Any, settings: Settings) -> None:
        super().__init__(name, options, settings)
        self.plugin: Any = None
        self.booster: Any = None
        self.model: Any = None
        #: ColossalAI's optimizer wrapper (LowLevelZeroOptimizer, GeminiOptimizer, ...)
        self.optimizer: Any = None
        self._warned_sync = False

    # ---- launch -------------------------------------------------------------------------------
    def launch(self) -> None:
        want = getattr(self.options, "device", "auto")
        cuda = torch.cuda.is_available()
        if want == "cpu" and cuda:
            raise ConfigError(
                f"{self.name}: device='cpu' while CUDA is available: ColossalAI picks its CUDA "
                "accelerator whenever CUDA is present, so the CPU cannot be forced here"
            )
        self._device = self.pick_device()
        if self._device.type not in self.devices:
            raise ConfigError(f"{self.name} needs a CUDA GPU: {self.cpu_refusal()}")
        check_device_supports(self.settings.precision or "32-true", self._device)
        self.check_device(self._device)
        self.join_process_group()
        if self._device.type == "cpu":
            from accelkit_colossalai import cpu_shim

            cpu_shim.apply()
        from colossalai.booster import Booster

        self.precision = self.make_precision()
        self.plugin = self.build_plugin()
        self.booster = Booster(plugin=self.plugin)

    def cpu_refusal(self) -> str:
        return "it does not run on the CPU"

    def check_device(self, device: torch.device) -> None:
        """Refuse what the plugin cannot do on ``device``."""

    def make_precision(self) -> Precision:
        # the plugin runs precision; for "-mixed" it keeps fp32 and accelkit autocasts
        return BoundaryCastPrecision(self.settings.precision or "32-true", self._device.type)

    def build_plugin(self) -> Any:
        raise NotImplementedError

    def plugin_precision(self) -> str:
        return opts.PLUGIN_PRECISION[self.settings.precision or "32-true"][0]

    def clip_norm_for_plugin(self, *, norm_needs_clipping: bool) -> float:
        """The plugin's ``max_norm``: accelkit's ``max_grad_norm``; infinity where the plugin
        computes the gradient norm only while clipping and ``track_grad_norm`` wants it."""
        if self.settings.max_grad_norm is not None:
            return float(self.settings.max_grad_norm)
        if norm_needs_clipping and self.settings.track_grad_norm:
            return math.inf
        return 0.0

    # ---- setup --------------------------------------------------------------------------------
    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        if self.capabilities.init_context == "lazy" and empty_init is not False:
            from colossalai.lazy import LazyInitContext

            return LazyInitContext(default_device=self._device)
        return super().init_module(empty_init)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer | None) -> Any:
        return optimizer

    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        activation_checkpointing: Any = None,
        compile: bool | dict[str, Any] = False,
    ) -> SetupResult:
        if self.model is not None:
            raise UnsupportedError(
                f"{self.name}: one model per Booster; build another accelerator with "
                "accelkit.get() for a second model"
            )
        if compile:
            raise UnsupportedError(f"{self.name}: setup(compile=...) is not supported")
        if len(optimizers) > 1:
            raise UnsupportedError(
                f"{self.name}: the Booster wraps one optimizer per model, got {len(optimizers)}"
            )
        if optimizers:
            owned = {id(p) for p in model.parameters()}
            if any(id(p) not in owned for g in optimizers[0].param_groups for p in g["params"]):
                raise ConfigError(
                    f"{self.name}: the optimizer holds parameters that are not this model's; "
                    "build it on model.parameters() of the model passed to setup()"
                )
            if optimizers[0].state:
                raise ConfigError(
                    f"{self.name}: the optimizer already has state; ColossalAI re-creates the "
                    "parameters it steps, so set up a fresh optimizer and load state with "
                    "accel.load()"
                )
        if activation_checkpointing:
            apply_activation_checkpointing(model, activation_checkpointing)
        optimizer = self.prepare_optimizer(optimizers[0] if optimizers else None)
        boosted, wrapper, *_ = self.booster.boost(model, optimizer)
        self.model, self.optimizer = boosted, wrapper
        return SetupResult(boosted, [] if wrapper is None else [self.torch_optimizer(wrapper)])

    @staticmethod
    def torch_optimizer(wrapper: Any) -> torch.optim.Optimizer:
        """The torch optimizer inside ColossalAI's wrapper (its param_groups are the live ones)."""
        inner = wrapper
        while not isinstance(inner, torch.optim.Optimizer):
            inner = inner.optim
        return inner

    # ---- the loop -----------------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.precision.forward_context()

    def before_backward(self, model: Any, *, closes_window: bool) -> None:
        if (
            not self._warned_sync
            and not closes_window
            and not self.capabilities.no_sync
            and self.world_size > 1
        ):
            self._warned_sync = True
            log.warning(
                "%s: gradients are reduced at every micro-batch of an accumulation window "
                "(the ColossalAI plugin has no no_sync in this configuration); the numbers are "
                "the same, accumulate() only cannot save the communication",
                self.name,
            )

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None, **kwargs: Any) -> None:
        if self.optimizer is None:
            raise UnsupportedError(f"{self.name}: call accel.setup(model, optimizer) first")
        loss = self.precision.scale_loss(loss)
        if kwargs:
            self.optimizer.backward(loss, **kwargs)
        else:
            self.booster.backward(loss, self.optimizer)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        if not self.capabilities.no_sync or self.model is None:
            return contextlib.nullcontext()
        return self.booster.no_sync(self.model, self.optimizer)

    def optimizer_step(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None,
        track_grad_norm: bool,
    ) -> StepResult:
        wrapper = self.optimizer
        mixin = fp16_mixin(wrapper)
        scale = mixin.loss_scale if mixin is not None else None
        wrapper.step()
        found_inf = None
        skipped = False
        if mixin is not None:
            found_inf = mixin.found_overflow.detach().to(torch.float32).reshape(-1)[0].cpu()
            skipped = bool(found_inf > 0)
        norm = None
        if max_grad_norm is not None or track_grad_norm:
            if skipped:
                norm = torch.tensor(math.inf)
            else:
                raw = wrapper.get_grad_norm()
                if raw is None:
                    raise UnsupportedError(
                        f"{self.name}: the ColossalAI optimizer reported no gradient norm"
                    )
                value = float(raw) / scale if scale is not None else float(raw)
                norm = torch.tensor(value, dtype=torch.float32)
        return StepResult(norm, found_inf)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=True)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from colossalai.interface import ModelWrapper

        inner = model
        while isinstance(inner, ModelWrapper):
            inner = inner.unwrap(unwrap_peft=False)
        from torch.nn.parallel import DistributedDataParallel

        while isinstance(inner, DistributedDataParallel):
            inner = inner.module
        return inner

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        mixin = fp16_mixin(self.optimizer)
        if mixin is None:
            return {}
        scaler = mixin.grad_scaler
        return {
            "colossalai_loss_scaler": {
                "scale": float(scaler.scale.item()),
                "growth_step": int(scaler._growth_step),
                "hysteresis_step": int(scaler._hysteresis_step),
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("colossalai_loss_scaler")
        mixin = fp16_mixin(self.optimizer)
        if not saved or mixin is None:
            return
        scaler = mixin.grad_scaler
        scaler._scale.fill_(saved["scale"])
        scaler._growth_step = saved["growth_step"]
        scaler._hysteresis_step = saved["hysteresis_step"]

    def local_fragments(self, state: dict[str, Any]) -> Any:
        from accelkit_colossalai import checkpoint

        return checkpoint.local_fragments(self, state)

    def load_fragments(self, reader: Any, state: dict[str, Any]) -> None:
        from accelkit_colossalai import checkpoint

        checkpoint.load_fragments(self, reader, state)

    def check_load(self, reader: Any, state: dict[str, Any]) -> None:
        """The dense check, then the boosted optimizer's saved state keys against its live ones
        (another optimizer's checkpoint is refused)."""
        from accelkit_colossalai import checkpoint

        super().check_load(reader, state)
        checkpoint.check_optimizer_states(self, reader, state)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.unwrap(model).state_dict().items()}

    def teardown(self) -> None:
        self.model = self.optimizer = None


def fp16_mixin(wrapper: Any) -> Any:
    """ColossalAI's fp16 loss-scaling mixin of an optimizer wrapper, or None."""
    if wrapper is None:
        return None
    from colossalai.amp.naive_amp.mixed_precision_mixin import FP16MixedPrecisionMixin

    for attr in ("mixed_precision_mixin", "mix_precision_mixin", "mixed_precision"):
        mixin = getattr(wrapper, attr, None)
        if isinstance(mixin, FP16MixedPrecisionMixin):
            return mixin
    return None


# ---- TorchDDPPlugin ---------------------------------------------------------------------------
class ColossalDDPBackend(ColossalAIBackend):
    """``colossalai_ddp``: TorchDDPPlugin. The plugin leaves precision to its user, so accelkit
    runs it as on ``ddp`` (autocast, GradScaler, or weights cast for ``-true``)."""

    capabilities = Capabilities(
        # one model per Booster: its parts cannot each be set up with an optimizer
        several_optimizers=False,
        controls_precision=False,
        controls_device=True,
        no_sync=True,
        manual_clip=True,
        distributed=True,
        compile=False,
        precisions=PRECISIONS,
    )
    options_class = opts.DDPOptions
    dtype_table = NATIVE_DTYPES

    def make_precision(self) -> Precision:
        return native_precision(self.settings.precision or "32-true", self._device.type)

    def build_plugin(self) -> Any:
        from colossalai.booster.plugin import TorchDDPPlugin

        o = self.options
        return TorchDDPPlugin(
            broadcast_buffers=o.broadcast_buffers,
            bucket_cap_mb=o.bucket_cap_mb,
            find_unused_parameters=o.find_unused_parameters,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            static_graph=o.static_graph,
            **o.plugin_kwargs,
        )

    def setup(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], **kwargs: Any):
        model = self.precision.convert_module(model.to(self._device))
        return super().setup(model, optimizers, **kwargs)

    def optimizer_step(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None,
        track_grad_norm: bool,
    ) -> StepResult:
        # the plugin's wrapper only forwards step(); accelkit's precision policy does the rest
        return Backend.optimizer_step(
            self, model, optimizer, max_grad_norm=max_grad_norm, track_grad_norm=track_grad_norm
        )

    def state_dict(self) -> dict[str, Any]:
        return Backend.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        Backend.load_state_dict(self, state)


# ---- LowLevelZeroPlugin -----------------------------------------------------------------------
class ColossalZeroBackend(ColossalAIBackend):
    """``colossalai_zero``: LowLevelZeroPlugin, ZeRO stage 1 (optimizer state sharded) or 2
    (gradients too), each parameter split evenly (padded) across ranks."""

    capabilities = Capabilities(
        # one model per Booster: its parts cannot each be set up with an optimizer
        several_optimizers=False,
        controls_precision=True,
        controls_device=True,
        no_sync=False,
        manual_clip=False,
        sharded=True,
        distributed=True,
        offload=True,
        compile=False,
        precisions=tuple(opts.ZERO_DTYPES),
    )
    options_class = opts.ZeroOptions
    dtype_table = opts.ZERO_DTYPES

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        # LowLevelZeroPlugin.support_no_sync(): stage 1 only
        return dataclasses.replace(cls.capabilities, no_sync=options.stage == 1)

    def check_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            return
        if self.settings.precision == "16-true":
            raise ConfigError(
                f"{self.name}: precision='16-true' needs CUDA (ColossalAI's fp16 loss scaler "
                "queries the CUDA device count); on the CPU use '32-true', 'bf16-mixed' or "
                "'bf16-true'"
            )
        if self.options.overlap_communication:
            raise ConfigError(
                f"{self.name}: overlap_communication=True needs CUDA streams; leave it unset "
                "(off on the CPU)"
            )

    def build_plugin(self) -> Any:
        from colossalai.booster.plugin import LowLevelZeroPlugin

        o = self.options
        overlap = o.overlap_communication
        if overlap is None:
            overlap = self._device.type == "cuda"
        return LowLevelZeroPlugin(
            stage=o.stage,
            precision=self.plugin_precision(),
            max_norm=self.clip_norm_for_plugin(norm_needs_clipping=False),
            reduce_bucket_size_in_m=o.reduce_bucket_size_in_m,
            communication_dtype=_DTYPES.get(o.communication_dtype or ""),
            overlap_communication=overlap,
            cpu_offload=o.cpu_offload,
            master_weights=o.master_weights,
            **o.loss_scale_kwargs(),
            **o.plugin_kwargs,
        )


# ---- GeminiPlugin -----------------------------------------------------------------------------
class ColossalGeminiBackend(ColossalAIBackend):
    """``colossalai_gemini``: GeminiPlugin, parameters, gradients and optimizer state in chunks
    sharded across ranks and placed on GPU or CPU by the placement policy."""

    capabilities = Capabilities(
        # one model per Booster: its parts cannot each be set up with an optimizer
        several_optimizers=False,
        controls_precision=True,
        controls_device=True,
        no_sync=False,
        manual_clip=False,
        sharded=True,
        distributed=True,
        offload=True,
        compile=False,
        precisions=tuple(opts.GEMINI_DTYPES),
        init_context="lazy",
        activation_checkpointing=True,
    )
    options_class = opts.GeminiOptions
    dtype_table = opts.GEMINI_DTYPES
    devices = ("cuda",)

    @classmethod
    def resolve_settings(cls, name: str, options: Any, settings: Settings) -> Settings:
        if settings.precision is None:
            raise ConfigError(
                f"{name}: Gemini has no fp32 mode (its chunks hold half-precision weights with "
                "an fp32 master); pass precision='bf16-true' or precision='16-true'"
            )
        return super().resolve_settings(name, options, settings)

    def cpu_refusal(self) -> str:
        return (
            "Gemini's optimizers (HybridAdam, CPUAdam, FusedAdam) are CUDA kernels and its "
            "chunks use CUDA streams; use colossalai_zero or colossalai_ddp on the CPU"
        )

    def build_plugin(self) -> Any:
        from colossalai.booster.plugin import GeminiPlugin

        o = self.options
        return GeminiPlugin(
            placement_policy=o.placement_policy,
            shard_param_frac=o.shard_param_frac,
            offload_optim_frac=o.offload_optim_frac,
            offload_param_frac=o.offload_param_frac,
            warmup_non_model_data_ratio=o.warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=o.steady_cuda_cap_ratio,
            pin_memory=o.pin_memory,
            master_weights=o.master_weights,
            search_range_m=o.search_range_m,
            hidden_dim=o.hidden_dim,
            min_chunk_size_m=o.min_chunk_size_m,
            tp_size=o.tp_size,
            extra_dp_size=o.extra_dp_size,
            enable_async_reduce=o.enable_async_reduce,
            precision=self.plugin_precision(),
            max_norm=self.clip_norm_for_plugin(norm_needs_clipping=True),
            enable_gradient_accumulation=self.settings.accumulation_steps > 1,
            **o.loss_scale_kwargs(),
            **o.plugin_kwargs,
        )

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer | None) -> Any:
        if optimizer is None:
            return None
        from colossalai.nn.optimizer import CPUAdam, FusedAdam, HybridAdam

        if isinstance(optimizer, (HybridAdam, CPUAdam, FusedAdam)):
            return optimizer
        kind = type(optimizer)
        if kind not in (torch.optim.Adam, torch.optim.AdamW) or not self.options.replace_torch_adam:
            raise ConfigError(
                f"{self.name}: Gemini steps only ColossalAI's HybridAdam, CPUAdam or FusedAdam; "
                f"got {kind.__name__}. Build colossalai.nn.optimizer.HybridAdam(model.parameters(), "
                "...), or pass a torch Adam/AdamW with replace_torch_adam=True"
            )
        return replace_with_hybrid_adam(optimizer, adamw=kind is torch.optim.AdamW)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Gemini keeps the weights in chunks: gather them on every rank (a collective; in the
        chunks' bf16/fp16)."""
        if self.model is None:
            return super().full_state_dict(model)
        return dict(self.model.state_dict(only_rank_0=False))


def replace_with_hybrid_adam(optimizer: torch.optim.Optimizer, *, adamw: bool) -> Any:
    """A HybridAdam with the param groups and hyperparameters of a torch Adam/AdamW."""
    from colossalai.nn.optimizer import HybridAdam

    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ConfigError(f"HybridAdam has no {flag}; got {flag}=True in a param group")
    groups = []
    for group in optimizer.param_groups:
        groups.append(
            {
                "params": list(group["params"]),
                "lr": float(group["lr"]),
                "betas": tuple(group["betas"]),
                "eps": group["eps"],
                "weight_decay": group["weight_decay"],
            }
        )
    log.info(
        "colossalai_gemini: %s replaced by colossalai.nn.optimizer.HybridAdam (adamw_mode=%s)",
        type(optimizer).__name__,
        adamw,
    )
    return HybridAdam(groups, adamw_mode=adamw)


# ---- HybridParallelPlugin ---------------------------------------------------------------------
#: accelkit's schedule names -> HybridParallelPlugin's ``pp_style`` (zbv needs scheduler nodes
#: built per model: not mapped)
PIPELINE_STYLES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved"}


class ColossalHybridBackend(ColossalAIBackend):
    """``colossalai_hybrid``: HybridParallelPlugin, tensor parallelism through Shardformer (a
    model Shardformer has a policy for: most Hugging Face transformers) plus data parallelism,
    plain or ZeRO 1/2. ``setup_dataloader`` shards data by the data-parallel rank."""

    capabilities = Capabilities(
        # one model per Booster: its parts cannot each be set up with an optimizer
        several_optimizers=False,
        controls_precision=True,
        controls_device=True,
        no_sync=True,
        manual_clip=False,
        sharded=True,
        distributed=True,
        offload=True,
        compile=False,
        precisions=tuple(opts.HYBRID_DTYPES),
        init_context="lazy",
        pipeline_schedules=tuple(PIPELINE_STYLES),
    )
    options_class = opts.HybridOptions
    dtype_table = opts.HYBRID_DTYPES

    @classmethod
    def pipeline_refusal(cls, options: Any) -> str | None:
        if options.zero_stage == 2:
            return (
                "ColossalAI's HybridParallelPlugin refuses ZeRO-2 with pipeline parallelism "
                "('zero stage must be 0 or 1 when using pipeline parallelism'): use zero_stage=0 "
                "or 1 with pp"
            )
        return None

    @classmethod
    def check_settings(cls, name: str, options: Any, settings: Settings) -> None:
        pipeline = settings.pipeline
        if pipeline is not None and pipeline.split != "auto":
            raise ConfigError(
                f"{name} with pp: ColossalAI splits the model by its Shardformer policy "
                f"(decoder layers spread over the stages); split={pipeline.split!r} cannot be "
                "given, leave it 'auto'"
            )
        if options.zero_stage > 0 and settings.precision in ("32-true", "bf16-mixed"):
            raise ConfigError(
                f"{name}: zero_stage={options.zero_stage} needs precision 'bf16-true' or "
                f"'16-true' (ColossalAI's hybrid ZeRO has no fp32 mode); got "
                f"{settings.precision!r}"
            )

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        zero = options.zero_stage
        return dataclasses.replace(
            cls.capabilities,
            pipeline_schedules=() if zero == 2 else tuple(PIPELINE_STYLES),
            no_sync=zero != 2,
            sharded=zero > 0 or options.tp_size > 1,
            # ZeRO over tensor-parallel pieces is refused by the portable checkpoint; a fused
            # or padded parameter is refused at save, named (checkpoint.py)
            portable_checkpoint=options.tp_size == 1 or zero == 0,
        )

    def check_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            return
        if self.settings.precision == "16-true":
            raise ConfigError(
                f"{self.name}: precision='16-true' needs CUDA (ColossalAI's fp16 loss scaler "
                "queries the CUDA device count)"
            )
        if self.options.overlap_communication:
            raise ConfigError(f"{self.name}: overlap_communication=True needs CUDA streams")

    def build_plugin(self) -> Any:
        from colossalai.booster.plugin import HybridParallelPlugin

        o = self.options
        overlap = o.overlap_communication
        if overlap is None:
            overlap = self._device.type == "cuda"
        kwargs: dict[str, Any] = dict(
            tp_size=o.tp_size,
            **self._pipeline_kwargs(),
            zero_stage=o.zero_stage,
            enable_all_optimization=o.enable_all_optimization,
            enable_fused_normalization=o.enable_fused_normalization,
            enable_flash_attention=o.enable_flash_attention,
            enable_sequence_parallelism=o.enable_sequence_parallelism,
            cpu_offload=o.cpu_offload,
            overlap_communication=overlap,
            zero_bucket_size_in_m=o.zero_bucket_size_in_m,
            communication_dtype=_DTYPES.get(o.communication_dtype or ""),
            broadcast_buffers=o.broadcast_buffers,
            ddp_bucket_cap_mb=o.ddp_bucket_cap_mb,
            find_unused_parameters=o.find_unused_parameters,
            precision=self.plugin_precision(),
            max_norm=self.clip_norm_for_plugin(norm_needs_clipping=o.zero_stage == 0),
            **o.loss_scale_kwargs(),
        )
        if o.sp_size is not None:
            kwargs["sp_size"] = o.sp_size
        if o.sequence_parallelism_mode is not None:
            kwargs["sequence_parallelism_mode"] = o.sequence_parallelism_mode
        kwargs.update(o.plugin_kwargs)
        return HybridParallelPlugin(**kwargs)

    def _pipeline_kwargs(self) -> dict[str, Any]:
        """HybridParallelPlugin's pipeline arguments from ``settings.pipeline``."""
        pipeline = self.settings.pipeline
        if pipeline is None:
            return {"pp_size": 1}
        return dict(
            pp_size=pipeline.pp,
            num_microbatches=pipeline.microbatches,
            pp_style=PIPELINE_STYLES[pipeline.schedule],
            num_model_chunks=pipeline.stages_per_rank,
            # the interleaved schedule's overlapped p2p hangs on gloo (measured: killed at 300 s)
            overlap_p2p=self._device.type == "cuda",
        )

    # ---- the pipeline -------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, optimizers: list[Any], **kwargs: Any) -> SetupResult:
        result = super().setup(model, optimizers, **kwargs)
        if self.settings.pipeline is not None:
            self._in_pipeline = False
            result.model.register_forward_pre_hook(self._refuse_call_outside_pipeline)
        return result

    def _refuse_call_outside_pipeline(self, module: Any, args: Any) -> None:
        if not self._in_pipeline:
            raise UnsupportedError(
                f"pipeline parallel ({self.name}): no rank holds the whole model, so model(...) "
                "cannot run; call loss = accel.forward_backward(model, input_ids=..., labels=...) "
                "then accel.step()"
            )

    def pipeline_forward_backward(
        self,
        model: torch.nn.Module,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        target: Any,
        loss_fn: Any,
        closes_window: bool,
    ) -> torch.Tensor:
        """``booster.execute_pipeline`` over the batch (``kwargs``, the model's keyword
        inputs), which ColossalAI cuts into ``microbatches``. ColossalAI divides each
        micro-batch loss by the micro-batches; accelkit's criterion divides it by
        ``accumulation_steps`` too. The mean loss, found on the last stage only, is broadcast
        over the pipeline."""
        import torch.distributed as dist

        from accelkit.sdk import split_microbatches

        if inputs:
            raise UnsupportedError(
                f"{self.name} with pp: pass the model's inputs by keyword "
                "(forward_backward(model, input_ids=ids, labels=ids)): ColossalAI's pipeline "
                "hands each stage the batch's keywords"
            )
        if self.model is None or self.optimizer is None:
            raise UnsupportedError(f"{self.name}: call accel.setup(model, optimizer) first")
        pipeline = self.settings.pipeline
        split_microbatches(kwargs, pipeline.microbatches)  # an uneven batch: the named error
        targets = (
            split_microbatches(target, pipeline.microbatches, "target")
            if target is not None
            else None
        )
        steps = self.settings.accumulation_steps
        seen = [0]

        def criterion(outputs: Any, micro_batch: Any) -> torch.Tensor:
            if loss_fn is None:
                loss = outputs if isinstance(outputs, torch.Tensor) else outputs.loss
            else:  # the last stage's micro-batches arrive in order
                loss = loss_fn(outputs, targets[seen[0]] if targets is not None else None)
            seen[0] += 1
            return loss / steps if steps > 1 else loss

        self._in_pipeline = True
        try:
            with self.precision.forward_context():
                out = self.booster.execute_pipeline(
                    iter([dict(kwargs)]), self.model, criterion, self.optimizer, return_loss=True
                )
        finally:
            self._in_pipeline = False
        manager = self.plugin.stage_manager
        group = manager.p2p_group
        loss = out.get("loss")
        value = torch.zeros((), dtype=torch.float32, device=self._device)
        if loss is not None:
            value = loss.detach().to(torch.float32).reshape(()) * steps
        last = dist.get_global_rank(group, manager.num_stages - 1)
        dist.broadcast(value, src=last, group=group)
        return value

    def replica_holders(self) -> tuple[int, int]:
        """Under ``pp`` only the ranks of this rank's stage (its data- and tensor-parallel
        peers) hold its whole tensors: this rank's index among them, and their count."""
        if self.settings.pipeline is None or self.plugin is None:
            return self.rank, self.world_size
        mesh = self.plugin.pg_mesh
        axis = self.plugin.pp_axis
        mine = mesh.unravel(self.rank, mesh.shape)[axis]
        stage = [r for r in range(self.world_size) if mesh.unravel(r, mesh.shape)[axis] == mine]
        return stage.index(self.rank), len(stage)

    @property
    def data_parallel_rank(self) -> int:
        import torch.distributed as dist

        if self.plugin is None:
            return self.rank
        return dist.get_group_rank(self.plugin.dp_group, dist.get_rank())

    @property
    def data_parallel_world_size(self) -> int:
        if self.plugin is None:
            return self.world_size
        return self.plugin.dp_group.size()

    def data_parallel_group(self) -> Any:
        """The plugin's data-parallel group: under ``tp_size``/``pp_size`` > 1 the ranks of one
        replica read the same samples, so ``gather_for_metrics`` gathers over this group."""
        return None if self.plugin is None else self.plugin.dp_group
