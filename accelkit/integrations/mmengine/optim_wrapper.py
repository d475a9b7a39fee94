"""``AccelkitOptimWrapper``: MMEngine's optimizer-wrapper API on top of an Accelerator.

MMEngine's rule for accumulation (``OptimWrapper`` in mmengine/optim/optimizer/optimizer_wrapper.py)
is kept exactly, because MMEngine users rely on it:

- windows are counted over the whole run (``_inner_count``, which continues across epochs and
  starts at the resumed iteration), not per epoch;
- the loss is divided by ``accumulative_counts``, except in the last window of the run when
  ``max_iters`` is not a multiple of it: there it is divided by the remainder;
- the optimizer steps when ``_inner_count`` is a multiple of ``accumulative_counts`` or equals
  ``max_iters``;
- parameter schedulers are stepped by MMEngine's ParamSchedulerHook (every iteration or every
  epoch as configured), not by accelkit after each applied step.

accelkit divides the loss by ``accumulation_steps`` (or lets the backend do it, as DeepSpeed does),
so where MMEngine's factor differs the loss is multiplied by ``accumulation_steps / factor`` first;
the Accelerator's window is placed on MMEngine's counter before each forward and each step, so
gradient sync and the optimizer step happen exactly where MMEngine would have them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS

from accelkit.errors import ConfigError, UnsupportedError

if TYPE_CHECKING:
    from accelkit.accelerator import Accelerator


@OPTIM_WRAPPERS.register_module()
class AccelkitOptimWrapper(OptimWrapper):
    """MMEngine optimizer wrapper whose backward/step/zero_grad go through an Accelerator.

    Built from the user's ``optim_wrapper`` config by the Runner or Strategy, then bound to the
    Accelerator with :meth:`attach` once ``accel.setup(model, optimizer)`` has run.
    ``clip_grad=dict(max_norm=X)`` is applied by accelkit (``max_grad_norm``) inside the step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulative_counts: int = 1,
        clip_grad: dict | None = None,
    ) -> None:
        super().__init__(optimizer, accumulative_counts, clip_grad)
        self.accelerator: Accelerator | None = None
        self._model: torch.nn.Module | None = None

    # ---- binding ------------------------------------------------------------------------------
    def attach(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        one_of_several: bool = False,
    ) -> None:
        """Use ``optimizer`` (from ``accel.setup``) and route every update through ``accelerator``.

        ``one_of_several``: a wrapper of an ``OptimWrapperDict``, whose ``accumulative_counts``
        may be smaller than the Accelerator's (which accumulates over the largest of them)."""
        counts, steps = self._accumulative_counts, accelerator.accumulation_steps
        if counts != steps and not (one_of_several and counts < steps):
            raise ConfigError(
                f"the accelerator accumulates over {accelerator.accumulation_steps} micro-batches "
                f"but optim_wrapper says accumulative_counts={self._accumulative_counts}"
            )
        self.accelerator = accelerator
        self._model = model
        self.optimizer = optimizer

    @property
    def _accel(self) -> Accelerator:
        if self.accelerator is None:
            raise UnsupportedError(
                "AccelkitOptimWrapper is not attached to an Accelerator yet; build it through "
                "AccelkitRunner or AccelkitStrategy"
            )
        return self.accelerator

    def _place_window(self, *, closes: bool, counted: int) -> None:
        """Put the Accelerator's window where MMEngine's counter is.

        ``counted`` micro-batches of the current window have been counted by accelkit already;
        ``closes`` says whether the micro-batch about to be counted ends the window. A wrapper
        of an ``OptimWrapperDict`` that accumulates over fewer micro-batches than the
        Accelerator keeps its open window at 0 (counting one more never closes it).
        """
        accel = self._accel
        n = accel.accumulation_steps
        windows = getattr(accel, "_windows", None)
        key = id(self.optimizer)
        if windows is None or key not in windows:
            raise UnsupportedError("this Accelerator does not expose its accumulation window")
        if closes:
            windows[key].micro = n - 1
        else:
            windows[key].micro = counted % n if self._accumulative_counts == n else 0

    # ---- MMEngine's API -----------------------------------------------------------------------
    def _loss_factor(self) -> int:
        """MMEngine's divisor for the loss of the coming micro-batch (see ``scale_loss``)."""
        n = self._accumulative_counts
        if n == 1:
            return 1
        if self._max_counts == -1:
            return n
        if self._inner_count < self._max_counts - self._remainder_counts:
            return n
        if self._remainder_counts <= 0:
            raise ConfigError(
                "accumulation counters are inconsistent: initialize_count_status was called with "
                f"init_counts={self._inner_count} and max_counts={self._max_counts}"
            )
        return self._remainder_counts

    def _backward_divided_by(self, loss: torch.Tensor, divisor: int, **kwargs: Any) -> None:
        accel = self._accel
        n = accel.accumulation_steps
        # a backend that reduces at its own boundary (DeepSpeed) asks the window before backward
        self._place_window(closes=self.should_sync(), counted=self._inner_count)
        if n != divisor:
            # accelkit (or the backend) divides by n; MMEngine wants loss / divisor
            loss = loss * (n / divisor)
        accel.backward(loss, model=self._model, **kwargs)
        self._inner_count += 1

    def update_params(  # type: ignore[override]
        self,
        loss: torch.Tensor,
        step_kwargs: dict | None = None,
        zero_kwargs: dict | None = None,
    ) -> None:
        """Backward with MMEngine's loss factor; step and zero_grad where MMEngine would."""
        if step_kwargs or zero_kwargs:
            raise UnsupportedError("accelkit's optimizer step takes no step_kwargs/zero_kwargs")
        self._backward_divided_by(loss, self._loss_factor())
        if self.should_update():
            self.step()
            self.zero_grad()
        else:
            # count the micro-batch in accelkit's window without closing it
            self._place_window(closes=False, counted=self._inner_count - 1)
            self._accel.step(self.optimizer)

    def update_params_by(self, forward_backward: Any) -> torch.Tensor:
        """Under pipeline parallelism: ``forward_backward(factor)`` runs the forward and
        backward of the whole batch (``accel.forward_backward``, each loss multiplied by
        ``factor``, MMEngine's accumulation factor over accelkit's); then step and zero_grad
        where :meth:`update_params` would. Returns what ``forward_backward`` returned."""
        n = self._accel.accumulation_steps
        divisor = self._loss_factor()
        self._place_window(closes=self.should_sync(), counted=self._inner_count)
        loss = forward_backward(n / divisor)
        self._inner_count += 1
        if self.should_update():
            self.step()
            self.zero_grad()
        else:
            self._place_window(closes=False, counted=self._inner_count - 1)
            self._accel.step(self.optimizer)
        return loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Plain backward, as MMEngine's ``OptimWrapper.backward`` (no accumulation factor)."""
        self._backward_divided_by(loss, 1, **kwargs)

    def step(self, **kwargs: Any) -> None:
        """Unscale, clip (``clip_grad``), step: always applies, as MMEngine's ``step`` does."""
        if kwargs:
            raise UnsupportedError("accelkit's optimizer step takes no keyword arguments")
        accel = self._accel
        self._place_window(closes=True, counted=0)
        accel.step(self.optimizer)
        norm = accel.grad_norm
        if norm is not None:
            self.message_hub.update_scalar("train/grad_norm", float(norm))

    def zero_grad(self, **kwargs: Any) -> None:
        self._accel.zero_grad(self.optimizer)

    @contextlib.contextmanager
    def optim_context(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip gradient sync inside an accumulation window where the backend can."""
        accel = self._accel
        self._place_window(closes=self.should_sync(), counted=self._inner_count)
        with accel.accumulate(self._model):
            yield


_ON_ACCELKIT: dict[type, type] = {}


def on_accelkit(wrapper_class: type[OptimWrapper]) -> type[AccelkitOptimWrapper]:
    """``wrapper_class`` (an ``OptimWrapper`` subclass of the user's) on top of accelkit.

    The class built is ``(wrapper_class, AccelkitOptimWrapper)``: Python's method order puts
    the user's overrides first and accelkit's wrapper where ``OptimWrapper`` was, so a
    ``super().update_params(loss)`` in the subclass goes through accelkit; what the subclass
    does not override is accelkit's. ``isinstance(wrapper, wrapper_class)`` holds.
    """
    if issubclass(wrapper_class, AccelkitOptimWrapper):
        return wrapper_class
    built = _ON_ACCELKIT.get(wrapper_class)
    if built is None:
        built = type(
            wrapper_class.__name__,
            (wrapper_class, AccelkitOptimWrapper),
            {
                "__module__": wrapper_class.__module__,
                "__qualname__": wrapper_class.__qualname__,
                "__doc__": f"{wrapper_class.__qualname__} on accelkit (AccelkitOptimWrapper).",
            },
        )
        _ON_ACCELKIT[wrapper_class] = built
    return built
