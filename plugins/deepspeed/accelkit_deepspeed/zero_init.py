"""``init_module()`` under ZeRO-3, and the guard that refuses silent writes to partitioned weights.

Inside ``deepspeed.zero.Init`` each module's parameters are partitioned as soon as the module's
own ``__init__`` returns: ``param.data`` becomes an empty tensor and the values live in
``param.ds_tensor``. From then on ``torch.nn.init.normal_(param)``, ``param.data.copy_(...)`` or
``load_state_dict`` change nothing, without an error. That is the classic way to train a
ZeRO-3 model from the wrong weights.

The guard makes those writes fail at once, with the fix in the message. It swaps the class of
each partitioned parameter for :class:`GuardedParameter`, whose ``__torch_function__`` refuses
in-place ops and ``.data`` access from user code while the parameter is partitioned, and adds a
``load_state_dict`` pre-hook to the modules that hold them. DeepSpeed's own code passes: the
methods DeepSpeed attaches to each parameter (``all_gather``, ``partition``, ...) are wrapped to
run in a trusted scope, so what they do to the parameter is theirs to do. Anything done while the
parameters are gathered passes too (``deepspeed.zero.GatheredParameters``, or ``model.apply(fn)``
inside ``init_module()``, which DeepSpeed gathers itself). ``setup()`` restores the plain
``Parameter`` class and DeepSpeed's own methods, so training pays nothing.

While the model is being built (inside ``init_module()``), a write to a parameter that is
already partitioned gathers it instead of failing (:class:`_BuildGathers`): a Transformers
model's ``post_init()`` initialises its submodules' weights after they were partitioned.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accelkit.sdk import UnsupportedError

#: in-place tensor methods that change no values
_HARMLESS_INPLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad", "record_stream"})
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)

FIX = (
    "Set weights while the parameters are gathered: inside "
    "`with deepspeed.zero.GatheredParameters(list_of_params, modifier_rank=0):`, or in the "
    "module's own __init__ / `model.apply(init_fn)` while the model is built under "
    "accel.init_module() (DeepSpeed gathers there); or load them after setup with "
    "accel.load(path, {'model': model})."
)


class PartitionedParameterError(UnsupportedError):
    """A write to a ZeRO-3 partitioned parameter that would silently change nothing."""


def is_partitioned(param: Any) -> bool:
    status = getattr(param, "ds_status", None)
    return status is not None and getattr(status, "name", "") == "NOT_AVAILABLE"


_scope = threading.local()


@contextlib.contextmanager
def _trusted() -> Iterator[None]:
    """A scope in which the guard lets everything through: DeepSpeed's own partition work."""
    depth = getattr(_scope, "depth", 0)
    _scope.depth = depth + 1
    try:
        yield
    finally:
        _scope.depth = depth


def _is_trusted() -> bool:
    return getattr(_scope, "depth", 0) > 0


