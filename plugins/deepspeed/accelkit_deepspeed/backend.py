"""The DeepSpeed backend: ZeRO 0-3 with offload, behind accelkit's protocol.

How accelkit's loop maps onto the engine:

* ``accel.backward(loss)`` -> ``engine.backward(loss)``, which divides by
  ``gradient_accumulation_steps`` itself (``capabilities.scales_loss_for_accumulation``).
  Just before it, the Accelerator tells the backend whether this micro-batch closes the
  accumulation window (:meth:`DeepSpeedBackend.before_backward`), and the backend sets the
  engine's boundary to match (``engine.set_gradient_accumulation_boundary``). DeepSpeed needs to
  know it *before* backward: ZeRO-0/1 all-reduce and ZeRO offload copy gradients at the
  boundary's backward. So DeepSpeed's boundary is accelkit's window, the short last window of a
  loader included, and DeepSpeed's own micro-step counter plays no part.
* ``accel.step()`` -> at the window's close only, ``engine.step()``: reduce, clip, step, zero.
* ``grad_norm`` is DeepSpeed's (``engine.get_global_grad_norm()``), computed here where DeepSpeed
  records none (ZeRO-0 without its bf16/fp16 optimizer), and divided by the GradScaler's scale
  under 16-mixed, where DeepSpeed reports the scaled norm.

Pipeline parallelism (``pp > 1``): ``setup`` builds DeepSpeed's ``PipelineEngine`` over the
stage of an ``nn.Sequential`` and ``accel.forward_backward`` runs ``train_batch``
(:mod:`accelkit_deepspeed.pipeline` says how the loop maps and what is refused).

Several models: each ``setup()`` builds its own engine (DeepSpeed trains one model and one
optimizer per engine, as DeepSpeed-Chat's actor/critic do). The backend finds the engine of each
call from what the Accelerator passes: the model of ``backward(loss, model=...)``, the model and
optimizer of ``step(opt)``. With one trained model ``model=`` may be left out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import warnings
from typing import Any

import torch

from accelkit.sdk import (
    BoundaryCastPrecision,
    Capabilities,
    ConfigError,
    DistributedBackend,
    Settings,
    SetupResult,
    StepResult,
    UnsupportedError,
    apply_activation_checkpointing,
)
from accelkit_deepspeed import config as dsconfig
from accelkit_deepspeed import pipeline as dspipe
from accelkit_deepspeed import zero_init

#: the FutureWarnings torch gives for the collectives DeepSpeed calls (see _import_deepspeed)
DEPRECATED_COLLECTIVES = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
)

log = logging.getLogger("accelkit")


@dataclasses.dataclass
class _EngineRecord:
    """One engine of this backend: what ``setup`` built for one model."""

    engine: Any
    #: set up with an optimizer (a frozen model set up alone is evaluation-only)
    trains: bool
    #: DeepSpeed's managed_gradient_accumulation (False: step() is the boundary itself)
    managed: bool
    #: a PipelineEngine (``pp > 1``): train_batch steps the optimizer itself
    pipeline: bool = False
    #: the pipeline's loss slot and the last micro-batch shapes (PipelineEngine caches them)
    loss_slot: Any = None
    shapes: Any = None
    #: the gradient norm measured inside the last train_batch (ZeRO-0, where DeepSpeed has none)
    norm: torch.Tensor | None = None


class DeepSpeedBackend(DistributedBackend):
    """``deepspeed``, ``deepspeed_stage_1/2/3`` and ``deepspeed_stage_3_offload``."""

    capabilities = Capabilities(
        # one engine per set-up model, each with one optimizer: offered to loops that set up
        # each model themselves (tests/test_multi_model.py), not for a framework's several
        # optimizers over one model's parts (MMEngine's OptimWrapperDict; untested there)
        several_optimizers=False,
        controls_precision=True,
        controls_device=True,
        scales_loss_for_accumulation=True,
        no_sync=False,
        manual_clip=False,
        sharded=True,
        distributed=True,
        offload=True,
        init_context="device",
        compile=False,
        portable_checkpoint=True,
        pipeline_schedules=dspipe.SCHEDULES,
    )
    options_class = dsconfig.DeepSpeedOptions
    dtype_table = dsconfig.DTYPES

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def parse_config(cls, name: str, config: Any, overrides: dict[str, Any]) -> Any:
        return dsconfig.parse(name, config, overrides)

    @classmethod
    def resolve_settings(cls, name: str, options: Any, settings: Settings) -> Settings:
        precision, steps, max_norm = dsconfig.reconcile(
            name, options, settings.precision, settings.accumulation_steps, settings.max_grad_norm
        )
        if settings.pipeline is not None:
            if steps > 1:
                raise ConfigError(
                    f"{name} with pp: DeepSpeed's train_batch steps the optimizer after every "
                    f"batch, so accumulation_steps={steps} cannot hold a window open; raise "
                    f"pipeline['microbatches'] to {settings.pipeline.microbatches * steps} "
                    "instead (the same gradient, one forward_backward per step)"
                )
            if precision in ("bf16-mixed", "16-mixed"):
                raise ConfigError(
                    f"{name} with pp: precision={precision!r} (torch autocast) is not run under "
                    "DeepSpeed's PipelineEngine by accelkit; use '32-true' or 'bf16-true'"
                )
        return dataclasses.replace(
            settings, precision=precision, accumulation_steps=steps, max_grad_norm=max_norm
        )

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        stage = dsconfig.zero_stage(options)
        return dataclasses.replace(
            cls.capabilities,
            sharded=stage >= 1,
            init_context="zero.Init" if stage == 3 else "device",
            pipeline_schedules=dspipe.SCHEDULES if stage in dspipe.ZERO_STAGES else (),
        )

    @classmethod
    def pipeline_refusal(cls, options: Any) -> str | None:
        if dsconfig.zero_stage(options) not in dspipe.ZERO_STAGES:
            return dspipe.ZERO_REFUSAL
        return None

    def __init__(self, name: str, options: Any, settings: Settings) -> None:
        super().__init__(name, options, settings)
        self.stage = dsconfig.zero_stage(options)
        offload_optimizer, offload_param = dsconfig.offload_devices(options)
        self.offloads = (offload_optimizer, offload_param)
        # DeepSpeed's engine runs precision itself (autocast included); accelkit casts at the
        # model's boundary only
        self.precision = BoundaryCastPrecision(settings.precision or "32-true")
        self._records: list[_EngineRecord] = []  # one per setup(), in setup order
        self._micro_batch: int | None = None
        self._deepspeed: Any = None

    # ---- engines ------------------------------------------------------------------------------
    @property
    def engines(self) -> list[Any]:
        """Every engine, one per ``setup()``, in setup order."""
        return [r.engine for r in self._records]

    @property
    def engine(self) -> Any:
        """The first engine set up (the only one with one model), or None before setup."""
        return self._records[0].engine if self._records else None

    def _record_of(self, model: Any) -> _EngineRecord | None:
        """The record of the engine ``model`` is (or wraps), or None."""
        for record in self._records:
            if model is record.engine or model is record.engine.module:
                return record
        return None

    def engine_of(self, model: torch.nn.Module | None) -> Any:
        """The engine of ``model`` (the one ``setup`` returned, or the module inside it); with
        ``model=None``, the only engine that trains."""
        return self._record_for(model).engine

    def _record_for(self, model: torch.nn.Module | None) -> _EngineRecord:
        """:meth:`engine_of`'s record, or the error that says which model to pass."""
        if not self._records:
            raise UnsupportedError(
                f"{self.name}: call accel.setup(model, optimizer) before training"
            )
        if model is None:
            trained = [r for r in self._records if r.trains] or self._records
            if len(trained) == 1:
                return trained[0]
            raise ConfigError(
                f"{self.name}: {len(trained)} models are set up, each in its own DeepSpeed "
                "engine; say which one this loss trains: accel.backward(loss, model=...)"
            )
        record = self._record_of(model)
        if record is None:
            raise ConfigError(
                f"{self.name}: this {type(model).__name__} was not set up by this accelerator; "
                "pass the model accel.setup() returned"
            )
        return record

    def _engine_of_step(self, model: Any, optimizer: Any) -> Any:
        """The engine that owns ``optimizer`` (what ``setup`` returned for it)."""
        for record in self._records:
            if optimizer is record.engine.optimizer:
                return record.engine
        return self.engine_of(model)

    # ---- launch -------------------------------------------------------------------------------
    def launch(self) -> None:
        self._device = self.pick_device()
        if self._device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed = self._import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        from accelkit_deepspeed import native_check

        native_check.check(f"backend {self.name!r}", self.options.ds_config)

        accelerator = get_accelerator()
        if accelerator.device_name() != self._device.type:
            raise ConfigError(
                f"{self.name}: DeepSpeed picked its {accelerator.device_name()!r} accelerator but "
                f"accelkit runs on {self._device.type!r}. Set DS_ACCELERATOR={self._device.type} "
                "before deepspeed is first imported, or pass device='auto'."
            )
        self._check_precision_supported(accelerator)
        if self._device.type == "cpu" and not self.options.cpu_shm_comm:
            _skip_shm_comm_build()
        self.join_process_group()
        deepspeed.init_distributed(
            dist_backend=accelerator.communication_backend_name(),
            timeout=datetime.timedelta(seconds=self.options.timeout),
        )

    def _import_deepspeed(self) -> Any:
        if self._deepspeed is None:
            # torch >= 2.10 deprecates the two collectives DeepSpeed's ZeRO calls on every step
            # (deepspeed/comm/torch.py); the FutureWarning came back about once per step per rank
            # (1,003 lines in a 250-step ZeRO-3 demo). Only these two messages are silenced.
            warnings.filterwarnings(
                "ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning
            )
            import deepspeed
            from deepspeed.utils import logger as ds_logger

            ds_logger.setLevel(self.options.log_level)
            self._deepspeed = deepspeed
        return self._deepspeed

    def _check_precision_supported(self, accelerator: Any) -> None:
        precision = self.settings.precision
        if precision == "16-true" and not accelerator.is_fp16_supported():
            raise ConfigError(
                f"{self.name}: precision='16-true' uses DeepSpeed's fp16 section, which DeepSpeed's "
                f"{accelerator.device_name()!r} accelerator refuses here ('Type fp16 is not "
                "supported on your device'). Use '16-mixed' (torch autocast), a bf16 precision, "
                "or a GPU."
            )
        if precision == "bf16-true" and not accelerator.is_bf16_supported():
            raise ConfigError(
                f"{self.name}: precision='bf16-true' needs bf16 support, which DeepSpeed's "
                f"{accelerator.device_name()!r} accelerator lacks here. Use '32-true' or a "
                "16-bit precision the device supports."
            )

    # ---- data parallelism under a pipeline -----------------------------------------------------
    @property
    def data_parallel_world_size(self) -> int:
        """Under ``pp``, the replicas of a stage (DeepSpeed's grid: ``world / pp``)."""
        pipeline = self.settings.pipeline
        return self.world_size // pipeline.pp if pipeline is not None else self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """Under ``pp``, this rank's replica: DeepSpeed numbers ranks ``stage * dp + replica``."""
        if self.settings.pipeline is None:
            return self.rank
        return self.rank % self.data_parallel_world_size

    def replica_holders(self) -> tuple[int, int]:
        """Under ``pp`` a stage's tensors are held by its data-parallel replicas only."""
        return self.data_parallel_rank, self.data_parallel_world_size

    def data_parallel_group(self) -> Any:
        engine = self.engine
        if self.settings.pipeline is None or engine is None:
            return None
        return engine.grid.get_data_parallel_group()

    # ---- the DeepSpeed config -------------------------------------------------------------
    def ds_config(self, *, client_optimizer: bool = True) -> dict[str, Any]:
        """The DeepSpeed config this backend hands to ``deepspeed.initialize`` (and zero.Init).
        Under ``pp`` DeepSpeed's accumulation is the micro-batches of one ``train_batch``."""
        pipeline = self.settings.pipeline
        micro_batch = self._micro_batch or dsconfig.DEFAULT_MICRO_BATCH
        if pipeline is not None and self._micro_batch:
            micro_batch = max(1, self._micro_batch // pipeline.microbatches)
        return dsconfig.build_ds_config(
            self.options,
            precision=self.settings.precision or "32-true",
            accumulation_steps=(
                pipeline.microbatches if pipeline is not None else self.settings.accumulation_steps
            ),
            max_grad_norm=self.settings.max_grad_norm,
            micro_batch=micro_batch,
            client_optimizer=client_optimizer,
        )

    def on_dataloader(self, loader: Any) -> None:
        """DeepSpeed's ``train_micro_batch_size_per_gpu`` comes from a loader set up before setup."""
        batch = getattr(loader, "batch_size", None)
        if batch is None:
            return
        if self.engine is None:
            self._micro_batch = self._micro_batch or int(batch)
            return
        if batch != self.engine.train_micro_batch_size_per_gpu():
            log.info(
                "deepspeed: the loader's batch size %d differs from the engine's "
                "train_micro_batch_size_per_gpu=%d (set when setup() ran before "
                "setup_dataloader()); DeepSpeed uses it for logging and throughput only",
                batch,
                self.engine.train_micro_batch_size_per_gpu(),
            )

    # ---- model building -----------------------------------------------------------------------
    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """ZeRO-3: ``deepspeed.zero.Init`` with the final config (parameters are partitioned,
        and offloaded with offload_param, while they are built). Other stages: the device."""
        if self.stage != 3:
            return super().init_module(empty_init)
        deepspeed = self._import_deepspeed()
        return zero_init.guarded_zero_init(
            deepspeed, config_dict_or_path=self.ds_config(), enabled=empty_init is not False
        )

    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        activation_checkpointing: Any = None,
        compile: bool | dict[str, Any] = False,
    ) -> SetupResult:
        if self._record_of(model) is not None:
            raise ConfigError(
                f"{self.name}: this model is already set up (it has its engine); set up each "
                "model once"
            )
        if compile:
            raise UnsupportedError(f"{self.name}: setup(compile=...) is not supported yet")
        if self.settings.pipeline is not None:
            return self._setup_pipeline(model, optimizers, activation_checkpointing)
        if len(optimizers) > 1:
            raise UnsupportedError(
                f"{self.name}: DeepSpeed trains one optimizer per engine, got {len(optimizers)}"
            )
        if optimizers:
            owned = {id(p) for p in model.parameters()}
            if any(id(p) not in owned for g in optimizers[0].param_groups for p in g["params"]):
                raise ConfigError(
                    f"{self.name}: the optimizer holds parameters that are not this model's; "
                    "build it on model.parameters() of the model passed to setup()"
                )
        config = self.ds_config(client_optimizer=bool(optimizers))
        if optimizers and dsconfig._is_set(config.get("optimizer")):
            raise ConfigError(
                f"{self.name}: the DeepSpeed config names an optimizer and setup() got one too. "
                "Drop the config's 'optimizer' section, or call setup(model) alone to use it."
            )
        if (
            not optimizers
            and self.stage in (1, 2)
            and not dsconfig._is_set(config.get("optimizer"))
        ):
            # evaluation only (MMEngine's val/test): ZeRO-1/2 partition optimizer state and
            # gradients, of which there are none, and DeepSpeed refuses these stages without an
            # optimizer; the replicated model is the same at stage 0
            config = {**config, "zero_optimization": {**config["zero_optimization"], "stage": 0}}
        zero_init.release(model)
        if self._micro_batch is None and "train_micro_batch_size_per_gpu" not in (
            self.options.ds_config or {}
        ):
            log.info(
                "deepspeed: train_micro_batch_size_per_gpu=%d (set up the dataloader before the "
                "model to take its batch size; DeepSpeed uses it for logging only)",
                config.get("train_micro_batch_size_per_gpu", dsconfig.DEFAULT_MICRO_BATCH),
            )
        if activation_checkpointing:
            apply_activation_checkpointing(model, activation_checkpointing)
        deepspeed = self._import_deepspeed()
        _forget_other_autocast(config)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizers[0] if optimizers else None, config=config
        )
        # managed_gradient_accumulation=false (DeepSpeed >= 0.19): step() is the boundary itself
        managed = getattr(engine, "managed_gradient_accumulation", None)
        # ZeRO-3 without an optimizer returns its parameter coordinator as the "optimizer"
        trains = bool(optimizers) or dsconfig._is_set(config.get("optimizer"))
        self._records.append(
            _EngineRecord(
                engine, trains and optimizer is not None, managed is None or bool(managed())
            )
        )
        if len(self._records) > 1:
            log.debug("deepspeed: engine %d set up (one per model)", len(self._records))
        opts = [engine.optimizer] if trains and optimizer is not None else []
        return SetupResult(engine, opts)

    def _setup_pipeline(
        self, model: torch.nn.Module, optimizers: list[Any], activation_checkpointing: Any
    ) -> SetupResult:
        """``pp > 1``: this rank's stage as a PipelineEngine, the optimizer cut to its
        parameters (hyperparameters and groups kept)."""
        pipeline = self.settings.pipeline
        if activation_checkpointing:
            raise UnsupportedError(
                f"{self.name} with pp: activation_checkpointing is not mapped onto "
                "PipelineModule's activation_checkpoint_interval yet"
            )
        if len(optimizers) != 1:
            raise UnsupportedError(
                f"{self.name} with pp: setup(model, optimizer) with one optimizer (DeepSpeed's "
                f"train_batch steps it), got {len(optimizers)}"
            )
        if self._records:
            raise UnsupportedError(f"{self.name} with pp: one pipelined model per accelerator")
        self._import_deepspeed()
        optimizer = optimizers[0]
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for g in optimizer.param_groups for p in g["params"]):
            raise ConfigError(
                f"{self.name}: the optimizer holds parameters that are not this model's; "
                "build it on model.parameters() of the model passed to setup()"
            )
        module, _ = dspipe.build_module(model, pipeline.pp, pipeline.split)
        local = {id(p) for p in module.parameters()}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in local]
        for param in [p for p in optimizer.state if id(p) not in local]:
            del optimizer.state[param]
        config = self.ds_config(client_optimizer=True)
        _forget_other_autocast(config)
        engine, _ds_optimizer, _, _ = self._deepspeed.initialize(
            model=module, optimizer=optimizer, config=config
        )
        record = _EngineRecord(engine, True, False, pipeline=True, loss_slot=module.loss_fn)
        original_step = engine._take_model_step

        def take_model_step(lr_kwargs: Any) -> None:
            # the norm before clipping and stepping, where DeepSpeed records none (ZeRO-0)
            if self._wants_norm and not _records_norm(engine):
                record.norm = dspipe.stage_grad_norm(engine)
            original_step(lr_kwargs)

        engine._take_model_step = take_model_step
        engine.forward = dspipe.refuse_call  # model(x) names forward_backward
        self._records.append(record)
        return SetupResult(engine, [engine.optimizer])

    @property
    def _wants_norm(self) -> bool:
        return self.settings.max_grad_norm is not None or self.settings.track_grad_norm

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
        """One ``train_batch`` over the batch cut into ``microbatches``: forward, backward and
        DeepSpeed's optimizer step; returns this replica's mean micro-batch loss on every
        stage (DeepSpeed broadcasts it from the last)."""
        record = self._record_for(model)
        if not record.pipeline:
            raise UnsupportedError(f"{self.name}: this model was not set up as a pipeline")
        engine = record.engine
        batch = dspipe.micro_batches(
            tuple(self.convert_input(x) for x in inputs),
            kwargs,
            target,
            self.settings.pipeline.microbatches,
        )
        shapes = dspipe.shapes(batch)
        if record.shapes is not None and shapes != record.shapes:
            engine.reset_activation_shape()  # PipelineEngine caches its receive buffers
        record.shapes = shapes
        record.loss_slot.fn = loss_fn
        record.norm = None
        engine.train_batch(iter(batch))
        return engine.dp_group_loss.detach().to(torch.float32).reshape(())

    # ---- the loop -----------------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine's forward runs torch_autocast itself

    def before_backward(self, model: Any, *, closes_window: bool) -> None:
        """Tell the model's engine whether this backward closes its window (called by the
        Accelerator, with the window of that model's optimizer)."""
        if not self._records:
            return  # backward() says what is missing
        record = self._record_for(model)
        if record.managed:
            record.engine.set_gradient_accumulation_boundary(closes_window)

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None, **kwargs: Any) -> None:
        if not self._records:
            raise UnsupportedError(
                f"{self.name}: call accel.setup(model, optimizer) before backward"
            )
        self.engine_of(model).backward(loss, **kwargs)

    def _grad_scaler(self, engine: Any = None) -> Any:
        """torch's GradScaler DeepSpeed uses under 16-mixed (torch_autocast fp16), else None."""
        engine = engine if engine is not None else self.engine
        if engine is None:
            return None
        if self.stage == 0:
            return getattr(engine, "torch_autocast_z0_gradscaler", None)
        return getattr(engine.optimizer, "torch_autocast_gradscaler", None)

    def optimizer_step(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None,
        track_grad_norm: bool,
    ) -> StepResult:
        engine = self._engine_of_step(model, optimizer)
        want_norm = max_grad_norm is not None or track_grad_norm
        record = self._record_of(engine)
        if record is not None and record.pipeline:
            # train_batch has stepped, clipped and zeroed already: report only
            if not want_norm:
                return StepResult(None, None)
            norm = record.norm if record.norm is not None else engine.get_global_grad_norm()
            return StepResult(_as_tensor(norm), None)
        scaler = self._grad_scaler(engine)
        scale = getattr(scaler, "_scale", None) if scaler is not None else None
        scale_before = scale.detach().clone() if scale is not None else None
        own_norm = None
        if want_norm and self.stage == 0 and not _records_norm(engine):
            own_norm = self._local_grad_norm(engine, scale_before)
        engine.step()
        found_inf = None
        if self.settings.precision == "16-true":
            found_inf = torch.tensor(0.0 if engine.was_step_applied() else 1.0)
        elif scaler is not None and scale_before is not None:
            if self.stage >= 1:
                # ZeRO skips an overflowed step before torch's GradScaler sees it, so the scale
                # would never back off (DeepSpeed 0.19.8): back it off as GradScaler would.
                skipped = not engine.was_step_applied()
                if skipped:
                    scaler.update(new_scale=scale_before * scaler.get_backoff_factor())
                found_inf = torch.tensor(1.0 if skipped else 0.0)
            else:
                found_inf = (scaler._scale < scale_before).to(torch.float32)
        norm = None
        if want_norm:
            norm = own_norm if own_norm is not None else _as_tensor(engine.get_global_grad_norm())
            if norm is not None and self.stage >= 1 and scale_before is not None:
                norm = norm / scale_before.to(norm.device, norm.dtype)  # DeepSpeed's is scaled
            if norm is not None and found_inf is not None:
                inf = torch.full_like(norm, math.inf)
                norm = torch.where(found_inf.to(norm.device) > 0, inf, norm)
        return StepResult(norm, found_inf)

    def _local_grad_norm(self, engine: Any, scale: torch.Tensor | None) -> torch.Tensor:
        """ZeRO-0: gradients are whole and already averaged at the boundary; norm them here."""
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm(grads).to(torch.float32)
        return norm / scale.to(norm.device) if scale is not None else norm

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        records = [r for r in self._records if r.engine.optimizer is optimizer]
        if not records and len(self._records) == 1:
            records = self._records
        for record in records:
            if not record.pipeline:  # train_batch zeroes its own
                record.engine.zero_grad()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        inner = getattr(model, "module", model)
        return super().unwrap(inner)

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The engine's loss scale (16-true), GradScaler (16-mixed) and step counters."""
        from accelkit_deepspeed import checkpoint

        return checkpoint.engine_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from accelkit_deepspeed import checkpoint

        checkpoint.load_engine_state(self, state)

    def local_fragments(self, state: dict[str, Any]) -> Any:
        """This rank's ranges of the fp32 masters, weights and optimizer state (no gather)."""
        from accelkit_deepspeed import checkpoint

        return checkpoint.local_fragments(self, state)

    def load_fragments(self, reader: Any, state: dict[str, Any]) -> None:
        """Fill this rank's ranges from any portable checkpoint, then refresh the bf16/fp16
        weights from the fp32 masters."""
        from accelkit_deepspeed import checkpoint

        checkpoint.load_fragments(self, reader, state)

    def check_load(self, reader: Any, state: dict[str, Any]) -> None:
        """The dense check with each ZeRO-3 parameter's full shape (``ds_shape``): its own
        ``shape`` is the empty placeholder partitioning leaves; then each engine optimizer's
        saved state keys against its live ones (another optimizer's checkpoint is refused)."""
        from accelkit.sdk import check_dense_load
        from accelkit_deepspeed import checkpoint

        check_dense_load(
            self,
            reader,
            state,
            shape_of=lambda t: tuple(getattr(t, "ds_shape", None) or t.shape),
        )
        checkpoint.check_optimizer_states(self, reader, state)

    def save_native(self, path: Any, state: dict[str, Any], **kwargs: Any) -> Any:
        """``accel.save(path, state, format="native")``: DeepSpeed's own ``save_checkpoint``."""
        from accelkit_deepspeed import native

        return native.save(self, path, state, **kwargs)

    def load_native(self, path: Any, state: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """``accel.load(path, state, format="native")``: DeepSpeed's own ``load_checkpoint``."""
        from accelkit_deepspeed import native

        return native.load(self, path, state, **kwargs)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model on every rank: ZeRO-3 gathers each parameter (a collective)."""
        module = self.unwrap(model)
        if self.stage != 3:
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
        deepspeed = self._import_deepspeed()
        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def teardown(self) -> None:
        self._records.clear()

    def release(self) -> None:
        """Destroy every engine built so far (its hooks, buffers and optimizer go with it)."""
        for record in self._records:
            destroy = getattr(record.engine, "destroy", None)
            if callable(destroy):
                destroy()
        self._records.clear()


# ---- helpers --------------------------------------------------------------------------------
def _as_tensor(value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32)


def _records_norm(engine: Any) -> bool:
    """Whether DeepSpeed computes the gradient norm in this configuration (ZeRO-0: only its
    bf16/fp16 optimizers do)."""
    return hasattr(engine.optimizer, "_global_grad_norm")


def _skip_shm_comm_build() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory all-reduce op (~100 s of g++ on the
    first run) on the CPU: only its inference all-reduce uses it, and without it DeepSpeed
    falls back to torch.distributed."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict) and "deepspeed_shm_comm" in compatible:
        compatible["deepspeed_shm_comm"] = False


def _forget_other_autocast(config: dict[str, Any]) -> None:
    """DeepSpeed keeps "torch_autocast is on" in module globals, so an engine built after an
    autocast engine in the same process would scale its fp32 gradients too (0.19.8). Reset them
    when this engine does not autocast."""
    if (config.get("torch_autocast") or {}).get("enabled"):
        return
    try:
        from deepspeed.runtime import torch_autocast
    except ImportError:
        return
    if getattr(torch_autocast, "TORCH_AUTOCAST_INITIALIZED", False):
        torch_autocast.TORCH_AUTOCAST_INITIALIZED = False
        torch_autocast.TORCH_AUTOCAST_DTYPE = None
