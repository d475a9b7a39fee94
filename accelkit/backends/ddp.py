"""torch DistributedDataParallel: gloo on the CPU, nccl on CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from accelkit.backend import Capabilities, SetupResult
from accelkit.backends.distributed import DistributedBackend, DistributedOptions
from accelkit.backends.pipelining import PipelinedModule, PipelineParallel
from accelkit.backends.single import SingleDeviceBackend
from accelkit.errors import ConfigError
from accelkit.float8 import Float8Options
from accelkit.precision import NATIVE_PRECISIONS


@dataclass
class DDPWrapOptions(DistributedOptions):
    """What ``DistributedDataParallel`` is built with: the options a backend built on
    :class:`DDPBackend` keeps when it offers none of the built-in communication hooks."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True


@dataclass
class CommHookOptions:
    """The built-in gradient communication hooks of :meth:`DDPBackend.on_wrapped`."""

    #: gradient communication hook: None, "fp16" / "bf16" (compress to that dtype for the
    #: all-reduce) or "powersgd" (low-rank compression with error feedback; its state is saved)
    comm_hook: Literal["fp16", "bf16", "powersgd"] | None = None
    #: PowerSGD: the rank of the approximation, and the steps of plain all-reduce before it
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2

    def check_comm_hook_options(self) -> None:
        """Validate the fields above (a dataclass composing this one calls it in
        ``__post_init__``)."""
        if self.comm_hook not in (None, "fp16", "bf16", "powersgd"):
            raise ValueError(
                f"option 'comm_hook' must be None, 'fp16', 'bf16' or 'powersgd', got {self.comm_hook!r}"
            )
        if self.powersgd_rank < 1 or self.powersgd_start_iter < 0:
            raise ValueError("powersgd_rank must be >= 1 and powersgd_start_iter >= 0")


@dataclass
class DDPOptions(DDPWrapOptions, CommHookOptions):
    """Options of ``ddp`` without fp8: :class:`DDPWrapOptions` and :class:`CommHookOptions`.
    A backend built on :class:`DDPBackend` extends this one, or :class:`DDPWrapOptions` to
    offer none of the built-in hooks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_comm_hook_options()


@dataclass
class TorchDDPOptions(DDPOptions, Float8Options):
    """Options of the torch-native ``ddp``: :class:`DDPOptions` and the ``fp8_*`` options of
    ``precision="fp8-mixed"``. Kept out of :class:`DDPOptions`, which plugin backends built on
    :class:`DDPBackend` extend without offering fp8-mixed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_fp8_options()


