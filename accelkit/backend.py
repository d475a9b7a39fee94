"""The backend protocol: what a plugin implements, and the defaults torch-native backends share.

The :class:`~accelkit.accelerator.Accelerator` calls only the methods of :class:`Backend` and
branches only on :class:`Capabilities`, never on a backend's name. This is the bottom layer
(docs/architecture.md, "Layers"): it imports nothing of the checkpoint package; the default of
the checkpoint hooks is installed from there (:class:`CheckpointDefaults`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch
import torch.distributed as dist

from accelkit import distributed
from accelkit.config import build_options
from accelkit.errors import ConfigError, UnsupportedError
from accelkit.pipeline import PipelineSettings
from accelkit.precision import (
    NATIVE_DTYPES,
    PRECISIONS,
    DtypeRow,
    Precision,
    configurable_precisions,
    normalize_precision,
)


@dataclass(frozen=True)
class Capabilities:
    """What a backend controls and supports, in the spirit of ColossalAI's plugin flags."""

    #: the backend runs precision itself; ``Accelerator.autocast()`` is then a no-op
    controls_precision: bool = False
    #: the backend places the model on its device itself (no ``.to(device)`` by accelkit)
    controls_device: bool = False
    #: the backend divides the loss by the accumulation steps itself (DeepSpeed's backward)
    scales_loss_for_accumulation: bool = False
    #: ``no_sync`` skips gradient sync inside an accumulation window
    no_sync: bool = False
    #: skipping sync is on by default (False where it costs memory, e.g. FSDP2)
    no_sync_by_default: bool = True
    #: ``Accelerator.clip_grad_norm`` works (false where gradients are partitioned)
    manual_clip: bool = True
    #: parameters or optimizer state are partitioned across ranks
    sharded: bool = False
    #: several processes; collectives are real
    distributed: bool = False
    #: parameters or optimizer state can live in CPU memory
    offload: bool = False
    #: precision strings the backend accepts
    precisions: tuple[str, ...] = PRECISIONS
    #: what ``init_module()`` does: "device", "meta", "zero.Init", "lazy"
    init_context: str = "device"
    #: ``setup(..., activation_checkpointing=...)`` is supported
    activation_checkpointing: bool = True
    #: ``setup(..., compile=True)`` is supported
    compile: bool = True
    #: accelkit's portable checkpoint reads and writes this backend's state
    portable_checkpoint: bool = True
    #: pipeline schedules it runs with ``pp > 1`` (names of :data:`accelkit.pipeline.SCHEDULES`);
    #: empty: no pipeline parallelism, and ``accelkit.get`` refuses ``pp > 1``
    pipeline_schedules: tuple[str, ...] = ()
    #: the parts of one model (a GAN's generator and discriminator) can each be set up on one
    #: Accelerator with their own optimizer and trained by losses that cross parts, as
    #: frameworks with several optimizers per model do (MMEngine's ``OptimWrapperDict``)
    several_optimizers: bool = True


def check_precision_supported(name: str, precision: str, capabilities: Capabilities) -> None:
    """Refuse a precision the backend does not list in ``capabilities.precisions``."""
    supported = capabilities.precisions
    if precision not in supported:
        raise ConfigError(
            f"backend {name!r} does not support precision {precision!r}; "
            f"supported: {', '.join(supported)}"
        )


@dataclass(frozen=True)
class Settings:
    """The training semantics shared by every backend.

    See docs/architecture.md, "Semantics that hold on every backend".
    """

    precision: str | None = None
    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    seed: int | None = None
    track_grad_norm: bool = False
    #: clamp every gradient element to [-v, v] inside ``step()`` (before ``max_grad_norm``)
    max_grad_value: float | None = None
    #: ``pp > 1``: the pipeline to run (None: no pipeline parallelism); see docs/pipeline.md
    pipeline: PipelineSettings | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigError(
                f"accumulation_steps must be an int >= 1, got {self.accumulation_steps!r}"
            )
        if self.max_grad_norm is not None and (
            isinstance(self.max_grad_norm, bool)
            or not isinstance(self.max_grad_norm, (int, float))
            or not self.max_grad_norm > 0
        ):
            raise ConfigError(
                f"max_grad_norm must be a positive number or None, got {self.max_grad_norm!r}"
            )
        if self.max_grad_value is not None and (
            isinstance(self.max_grad_value, bool)
            or not isinstance(self.max_grad_value, (int, float))
            or not self.max_grad_value > 0
        ):
            raise ConfigError(
                f"max_grad_value must be a positive number or None, got {self.max_grad_value!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ConfigError(f"seed must be an int or None, got {self.seed!r}")


@dataclass
class StepResult:
    """What one applied (or skipped) optimizer step reports back."""

    grad_norm: torch.Tensor | None = None
    #: 0-d tensor > 0 when the step was skipped (fp16 overflow); None when it cannot be skipped
    found_inf: torch.Tensor | None = None


@dataclass
class NoOptions:
    """Backends without options."""


@dataclass
class SetupResult:
    """What :meth:`Backend.setup` returns: the model to train and the torch optimizers."""

    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)


