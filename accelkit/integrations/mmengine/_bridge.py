"""What AccelkitRunner and AccelkitStrategy share: building the Accelerator from MMEngine's config,
joining the process group, setting the model and optimizer up in one call, and checkpoint I/O."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any

import torch

import accelkit
from accelkit import distributed
from accelkit.backend import Capabilities
from accelkit.checkpoint.store import is_remote
from accelkit.errors import CheckpointError, ConfigError, UnsupportedError
from accelkit.integrations.mmengine import checkpoint as ckpt
from accelkit.integrations.mmengine._settings import (
    AdapterOptions,
    TrainingSettings,
    accelerator_kwargs,
    backend_class,
    mmengine_wrapper_options,
)
from accelkit.integrations.mmengine.model_wrapper import AccelkitModelWrapper, user_state_dict
from accelkit.integrations.mmengine.optim_wrapper import AccelkitOptimWrapper

log = logging.getLogger("accelkit")


def join_process_group(dist_backend: str | None = None, timeout: float | None = None) -> None:
    """Join the default process group the way MMEngine's launcher would, but on CPU too.

    MMEngine's ``init_dist`` calls ``torch.cuda.set_device`` unconditionally
    (mmengine/dist/utils.py:130), which fails on a CPU-only torch; here gloo is used when there
    is no CUDA device or ``dist_cfg=dict(backend='gloo')`` asks for it.
    """
    if distributed.is_initialized():
        return
    use_cuda = torch.cuda.is_available() and dist_backend != "gloo"
    if use_cuda:
        index = distributed.local_rank()
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        if dist_backend not in (None, "gloo"):
            log.info("no CUDA device: using gloo instead of %s", dist_backend)
        device = torch.device("cpu")
    distributed.init_process_group(device, timeout)


class _StaticLossScale:
    """MMEngine's ``AmpOptimWrapper(loss_scale=<number>)``: the scale goes back to the number
    after every step (``loss_scaler.update(loss_scale)``); overflowed steps are still skipped."""

    static_scale: float

    def update(self, new_scale: Any = None) -> None:
        super().update(self.static_scale if new_scale is None else new_scale)  # type: ignore[misc]


def apply_loss_scale(accel: accelkit.Accelerator, settings: TrainingSettings) -> None:
    """Give the backend's fp16 GradScaler the arguments of ``AmpOptimWrapper(loss_scale=...)``.

    ``'dynamic'`` needs nothing: MMEngine's ``GradScaler()`` and accelkit's ``16-mixed`` scaler
    have the same defaults. A number or a dict needs a scaler accelkit runs (the torch-native
    backends, ``ShardedGradScaler`` on fsdp); a backend whose library scales the loss itself
    (DeepSpeed, ColossalAI's ZeRO) is refused, as is any precision but 16-mixed.
    """
    if settings.grad_scaler is None:
        return
    precision = getattr(accel.backend, "precision", None)
    scaler = getattr(precision, "scaler", None)
    if accel.precision != "16-mixed" or not isinstance(scaler, torch.amp.GradScaler):
        raise UnsupportedError(
            f"AmpOptimWrapper loss_scale={settings.static_loss_scale or settings.grad_scaler!r} "
            f"cannot be honoured on backend {accel.name!r} with precision {accel.precision!r}: "
            "accelkit runs no torch GradScaler there (the backend's library scales the loss "
            "itself). Set the loss scale in the backend's own options (deepspeed: loss_scale, "
            "initial_scale_power; colossalai: initial_scale), or remove loss_scale"
        )
    scaler_class: type = type(scaler)
    if settings.static_loss_scale is not None:
        scaler_class = type(f"Static{scaler_class.__name__}", (_StaticLossScale, scaler_class), {})
    device_type = getattr(precision, "device_type", None) or accel.device.type
    new_scaler = scaler_class(device_type, **settings.grad_scaler)
    if settings.static_loss_scale is not None:
        new_scaler.static_scale = settings.static_loss_scale
    precision.scaler = new_scaler
    log.info("fp16 loss scaler from AmpOptimWrapper loss_scale: %s", settings.grad_scaler)


def check_clipping(accel: accelkit.Accelerator, settings: TrainingSettings) -> None:
    """Clipping comes from ``optim_wrapper.clip_grad`` alone, as in MMEngine.

    A backend's own config may clip by itself: a native DeepSpeed config without
    ``gradient_clipping`` keeps DeepSpeed's default, 1.0. Silently clipping a run whose MMEngine
    config does not clip (or clips at another norm) would change its training; refuse it.
    """
    if accel.max_grad_norm == settings.max_grad_norm:
        return
    wanted = (
        "has no clip_grad"
        if settings.max_grad_norm is None
        else f"clips at max_norm={settings.max_grad_norm}"
    )
    raise ConfigError(
        f"backend {accel.name!r} would clip gradients at max_grad_norm={accel.max_grad_norm} "
        f"(its config says so, or its library's default does), but optim_wrapper {wanted}: "
        "MMEngine's clip_grad decides. Set optim_wrapper=dict(clip_grad=dict(max_norm=X)), or "
        "turn clipping off in the backend config (a native DeepSpeed config: "
        "'gradient_clipping': 0.0)"
    )


def backends_with_several_optimizers() -> list[str]:
    """The registered backends whose capabilities say they train several optimizers over the
    parts of one model (for an error message: it imports their backend classes)."""
    from accelkit import registry

    host = registry.host()
    host.ensure_loaded()
    names = []
    for name in host.registry.names():
        spec = host.registry.get(name)
        if spec is None or spec.alias_of is not None or spec.missing_libraries():
            continue
        try:
            cls = spec.load_class()
            if cls.select_backend() is not None:  # a name that picks another backend
                continue
            capabilities = getattr(cls, "capabilities", None)
        except Exception:  # a backend that cannot load cannot be recommended
            continue
        if isinstance(capabilities, Capabilities) and capabilities.several_optimizers:
            names.append(name)
    return names


def check_several_optimizers(name: str, capabilities: Any, settings: TrainingSettings) -> None:
    """Refuse, when the Runner or strategy is built (before the backend is), an
    ``OptimWrapperDict`` on a backend that takes one model with one optimizer, naming the
    backends that take several."""
    if not settings.several or capabilities.several_optimizers:
        return
    wrappers = ", ".join(n for n in settings.several if n)
    raise UnsupportedError(
        f"backend {name!r} cannot train several optimizers over one model "
        f"(optim_wrapper builds an OptimWrapperDict{f': {wrappers}' if wrappers else ''}): "
        "it sets up one model with one optimizer. Backends that can: "
        f"{', '.join(backends_with_several_optimizers())}; or train this model with one "
        "optimizer"
    )


def check_amp_device(accel: accelkit.Accelerator, adapter: AdapterOptions, amp: str | None) -> None:
    """``AmpOptimWrapper`` (``tools/train.py --amp``) on the CPU: refused, as MMEngine's own
    ``AmpOptimWrapper`` refuses it (it needs a GPU, NPU, MLU or MUSA); fp16 autocast on a CPU
    trains far slower than fp32. Asked for in the ``accelkit`` section, it runs (warned)."""
    if accel.device.type != "cpu":
        return
    if amp is not None and adapter.precision is None:
        raise ConfigError(
            f"optim_wrapper type 'AmpOptimWrapper' (tools/train.py --amp) asks for {amp} on "
            f"backend {accel.name!r}, which trains on the CPU: MMEngine refuses AmpOptimWrapper "
            "there (it needs a GPU, NPU, MLU or MUSA), and autocast on a CPU trains far slower "
            "than fp32. Train without --amp (optim_wrapper type 'OptimWrapper'), use a GPU "
            f"backend, or ask accelkit for it explicitly: accelkit=dict(precision={amp!r})"
        )
    if accel.precision in ("16-mixed", "16-true"):
        log.warning(
            "precision %r on the CPU: fp16 arithmetic is emulated there and trains far slower "
            "than fp32 (MMEngine refuses AmpOptimWrapper on a CPU)",
            accel.precision,
        )


class _LoaderBatchSize:
    """What a backend's ``on_dataloader`` hook reads of a loader (its ``batch_size``), for the
    loader MMEngine builds itself: DeepSpeed takes ``train_micro_batch_size_per_gpu`` from it,
    and has no note to log that an MMEngine user could not act on."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = int(batch_size)


class Bridge:
    """One Accelerator and the model/optimizer it set up, seen from MMEngine."""

    def __init__(self, adapter: AdapterOptions) -> None:
        self.adapter = adapter
        self.accelerator: accelkit.Accelerator | None = None

    # ---- building -----------------------------------------------------------------------------
    def build_accelerator(
        self,
        settings: TrainingSettings,
        *,
        model_wrapper_cfg: Any = None,
        find_unused_parameters: Any = None,
        launched_distributed: bool = True,
    ) -> accelkit.Accelerator:
        """Build the Accelerator once; DDP-like backends wrap the model as MMEngine's own DDP
        would (``broadcast_buffers=False`` unless ``model_wrapper_cfg`` or the section says)."""
        if self.accelerator is None:
            wrapper_options = mmengine_wrapper_options(
                self.adapter,
                model_wrapper_cfg,
                find_unused_parameters=find_unused_parameters,
                distributed=launched_distributed,
            )
            kwargs = accelerator_kwargs(self.adapter, settings, wrapper_options)
            cls, _ = backend_class(self.adapter.backend)
            check_several_optimizers(self.adapter.backend, cls.capabilities, settings)
            accel = accelkit.get(self.adapter.backend, **kwargs)
            check_amp_device(accel, self.adapter, settings.precision)
            check_clipping(accel, settings)
            apply_loss_scale(accel, settings)
            self.accelerator = accel
            log.info("MMEngine on accelkit: %r", self.accelerator)
            launched = distributed.launched_world_size()
            if launched > 1 and not self.accelerator.capabilities.distributed:
                log.warning(
                    "backend %r runs one process on its own: the %d launched processes will not "
                    "synchronise gradients (use a distributed backend such as 'ddp')",
                    self.accelerator.name,
                    launched,
                )
        return self.accelerator

    @property
    def accel(self) -> accelkit.Accelerator:
        if self.accelerator is None:
            raise RuntimeError("the Accelerator is built when training or evaluation starts")
        return self.accelerator

    def model_context(self) -> contextlib.AbstractContextManager:
        """Where to build the model: as MMEngine does, or inside ``accel.init_module()`` when
        the user asked for it (``init_module=True``)."""
        return self.accel.init_module() if self.adapter.init_module else contextlib.nullcontext()

    @property
    def runs_init_weights(self) -> bool:
        """MMEngine's ``init_weights`` needs materialised weights, which ``init_module`` may not
        give (meta device, ZeRO-3 partitions): there the backend initialises the weights."""
        if self.adapter.init_module and self.accel.capabilities.init_context != "device":
            log.info(
                "init_weights skipped: the model was built inside accel.init_module() (%s)",
                self.accel.capabilities.init_context,
            )
            return False
        return True

    def setup(
        self, model: torch.nn.Module, optim_wrapper: Any, *, micro_batch: int | None = None
    ) -> AccelkitModelWrapper:
        """``accel.setup(model, optimizer)`` in one call, then bind the optimizer wrapper; with
        an ``OptimWrapperDict``, :meth:`setup_parts`. ``micro_batch``: the per-process batch
        size of the training dataloader MMEngine built (the backend's ``on_dataloader`` hook
        sees it before setup, as if accelkit had set the loader up first)."""
        from mmengine.optim import OptimWrapperDict

        accel = self.accel
        if isinstance(model, AccelkitModelWrapper):
            raise ConfigError("this model is already set up by accelkit")
        if optim_wrapper is not None and micro_batch is not None:
            accel.backend.on_dataloader(_LoaderBatchSize(micro_batch))
        if isinstance(optim_wrapper, OptimWrapperDict):
            return self.setup_parts(model, optim_wrapper)
        kwargs = dict(self.adapter.setup_kwargs)
        if self.adapter.pipeline_loss is not None and accel.backend.settings.pipeline is not None:
            return self._setup_pipeline(model, optim_wrapper, kwargs)
        if optim_wrapper is None:
            wrapped = accel.setup(model, **kwargs)
        else:
            if not isinstance(optim_wrapper, AccelkitOptimWrapper):
                raise ConfigError(
                    f"expected an AccelkitOptimWrapper, got {type(optim_wrapper).__name__}"
                )
            wrapped, optimizer = accel.setup(model, optim_wrapper.optimizer, **kwargs)
            optim_wrapper.attach(accel, wrapped, optimizer)
        return AccelkitModelWrapper(accelerator=accel, model=wrapped, module=model)

    def _setup_pipeline(
        self, model: torch.nn.Module, optim_wrapper: Any, kwargs: dict[str, Any]
    ) -> AccelkitModelWrapper:
        """``pp > 1``: a copy of the whole model for validation (made before setup, which
        splits the model), then ``accel.setup`` as usual."""
        import copy

        accel = self.accel
        if optim_wrapper is None:
            raise UnsupportedError(
                "pp under MMEngine: val()/test() alone has no pipeline to run; evaluate the "
                "checkpoint without pp (accelkit=dict(backend=..., pp=1))"
            )
        if not isinstance(optim_wrapper, AccelkitOptimWrapper):
            raise ConfigError(
                f"expected an AccelkitOptimWrapper, got {type(optim_wrapper).__name__}"
            )
        eval_copy = copy.deepcopy(model)
        wrapped, optimizer = accel.setup(model, optim_wrapper.optimizer, **kwargs)
        optim_wrapper.attach(accel, wrapped, optimizer)
        return AccelkitModelWrapper(
            accelerator=accel,
            model=wrapped,
            module=model,
            pipeline_loss=self.adapter.pipeline_loss,
            eval_copy=eval_copy,
        )

    def setup_parts(self, model: torch.nn.Module, wrappers: Any) -> AccelkitModelWrapper:
        """Several optimizers (a GAN's generator and discriminator): each submodule that an
        optimizer trains is set up on its own with its optimizers and put back into the model
        in its place, as MMEngine's ``MMSeparateDistributedDataParallel`` wraps each submodule
        in its own DDP, so that separate backward passes synchronise correctly. The other
        submodules are moved to the device. The model's own ``train_step`` then runs, calling
        ``optim_wrapper['generator'].update_params(loss)`` as under MMEngine."""
        accel = self.accel
        settings = TrainingSettings(several=tuple(wrappers.keys()))
        check_several_optimizers(accel.name, accel.capabilities, settings)
        owner = {id(p): name for name, child in model.named_children() for p in child.parameters()}
        by_part: dict[str, list[tuple[str, AccelkitOptimWrapper]]] = {}
        for name, wrapper in wrappers.items():
            if not isinstance(wrapper, AccelkitOptimWrapper):
                raise ConfigError(
                    f"optim_wrapper[{name!r}] is a {type(wrapper).__name__}, not an "
                    "AccelkitOptimWrapper: build it through AccelkitRunner or AccelkitStrategy"
                )
            held = {owner.get(id(p)) for g in wrapper.optimizer.param_groups for p in g["params"]}
            if None in held or len(held) != 1:
                where = sorted(h or "(the model itself)" for h in held)
                raise ConfigError(
                    f"optim_wrapper[{name!r}]'s optimizer holds parameters of {where}: with "
                    "several optimizers each submodule is set up on its own (as MMEngine's "
                    "MMSeparateDistributedDataParallel wraps it), so every optimizer must "
                    "train parameters of one submodule of the model (model.<name>)"
                )
            by_part.setdefault(held.pop(), []).append((name, wrapper))
        kwargs = dict(self.adapter.setup_kwargs)
        parts: dict[str, torch.nn.Module] = {}
        for name, child in list(model.named_children()):
            items = by_part.get(name)
            if not items:
                if not accel.capabilities.controls_device:
                    child.to(accel.device)
                continue
            wrapped, *optimizers = accel.setup(child, *(w.optimizer for _, w in items), **kwargs)
            for (_, wrapper), optimizer in zip(items, optimizers):
                wrapper.attach(accel, wrapped, optimizer, one_of_several=True)
            model._modules[name] = wrapped
            parts[name] = wrapped
        if not accel.capabilities.controls_device:  # the model's own parameters and buffers
            for tensor in (*model._parameters.values(), *model._buffers.values()):
                if tensor is not None and tensor.device != accel.device:
                    tensor.data = tensor.data.to(accel.device)
        log.info(
            "several optimizers: %s set up one by one (%s)",
            ", ".join(parts),
            ", ".join(f"{n}: {[w for w, _ in items]}" for n, items in by_part.items()),
        )
        return AccelkitModelWrapper(accelerator=accel, model=model, module=model, parts=parts)

    # ---- checkpoints --------------------------------------------------------------------------
    def partitions_parameters(self, model: torch.nn.Module) -> bool:
        """Whether a rank holds only part of some parameter: FSDP's DTensors, ZeRO-3's
        partitions, flat or emptied parameters. DDP, DeepSpeed ZeRO-1/2, FairScale OSS/SDP and
        ColossalAI's ZeRO-1/2 shard optimizer state (and gradients) only: every rank holds
        the whole model, so its ``state_dict()`` is the full weights without a gather."""
        if not self.accel.capabilities.sharded:
            return False
        for param in self.accel.unwrap(model).parameters():
            if hasattr(param, "to_local") or hasattr(param, "ds_id") or param.numel() == 0:
                return True
            if type(param).__name__ == "FlatParameter":
                return True
        return False

    def _load_target(self, model: AccelkitModelWrapper) -> torch.nn.Module:
        """What a checkpoint's weights go into. A test-time-augmentation model (``tools/test.py
        --tta`` builds ``model = dict(**tta_model, module=model)``) holds the trained model as
        ``.module``, and the checkpoint holds that model's weights, as MMEngine's own loader
        reads them (``load_state_dict`` steps into a BaseTTAModel's ``.module``)."""
        from mmengine.model import BaseTTAModel

        if isinstance(model.module, BaseTTAModel) and not self.partitions_parameters(model.wrapped):
            return model.module.module
        return model.wrapped

    def hook_view(self, model: AccelkitModelWrapper) -> dict[str, torch.Tensor] | None:
        """``checkpoint['state_dict']`` as MMEngine's hooks expect to see it (EMAHook swaps its
        entries), or None where the backend partitions parameters, where it would be a gather
        of the whole model."""
        if self.partitions_parameters(model.wrapped):
            return None
        if model.parts:
            return user_state_dict(self.accel, model.wrapped, model.parts, full=False)
        return dict(self.accel.unwrap(model.wrapped).state_dict())

    def _objects(
        self, model: AccelkitModelWrapper, optim_wrapper: Any, *, loading: bool = False
    ) -> dict[str, Any]:
        """What ``accel.save``/``accel.load`` get: the model (its parts, with several
        optimizers) and the optimizers of ``optim_wrapper`` (None: none)."""
        from mmengine.optim import OptimWrapperDict

        if optim_wrapper is None:
            optimizers = {}
        elif isinstance(optim_wrapper, OptimWrapperDict):
            optimizers = {name: w.optimizer for name, w in optim_wrapper.items()}
        else:
            optimizers = {"": optim_wrapper.optimizer}
        target = self._load_target(model) if loading and not model.parts else model.wrapped
        return ckpt.checkpoint_objects(target, model.parts, optimizers)

    def _load_weights(
        self,
        model: AccelkitModelWrapper,
        state_dict: dict[str, Any],
        *,
        strict: bool,
        revise_keys: list[tuple[str, str]],
    ) -> None:
        """A whole model's state dict (user names) into the set-up model; with several
        optimizers on a backend that shards, part by part (each part is its own set-up model)."""
        if model.parts:  # MMEngine's MMSeparateDistributedDataParallel checkpoints name
            # each part's DDP too (generator.module.0.weight)
            revise_keys = [
                *revise_keys,
                (rf"^({'|'.join(map(re.escape, model.parts))})\.module\.", r"\1."),
            ]
        if not (model.parts and self.accel.capabilities.sharded):
            ckpt.load_state_dict_into(
                self.accel, model.wrapped, state_dict, strict=strict, revise_keys=revise_keys
            )
            return
        state_dict = ckpt.revise_state_dict(dict(state_dict), revise_keys)
        for name, part in model.parts.items():
            prefix = f"{name}."
            own = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
            ckpt.load_state_dict_into(self.accel, part, own, strict=strict, revise_keys=[])
        rest = {k: v for k, v in state_dict.items() if k.split(".", 1)[0] not in model.parts}
        if rest:
            from mmengine.runner.checkpoint import load_state_dict

            load_state_dict(model.wrapped, rest, strict=False)

    def _layout_differs(self, path: str, model: AccelkitModelWrapper) -> bool:
        """The checkpoint holds the model otherwise than it is set up (one optimizer's
        ``model`` against several optimizers' parts, or other parts)."""
        if is_remote(path):
            return False
        return sorted(ckpt.saved_parts(path)) != sorted(model.parts)

    def check_hooks(self, hooks: list[Any], model: AccelkitModelWrapper) -> None:
        """Refuse, before training, the hooks that cannot work on this backend.

        MMEngine's EMAHook deep-copies the model and averages its parameters in place: where a
        rank holds only partitions of them (fsdp, DeepSpeed ZeRO-3) it fails deep in the run
        (FSDP refuses the deepcopy; ZeRO-3 averages empty partitions)."""
        from mmengine.hooks import EMAHook

        ema = [type(h).__name__ for h in hooks if isinstance(h, EMAHook)]
        if ema and self.partitions_parameters(model.wrapped):
            raise UnsupportedError(
                f"{ema[0]} cannot run on backend {self.accel.name!r}, which partitions the "
                "model's parameters across ranks (it averages and swaps whole parameters); it "
                "works on backends that keep the whole model on every rank (cpu, cuda, ddp, "
                "DeepSpeed ZeRO-1/2, fairscale_oss/sdp, colossalai_ddp/zero)"
            )

    @staticmethod
    def call_save_hooks(call: Any, checkpoint: dict[str, Any]) -> None:
        """Run ``before_save_checkpoint`` hooks, explaining what accelkit cannot give them."""
        try:
            call(checkpoint)
        except KeyError as err:
            if "state_dict" in checkpoint or err.args != ("state_dict",):
                raise
            raise UnsupportedError(
                "a hook (EMAHook?) needs checkpoint['state_dict'], the whole model's weights; "
                "accelkit gives it to hooks on backends that do not shard the model only"
            ) from err

    def save(
        self,
        path: str,
        model: AccelkitModelWrapper,
        optim_wrapper: AccelkitOptimWrapper | None,
        checkpoint: dict[str, Any],
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """Write the portable checkpoint (to a directory, or ``s3://`` with ``storage_options``
        from ``backend_args``). The model's own weights come from the backend's fragments;
        ``checkpoint['state_dict']`` (the hooks' view) is not stored, and EMAHook's swap is
        undone so that ``ema_state_dict`` holds the averaged weights."""
        checkpoint = dict(checkpoint)
        view = checkpoint.pop("state_dict", None)
        ema = checkpoint.get("ema_state_dict")
        if view is not None and isinstance(ema, dict):
            ema = checkpoint["ema_state_dict"] = dict(ema)
            ckpt.swap_ema_state(view, ema)
        ckpt.save(
            self.accel,
            path,
            objects=self._objects(model, optim_wrapper),
            checkpoint=checkpoint,
            step=checkpoint.get("meta", {}).get("iter"),
            storage_options=storage_options,
        )

    def load(
        self,
        path: str,
        model: AccelkitModelWrapper,
        optim_wrapper: Any,
        *,
        strict: bool,
        revise_keys: list[tuple[str, str]],
        before_model: Any = None,
        resume: bool = False,
    ) -> dict[str, Any]:
        """Load a portable checkpoint, or a pickled ``.pth`` where ``trust_pickle`` allows.

        Returns MMEngine's view of the checkpoint (``meta``, ``message_hub``,
        ``param_schedulers``, ...). Weights and, with ``optim_wrapper``, optimizer state are
        loaded in place. ``before_model`` (MMEngine's ``after_load_checkpoint`` hooks) sees the
        checkpoint as MMEngine would have written it, and what it leaves in
        ``checkpoint['state_dict']`` is what the model ends up with, as in MMEngine (EMAHook
        puts the averaged weights there for ``load_from``, the trained ones for ``resume``).
        ``resume``: restore the random state too; ``load_from`` keeps the new run's, as
        MMEngine's ``load_from`` does (it restores weights only).
        """
        path = os.fspath(path)
        if ckpt.is_portable(path) and self._layout_differs(path, model):
            if optim_wrapper is not None:
                raise CheckpointError(
                    f"{path!r} holds the model "
                    + (
                        f"in parts ({', '.join(ckpt.saved_parts(path))}: several optimizers)"
                        if ckpt.saved_parts(path)
                        else "whole (one optimizer)"
                    )
                    + ", and this run sets it up "
                    + (f"in parts ({', '.join(model.parts)})" if model.parts else "whole")
                    + ": its optimizer state cannot be resumed here. load_from it (weights "
                    "only), or resume with the optim_wrapper it was trained with"
                )
            state = ckpt.read_as_mmengine(path)  # weights by name, whatever the layout
            state.pop("optimizer", None)
            if before_model is not None:
                before_model(state)
            self._load_weights(model, state.pop("state_dict"), strict=strict, revise_keys=[])
            return state
        if ckpt.is_portable(path):
            state = ckpt.load(
                self.accel,
                path,
                objects=self._objects(model, optim_wrapper, loading=True),
                strict=strict,
                rng=resume,
            )
            view = self.hook_view(model)
            if before_model is not None and view is not None:
                live = dict(view)
                state["state_dict"] = view
                if isinstance(state.get("ema_state_dict"), dict):
                    ckpt.swap_ema_state(view, state["ema_state_dict"])  # MMEngine's layout
                before_model(state)
                changed = {k: v for k, v in view.items() if k in live and v is not live[k]}
                if changed:
                    self._load_weights(model, changed, strict=False, revise_keys=[])
                state.pop("state_dict", None)
            elif before_model is not None:
                before_model(state)
            return state
        if os.path.isdir(path):
            raise CheckpointError(
                f"{path!r} is a directory without {ckpt.MANIFEST}: not an accelkit checkpoint "
                "(an unfinished save, or another tool's format)"
            )
        state = ckpt.read_pickled(path, trust_pickle=self.adapter.trust_pickle)
        if "state_dict" not in state:  # a bare state dict
            state = {"state_dict": state}
        if before_model is not None:
            before_model(state)
        if model.parts and self.accel.capabilities.sharded:
            if optim_wrapper is not None and "optimizer" in state:
                raise UnsupportedError(
                    f"resuming the several optimizers of a pickled .pth on {self.accel.name!r} "
                    "(a backend that shards) is not supported: load_from it (weights only), "
                    "or resume an accelkit checkpoint"
                )
            self._load_weights(
                model, state.pop("state_dict"), strict=strict, revise_keys=revise_keys
            )
            return state
        if self.accel.capabilities.sharded:
            # weights and optimizer state through a temporary portable checkpoint: each rank
            # takes its own ranges, and the backend refreshes its masters and partitions
            optimizer_state = state.pop("optimizer", None) if optim_wrapper is not None else None
            ckpt.load_full_state_dict(
                self.accel,
                model.wrapped,
                ckpt.revise_state_dict(dict(state.pop("state_dict")), revise_keys),
                strict=strict,
                optimizer=None if optimizer_state is None else optim_wrapper.optimizer,
                optimizer_state=optimizer_state,
            )
            return state
        self._load_weights(model, state.pop("state_dict"), strict=strict, revise_keys=revise_keys)
        if optim_wrapper is not None and "optimizer" in state:
            optim_wrapper.load_state_dict(state.pop("optimizer"))
        return state
