"""``AccelkitStrategy``: any accelkit backend as an MMEngine FlexibleRunner strategy::

    runner = FlexibleRunner(
        ...,
        strategy=dict(type='AccelkitStrategy', backend='deepspeed',
                      config=dict(zero_stage=2), precision='bf16-mixed'),
    )

``prepare`` builds the Accelerator (accumulation and clipping come from ``optim_wrapper``), builds
the model (inside ``accel.init_module()`` where the backend needs it), builds the optimizer, calls
``accel.setup(model, optimizer)`` once, and then builds the parameter schedulers on the result.
Checkpoints go through accelkit's portable format.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mmengine
from mmengine._strategy import BaseStrategy
from mmengine.registry import STRATEGIES
from mmengine.utils import get_git_hash

from accelkit.integrations.mmengine._bridge import Bridge, join_process_group
from accelkit.integrations.mmengine._settings import AdapterOptions, read_optim_wrapper_cfg
from accelkit.integrations.mmengine.several_optimizers import adopt_built

_BASE_KEYS = ("work_dir", "experiment_name", "env_kwargs", "log_kwargs", "auto_scale_lr")


@STRATEGIES.register_module()
class AccelkitStrategy(BaseStrategy):
    """MMEngine strategy backed by :func:`accelkit.get`.

    Args:
        backend: an accelkit backend name (``accelkit env`` lists them).
        config: the backend's config (dict, YAML/JSON path, or its native config).
        precision: ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true``.
        trust_pickle: allow ``load_from``/``resume`` of pickled ``.pth`` checkpoints.
        init_module: build the model inside ``accel.init_module()`` (meta device, ZeRO-3 init).
        setup_kwargs: keyword arguments for ``accel.setup`` (``activation_checkpointing=...``).
        **options: backend options, and BaseStrategy's own arguments.
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        config: Any = None,
        precision: str | None = None,
        trust_pickle: bool = False,
        init_module: bool = False,
        setup_kwargs: dict | None = None,
        **options: Any,
    ) -> None:
        base = {k: options.pop(k) for k in _BASE_KEYS if k in options}
        section = dict(
            backend=backend,
            config=config,
            precision=precision,
            trust_pickle=trust_pickle,
            init_module=init_module,
            setup_kwargs=setup_kwargs,
            **options,
        )
        self._bridge = Bridge(AdapterOptions.parse(section, "AccelkitStrategy"))
        super().__init__(**base)

    @property
    def accelerator(self) -> Any:
        return self._bridge.accelerator

    def _setup_distributed(
        self, launcher: str | None = None, backend: str = "nccl", **kwargs: Any
    ) -> None:
        join_process_group(backend, kwargs.get("timeout"))

    def prepare(
        self,
        model: Any,
        *,
        optim_wrapper: Any = None,
        param_scheduler: Any = None,
        compile: dict | bool = False,
        dispatch_kwargs: dict | None = None,
    ) -> Any:
        if self._prepared:
            return self._prepared_components()
        if dispatch_kwargs is not None:
            self.dispatch_kwargs.update(dispatch_kwargs)
        optim_cfg, settings = read_optim_wrapper_cfg(optim_wrapper)
        self._bridge.build_accelerator(settings)
        with self._bridge.model_context():
            model = self.build_model(model)
        if self._bridge.runs_init_weights:
            model = self._init_model_weights(model)
        wrapper = None
        if optim_cfg is not None:
            wrapper = adopt_built(self.build_optim_wrapper(optim_cfg, model), settings)
            self.optim_wrapper = wrapper
        self.model = self._bridge.setup(
            model, wrapper, micro_batch=self.dispatch_kwargs.get("train_micro_batch_size_per_gpu")
        )
        self.model = self.compile_model(self.model, compile=compile)
        if wrapper is not None:
            self._scale_lr()
            if "max_iters" in self.dispatch_kwargs:
                wrapper.initialize_count_status(self.model, 0, self.dispatch_kwargs["max_iters"])
        if param_scheduler is not None:
            self.param_schedulers = self.build_param_scheduler(param_scheduler, self.optim_wrapper)
        self._prepared = True
        return self._prepared_components()

    def build_param_scheduler(
        self, scheduler: Any, optim_wrapper: Any, default_args: dict | None = None
    ) -> Any:
        """MMEngine's, with a dict of schedulers per optimizer: MMEngine 0.10's BaseStrategy
        pops ``max_epochs``/``max_iters`` out of the ``default_args`` it shares between the
        optimizers, so a second optimizer's scheduler without ``end`` fails ("max_epochs must
        be specified in default_args"); here each optimizer gets its own."""
        from mmengine.optim import OptimWrapperDict

        if not isinstance(optim_wrapper, OptimWrapperDict):
            return super().build_param_scheduler(scheduler, optim_wrapper, default_args)
        per_name = isinstance(scheduler, dict) and "type" not in scheduler
        return {
            name: super(AccelkitStrategy, self).build_param_scheduler(
                scheduler[name] if per_name else scheduler,
                wrapper,
                None if default_args is None else dict(default_args),
            )
            for name, wrapper in optim_wrapper.items()
        }

    # ---- checkpoints --------------------------------------------------------------------------
    def load_checkpoint(
        self,
        filename: str,
        *,
        map_location: Any = "cpu",
        strict: bool = False,
        revise_keys: list = [(r"^module.", "")],  # noqa: B006 - MMEngine's signature
        callback: Callable | None = None,
    ) -> dict:
        self.logger.info(f"Load checkpoint from {filename}")
        return self._bridge.load(
            filename,
            self.model,
            None,
            strict=strict,
            revise_keys=revise_keys,
            before_model=callback,
            resume=False,  # load_from: the weights, never the random state
        )

    def resume(
        self,
        filename: str,
        *,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        map_location: Any = "default",
        callback: Callable | None = None,
    ) -> dict:
        self.logger.info(f"Resume checkpoint from {filename}")
        optim_wrapper = getattr(self, "optim_wrapper", None) if resume_optimizer else None
        checkpoint = self._bridge.load(
            filename,
            self.model,
            optim_wrapper,
            strict=True,
            revise_keys=[(r"^module.", "")],
            before_model=callback,
            resume=True,
        )
        if resume_param_scheduler and hasattr(self, "param_schedulers"):
            if "param_schedulers" in checkpoint:
                self.load_scheduler_state_dict(checkpoint.pop("param_schedulers"))
            else:
                self.logger.warning(f"{filename} holds no parameter scheduler state")
        resumed_seed = checkpoint["meta"].get("seed", None)
        current_seed = self._randomness.get("seed")
        if resumed_seed is not None and resumed_seed != current_seed:
            if current_seed is not None:
                self.logger.warning(
                    f'The value of random seed in the checkpoint "{resumed_seed}" is different '
                    f'from the value in `randomness` config "{current_seed}"'
                )
            self._randomness.update(seed=resumed_seed)
            self._set_randomness(**self._randomness)
        if hasattr(self, "optim_wrapper") and "max_iters" in self.dispatch_kwargs:
            self.optim_wrapper.initialize_count_status(
                self.model, checkpoint["meta"]["iter"], self.dispatch_kwargs["max_iters"]
            )
        return checkpoint

    def save_checkpoint(
        self,
        filename: str,
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra_ckpt: dict | None = None,
        callback: Callable | None = None,
    ) -> None:
        checkpoint = dict(extra_ckpt or {})
        checkpoint.setdefault("meta", {})
        checkpoint["meta"].update(
            seed=self.seed,
            time=time.strftime("%Y%m%d_%H%M%S", time.localtime()),
            mmengine=mmengine.__version__ + get_git_hash(),
        )
        if save_param_scheduler and hasattr(self, "param_schedulers"):
            checkpoint["param_schedulers"] = self.scheduler_state_dict()
        view = self._bridge.hook_view(self.model)
        if view is not None:
            checkpoint["state_dict"] = view
        if callback is not None:
            self._bridge.call_save_hooks(callback, checkpoint)
        optim_wrapper = getattr(self, "optim_wrapper", None) if save_optimizer else None
        self._bridge.save(filename, self.model, optim_wrapper, checkpoint)