@dataclass
class OwnedState:
    """An optimizer whose per-parameter state lives whole on the one rank that owns each
    parameter (ZeRO-1: torch's ``ZeroRedundancyOptimizer``, FairScale's ``OSS``), as
    :meth:`Backend.owned_optimizer_state` describes it. With it, the default checkpoint hooks
    save each parameter's state (tensors and other values) from its owner, read it back into
    whichever rank owns the parameter now (any world size, any backend), and check a load
    against the live state of every rank."""

    #: the param groups over the module's parameters, the same on every rank: their
    #: hyperparameters are saved and loaded, and their parameters name the state
    groups: list[dict[str, Any]]
    #: the live per-parameter state this rank holds (the local optimizer's ``state``)
    state: dict[Any, dict[str, Any]]
    #: whether this rank owns a parameter of ``groups`` (and so holds its state)
    owns: Callable[[Any], bool]
    #: the optimizer that steps the state: the checkpoint records its class and family, and its
    #: param groups (one per group of ``groups``) get the loaded hyperparameters too
    optimizer: Any


class CheckpointDefaults(Protocol):
    """What :class:`Backend`'s three checkpoint hooks run unless a backend overrides them.

    The portable format lives above this protocol (it imports :class:`Backend`, never the
    reverse), so its dense default, :mod:`accelkit.checkpoint.shards.dense`, is installed here by
    the checkpoint package when it loads; every save and load goes through that package."""

    def local_fragments(self, backend: Backend, state: dict[str, Any]) -> Iterator[Any]: ...

    def load_fragments(self, backend: Backend, reader: Any, state: dict[str, Any]) -> None: ...

    def check_load(self, backend: Backend, reader: Any, state: dict[str, Any]) -> None: ...


_checkpoint_defaults: CheckpointDefaults | None = None


def set_checkpoint_defaults(defaults: CheckpointDefaults) -> None:
    """Install the default of the checkpoint hooks (:mod:`accelkit.checkpoint` does, once)."""
    global _checkpoint_defaults
    _checkpoint_defaults = defaults


def checkpoint_defaults() -> CheckpointDefaults:
    """The installed default of the checkpoint hooks."""
    if _checkpoint_defaults is None:
        raise UnsupportedError(
            "the portable checkpoint is not loaded: import accelkit.checkpoint before calling a "
            "backend's checkpoint hooks"
        )
    return _checkpoint_defaults


