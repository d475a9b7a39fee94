"""``AccelkitRunner``: MMEngine's classic Runner on any accelkit backend.

An existing config changes in one place::

    custom_imports = dict(imports=['accelkit.integrations.mmengine'])
    runner_type = 'AccelkitRunner'
    accelkit = dict(backend='ddp')           # or 'cpu', 'fsdp', 'deepspeed', ... plus its options

MMEngine's Runner wraps the model in ``__init__`` and builds the optimizer later, in ``train()``;
backends such as DeepSpeed need both at once. This Runner keeps the model unwrapped until the
optimizer exists and then calls ``accel.setup(model, optimizer)`` once, before the parameter
schedulers are built. Everything else (loops, hooks, logging, validation, ``resume=True``,
``load_from``) is MMEngine's own code; checkpoints go through accelkit's portable format.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import mmengine
import torch
from mmengine.model import convert_sync_batchnorm, revert_sync_batchnorm
from mmengine.optim import OptimWrapperDict
from mmengine.registry import RUNNERS
from mmengine.runner import BaseLoop, Runner
from mmengine.utils import get_git_hash

from accelkit.errors import ConfigError, UnsupportedError
from accelkit.integrations.mmengine import checkpoint as ckpt
from accelkit.integrations.mmengine import object_storage
from accelkit.integrations.mmengine._bridge import Bridge, join_process_group
from accelkit.integrations.mmengine._settings import AdapterOptions, read_optim_wrapper_cfg
from accelkit.integrations.mmengine.hooks import AccelkitCheckpointHook, use_safe_rotation
from accelkit.integrations.mmengine.model_wrapper import AccelkitModelWrapper
from accelkit.integrations.mmengine.optim_wrapper import AccelkitOptimWrapper
from accelkit.integrations.mmengine.several_optimizers import adopt_built


def _wrappers(optim_wrapper: Any) -> list[Any]:
    return list(optim_wrapper.values()) if isinstance(optim_wrapper, OptimWrapperDict) else []


def reshard_sampler(sampler: Any, rank: int, world: int) -> None:
    """Point MMEngine's ``DefaultSampler`` / ``InfiniteSampler`` at another rank and world
    size (the data-parallel ones), as if they had been built with them."""
    import math

    from mmengine.dataset import DefaultSampler, InfiniteSampler

    if isinstance(sampler, DefaultSampler):
        sampler.rank, sampler.world_size = rank, world
        if sampler.round_up:
            sampler.num_samples = math.ceil(len(sampler.dataset) / world)
            sampler.total_size = sampler.num_samples * world
        else:
            sampler.num_samples = math.ceil((len(sampler.dataset) - rank) / world)
            sampler.total_size = len(sampler.dataset)
    elif isinstance(sampler, InfiniteSampler):
        sampler.rank, sampler.world_size = rank, world
        sampler.indices = sampler._indices_of_rank()
    else:
        raise UnsupportedError(
            f"pp under MMEngine: the training sampler {type(sampler).__name__} cannot be "
            "sharded by the data-parallel rank (every stage of a replica must read the same "
            "batches); use DefaultSampler or InfiniteSampler"
        )


@RUNNERS.register_module()
class AccelkitRunner(Runner):
    """MMEngine's Runner with the model, optimizer and checkpoints handled by accelkit.

    Takes every argument of ``mmengine.runner.Runner`` plus ``accelkit=dict(backend=...,
    config=..., precision=..., trust_pickle=False, **backend_options)``, which may also come
    from the config's top-level ``accelkit`` key.
    """

    def __init__(self, *args: Any, accelkit: dict | None = None, **kwargs: Any) -> None:
        self._accelkit_section = accelkit
        self._bridge: Bridge | None = None
        self._weights_initialised = False
        self._optim_settings: Any = None
        #: the wrapper the model was set up with (None: not set up, or for evaluation only)
        self._setup_wrapper: Any = None
        #: inside train(): building the optimizer wrapper sets the model up with it
        self._in_train = False
        super().__init__(*args, **kwargs)

    @property
    def accelerator(self) -> Any:
        """The :class:`accelkit.Accelerator` this Runner trains with."""
        return self._bridge.accel if self._bridge is not None else None

    # ---- environment and model ----------------------------------------------------------------
    def setup_env(self, env_cfg: dict) -> None:
        section = self._accelkit_section
        if section is None:
            section = self.cfg.get("accelkit")
        adapter = AdapterOptions.parse(section, "accelkit")
        optim_cfg, settings = read_optim_wrapper_cfg(self.optim_wrapper)
        if optim_cfg is not None:
            self.optim_wrapper = optim_cfg
        self._optim_settings = settings
        self._bridge = Bridge(adapter)
        self._bridge.build_accelerator(
            settings,
            model_wrapper_cfg=self.cfg.get("model_wrapper_cfg"),
            find_unused_parameters=self.cfg.get("find_unused_parameters"),
            launched_distributed=self.distributed,
        )
        if self.distributed:
            dist_cfg = env_cfg.get("dist_cfg", {}) or {}
            join_process_group(dist_cfg.get("backend"), dist_cfg.get("timeout"))
        super().setup_env(env_cfg)

    def build_model(self, model: Any) -> Any:
        if isinstance(model, dict):
            with self._bridge.model_context():
                return super().build_model(model)
        return super().build_model(model)

    def wrap_model(self, model_wrapper_cfg: dict | None, model: Any) -> Any:
        """Leave the model unwrapped: accelkit wraps it together with its optimizer.

        ``model_wrapper_cfg`` was read in ``setup_env``: the DDP options it names went to the
        backend's options, anything else was refused there."""
        if self._world_size == 1:
            return revert_sync_batchnorm(model)
        sync_bn = self.cfg.get("sync_bn", None)
        return convert_sync_batchnorm(model, sync_bn) if sync_bn is not None else model

    def _init_model_weights(self) -> None:
        if self._weights_initialised:
            return
        self._weights_initialised = True
        if self._bridge.runs_init_weights:
            accel = self._bridge.accel
            if not accel.capabilities.sharded:
                # where MMEngine's Runner has it by now (wrap_model moved it): a random
                # init_cfg then draws from the same device's generator. In place, so the
                # optimizer already built keeps its parameters.
                self.model.to(accel.device)
            super()._init_model_weights()

    def _set_up_model(self) -> AccelkitModelWrapper | None:
        """The model accelkit set up, also where a hook put a model around it (PrepareTTAHook
        makes ``runner.model`` a TTA model holding it)."""
        if isinstance(self.model, AccelkitModelWrapper):
            return self.model
        if isinstance(self.model, torch.nn.Module):
            for module in self.model.modules():
                if isinstance(module, AccelkitModelWrapper):
                    return module
        return None

    def _setup_model(self, optim_wrapper: Any) -> None:
        if self._set_up_model() is not None:
            if optim_wrapper is None or optim_wrapper is self._setup_wrapper:
                return
            if self._setup_wrapper is None:
                raise UnsupportedError(
                    "the model was set up for evaluation only (val()/test() ran first); call "
                    "train() before val()/test(), or build a new Runner to train"
                )
            raise UnsupportedError(
                "the model is already set up with runner.optim_wrapper (accelkit's backend "
                "takes a model and its optimizer together, once); train with "
                "runner.optim_wrapper, or build a new Runner to train with another optimizer"
            )
        if optim_wrapper is not None:  # MMEngine's val()/test() never initialise
            self._init_model_weights()  # before setup: a sharded model cannot be re-initialised
        micro_batch = None
        if optim_wrapper is not None and isinstance(self._train_loop, BaseLoop):
            micro_batch = getattr(self._train_loop.dataloader, "batch_size", None)
        self.model = self._bridge.setup(self.model, optim_wrapper, micro_batch=micro_batch)
        self._setup_wrapper = optim_wrapper
        self._bridge.check_hooks(self._hooks, self.model)  # before before_run builds EMAHook's copy

    def build_train_loop(self, loop: Any) -> Any:
        """MMEngine's, with the training sampler sharded by the data-parallel rank under
        ``pp``: the stages of one replica must read the same batches (MMEngine's samplers shard
        by the process rank)."""
        built = super().build_train_loop(loop)
        accel = self.accelerator
        if accel is not None and accel.backend.settings.pipeline is not None:
            reshard_sampler(
                built.dataloader.sampler,
                accel.backend.data_parallel_rank,
                accel.backend.data_parallel_world_size,
            )
        return built

    def build_optim_wrapper(self, optim_wrapper: Any) -> Any:
        """MMEngine's ``build_optim_wrapper``, building an :class:`AccelkitOptimWrapper`.

        As in MMEngine, every call builds a new wrapper (an ``OptimWrapper`` given is returned as
        it is). The one ``train()`` builds (and a resume's) is the one the model is set up with;
        a wrapper built outside ``train()`` is bound to the backend when ``train()`` starts with
        it as ``runner.optim_wrapper``."""
        wrapper = self._build_optim_wrapper(optim_wrapper)
        if self._in_train:
            self._setup_model(wrapper)
        return wrapper

    def _build_optim_wrapper(self, optim_wrapper: Any) -> Any:
        if isinstance(optim_wrapper, (AccelkitOptimWrapper, OptimWrapperDict)) and all(
            isinstance(w, AccelkitOptimWrapper) for w in _wrappers(optim_wrapper)
        ):
            return optim_wrapper
        settings = self._optim_settings
        if optim_wrapper is not self.optim_wrapper:
            optim_wrapper, settings = read_optim_wrapper_cfg(optim_wrapper)
            # one optimizer or several is no setting of the backend (setup checks that it can
            # hold several): only what the Accelerator was built with must agree
            built = self._optim_settings
            if built is not None and dataclasses.replace(settings, several=built.several) != built:
                raise ConfigError(
                    "this optim_wrapper trains with other settings (accumulative_counts, "
                    "clip_grad, AMP) than the config's optim_wrapper, from which the Runner "
                    f"built accelkit's backend ({settings} != {built}); change the config's "
                    "optim_wrapper instead"
                )
        wrapper = super().build_optim_wrapper(optim_wrapper)
        return adopt_built(wrapper, settings)

    def train(self) -> Any:
        self._in_train = True
        try:
            return super().train()
        finally:
            self._in_train = False
            self._end_run()

    def val(self) -> dict:
        self._setup_model(None)
        try:
            return super().val()
        finally:
            self._end_run()

    def test(self) -> dict:
        self._setup_model(None)
        try:
            return super().test()
        finally:
            self._end_run()

    def _end_run(self) -> None:
        """Whatever way a run ends (a refusal raised after ``before_run`` included), accelkit's
        log lines stop going into its log file."""
        for hook in self._hooks:
            if isinstance(hook, AccelkitCheckpointHook):
                hook.detach_log_forwarder()

    def register_hooks(self, default_hooks: Any = None, custom_hooks: Any = None) -> None:
        super().register_hooks(default_hooks, custom_hooks)
        use_safe_rotation(self._hooks)

    # ---- checkpoints --------------------------------------------------------------------------
    def resume(
        self,
        filename: str,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        map_location: Any = "default",
    ) -> None:
        self._resume_optimizer = resume_optimizer
        try:
            super().resume(filename, resume_optimizer, resume_param_scheduler, map_location)
        finally:
            self._resume_optimizer = None

    def load_checkpoint(
        self,
        filename: str,
        map_location: Any = "cpu",
        strict: bool = False,
        revise_keys: list = [(r"^module.", "")],  # noqa: B006 - MMEngine's signature
    ) -> dict:
        resuming = getattr(self, "_resume_optimizer", None) is not None
        optim_wrapper = None
        if resuming and self._resume_optimizer:
            optim_wrapper = self.optim_wrapper = self._build_optim_wrapper(self.optim_wrapper)
            self._setup_model(optim_wrapper)
        else:
            self._setup_model(None)
        checkpoint = self._bridge.load(
            filename,
            self._set_up_model(),
            optim_wrapper,
            strict=strict or resuming,
            revise_keys=revise_keys,
            before_model=lambda c: self.call_hook("after_load_checkpoint", checkpoint=c),
            resume=resuming,
        )
        self._has_loaded = True
        self.logger.info(f"Load checkpoint from {filename}")
        return checkpoint

    def save_checkpoint(
        self,
        out_dir: str,
        filename: str,
        file_client_args: dict | None = None,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        meta: dict | None = None,
        by_epoch: bool = True,
        backend_args: dict | None = None,
    ) -> None:
        """Write a portable checkpoint; every rank takes part (sharded backends need it).
        ``backend_args`` are an ``s3://`` ``out_dir``'s storage options (object_storage.py)."""
        if file_client_args is not None:
            raise UnsupportedError(
                "file_client_args (deprecated by MMEngine) are not supported: pass backend_args "
                "(the endpoint and credentials of an s3:// out_dir) instead"
            )
        options = object_storage.storage_options(backend_args)
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise TypeError(f"meta should be a dict or None, but got {type(meta)}")
        if by_epoch:
            meta.setdefault("epoch", self.epoch + 1)
            meta.setdefault("iter", self.iter)
        else:
            meta.setdefault("epoch", self.epoch)
            meta.setdefault("iter", self.iter + 1)
        meta.update(
            cfg=self.cfg.pretty_text,
            seed=self.seed,
            experiment_name=self.experiment_name,
            time=time.strftime("%Y%m%d_%H%M%S", time.localtime()),
            mmengine_version=mmengine.__version__ + get_git_hash(),
        )
        if hasattr(self.train_dataloader.dataset, "metainfo"):
            meta.update(dataset_meta=self.train_dataloader.dataset.metainfo)
        checkpoint: dict[str, Any] = {"meta": meta, "message_hub": self.message_hub.state_dict()}
        if save_param_scheduler and self.param_schedulers is not None:
            if isinstance(self.param_schedulers, dict):
                checkpoint["param_schedulers"] = {
                    name: [s.state_dict() for s in schedulers]
                    for name, schedulers in self.param_schedulers.items()
                }
            else:
                checkpoint["param_schedulers"] = [s.state_dict() for s in self.param_schedulers]
        model = self._set_up_model()
        if model is None:  # before train()/val()/test()
            ckpt.save_before_setup(
                self.accelerator,
                os.path.join(out_dir, filename),
                model=self.model,
                checkpoint=checkpoint,
                before_save=lambda c: self.call_hook("before_save_checkpoint", checkpoint=c),
                storage_options=options,
            )
            return
        view = self._bridge.hook_view(model)
        if view is not None:
            checkpoint["state_dict"] = view
        self._bridge.call_save_hooks(
            lambda c: self.call_hook("before_save_checkpoint", checkpoint=c), checkpoint
        )
        optim_wrapper = self.optim_wrapper if save_optimizer else None
        if not isinstance(optim_wrapper, (AccelkitOptimWrapper, OptimWrapperDict)):
            optim_wrapper = None  # a config not built yet
        self._bridge.save(
            os.path.join(out_dir, filename), model, optim_wrapper, checkpoint, options
        )