def _trusting(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _trusted():
            return method(*args, **kwargs)

    call._accelkit_wrapped = method  # type: ignore[attr-defined]
    return call


def _describe(param: Any) -> str:
    where = getattr(param, "_accelkit_name", None) or "a parameter"
    return f"{where} (shape {tuple(getattr(param, 'ds_shape', ()))})"


class GuardedParameter(torch.nn.Parameter):
    """A ZeRO-3 parameter between build and ``setup``: refuses writes that would be lost."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # the tensor an op writes to: the first argument (``p.add_(1)``), or a keyword argument
        # (``torch.nn.init.normal_(tensor=p)`` dispatches that way), or ``out=``
        target = (
            args[0]
            if args
            else next((v for v in kwargs.values() if isinstance(v, GuardedParameter)), None)
        )
        out = kwargs.get("out")
        if isinstance(out, GuardedParameter) and is_partitioned(out):
            target = out
        if isinstance(target, GuardedParameter) and not _is_trusted() and is_partitioned(target):
            _check(func, target)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _check(func: Any, param: Any) -> None:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        if attribute != "data":
            return
        if name == "__get__" and _gather_while_building(param):
            return
        action = "reading .data of" if name == "__get__" else "assigning .data of"
        raise PartitionedParameterError(
            f"{action} {_describe(param)}, which ZeRO-3 has partitioned: its .data is an empty "
            f"placeholder, so a write through it would be silently lost. {FIX}"
        )
    inplace = (
        name.endswith("_") and not name.startswith("_") and name not in _HARMLESS_INPLACE
    ) or name in _INPLACE_DUNDERS
    if inplace and _gather_while_building(param):
        return
    if inplace:
        raise PartitionedParameterError(
            f"{name}() on {_describe(param)}, which ZeRO-3 has partitioned (it was built under "
            f"accel.init_module()): the write would silently change nothing. {FIX}"
        )


class _BuildGathers:
    """Partitioned parameters that the model's own construction code writes after partitioning.

    A Transformers model initialises its weights in ``post_init()``, at the end of its root's
    ``__init__``, when every submodule is already partitioned; DeepSpeed gathers only the
    parameters a module holds itself around ``model.apply(fn)``, so GPT-2's scaled init of its
    ``c_proj`` weights (written from the parent module) would be lost. Inside
    ``init_module()`` such a write gathers the parameter first; the gathered ones are broadcast
    from rank 0 and partitioned again as soon as a parameter of another module is touched, a
    module finishes building, or the build ends: at most one module's parameters are whole."""

    def __init__(self) -> None:
        self.params: list[Any] = []
        self.owner: Any = None

    def gather(self, param: Any) -> None:
        owner = getattr(param, "_accelkit_owner", None)
        if self.params and (owner is None or owner is not self.owner):
            self.flush()
        with _trusted():
            param.all_gather()
        self.params.append(param)
        self.owner = owner

    def flush(self) -> None:
        params, self.params, self.owner = self.params, [], None
        with _trusted():
            for param in params:
                torch.distributed.broadcast(
                    param.data.view(torch.uint8), 0, group=param.ds_process_group
                )
            for param in params:
                param.partition(has_been_updated=True)


def _gather_while_building(param: Any) -> bool:
    """Inside ``init_module()``: gather ``param`` for the write about to happen."""
    gathers = getattr(_scope, "build", None)
    if gathers is None:
        return False
    gathers.gather(param)
    return True


def _refuse_load_state_dict(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    if any(is_partitioned(p) for p in module.parameters(recurse=False)):
        raise PartitionedParameterError(
            f"load_state_dict into {type(module).__name__}, whose parameters ZeRO-3 has "
            f"partitioned: torch would copy into empty placeholders. {FIX}"
        )


def protect(module: torch.nn.Module) -> None:
    """Guard the partitioned parameters ``module`` holds itself (not its children's)."""
    guarded = False
    for name, param in module.named_parameters(recurse=False):
        if type(param) is torch.nn.Parameter and hasattr(param, "ds_status"):
            # DeepSpeed's per-parameter methods (all_gather, partition, ...) may touch the
            # partitioned tensor: they run trusted until setup() hands them back unwrapped
            for attr, value in list(vars(param).items()):
                if callable(value) and not attr.startswith("_"):
                    setattr(param, attr, _trusting(value))
            param.__class__ = GuardedParameter
            param._accelkit_name = f"{type(module).__name__}.{name}"
            param._accelkit_owner = module
            guarded = True
    if guarded and not hasattr(module, "_accelkit_zero_guard"):
        module._accelkit_zero_guard = module.register_load_state_dict_pre_hook(
            _refuse_load_state_dict
        )


def release(model: torch.nn.Module) -> int:
    """Give ``model``'s parameters back their plain class; returns how many were guarded."""
    count = 0
    for module in model.modules():
        handle = module.__dict__.pop("_accelkit_zero_guard", None)
        if handle is not None:
            handle.remove()
        for param in module.parameters(recurse=False):
            if type(param) is GuardedParameter:
                param.__class__ = torch.nn.Parameter
                param.__dict__.pop("_accelkit_owner", None)
                for attr, value in list(vars(param).items()):
                    original = getattr(value, "_accelkit_wrapped", None)
                    if original is not None:
                        setattr(param, attr, original)
                count += 1
    return count


def guarded_zero_init(deepspeed: Any, **kwargs: Any) -> Any:
    """``deepspeed.zero.Init(**kwargs)`` that guards each module's parameters once partitioned."""
    # torch._dynamo's first import checks torch.Tensor.__new__'s signature, which zero.Init
    # replaces: imported inside the build (Transformers imports a model's module, and torchao,
    # on first use) it fails. Importing it first costs about a second, once per process.
    import torch._dynamo  # noqa: F401

    class GuardedInit(deepspeed.zero.Init):
        def __enter__(self) -> Any:
            entered = super().__enter__()
            if self.enabled:
                self._accelkit_outer = getattr(_scope, "build", None)
                _scope.build = _BuildGathers()
            return entered

        def __exit__(self, *exc: Any) -> Any:
            if self.enabled:
                gathers, _scope.build = _scope.build, self._accelkit_outer
                gathers.flush()
            return super().__exit__(*exc)

        def _post_init_method(self, module: torch.nn.Module) -> None:
            gathers = getattr(_scope, "build", None)
            if gathers is not None:
                gathers.flush()
            super()._post_init_method(module)
            protect(module)

    return GuardedInit(**kwargs)


def iter_guarded(model: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    return (p for p in model.parameters() if type(p) is GuardedParameter)
