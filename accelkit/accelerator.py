"""The one facade users touch. It owns the training semantics of docs/architecture.md,
"Semantics that hold on every backend" (the micro-batch counter, loss scaling for accumulation,
when a window closes, scheduler stepping) and delegates everything backend-specific to a
:class:`~accelkit.backend.Backend`.

Over 800 lines: it is the one class users touch, each public call a short method that
delegates; the features with bodies of their own (checkpoints, tracking, preemption) already
live in their modules and are reached from here by a few lines each."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accelkit import distributed
from accelkit.backend import Backend, Capabilities, StepResult
from accelkit.data import AcceleratedDataLoader, rebuild_dataloader
from accelkit.errors import ConfigError, UnsupportedError
from accelkit.seed import seed_everything
from accelkit.wrappers import (
    AcceleratedOptimizer,
    check_setup_arguments,
    guard_scheduler_step,
    is_composite_part,
    learning_rates,
    mark_step_tracked,
    own_optimizer,
    patch_forward,
    release_scheduler,
    say_which_learning_rate_won,
)

if TYPE_CHECKING:
    from accelkit.preemption import StopSignal
    from accelkit.tracking import Trackers

log = logging.getLogger("accelkit")

_UNADOPTED_SCHEDULER = (
    "an LR scheduler was built on the optimizer that setup() returned, and accelkit no longer "
    "adopts such a scheduler implicitly: it is not stepped by accel.step(). Hand it over once "
    "after building it, `scheduler = accel.setup_scheduler(scheduler)` (or build it on the "
    "original optimizer and pass `accel.setup(model, optimizer, scheduler=scheduler)`); accelkit "
    "then steps it after every applied optimizer step and never on a skipped fp16 step. A loop "
    "that steps the scheduler itself may keep doing so."
)

_EVERY_RANK = (
    "save() and load() are collective on every backend: call them on every rank, not under "
    "`if accel.is_main:` (each rank writes or reads its own part)."
)


@dataclass
class _Window:
    """Accumulation state of one optimizer: micro-batches seen since the last applied step."""

    micro: int = 0


class Accelerator:
    """Run one training loop on any backend. Build it with :func:`accelkit.get`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        #: the backend overrides the before_backward hook: only then is the window's end worked
        #: out before each backward (a few microseconds the hot loop of others does not pay)
        self._backend_sees_backward = type(backend).before_backward is not Backend.before_backward
        self._optimizers: list[AcceleratedOptimizer] = []
        self._windows: dict[int, _Window] = {}
        self._schedulers: dict[int, list[tuple[Any, Any]]] = {}
        self._models: list[torch.nn.Module] = []
        #: the modules handed to setup(), as given (a wrapper's unwrap may not reach them)
        self._raw_models: list[torch.nn.Module] = []
        self._given_optimizers: list[torch.optim.Optimizer] = []
        self._loaders: list[AcceleratedDataLoader] = []
        #: loaders being iterated, the one that yielded the latest batch last (an evaluation
        #: loop inside a training batch nests)
        self._active_loaders: list[AcceleratedDataLoader] = []
        self._last: StepResult = StepResult()
        self._applied_steps = 0
        #: what :meth:`log` writes to; built by :meth:`init_trackers`, closed by :meth:`end_training`
        self._trackers: Trackers | None = None
        #: :meth:`log` before :meth:`init_trackers` warns once
        self._warned_no_trackers = False
        #: the stop-signal watcher behind :attr:`should_stop`, made at its first use
        self._stop_signal: StopSignal | None = None

    # ---- what we run on -----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def local_rank(self) -> int:
        return self.backend.local_rank

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @property
    def precision(self) -> str:
        return self.backend.settings.precision or "32-true"

    @property
    def accumulation_steps(self) -> int:
        return self.backend.settings.accumulation_steps

    @property
    def max_grad_norm(self) -> float | None:
        return self.backend.settings.max_grad_norm

    @property
    def applied_steps(self) -> int:
        """Optimizer steps applied (windows closed, skipped ones included) since setup, continued
        from the checkpoint's count by :meth:`load`."""
        return self._applied_steps

    def __repr__(self) -> str:
        return (
            f"Accelerator(backend={self.name!r}, device={self.device}, precision={self.precision!r}, "
            f"world_size={self.world_size}, accumulation_steps={self.accumulation_steps})"
        )

    # ---- setup --------------------------------------------------------------------------------
    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Context to build the model in: on the device, on meta, or partitioned (ZeRO-3)."""
        if self.capabilities.init_context == "zero.Init":  # partitions collectively
            distributed.refuse_unsynced(f"{self.name}: init_module()")
        return self.backend.init_module(empty_init)

    def setup(
        self,
        model: torch.nn.Module,
        *optimizers: torch.optim.Optimizer,
        scheduler: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Wrap ``model`` and its optimizers for the backend.

        Returns the model alone, or ``(model, opt, ...)``. The returned optimizers are
        ``torch.optim.Optimizer`` instances, so torch LR schedulers accept them. ``kwargs`` go
        to the backend (``compile=True``, ``activation_checkpointing=...``, ...).
        """
        distributed.refuse_unsynced("setup()")  # wrapping broadcasts or shards the weights
        check_setup_arguments(self._is_set_up(model), optimizers)
        result = self.backend.setup(model, list(optimizers), **kwargs)
        wrapped = patch_forward(result.model, self.backend)
        self._models.append(wrapped)
        self._raw_models.append(model)
        self._given_optimizers.extend(optimizers)
        outs = []
        for inner in result.optimizers:
            proxy = AcceleratedOptimizer(inner, self, wrapped)
            self._optimizers.append(proxy)
            self._windows[id(proxy)] = _Window()
            self._schedulers[id(proxy)] = []
            outs.append(proxy)
        if scheduler is not None:
            if len(outs) != 1:
                raise ConfigError(
                    "scheduler= needs exactly one optimizer in setup(); use setup_scheduler()"
                )
            self.setup_scheduler(scheduler, outs[0])
        return wrapped if not outs else (wrapped, *outs)

    def setup_scheduler(self, scheduler: Any, optimizer: AcceleratedOptimizer | None = None) -> Any:
        """Have accelkit step ``scheduler`` after every applied step of ``optimizer``; returns it.

        The scheduler may be built on an optimizer :meth:`setup` returned or on the original one
        (it is re-bound). From then on accelkit steps it once per applied optimizer step (never
        on a step the fp16 loss scaler skipped), and the loop's own ``scheduler.step()`` is a
        warned no-op. Hand over a composite (``SequentialLR``, ``ChainedScheduler``), not its
        parts. ``optimizer`` is needed only when the scheduler's own does not tell.
        """
        if optimizer is None:
            target = getattr(scheduler, "optimizer", None)
            matches = [o for o in self._optimizers if target is o or target is o.optimizer]
            if not matches and len(self._optimizers) == 1:
                matches = self._optimizers
            if not matches:
                raise ConfigError(
                    "cannot tell which optimizer this scheduler belongs to; pass optimizer="
                )
            optimizer = matches[0]
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            scheduler.optimizer = optimizer  # rebind: the backend may have replaced the optimizer
            mark_step_tracked(optimizer)
        self._adopt_scheduler(scheduler, optimizer)
        return scheduler

    def _adopt_scheduler(self, scheduler: Any, optimizer: AcceleratedOptimizer) -> None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "ReduceLROnPlateau steps on a metric, so accelkit cannot step it: keep calling "
                "scheduler.step(metric) in your loop and do not hand it over"
            )
        if is_composite_part(scheduler):
            return
        entries = self._schedulers.setdefault(id(optimizer), [])
        if any(s is scheduler for s, _ in entries):
            return
        # SequentialLR / ChainedScheduler step their parts themselves: step only the composite
        parts = getattr(scheduler, "_schedulers", None) or ()
        adopted_parts = [p for p in parts if any(p is s for s, _ in entries)]
        if adopted_parts:
            # the composite's construction stepped its first part, a no-op under our guard
            raise ConfigError(
                f"{type(scheduler).__name__} is built on schedulers that were already handed to "
                "accelkit; build the composite first and hand over only it: "
                "accel.setup_scheduler(composite)"
            )
        for part in parts:
            release_scheduler(part)
        entries.append((scheduler, guard_scheduler_step(scheduler)))

    def setup_dataloader(
        self,
        loader: torch.utils.data.DataLoader,
        *,
        shuffle: bool | None = None,
        move_to_device: bool = True,
        use_distributed_sampler: bool = True,
        stream_split: str = "auto",
    ) -> AcceleratedDataLoader:
        """Shard ``loader`` by data-parallel rank, move batches, make it resumable mid-epoch.

        ``stream_split`` (streams only): ``"auto"`` reads each rank's own shards where the
        dataset has ``n_shards``/``shard`` and they divide evenly, else strides; ``"shards"``
        insists; ``"stride"`` always strides (a position that resumes at any world size)."""
        sampler = None
        if use_distributed_sampler:
            seed = self.backend.settings.seed
            loader, sampler = rebuild_dataloader(
                loader,
                num_replicas=self.backend.data_parallel_world_size,
                rank=self.backend.data_parallel_rank,
                seed=0 if seed is None else seed,
                shuffle=shuffle,
                seed_workers=os.environ.get("ACCELKIT_SEED_WORKERS") == "1",
                stream_split=stream_split,
            )
        wrapped = AcceleratedDataLoader(loader, sampler, self, move_to_device)
        self._loaders.append(wrapped)
        self.backend.on_dataloader(wrapped)
        return wrapped

    # ---- the loop -----------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """Precision context for code outside the model's forward (a loss computed separately)."""
        if self.capabilities.controls_precision:
            return contextlib.nullcontext()
        return self.backend.forward_context()

    def backward(
        self, loss: torch.Tensor, *, model: torch.nn.Module | None = None, **kwargs: Any
    ) -> None:
        """Backward with loss scaling; divides by ``accumulation_steps`` exactly once."""
        if not self._models or (model is not None and not self._is_set_up(model)):
            raise UnsupportedError(
                "backward() on a model that was not set up: the backend never wrapped it, so "
                "its gradient sync, sharding and loss scaling would silently not happen. Call "
                "`model, optimizer = accel.setup(model, optimizer)` first and compute the loss "
                "with the model it returns"
                + (
                    " (and pass that one as backward(..., model=...))."
                    if model is not None
                    else "."
                )
            )
        steps = self.accumulation_steps
        if steps > 1 and not self.capabilities.scales_loss_for_accumulation:
            loss = loss / steps
        if model is None and len(self._models) == 1:
            model = self._models[0]
        # for backends that must know before backward whether it closes the window (an engine
        # that reduces gradients at its own accumulation boundary)
        if self._backend_sees_backward:
            windows = self._windows_of((model,) if model is not None else ())
            closes = not windows or any(self._closes_next(w) for w in windows)
            self.backend.before_backward(model, closes_window=closes)
        self.backend.backward(loss, model, **kwargs)

    def forward_backward(
        self,
        model: torch.nn.Module,
        *inputs: Any,
        target: Any = None,
        loss_fn: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward, loss and backward of one batch, the same call with and without pipeline
        parallelism; returns the loss (detached, 0-d), then ``accel.step()`` as usual.

        ``loss_fn(output, target)`` computes the loss; without it the model's output is the
        loss. Without a pipeline this is ``loss_fn(model(*inputs, **kwargs), target)`` and
        :meth:`backward` (the forward under the precision policy). With ``pp > 1`` the backend
        runs its schedule over ``pipeline["microbatches"]`` micro-batches of the batch, each
        micro-batch loss divided once by micro-batches x ``accumulation_steps``, and returns
        the mean micro-batch loss on every rank (docs/pipeline.md)."""
        if loss_fn is None and target is not None:
            raise ConfigError(
                "forward_backward(..., target=...) needs loss_fn=: it is called as "
                "loss_fn(output, target). Without loss_fn the model's output is the loss."
            )
        if self.backend.settings.pipeline is None:
            output = model(*inputs, **kwargs)
            loss = output if loss_fn is None else loss_fn(output, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError(
                    "forward_backward: the loss must be a one-element tensor, got "
                    + (
                        f"shape {tuple(loss.shape)}"
                        if isinstance(loss, torch.Tensor)
                        else type(loss).__name__
                    )
                    + "; pass loss_fn= that reduces the output to a scalar"
                )
            self.backward(loss, model=model)
            return loss.detach().reshape(())
        if not self._models or not self._is_set_up(model):
            raise UnsupportedError(
                "forward_backward() on a model that was not set up: call "
                "`model, optimizer = accel.setup(model, optimizer)` first and pass that model"
            )
        windows = self._windows_of((model,))
        closes = not windows or any(self._closes_next(w) for w in windows)
        return self.backend.pipeline_forward_backward(
            model, inputs, kwargs, target=target, loss_fn=loss_fn, closes_window=closes
        )

    def _is_set_up(self, model: torch.nn.Module) -> bool:
        """``model`` is one :meth:`setup` returned, or the user's own module inside one."""
        return any(model is m for m in self._raw_models) or any(
            model is m or model is self.backend.unwrap(m) for m in self._models
        )

    def _windows_of(self, models: tuple[torch.nn.Module, ...]) -> list[_Window]:
        """The windows of the optimizers of ``models`` (of all optimizers when none match)."""
        ids = {id(m) for m in models}
        own = [self._windows[id(o)] for o in self._optimizers if id(o._model) in ids]
        return own or list(self._windows.values())

    def _closes_next(self, window: _Window) -> bool:
        return window.micro + 1 >= self.accumulation_steps or self._end_of_loader

    def accumulate(self, *models: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip gradient sync inside an accumulation window, where that is safe and cheap.

        Optional: without it the numbers are the same and gradients sync every micro-batch.
        """
        if not self.capabilities.no_sync:  # nothing to skip: the hot loop pays nothing here
            return contextlib.nullcontext()
        return self._accumulate_without_sync(models)

    @contextlib.contextmanager
    def _accumulate_without_sync(self, models: tuple[torch.nn.Module, ...]) -> Iterator[None]:
        models = models or tuple(self._models)
        caps = self.capabilities
        may_skip = (
            caps.no_sync
            and self.world_size > 1
            and (
                caps.no_sync_by_default
                or getattr(self.backend.options, "skip_sync_in_accumulation", False)
            )
        )
        with contextlib.ExitStack() as stack:
            for model in models if may_skip else ():
                # each model by its own optimizers' windows (a GAN's two close at other times)
                windows = self._windows_of((model,))
                if windows and not any(self._closes_next(w) for w in windows):
                    stack.enter_context(self.backend.no_sync(model))
            yield

    def step(self, optimizer: AcceleratedOptimizer | None = None) -> bool:
        """Count a micro-batch; when the window closes, unscale, clip, step, zero_grad, schedule.

        Call it every micro-batch. Returns True when an optimizer step was applied (or skipped
        by the fp16 loss scaler). A window closes after ``accumulation_steps`` micro-batches or
        at the last batch of a loader from :meth:`setup_dataloader`, whichever comes first.
        """
        targets = (
            [own_optimizer(optimizer, self._optimizers, self._given_optimizers)]
            if optimizer is not None
            else self._optimizers
        )
        if not targets:
            raise UnsupportedError("no optimizer was set up; pass one to accelerator.setup()")
        applied = False
        for opt in targets:
            window = self._windows[id(opt)]
            window.micro += 1
            if window.micro < self.accumulation_steps and not self._end_of_loader:
                continue
            window.micro = 0
            self._apply(opt)
            applied = True
        if applied:
            self.backend.end_step()
        return applied

    def _apply(self, opt: AcceleratedOptimizer) -> None:
        settings = self.backend.settings
        if settings.max_grad_value is not None:
            self.backend.clip_grad_value(opt.optimizer, settings.max_grad_value)
        result = self.backend.optimizer_step(
            opt._model,
            opt.optimizer,
            max_grad_norm=settings.max_grad_norm,
            track_grad_norm=settings.track_grad_norm,
        )
        self.backend.zero_grad(opt.optimizer)
        opt.__dict__["_opt_called"] = True  # what torch's LR schedulers check
        self._last = result
        self._applied_steps += 1
        schedulers = self._schedulers.get(id(opt), [])
        if schedulers and not (result.found_inf is not None and bool(result.found_inf > 0)):
            for _, real_step in schedulers:
                real_step()
        elif not schedulers and opt.__dict__["_scheduler_built_on"]:
            opt.__dict__["_scheduler_built_on"] = False  # once per optimizer
            warnings.warn(_UNADOPTED_SCHEDULER, FutureWarning, stacklevel=3)

    def zero_grad(self, optimizer: AcceleratedOptimizer | None = None) -> None:
        """Zero gradients, except inside an open accumulation window (they are still needed)."""
        for opt in (
            [own_optimizer(optimizer, self._optimizers, self._given_optimizers)]
            if optimizer is not None
            else self._optimizers
        ):
            if self._windows[id(opt)].micro == 0:
                self.backend.zero_grad(opt.optimizer)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Total gradient norm before clipping of the last applied step (0-d tensor; inf if skipped).

        Computed only with ``max_grad_norm`` or ``track_grad_norm=True``; reading it with
        ``float()`` is the only host sync.
        """
        return self._last.grad_norm

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last applied window was skipped (fp16 overflow)."""
        found = self._last.found_inf
        return found is not None and bool(found > 0)

    def clip_grad_norm(
        self, max_norm: float, optimizer: AcceleratedOptimizer | None = None
    ) -> torch.Tensor:
        """Clip by hand (loops that clip themselves); returns the total norm before clipping."""
        if self.max_grad_norm is not None:
            raise ConfigError(
                "max_grad_norm is set, so step() already clips; do not clip by hand too"
            )
        opts = [optimizer] if optimizer is not None else self._optimizers
        if len(opts) != 1:
            raise ConfigError("clip_grad_norm needs optimizer= when several optimizers are set up")
        return self.backend.clip_grad_norm(opts[0]._model, opts[0].optimizer, max_norm)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's own module, without backend wrappers."""
        return self.backend.unwrap(model)

    def to_device(self, data: Any) -> Any:
        """Move tensors in nested containers to this process's device."""
        device = self.device

        def move(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return obj.to(device, non_blocking=True)
            if isinstance(obj, dict):
                return type(obj)((k, move(v)) for k, v in obj.items())
            if isinstance(obj, tuple) and hasattr(obj, "_fields"):
                return type(obj)(*(move(v) for v in obj))
            if isinstance(obj, (list, tuple)):
                return type(obj)(move(v) for v in obj)
            return obj

        return move(data)

    @property
    def _end_of_loader(self) -> bool:
        """Whether the current batch is the last of the innermost loader being iterated."""
        return bool(self._active_loaders) and self._active_loaders[-1].is_last_batch

    def _on_batch(self, loader: AcceleratedDataLoader) -> None:
        if not self._active_loaders or self._active_loaders[-1] is not loader:
            self._on_epoch_end(loader)
            self._active_loaders.append(loader)

    def _on_epoch_end(self, loader: AcceleratedDataLoader) -> None:
        """``loader`` stopped being iterated (its epoch ended, or the loop left it)."""
        self._active_loaders = [x for x in self._active_loaders if x is not loader]

    # ---- collectives --------------------------------------------------------------------------
    def barrier(self) -> None:
        distributed.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """All-reduce (``sum``, ``mean``, ``max``, ``min``) over the data-parallel replicas;
        returns a copy. The ranks of one tensor-parallel replica hold the same values, so the
        world group would count them ``tp`` times."""
        return distributed.all_reduce(
            tensor.to(self.device), op, self.backend.data_parallel_group()
        )

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object (or tensor) from rank ``src`` to every rank."""
        return distributed.broadcast_object(obj, src)

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather per-rank results for evaluation, dropping the samples the sampler padded.

        Tensors are concatenated along the first dimension (their sizes may differ per rank;
        a 0-d tensor gives one entry per rank); a dict is gathered value by value; other
        objects come back as a list with one entry per sample. At the last batch of an epoch,
        whatever has one entry per sample of the batch (a leading dimension of the batch's
        size) loses the entries of the samples the sampler repeated to even out the ranks.
        """
        return self._gather(data, self._last_batch_sizes())

    def _gather(self, data: Any, sizes: tuple[int, int] | None) -> Any:
        if isinstance(data, dict):
            return {key: self._gather(value, sizes) for key, value in data.items()}
        if isinstance(data, torch.Tensor):
            if data.dim() == 0:
                data = data.unsqueeze(0)
            elif sizes is not None and data.shape[0] == sizes[1]:
                data = data[: sizes[0]]
            # over the data-parallel replicas only: the ranks of one replica hold the same samples
            group = self.backend.data_parallel_group()
            counts = distributed.all_gather_object(int(data.shape[0]), group)
            pad = max(counts) - data.shape[0]
            if pad:
                data = torch.cat([data, data.new_zeros((pad, *data.shape[1:]))])
            gathered = distributed.all_gather(data.to(self.device), group)
            return torch.cat([gathered[r, : counts[r]] for r in range(len(counts))])
        items = list(data) if isinstance(data, (list, tuple)) else [data]
        if sizes is not None and len(items) == sizes[1]:
            items = items[: sizes[0]]
        gathered_items = distributed.all_gather_object(items, self.backend.data_parallel_group())
        return [x for part in gathered_items for x in part]

    def _last_batch_sizes(self) -> tuple[int, int] | None:
        """At an epoch's last batch from a padded sampler: (real samples, batch size) of this
        rank's batch; None elsewhere."""
        for loader in self._active_loaders[-1:]:  # the loader whose batch this is
            s = loader.sampler
            if loader.is_last_batch and s is not None and not s.drop_last:
                rest = max(s.dataset_len - s.start, 0)
                mine = len(range(s.rank, rest, s.num_replicas))
                before = (len(loader) - 1) * (loader.batch_size or 1)
                return max(mine - before, 0), len(s) - before
        return None

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main:
            print(*args, **kwargs)

    def seed_everything(self, seed: int, *, workers: bool = True) -> int:
        return seed_everything(seed, workers=workers)

    # ---- checkpoints --------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        *,
        format: str = "portable",
        **kwargs: Any,
    ) -> Any:
        """Write a portable checkpoint of ``state`` (models, optimizers, schedulers, loaders, extras).

        ``format="native"``: the backend library's own format instead, where it has one.
        Collective: every rank calls it (a rank that does not is named in the error, within
        the commit timeout: :mod:`accelkit.checkpoint.write.agreement`)."""
        from accelkit.checkpoint.write import agreement as commit

        bound = min(commit.timeout_s(), distributed.group_timeout_s())
        distributed.rendezvous("save()", _EVERY_RANK, bound)
        if format == "native":
            return self.backend.save_native(path, state, **kwargs)
        if format != "portable":
            raise ConfigError(f"format must be 'portable' or 'native', got {format!r}")
        from accelkit.checkpoint import save

        return save(self, path, state, **kwargs)

    def load_pretrained(
        self,
        model: torch.nn.Module,
        source: str | os.PathLike,
        *,
        strict: bool = True,
        rename: Any = None,
        strip_prefix: str | None = None,
        add_prefix: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """Fill the set-up ``model`` with pretrained weights, each rank reading only its pieces.

        ``source``: a Hugging Face-style directory (``model.safetensors``, or shards with
        ``model.safetensors.index.json``), one ``.safetensors`` file, or an accelkit checkpoint,
        on disk or in object storage (``s3://bucket/prefix``, with ``storage_options``).
        ``rename`` (a mapping or callable; None drops a key), then ``strip_prefix`` /
        ``add_prefix``, turn the file's names into the model's. ``strict``: missing and
        unexpected names raise (else they are logged). Shapes and dtypes are checked before
        anything is written; floats convert (bf16 files into fp32 weights). Collective."""
        from accelkit.checkpoint import load_pretrained

        if not self._is_set_up(model) and (
            self.capabilities.init_context != "device" or any(p.is_meta for p in model.parameters())
        ):
            raise UnsupportedError(
                "load_pretrained() fills a model that setup() returned, and this one was not "
                f"set up: on {self.name!r} the model built in init_module() gets its storage "
                "(allocated, sharded or partitioned) in setup(). Call "
                "`model, opt = accel.setup(model, opt)` first, then "
                "`accel.load_pretrained(model, source)`."
            )
        started = time.perf_counter()
        load_pretrained(
            self,
            model,
            source,
            strict=strict,
            rename=rename,
            strip_prefix=strip_prefix,
            add_prefix=add_prefix,
            storage_options=storage_options,
        )
        log.info(
            "loaded pretrained weights from %s in %.2f s", source, time.perf_counter() - started
        )
        from accelkit.checkpoint.shards.fragments import PRETRAINED_FROM
        from accelkit.checkpoint.store import store_for

        # where the weights came from: a later save records it, for the export's config.json
        store = store_for(source, storage_options)
        if store.local_directory(str(source)) is None:  # a URL: the prefix, or the object's
            url = store.display(str(source)).rstrip("/")
            folder_name = url if not url.endswith(".safetensors") else url.rsplit("/", 1)[0]
        else:
            local = Path(source)
            folder_name = str((local if local.is_dir() else local.parent).absolute())
        self.backend.unwrap(model).__dict__[PRETRAINED_FROM] = folder_name

    def load(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        *,
        strict: bool = True,
        format: str = "portable",
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Fill the objects in ``state`` in place from a checkpoint; return what was not consumed.

        ``format="native"``: read what ``save(..., format="native")`` wrote."""
        distributed.rendezvous("load()", _EVERY_RANK)
        if format == "native":
            return self.backend.load_native(path, state, strict=strict, **kwargs)
        if format != "portable":
            raise ConfigError(f"format must be 'portable' or 'native', got {format!r}")
        from accelkit.checkpoint import load_resolved

        built_with, built_bases = learning_rates(state), learning_rates(state, "initial_lr")
        started = time.perf_counter()
        unconsumed, manifest = load_resolved(self, path, state, strict=strict, **kwargs)
        log.info("loaded %s in %.2f s", path, time.perf_counter() - started)
        self._restore_applied_steps(manifest.data.get("applied_steps"))
        say_which_learning_rate_won(built_with, learning_rates(state), path, state, built_bases)
        return unconsumed

    def _restore_applied_steps(self, saved: Any) -> None:
        """Continue :attr:`applied_steps` from the count of the checkpoint just loaded (its
        manifest, read once with its weights), so a resumed run logs and saves at the steps an
        uninterrupted one would; checkpoints written before the count was saved leave it."""
        if isinstance(saved, int) and not isinstance(saved, bool):
            self._applied_steps = saved

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model state dict (a gather on sharded backends; for export)."""
        return self.backend.full_state_dict(model)

    # ---- loop features: preemption, resume, tracking (accelkit.preemption, accelkit.tracking) --
    @property
    def should_stop(self) -> bool:
        """True on every rank, at the same step, once any rank got a stop signal (SIGTERM or
        SIGUSR1 by default) or called :meth:`request_stop`. Read it at the step boundary; when
        True, save and leave the loop. Each read is one small all-reduce; the first read
        installs the signal handlers (see :mod:`accelkit.preemption`). When it turns True, an
        asynchronous save in flight is committed first, so the stop's grace period is not
        spent on it."""
        from accelkit.checkpoint.write import background
        from accelkit.preemption import watcher_of

        stop = watcher_of(self).check(self.device)
        if stop:
            background.wait()
        return stop

    def stop_on_signals(self, *signals: Any, check_every: int = 1) -> None:
        """Choose the signals that set :attr:`should_stop` (default SIGTERM, SIGUSR1) and install
        their handlers now; ``check_every=N`` all-reduces only every N-th read."""
        from accelkit.preemption import stop_on_signals

        stop_on_signals(self, signals or None, check_every=check_every)

    def request_stop(self) -> None:
        """Make :attr:`should_stop` True on every rank at its next read (a loop's own reason)."""
        from accelkit.preemption import watcher_of

        watcher_of(self, install=False).request()

    def auto_resume(
        self, directory: str | os.PathLike, state: dict[str, Any], **kwargs: Any
    ) -> Any:
        """Load the newest complete checkpoint under ``directory`` into ``state`` if there is
        one; return its path, or None. Also installs the stop-signal handlers."""
        from accelkit.preemption import auto_resume, watcher_of

        watcher_of(self)
        return auto_resume(self, directory, state, **kwargs)

    def init_trackers(
        self,
        directory: str | os.PathLike,
        trackers: Any = ("csv",),
        *,
        config: dict[str, Any] | None = None,
        tracker_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Trackers for :meth:`log`, built on rank 0: ``"csv"``, ``"tensorboard"``, a plugin's
        name (``accelkit_loggers`` hook), or tracker objects."""
        from accelkit.tracking import init_trackers

        init_trackers(self, directory, trackers, config=config, tracker_kwargs=tracker_kwargs)

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log scalars on rank 0 (other ranks return at once); ``step`` defaults to
        :attr:`applied_steps`."""
        from accelkit.tracking import log_metrics

        log_metrics(self, metrics, step)

    def main_process_first(self, *, local: bool = False, timeout_s: float | None = None) -> Any:
        """Context: the block runs on the main process (``local=True``: each node's) first, then
        on the others, which wait without a collective; collectives inside raise at once."""
        from accelkit.launcher import main_process_first

        return main_process_first(self, local=local, timeout_s=timeout_s)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """An Accelerator holds a process group, devices and live training state: a copy
        would train nothing. Refuse, saying what to copy instead."""
        from accelkit.errors import UnsupportedError

        class NotCopyable(UnsupportedError, TypeError):  # TypeError: what pickle's callers catch
            pass

        raise NotCopyable(
            "an Accelerator (the process group, devices and training state) cannot be copied "
            "or pickled; pickle the model's state_dict or save a checkpoint with accel.save(), "
            "and build a new Accelerator with accelkit.get() where it is needed"
        )

    def free_memory(self) -> None:
        """Forget every model, optimizer, scheduler and loader set up so far, let the backend
        release what it built for them (:meth:`~accelkit.backend.Backend.release`: engines,
        wrappers), and free cached memory. For a retry after an out-of-memory error
        (:func:`accelkit.find_executable_batch_size`) or a fresh start in the same process;
        set up again before training."""
        import gc

        from accelkit.checkpoint.write import background

        background.wait()
        self.backend.release()
        self._optimizers.clear()
        self._models.clear()
        self._raw_models.clear()
        self._given_optimizers.clear()
        self._schedulers.clear()
        self._windows.clear()
        self._loaders.clear()
        self._active_loaders.clear()
        self._last = StepResult()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wait_for_save(self) -> None:
        """Block until an ``accel.save(..., asynchronous=True)`` in flight is committed; raise
        :class:`~accelkit.errors.CheckpointError` if it failed. The next save, ``load``,
        ``end_training`` and interpreter exit wait anyway."""
        from accelkit.checkpoint.write import background

        background.wait()

    def end_training(self) -> None:
        """Wait for an asynchronous save in flight (raising its error), close the trackers and
        give the stop signals back to their former handlers."""
        from accelkit.checkpoint.write import background

        background.wait()
        trackers, self._trackers = self._trackers, None
        if trackers is not None:
            trackers.finish()
        if self._stop_signal is not None:
            self._stop_signal.uninstall()

    def teardown(self) -> None:
        self.backend.teardown()
