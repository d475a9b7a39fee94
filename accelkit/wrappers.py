"""What ``setup`` hands back: the user's module with its forward under the precision policy, and
a real ``torch.optim.Optimizer`` whose ``step``/``zero_grad`` go through the Accelerator."""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import types
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from accelkit.errors import ConfigError, UnsupportedError

if TYPE_CHECKING:
    from accelkit.backend import Backend

log = logging.getLogger("accelkit")

#: the Accelerator whose step() the optimizer runs (``Any``: the facade imports this module)
_Accelerator = Any


def patch_forward(module: torch.nn.Module, backend: Backend) -> torch.nn.Module:
    """Run ``module``'s forward under the backend's precision policy, in place.

    Patching the instance (instead of wrapping it in another Module) keeps ``state_dict`` keys,
    ``isinstance`` checks and attribute access exactly as the user wrote them. The patch is a
    method bound to ``module``, so ``copy.deepcopy`` binds it to the copy (whose forward then
    runs the copy's weights) and ``pickle`` stores the plain forward (the copy is unpatched).
    """
    if getattr(module.forward, "_accelkit_precision_forward", False):
        return module
    original = module.forward
    if inspect.ismethod(original) and original.__self__ is module:
        function = original.__func__

        @functools.wraps(function)
        def forward_method(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            args, kwargs = backend.convert_input((args, kwargs))
            with backend.forward_context():
                out = function(self, *args, **kwargs)
            return backend.convert_output(out)

        forward_method._accelkit_precision_forward = True  # type: ignore[attr-defined]
        module.forward = types.MethodType(forward_method, module)
        return module

    # a forward set on the instance by someone else (a closure, a compiled callable): copies
    # share it, as they would without accelkit
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = backend.convert_input((args, kwargs))
        with backend.forward_context():
            out = original(*args, **kwargs)
        return backend.convert_output(out)

    forward._accelkit_precision_forward = True  # type: ignore[attr-defined]
    module.forward = forward
    return module


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The optimizer ``setup`` returns. Shares ``param_groups`` and ``state`` with the backend's.

    ``step()`` is :meth:`Accelerator.step` for this optimizer: it applies only when the
    accumulation window closes. ``zero_grad()`` does nothing inside an open window. An LR
    scheduler built on this optimizer is stepped by accelkit after each applied step once it is
    handed over: ``accel.setup_scheduler(scheduler)``.

    It passes for the backend's optimizer: ``__class__`` is that optimizer's class, so
    ``isinstance(opt, torch.optim.AdamW)`` holds as for the optimizer the user built (code that
    checks the kind of optimizer keeps working); ``type(opt)`` still tells the truth. A copy
    (``copy.copy``, ``copy.deepcopy``, ``pickle``) is a copy of the backend's optimizer: a plain
    torch optimizer, detached from the Accelerator, exactly what copying that optimizer gives.
    """

    #: the checkpoint saves the optimizer inside (accelkit.checkpoint.shards.fragments.inner_optimizer)
    wraps_optimizer = True

    def __init__(
        self, optimizer: torch.optim.Optimizer, accelerator: _Accelerator, model: Any
    ) -> None:
        # Optimizer.__init__ is not called on purpose: the state lives in ``optimizer``.
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_accelerator"] = accelerator
        self.__dict__["_model"] = model
        #: torch built an LR scheduler on this optimizer (it wraps ``step`` to track calls);
        #: read by the Accelerator to warn when that scheduler was not handed over
        self.__dict__["_scheduler_built_on"] = False

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The backend's optimizer (DeepSpeed's or FSDP's, for example)."""
        return self.__dict__["_optimizer"]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise UnsupportedError(
                "optimizer closures are not supported by accelkit; call step() without one"
            )
        return self.__dict__["_accelerator"].step(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.__dict__["_accelerator"].zero_grad(self)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The backend's optimizer's class, for ``isinstance`` checks (``type()`` is not fooled)."""
        inner = self.__dict__.get("_optimizer")
        return AcceleratedOptimizer if inner is None else inner.__class__

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_optimizer")
        if inner is None:  # not built yet (an object under construction has an empty __dict__)
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "step" and getattr(value, "_wrapped_by_lr_sched", False):
            self.__dict__["_scheduler_built_on"] = True  # an LRScheduler.__init__ on us
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return self.optimizer.__getstate__()

    # Copies: the Accelerator keeps per-optimizer state (the accumulation window, the adopted
    # schedulers) and steps only the optimizers it set up, so a copy cannot go through it. A copy
    # is therefore the backend's optimizer copied, as torch copies it: a snapshot over copied
    # parameters (or the copied model's, when the model is copied in the same deepcopy).
    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle as the backend's optimizer: the pickle loads without accelkit."""
        return self.optimizer.__reduce_ex__(protocol)

    def __copy__(self) -> torch.optim.Optimizer:
        return copy.copy(self.optimizer)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.optim.Optimizer:
        accelerator = self.__dict__["_accelerator"]
        if memo.get(id(accelerator), accelerator) is not accelerator:
            raise UnsupportedError(
                "copy.deepcopy reached accelkit's Accelerator (which holds the optimizers setup() "
                "returned): an Accelerator owns the backend and its process groups and cannot be "
                "copied. Copy what you need without it: the model (copy.deepcopy(model); under "
                "MMEngine copy.deepcopy(runner.model), which shares the Accelerator), the "
                "optimizer (copy.deepcopy(optimizer) gives a plain torch optimizer), or their "
                "state_dict()s."
            )
        inner = self.optimizer
        try:
            return copy.deepcopy(inner, memo)
        except Exception as err:
            raise UnsupportedError(
                f"the backend's optimizer ({type(inner).__name__}) cannot be deep-copied: {err}. "
                "Copy its state instead: copy.deepcopy(optimizer.state_dict()), or save a "
                "checkpoint with accel.save()."
            ) from err

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def mark_step_tracked(optimizer: AcceleratedOptimizer) -> None:
    """Let a scheduler re-bound to ``optimizer`` see the step tracking torch installs itself.

    torch warns "optimizer.step() has been overridden" at the first scheduler step unless the
    optimizer's ``step`` carries its ``_wrapped_by_lr_sched`` mark; a scheduler built on the
    original optimizer and handed to ``setup`` would otherwise warn for nothing.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    object.__setattr__(optimizer, "step", tracked)


#: schedulers that a composite (SequentialLR, ChainedScheduler) steps; accelkit leaves them be
_COMPOSITE_PARTS: weakref.WeakSet = weakref.WeakSet()
#: what :func:`guard_scheduler_step` puts on a scheduler; kept out of its state_dict
_GUARD_ATTRIBUTES = ("step", "state_dict", "load_state_dict")


def is_composite_part(scheduler: Any) -> bool:
    return scheduler in _COMPOSITE_PARTS


def release_scheduler(scheduler: Any) -> None:
    """Undo :func:`guard_scheduler_step`: a composite scheduler steps this one itself."""
    for name in _GUARD_ATTRIBUTES:
        scheduler.__dict__.pop(name, None)
    _COMPOSITE_PARTS.add(scheduler)


def guard_scheduler_step(scheduler: LRScheduler) -> Any:
    """Make a user's own ``scheduler.step()`` a warned no-op; return the real step for accelkit.

    Installed on a scheduler already built (adoption is explicit), so no call of its own
    construction can land here."""
    real_step = scheduler.step
    warned = []

    @functools.wraps(real_step)
    def step(*args: Any, **kwargs: Any) -> None:
        if not warned:
            warned.append(True)
            warnings.warn(
                "accelkit steps this LR scheduler after every applied optimizer step (and not on "
                "a skipped fp16 step); this call of scheduler.step() is ignored. Remove it from "
                "your loop.",
                UserWarning,
                stacklevel=2,
            )

    cls = type(scheduler)

    def state_dict() -> dict[str, Any]:
        # torch's LRScheduler.state_dict is the instance __dict__: leave our guard out of it,
        # so that torch.save works and a load does not carry it onto another scheduler
        state = cls.state_dict(scheduler)
        for name in _GUARD_ATTRIBUTES:
            state.pop(name, None)
        return state

    def load_state_dict(state: dict[str, Any]) -> None:
        cls.load_state_dict(
            scheduler, {k: v for k, v in state.items() if k not in _GUARD_ATTRIBUTES}
        )

    scheduler.step = step
    scheduler.state_dict = state_dict
    scheduler.load_state_dict = load_state_dict
    return real_step


# ---- what a first run gets wrong: the error or the log line that says what to do ----------
def check_setup_arguments(model_was_set_up: bool, optimizers: tuple[Any, ...]) -> None:
    """Refuse a model that was set up already, and what is not a fresh torch optimizer where
    the optimizers belong (a scheduler: say where it goes)."""
    if model_was_set_up:
        raise ConfigError(
            "this model was already set up (setup() was called with it before, or it is the "
            "model setup() returned): wrapping it again would sync, shard or cast it twice. "
            "Call setup() once per model, with all of its optimizers, "
            "`model, opt_a, opt_b = accel.setup(model, opt_a, opt_b)`, and keep using what "
            "it returned; after accel.free_memory() a model may be set up again."
        )
    for opt in optimizers:
        if isinstance(opt, AcceleratedOptimizer):
            raise ConfigError("this optimizer was already set up; pass the original one")
        if is_scheduler(opt):
            raise ConfigError(
                f"setup() takes the model and its optimizers; {type(opt).__name__} is an LR "
                "scheduler. Hand it over after setup, `sched = accel.setup_scheduler(sched)` "
                "(it may be built on the optimizer setup() returned), or pass it by name: "
                "`accel.setup(model, opt, scheduler=sched)`."
            )
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"setup() takes torch optimizers, got {type(opt).__name__}")


def is_scheduler(obj: Any) -> bool:
    """An LR scheduler (torch's, or one shaped like it), given where an optimizer belongs."""
    if isinstance(
        obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau
    ):
        return True
    return (
        not isinstance(obj, torch.optim.Optimizer)
        and hasattr(obj, "optimizer")
        and hasattr(obj, "get_last_lr")
    )


def own_optimizer(optimizer: Any, returned: list[Any], given: list[Any]) -> Any:
    """``optimizer`` if it is one of those ``setup`` ``returned``, else an error that says
    which to pass (``given``: the ones handed to ``setup``)."""
    if any(optimizer is o for o in returned):
        return optimizer
    if any(optimizer is o for o in given) or any(optimizer is o.optimizer for o in returned):
        raise UnsupportedError(
            "this is the optimizer given to setup(); pass the one setup() returned "
            "(`model, opt = accel.setup(model, opt)`), which steps through the backend"
        )
    raise UnsupportedError(
        f"this {type(optimizer).__name__} was never set up: accel.step()/zero_grad() step "
        "only optimizers that setup() returned. Pass it to setup() with its model, "
        "`model, opt = accel.setup(model, opt)`, and use the optimizer it returns."
    )


def learning_rates(state: dict[str, Any], key: str = "lr") -> dict[str, list[Any]]:
    """Each optimizer's learning rate per param group, by its name in ``state`` (``key=
    "initial_lr"``: the base rate its scheduler was built with)."""
    return {
        name: [group.get(key) for group in obj.param_groups]
        for name, obj in state.items()
        if isinstance(obj, torch.optim.Optimizer)
    }


def _explained_by_scheduler(
    state: dict[str, Any], name: str, group: int, built_base: Any, loaded: Any
) -> bool:
    """Whether a scheduler loaded with the optimizer explains its rate: it was built on the same
    base rate as the checkpoint's, and its last rate is the optimizer's (a resume mid-schedule)."""
    optimizer = state[name]
    for obj in state.values():
        if not isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            continue
        target = getattr(obj, "optimizer", None)
        if target is not optimizer and getattr(optimizer, "optimizer", None) is not target:
            continue
        last = getattr(obj, "_last_lr", None) or []
        base = getattr(obj, "base_lrs", None) or []
        if group < len(last) and last[group] == loaded:
            return built_base is None or group >= len(base) or base[group] == built_base
    return False


def say_which_learning_rate_won(
    before: dict[str, list[Any]],
    after: dict[str, list[Any]],
    path: Any,
    state: dict[str, Any] | None = None,
    built_bases: dict[str, list[Any]] | None = None,
) -> None:
    """A resume keeps the checkpoint's learning rate, as every torch optimizer's
    ``load_state_dict`` does; when it differs from the one the script built, say so and how to
    choose the new one instead. Not when a scheduler in ``state`` explains the rate (built on the
    same base rate, ``built_bases``, its schedule has moved on): every restart would warn."""
    for name, built in before.items():
        loaded = after.get(name, built)
        bases = (built_bases or {}).get(name, [])
        changed = [
            (i, b, a)
            for i, (b, a) in enumerate(zip(built, loaded))
            if b != a
            and not (
                state is not None
                and name in state
                and _explained_by_scheduler(state, name, i, bases[i] if i < len(bases) else None, a)
            )
        ]
        if not changed:
            continue
        i, was, now = changed[0]
        log.warning(
            "resumed %r from %s with the checkpoint's learning rate %s (param group %d%s), not "
            "the %s it was built with: a resume continues the saved run and its schedule. To "
            "train at the new rate, set it after load: `for group in %s.param_groups: "
            'group["lr"] = %s` (and build or leave out the scheduler to match).',
            name,
            path,
            now,
            i,
            f" and {len(changed) - 1} more" if len(changed) > 1 else "",
            was,
            name,
            was,
        )