class Backend:
    """Base class of every backend. Subclasses override what differs.

    The defaults implement a single-process backend whose precision runs through a
    :class:`~accelkit.precision.Precision` policy, so torch-native backends stay short.
    """

    #: what this backend controls and supports. On the class: the answer for default options;
    #: on an instance: :meth:`capabilities_for` its options (set by ``__init__``)
    capabilities: Capabilities = Capabilities()
    options_class: ClassVar[type] = NoOptions
    #: precision string -> param/compute/master/reduce dtypes, published in docs
    dtype_table: ClassVar[dict[str, DtypeRow]] = NATIVE_DTYPES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that inherits ``capabilities`` inherits only the precisions its own
        ``options_class`` can configure: ``DDPBackend`` offers ``fp8-mixed`` with the ``fp8_*``
        options of its ``TorchDDPOptions``, and a subclass on ``DDPOptions`` (no ``fp8_*``)
        does not. A subclass that declares ``capabilities`` itself keeps what it declares (the
        conformance suite checks it)."""
        super().__init_subclass__(**kwargs)
        if "capabilities" in cls.__dict__:
            return
        inherited = cls.capabilities.precisions
        usable = configurable_precisions(inherited, cls.options_class)
        if usable != inherited:
            cls.capabilities = dataclasses.replace(cls.capabilities, precisions=usable)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def parse_config(cls, name: str, config: Any, overrides: dict[str, Any]) -> Any:
        """Validate the user's config; backends with a native config format override this."""
        return build_options(cls.options_class, f"backend {name!r}", config, overrides)

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        """Hook: the capabilities of this backend built with ``options``.

        Runs in ``__init__`` (the running backend's ``capabilities``) and in
        :func:`accelkit.describe` (which reports the same record without building anything), so
        the two cannot disagree. Gets the parsed options (``parse_config``'s result); returns a
        :class:`Capabilities`. Must not import the backend library. The default is the class
        attribute ``capabilities``; a backend whose capabilities depend on its options (a ZeRO
        stage, a tensor-parallel size) overrides this with ``dataclasses.replace``."""
        return cls.capabilities

    @classmethod
    def pipeline_refusal(cls, options: Any) -> str | None:
        """Hook: why these options rule out pipeline parallelism (``accelkit.get`` shows it when
        :meth:`capabilities_for` lists no ``pipeline_schedules`` and ``pp > 1``), or None for
        the generic refusal. Gets the parsed options."""
        return None

    @classmethod
    def select_backend(cls) -> str | None:
        """Hook: the name of another backend to build instead of this one, or None.

        Runs in :func:`accelkit.get` right after the class is loaded, before any option is
        parsed. Gets nothing; a name makes ``get`` start over with that backend and the same
        arguments (what ``auto`` does: ``ddp`` when launched on several processes, else the best
        single device). The default, None, builds this backend."""
        return None

    @classmethod
    def parse_precision(cls, name: str, precision: str | int | None) -> str | None:
        """The canonical string for the user's ``precision=`` (None stays None). A backend
        overrides this to explain a value its own library took (Apex's ``"O1"``) before the
        generic unknown-precision error, which lists ``capabilities.precisions``."""
        return normalize_precision(precision, cls.capabilities.precisions)

    @classmethod
    def resolve_settings(cls, name: str, options: Any, settings: Settings) -> Settings:
        """Final settings: precision from the explicit string, else the native config's, else
        32-true. Backends with a native config also reconcile accumulation and clipping here
        (a disagreement is an error). ``accelkit.get`` then checks the precision against
        ``capabilities.precisions``, once, for every backend."""
        return dataclasses.replace(settings, precision=settings.precision or "32-true")

    def __init__(self, name: str, options: Any, settings: Settings) -> None:
        self.name = name
        self.options = options
        self.settings = settings
        self.capabilities = type(self).capabilities_for(options)
        self.precision: Precision = Precision()
        self._device = torch.device("cpu")

    def launch(self) -> None:
        """Pick the device and, for distributed backends, join the process group."""

    def teardown(self) -> None:
        """Release what ``launch`` acquired (the process group is left to its owner)."""

    def release(self) -> None:
        """Hook: drop every reference to what :meth:`setup` built (engines, wrappers), so that
        ``Accelerator.free_memory()`` can free an attempt's memory. Gets and returns nothing;
        the backend must accept a new ``setup`` afterwards. The default holds nothing."""

    # ---- placement ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return dist.get_rank() if distributed.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if distributed.is_initialized() else 1

    @property
    def local_rank(self) -> int:
        return distributed.local_rank()

    @property
    def data_parallel_rank(self) -> int:
        """Rank among data-parallel replicas (differs from ``rank`` under tensor parallelism)."""
        return self.rank

    @property
    def data_parallel_world_size(self) -> int:
        return self.world_size

    def replica_holders(self) -> tuple[int, int]:
        """Hook: ``(index, count)`` of this rank among the ranks that hold the same whole
        (not sharded) tensors of the model and optimizer, so a checkpoint's writes of replicated
        tensors are spread over the ranks that have them. Runs in ``accel.save()``. The default,
        ``(rank, world_size)``: every rank holds every replicated tensor; under pipeline
        parallelism only the ranks of one stage do."""
        return self.rank, self.world_size

    def data_parallel_group(self) -> Any:
        """Hook: the process group of this rank's data-parallel peers, or None for every process.

        Collectives over samples (``gather_for_metrics``) run on it: under tensor or pipeline
        parallelism the ranks of one replica read the same samples, so gathering over every
        process would return each sample several times. Gets nothing; returns a
        ``torch.distributed`` group whose ranks are the replicas that ``data_parallel_rank``
        numbers. The default, None, is the world group (every process is a replica).
        """
        return None

    # ---- the training protocol -----------------------------------------------------------------
    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Context in which the user builds the model."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.device)
        stack.enter_context(self.precision.init_context())
        return stack

    def setup(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], **kwargs: Any
    ) -> SetupResult:
        """Wrap the model and optimizers; return what the loop trains with."""
        raise NotImplementedError

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.precision.forward_context()

    def convert_input(self, data: Any) -> Any:
        return self.precision.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.precision.convert_output(data)

    def before_backward(self, model: torch.nn.Module | None, *, closes_window: bool) -> None:
        """Hook: learn, before each backward, whether it closes the accumulation window.

        Runs in ``Accelerator.backward()`` before :meth:`backward`, on every micro-batch. Gets the
        set-up model the loss came from (None when several are set up and none was named) and
        ``closes_window``: True when the next ``step()`` applies the optimizer step. Returns
        nothing. For an engine with its own accumulation boundary (DeepSpeed) or a wrapper that
        must decide on gradient sync before backward (FairScale FSDP); the default does nothing.
        """

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None, **kwargs: Any) -> None:
        self.precision.scale_loss(loss).backward(**kwargs)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

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
        """Hook: one ``accel.forward_backward`` call under pipeline parallelism
        (``settings.pipeline`` is set; only backends listing ``capabilities.pipeline_schedules``
        get here).

        Gets the model :meth:`setup` returned, the batch's positional ``inputs`` and keyword
        ``kwargs`` (the first stage's), ``target`` (the last stage's; may be None), ``loss_fn``
        (``loss_fn(output, target)`` per micro-batch; None: the last stage's output is the loss)
        and ``closes_window`` (the next ``step()`` applies the optimizer). Must split the batch
        into ``settings.pipeline.microbatches``, run forward and backward over every stage with
        each micro-batch loss divided exactly once by ``microbatches * accumulation_steps``,
        scale it for fp16, and return the mean of the undivided micro-batch losses as a 0-d
        tensor on every rank. The default refuses."""
        raise UnsupportedError(
            f"backend {self.name!r} has no pipeline parallelism (capabilities.pipeline_schedules "
            "is empty)"
        )

    def grad_norm(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
    ) -> torch.Tensor:
        """Total gradient norm of the optimizer's parameters, clipping to ``max_norm`` if given."""
        params = [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        if not params:
            return torch.zeros((), device=self.device)
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params])
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def clip_grad_norm(
        self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """Clip by hand; only where ``capabilities.manual_clip``."""
        if not self.capabilities.manual_clip:
            raise UnsupportedError(
                f"backend {self.name!r} partitions gradients, so they cannot be clipped by hand. "
                "Pass max_grad_norm=... to accelkit.get() instead."
            )
        self.precision.unscale(optimizer)
        return self.grad_norm(model, optimizer, max_norm)

    def clip_grad_value(self, optimizer: torch.optim.Optimizer, value: float) -> None:
        """Clamp the gradients of ``optimizer`` to ``[-value, value]`` (unscaled first); only
        where ``capabilities.manual_clip`` (whole gradients are here before the step). Element
        by element, so a sharded gradient clamps the same as a whole one."""
        self.precision.unscale(optimizer)
        groups: dict[Any, list[torch.Tensor]] = {}  # one foreach per DTensor mesh
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for params in groups.values():
            torch.nn.utils.clip_grad_value_(params, value)

    def optimizer_step(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None,
        track_grad_norm: bool,
    ) -> StepResult:
        """Unscale, clip, step, update the loss scale. ``zero_grad`` is separate."""
        norm = None
        if max_grad_norm is not None or track_grad_norm:
            self.precision.unscale(optimizer)
            norm = self.grad_norm(model, optimizer, max_grad_norm)
        found_inf = self.precision.found_inf(optimizer)
        self.precision.step(optimizer)
        self.precision.update()
        if found_inf is not None and norm is not None:
            norm = torch.where(found_inf > 0, torch.full_like(norm, math.inf), norm)
        return StepResult(norm, found_inf)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def end_step(self) -> None:
        """Hook: finish one ``Accelerator.step()`` that closed at least one window.

        Runs once per such ``step()``, after every optimizer whose window closed has stepped
        (never when no window closed). Gets nothing; returns nothing. The default applies the
        loss-scale update once for all of them (torch's ``scaler.step(a); scaler.step(b);
        scaler.update()``)."""
        self.precision.flush_update()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's own module inside whatever wrapper the backend added."""
        inner = model
        for attr in ("module", "_orig_mod"):
            while hasattr(inner, attr) and isinstance(getattr(inner, attr), torch.nn.Module):
                inner = getattr(inner, attr)
        return inner

    def on_dataloader(self, loader: Any) -> None:
        """Hook: see each loader ``Accelerator.setup_dataloader()`` returns.

        Runs once per ``setup_dataloader()`` call, after the loader was sharded and wrapped. Gets
        the :class:`~accelkit.data.AcceleratedDataLoader`; returns nothing (DeepSpeed reads its
        micro-batch size from it). The default does nothing."""

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The backend's own small state (loss scaler), saved with every checkpoint."""
        return {"precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state.get("precision", {}))

    #: what a load at another world size than the save's does with the per-rank states of
    #: :meth:`rank_state_dict`: ``"refuse"`` fails the load before anything is written (the
    #: error says to resume at the saved world size), ``"drop"`` skips
    #: :meth:`load_rank_state_dict` with a warning, ``"merge"`` gives it every saved rank's state
    rank_state_on_resize: ClassVar[Literal["refuse", "drop", "merge"]] = "refuse"

    def rank_state_dict(self) -> dict[str, Any]:
        """Hook: this rank's own state, which differs from rank to rank (PowerSGD's error
        feedback, a per-rank counter).

        Runs on every rank in ``accel.save()``; returns what :meth:`state_dict` may return
        (numbers, strings, lists, dicts, tensors), written to this rank's own file.
        :meth:`state_dict` is saved from rank 0 only and read back on every rank, so per-rank
        values belong here. The default, ``{}``, saves nothing."""
        return {}

    def load_rank_state_dict(
        self, states: Mapping[int, dict[str, Any]], saved_world_size: int
    ) -> None:
        """Hook: restore what :meth:`rank_state_dict` saved.

        Runs on every rank in ``accel.load()``, after :meth:`load_state_dict`, whenever the
        checkpoint holds per-rank state; it may run before :meth:`setup` (keep the state until
        the objects it fills exist). At the saved world size ``states`` is ``{self.rank: what
        this rank saved}`` (empty if it saved nothing). At another world size
        :attr:`rank_state_on_resize` decides: with ``"merge"``, ``states`` maps every saved rank
        to its state, each read when first looked up. The default does nothing."""

    def local_fragments(self, state: dict[str, Any]) -> Iterator[Any]:
        """Yield this rank's pieces of model, master and optimizer state (portable checkpoint).

        The default, for whole tensors (or DTensors) and torch optimizers, is
        :func:`accelkit.checkpoint.shards.dense.local_fragments`."""
        return checkpoint_defaults().local_fragments(self, state)

    def load_fragments(self, reader: Any, state: dict[str, Any]) -> None:
        """Fill this rank's pieces of the objects in ``state`` from any checkpoint.

        Runs after :meth:`check_load` passed on every rank and every fragment's checksum was
        verified, so only an I/O error should fail here. The default is
        :func:`accelkit.checkpoint.shards.dense.load_fragments`."""
        checkpoint_defaults().load_fragments(self, reader, state)

    def owned_optimizer_state(self, optimizer: Any) -> OwnedState | None:
        """Hook: where the state of ``optimizer`` lives, when each parameter's state is whole on
        the one rank that owns it (ZeRO-1); None where the optimizer holds its own state.

        Runs in the default :meth:`local_fragments`, :meth:`load_fragments` and
        :meth:`check_load`, once per optimizer of the state, on every rank. Gets the optimizer
        :meth:`setup` returned (accelkit's proxy taken off); returns an :class:`OwnedState`.
        The default, None, keeps the dense behaviour: the optimizer's own ``state`` and groups,
        the same on every rank (docs/plugins.md, "Optimizer state owned by one rank")."""
        return None

    def check_load(self, reader: Any, state: dict[str, Any]) -> None:
        """Hook: raise :class:`~accelkit.errors.CheckpointError` if :meth:`load_fragments`
        would not fit the models and optimizers of ``state``, writing nothing.

        The load's validate phase: keys (the ``strict`` rule), full shapes, each optimizer's
        param groups, hyperparameter types and state keys. The default
        (:func:`accelkit.checkpoint.shards.dense.check_load`) checks the tensors
        :func:`~accelkit.checkpoint.format.fqn.module_tensors` lists with their ``shape`` (a
        DTensor's is global) and the torch optimizers. A backend whose live tensors hide their
        full shape passes its own to :func:`~accelkit.checkpoint.shards.validate.check_dense_load`."""
        checkpoint_defaults().check_load(self, reader, state)

    def save_native(self, path: Any, state: dict[str, Any], **kwargs: Any) -> Any:
        """``accel.save(..., format="native")``: the backend library's own checkpoint format."""
        raise UnsupportedError(
            f"{self.name}: no native checkpoint format; use the portable one (the default)"
        )

    def load_native(self, path: Any, state: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """``accel.load(..., format="native")``: read what :meth:`save_native` wrote."""
        raise UnsupportedError(
            f"{self.name}: no native checkpoint format; use the portable one (the default)"
        )

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model state dict on every rank (a documented gather, for export)."""
        return {k: v.detach() for k, v in self.unwrap(model).state_dict().items()}
