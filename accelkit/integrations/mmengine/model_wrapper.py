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


def _is_tta(model: Any) -> bool:
    from mmengine.model import BaseTTAModel

    return isinstance(model, BaseTTAModel)


def _run_forward(model: Any, data: Any, mode: str) -> Any:
    """Call ``model`` on what MMEngine's data preprocessor returned (as BaseModel does)."""
    if isinstance(data, dict):
        return model(**data, mode=mode)
    if isinstance(data, (list, tuple)):
        return model(*data, mode=mode)
    raise TypeError(f"the data preprocessor must return a dict, list or tuple, got {type(data)}")


def _module_handed_in(accelerator: Accelerator, wrapped: torch.nn.Module, model: Any) -> Any:
    """The model ``setup`` was given, as it is reached from what ``setup`` returned.

    ``accelerator.unwrap`` follows every ``.module``; a ``BaseTTAModel`` has one too (the model
    it augments), and following it would run the inner model's forward instead of the TTA
    model's ``test_step``. Walk the wrapper chain only down to the object handed in."""
    if model is None:
        return accelerator.unwrap(wrapped)
    inner = wrapped
    while inner is not model:
        nxt = next(
            (
                getattr(inner, attr)
                for attr in ("module", "_orig_mod")
                if isinstance(getattr(inner, attr, None), torch.nn.Module)
            ),
            None,
        )
        if nxt is None:  # the backend replaced the model: its own unwrap knows where it is
            return accelerator.unwrap(wrapped)
        inner = nxt
    return model


def user_state_dict(
    accelerator: Accelerator,
    model: torch.nn.Module,
    parts: dict[str, torch.nn.Module],
    *,
    full: bool,
) -> dict[str, Any]:
    """The state dict of a model whose submodules ``parts`` were set up one by one, under the
    user's names (no backend wrapper's ``module.``), in ``model.state_dict()``'s order.

    ``full``: gather the parts' whole tensors (sharded backends); otherwise the local ones."""
    state: dict[str, Any] = {}
    model._save_to_state_dict(state, "", False)  # the model's own parameters and buffers
    for name, child in model._modules.items():
        if child is None:
            continue
        if name in parts:
            part = parts[name]
            inner = (
                accelerator.full_state_dict(part) if full else accelerator.unwrap(part).state_dict()
            )
        else:
            inner = child.state_dict()
        state.update((f"{name}.{key}", value) for key, value in inner.items())
    return state