class DDPBackend(PipelineParallel, DistributedBackend, SingleDeviceBackend):
    """One model replica per process; gradients all-reduced in buckets during backward. With
    ``pp > 1``, one replica per pipeline stage: the ranks form a ``(pp, dp)`` mesh and each
    stage is replicated over its ``dp`` ranks (:mod:`accelkit.backends.pipelining`)."""

    capabilities = Capabilities(
        no_sync=True,
        distributed=True,
        precisions=NATIVE_PRECISIONS,
        pipeline_schedules=PipelineParallel.PIPELINE_SCHEDULES,
    )
    options_class = TorchDDPOptions
    #: the ``(pp, dp)`` mesh under pipeline parallelism (None without)
    mesh: Any = None

    def launch(self) -> None:
        super().launch()
        if getattr(self.options, "comm_hook", None) == "bf16" and self._device.type != "cuda":
            # gloo all-reduces bf16 fine; it is torch's hook that checks for CUDA and NCCL
            raise ConfigError(
                f"{self.name}: comm_hook='bf16' needs CUDA with NCCL (torch's bf16 compression "
                "hook refuses any other process group); on the CPU use comm_hook='fp16' or "
                "'powersgd'"
            )
        pipeline = self.settings.pipeline
        if pipeline is not None:
            from torch.distributed.device_mesh import init_device_mesh

            if getattr(self.options, "comm_hook", None) == "powersgd":
                raise ConfigError(
                    f"{self.name}: comm_hook='powersgd' is not supported with pp > 1 (its "
                    "error feedback is kept per model, and each stage is its own DDP model); "
                    "use 'bf16' or 'fp16', or none"
                )
            if self.world_size % pipeline.pp:
                raise ConfigError(
                    f"{self.name}: {self.world_size} ranks cannot be split into pp="
                    f"{pipeline.pp} pipeline stages; launch a multiple of {pipeline.pp} processes"
                )
            self.mesh = init_device_mesh(
                self._device.type,
                (pipeline.pp, self.world_size // pipeline.pp),
                mesh_dim_names=("pp", "dp"),
            )
        self._powersgd = None
        if getattr(self.options, "comm_hook", None) == "powersgd":  # before setup: a load may
            from accelkit.backends.powersgd import PowerSGDKeeper  # come first

            self._powersgd = PowerSGDKeeper(
                self.options.powersgd_rank, self.options.powersgd_start_iter
            )

    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        compile: bool | dict[str, Any] = False,
        activation_checkpointing: Any = None,
    ) -> SetupResult:
        if self.settings.pipeline is not None:
            return self.setup_pipeline(
                model,
                optimizers,
                compile=compile,
                activation_checkpointing=activation_checkpointing,
            )
        model = self.prepare_module(model, activation_checkpointing)
        ddp = DistributedDataParallel(model, **self.ddp_kwargs())
        self.on_wrapped(ddp)
        if compile:
            ddp.compile(**(compile if isinstance(compile, dict) else {}))
        return SetupResult(ddp, optimizers)

    # ---- pipeline parallelism ---------------------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        return self.rank if self.mesh is None else self.mesh["dp"].get_local_rank()

    @property
    def data_parallel_world_size(self) -> int:
        return self.world_size if self.mesh is None else self.mesh["dp"].size()

    def data_parallel_group(self) -> Any:
        return None if self.mesh is None else self.mesh["dp"].get_group()

    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Under pp: on meta (each rank then initialises only its stage, with the weights of a
        plain build); else on the device."""
        if self.settings.pipeline is None or empty_init is False:
            return super().init_module(empty_init)
        from accelkit.backends.fsdp import build_context

        return build_context(True, self.device, self.precision, [])

    def _materializer(self, model: torch.nn.Module) -> Any:
        from accelkit.backends.fsdp import _Materializer

        return _Materializer(model, self.device)

    def _wrap_stage(
        self, module: torch.nn.Module, activation_checkpointing: Any, compile: Any
    ) -> torch.nn.Module:
        """One pipeline stage: on the device, replicated over the stage's dp ranks."""
        module = self.prepare_module(module, activation_checkpointing)
        if self.mesh["dp"].size() == 1:
            return module
        if self.settings.pipeline.stages_per_rank > 1:
            # two DDP models of one rank running interleaved micro-batches break DDP's reducer
            # (torch 2.13: "rebuilt parameter indices size is not same"): the gradients are
            # averaged over the replicas once per window instead (optimizer_step)
            self._average_at_step = True
            return module
        ddp = DistributedDataParallel(
            module, process_group=self.mesh["dp"].get_group(), **self.ddp_kwargs()
        )
        self.on_wrapped(ddp)
        return ddp

    def grad_norm(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
    ) -> torch.Tensor:
        """Under pp: the norm over every stage's gradients."""
        if not isinstance(model, PipelinedModule):
            return super().grad_norm(model, optimizer, max_norm)
        return self.pipeline_grad_norm(
            model,
            optimizer,
            max_norm,
            lambda opt, _: super(DDPBackend, self).grad_norm(None, opt, None),
            torch.nn.utils.clip_grads_with_norm_,
        )

    #: interleaved stages without DDP: gradients averaged over the dp ranks at each step
    _average_at_step = False

    def optimizer_step(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        """Under pp, a weight tied across stages gets its gradients summed first (and, for
        interleaved stages, every gradient averaged over the replicas)."""
        if self._average_at_step:
            group, size = self.mesh["dp"].get_group(), self.mesh["dp"].size()
            for g in optimizer.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad, group=group)
                        p.grad.div_(size)
        self.sum_tied_grads(model)
        return super().optimizer_step(model, optimizer, **kwargs)

    def ddp_kwargs(self) -> dict[str, Any]:
        """Hook: the keyword arguments of ``DistributedDataParallel``, from the
        :class:`DDPWrapOptions`. Runs in ``setup``; a subclass adds its own to ``super()``'s."""
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
        return kwargs

    def on_wrapped(self, ddp: DistributedDataParallel) -> None:
        """Hook: runs in ``setup`` once ``DistributedDataParallel`` has wrapped the model, before
        ``compile``; gets the DDP module, returns nothing. The place to register a gradient
        communication hook (``ddp.register_comm_hook``). The default registers the built-in
        hook of the ``comm_hook`` option, where the options have one; a subclass that registers
        its own does not call it (DDP takes one hook)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = getattr(self.options, "comm_hook", None)
        if hook == "powersgd":
            self._powersgd.attach(ddp)
        elif hook is not None:
            compress = (
                default_hooks.fp16_compress_hook
                if hook == "fp16"
                else default_hooks.bf16_compress_hook
            )
            ddp.register_comm_hook(None, compress)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return (
            model.no_sync()
            if isinstance(model, DistributedDataParallel)
            else contextlib.nullcontext()
        )

    # ---- state: PowerSGD's factors and step count on rank 0, each rank's error feedback ----
    _powersgd: Any = None
    #: at another world size PowerSGD's error feedback starts at zero, as in a new run
    rank_state_on_resize = "drop"

    def state_dict(self) -> dict[str, Any]:
        """Adds PowerSGD's step count and low-rank factors by parameter (the same on every
        rank), so a resumed run keeps compressing where it stopped."""
        state = super().state_dict()
        if self._powersgd is not None:
            state["powersgd"] = self._powersgd.shared_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self._powersgd is not None and "powersgd" in state:
            self._powersgd.load_shared(state["powersgd"])

    def rank_state_dict(self) -> dict[str, Any]:
        """PowerSGD's error feedback, this rank's own, by parameter."""
        if self._powersgd is None:
            return {}
        return {"powersgd": self._powersgd.rank_state()}

    def load_rank_state_dict(
        self, states: Mapping[int, dict[str, Any]], saved_world_size: int
    ) -> None:
        mine = states.get(self.rank, {})
        if self._powersgd is not None and "powersgd" in mine:
            self._powersgd.load_rank_state(mine["powersgd"])
