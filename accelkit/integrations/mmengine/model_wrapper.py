"""``AccelkitModelWrapper``: what ``runner.model`` is once accelkit has set the model up.

MMEngine's loops call ``runner.model.train_step / val_step / test_step`` and ``train()/eval()``,
and hooks reach the user's model as ``runner.model.module`` when ``is_model_wrapper`` is true.
The wrapper gives them exactly that, whatever the backend put around the model (nothing, DDP,
a DeepSpeed engine, ...).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from mmengine.registry import MODEL_WRAPPERS

from accelkit.errors import UnsupportedError

if TYPE_CHECKING:
    from accelkit.accelerator import Accelerator


def _run_forward(model: Any, data: Any, mode: str) -> Any:
    """Call ``model`` on what MMEngine's data preprocessor returned (as BaseModel does)."""
    if isinstance(data, dict):
        return model(**data, mode=mode)
    if isinstance(data, (list, tuple)):
        return model(*data, mode=mode)
    raise TypeError(f"the data preprocessor must return a dict, list or tuple, got {type(data)}")


@MODEL_WRAPPERS.register_module()
class AccelkitModelWrapper:
    """The model from ``accel.setup`` seen through MMEngine's model-wrapper interface.

    ``module`` is the user's own ``BaseModel``; ``wrapped`` is what the backend returned and what
    the forward runs through (so DDP syncs, ZeRO-3 gathers, precision applies). Where the backend
    did not wrap the model, the user's own ``train_step``/``val_step``/``test_step`` run, so a
    model that overrides them keeps working.
    """

    def __init__(self, *, accelerator: Accelerator, model: torch.nn.Module) -> None:
        self.accelerator = accelerator
        self.wrapped = model
        self.module = accelerator.unwrap(model)

    @property
    def _unwrapped(self) -> bool:
        return self.wrapped is self.module

    def __getattr__(self, name: str) -> Any:
        # only reached for names not set in __init__: delegate to the user's model
        if name in ("wrapped", "module", "accelerator"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    def train(self, mode: bool = True) -> AccelkitModelWrapper:
        self.wrapped.train(mode)
        return self

    def eval(self) -> AccelkitModelWrapper:
        return self.train(False)

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, torch.Tensor]:
        if self._unwrapped:
            return self.module.train_step(data, optim_wrapper=optim_wrapper)
        # backward inside the window's context too (MMEngine's DDP wrapper leaves it outside):
        # backends that decide on gradient sync in backward hooks (FairScale's
        # ShardedDataParallel) need it there, and torch DDP decides in forward either way
        with optim_wrapper.optim_context(self.wrapped):
            data = self.module.data_preprocessor(data, True)
            losses = _run_forward(self.wrapped, data, mode="loss")
            parsed_loss, log_vars = self.module.parse_losses(losses)
            optim_wrapper.update_params(parsed_loss)
        return log_vars

    @property
    def _direct_eval(self) -> bool:
        """Evaluate on the module itself, as MMEngine's ``MMDistributedDataParallel`` does:
        torch DDP's forward would broadcast rank 0's buffers (BatchNorm statistics) in eval
        too. Other wrappers (sharded ones) must run their own forward to gather parameters."""
        return self._unwrapped or isinstance(
            self.wrapped, torch.nn.parallel.DistributedDataParallel
        )

    def val_step(self, data: Any) -> list:
        if self._direct_eval:
            return self.module.val_step(data)
        data = self.module.data_preprocessor(data, False)
        return _run_forward(self.wrapped, data, mode="predict")

    def test_step(self, data: Any) -> list:
        if self._direct_eval:
            return self.module.test_step(data)
        data = self.module.data_preprocessor(data, False)
        return _run_forward(self.wrapped, data, mode="predict")

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The user's model state (a full gather on sharded backends)."""
        return self.accelerator.full_state_dict(self.wrapped)

    def __repr__(self) -> str:
        return f"AccelkitModelWrapper({self.accelerator.name}: {type(self.wrapped).__name__})"

    # Copies share the Accelerator (the process's backend and process groups, as a deep-copied
    # DDP shares its process group) and copy the model: hooks such as EMAHook deep-copy it.
    def __copy__(self) -> AccelkitModelWrapper:
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> AccelkitModelWrapper:
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        memo.setdefault(id(self.accelerator), self.accelerator)
        try:
            copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        except Exception as err:
            raise UnsupportedError(
                f"runner.model cannot be deep-copied on {self.accelerator.name}: "
                f"{type(self.wrapped).__name__} refuses it ({err}). Where every rank holds the "
                "whole model, copy your model alone: copy.deepcopy(runner.model.module); where "
                "parameters are partitioned (fsdp, DeepSpeed ZeRO-3), build a new model and load "
                "runner.model.state_dict() (the gathered weights) into it."
            ) from err
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "runner.model (AccelkitModelWrapper) holds accelkit's Accelerator and cannot be "
            "pickled; pickle your model, runner.model.module, or save a checkpoint "
            "(runner.save_checkpoint)"
        )