@MODEL_WRAPPERS.register_module()
class AccelkitModelWrapper(torch.nn.Module):
    """The model from ``accel.setup`` seen through MMEngine's model-wrapper interface.

    An ``nn.Module`` like MMEngine's own wrappers: ``module`` (its one child) is the user's model,
    the one handed to ``setup`` (a ``BaseTTAModel`` stays one); ``wrapped`` is what the backend
    returned and what the forward runs through (so DDP syncs, ZeRO-3 gathers, precision
    applies). Where the backend did not wrap the model, the user's own
    ``train_step``/``val_step``/``test_step`` run, so a model that overrides them keeps working.
    """

    def __init__(
        self,
        *,
        accelerator: Accelerator,
        model: torch.nn.Module,
        module: torch.nn.Module | None = None,
        parts: dict[str, torch.nn.Module] | None = None,
        pipeline_loss: str | None = None,
        eval_copy: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        # plain attributes, not submodules: ``module`` is the one child, as in MMEngine's
        # wrappers (``named_parameters`` gives ``module.<name>``)
        object.__setattr__(self, "accelerator", accelerator)
        object.__setattr__(self, "wrapped", model)
        #: several optimizers: the submodules of the model set up one by one (name -> what
        #: ``setup`` returned, also in the model in their place), as MMEngine's
        #: MMSeparateDistributedDataParallel wraps them; empty for one optimizer
        object.__setattr__(self, "parts", dict(parts or {}))
        #: under ``pp``: the model's loss method path and the whole-model copy validation
        #: runs on (:meth:`_pipeline_train_step`, :meth:`_pipeline_eval_model`)
        object.__setattr__(self, "pipeline_loss", pipeline_loss)
        object.__setattr__(self, "_eval_copy", eval_copy)
        object.__setattr__(self, "_eval_version", None)
        if pipeline_loss is not None and module is not None:
            self.module = module  # the model as built: the stage is a pruned copy of it
        else:
            self.module = _module_handed_in(accelerator, model, module)
        object.__setattr__(self, "_setup_module", self.module)

    @property
    def _unwrapped(self) -> bool:
        return self.wrapped is self.module

    @property
    def _module_replaced(self) -> bool:
        """A hook set ``runner.model.module`` to another model (a TTA model around it): that
        model's own steps run, on top of the set-up model."""
        return self.module is not self._setup_module

    def __getattr__(self, name: str) -> Any:
        # only reached for names that are no attribute: parameters, buffers and the child
        # ``module`` first (nn.Module's), then the user's model, as before the wrapper existed
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    def train(self, mode: bool = True) -> AccelkitModelWrapper:
        super().train(mode)
        self.wrapped.train(mode)
        return self

    def eval(self) -> AccelkitModelWrapper:
        return self.train(False)

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, torch.Tensor]:
        if self.pipeline_loss is not None:
            return self._pipeline_train_step(data, optim_wrapper)
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

    def _pipeline_train_step(self, data: Any, optim_wrapper: Any) -> dict[str, torch.Tensor]:
        """``pp > 1``: the data preprocessor on every rank, then ``accel.forward_backward`` over
        the batch's ``inputs``. The stage forward runs in ``mode='tensor'``; on the last stage
        the loss method (``pipeline=dict(loss='head.loss')``) turns each micro-batch's output
        and its ``data_samples`` into the loss dict, and ``parse_losses`` into the loss. The
        data samples ride along as their indices (a micro-batch's target is its slice of
        them). The logged loss is the mean over the micro-batches, on every rank."""
        data = self.module.data_preprocessor(data, True)
        if not isinstance(data, dict) or "inputs" not in data:
            raise UnsupportedError(
                "pp under MMEngine: the data preprocessor must return a dict with 'inputs' (and "
                "'data_samples'), as BaseDataPreprocessor does"
            )
        inputs, samples = data["inputs"], data.get("data_samples")
        count = len(samples) if samples is not None else len(inputs)
        index = torch.arange(count, device=inputs.device if hasattr(inputs, "device") else None)
        stage = self.accelerator.unwrap(self.wrapped)
        parse = self.module.parse_losses

        def run(factor: float) -> torch.Tensor:
            def loss_fn(output: Any, rows: torch.Tensor) -> torch.Tensor:
                method: Any = stage
                for part in self.pipeline_loss.split("."):
                    method = getattr(method, part)
                picked = [samples[i] for i in rows.tolist()] if samples is not None else None
                parsed, _ = parse(method(output, picked))
                return parsed * factor if factor != 1 else parsed

            return self.accelerator.forward_backward(
                self.wrapped, inputs, target=index, loss_fn=loss_fn
            )

        loss = optim_wrapper.update_params_by(run)
        return {"loss": loss}

    def _pipeline_eval_model(self) -> torch.nn.Module:
        """Validation under ``pp``: the whole model, its weights gathered from every stage
        (``accel.full_state_dict``, a collective every rank runs at its first val_step after
        an optimizer step) into a copy made before setup. Every rank then evaluates its share
        of the validation data on the whole model; the memory is the whole model's."""
        if self._eval_copy is None:
            raise UnsupportedError("pp under MMEngine: no model copy to validate on")
        version = self.accelerator.applied_steps
        if self._eval_version != version:
            state = self.accelerator.full_state_dict(self.wrapped)
            self._eval_copy.load_state_dict(state, strict=True)
            object.__setattr__(self, "_eval_version", version)
        self._eval_copy.eval()
        return self._eval_copy

    @property
    def _direct_eval(self) -> bool:
        """Evaluate on the module itself, as MMEngine's ``MMDistributedDataParallel`` does:
        torch DDP's forward would broadcast rank 0's buffers (BatchNorm statistics) in eval
        too. Other wrappers (sharded ones) must run their own forward to gather parameters."""
        return self._unwrapped or isinstance(
            self.wrapped, torch.nn.parallel.DistributedDataParallel
        )

    def val_step(self, data: Any) -> list:
        if self.pipeline_loss is not None:
            return self._pipeline_eval_model().val_step(data)
        if self._direct_eval or self._module_replaced:
            return self.module.val_step(data)
        data = self.module.data_preprocessor(data, False)
        return _run_forward(self.wrapped, data, mode="predict")

    def test_step(self, data: Any) -> list:
        if self.pipeline_loss is not None:
            return self._pipeline_eval_model().test_step(data)
        if self._direct_eval or self._module_replaced or _is_tta(self.module):
            return self.module.test_step(data)
        data = self.module.data_preprocessor(data, False)
        return _run_forward(self.wrapped, data, mode="predict")

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The user's model state under its own names (a full gather on sharded backends).

        Inside another module (a TTA model around ``runner.model``) it fills that module's
        ``destination`` under ``prefix``, as the user's model there would."""
        if args:
            raise TypeError("AccelkitModelWrapper.state_dict takes keyword arguments only")
        state = (
            user_state_dict(self.accelerator, self.wrapped, self.parts, full=True)
            if self.parts
            else self.accelerator.full_state_dict(self.wrapped)
        )
        if destination is None:
            return state
        for key, value in state.items():
            destination[prefix + key] = value
        return destination

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
