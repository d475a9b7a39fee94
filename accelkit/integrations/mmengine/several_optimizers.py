"""Several optimizers built by MMEngine (an ``OptimWrapperDict``), moved onto accelkit.

Apart from optim_wrapper.py because it reads the Runner's optimizer settings (_settings.py),
which in turn build accelkit's wrapper classes: one module each way would import in a circle.
"""

from __future__ import annotations

from typing import Any

import torch
from mmengine.optim import OptimWrapper

from accelkit.errors import ConfigError
from accelkit.integrations.mmengine._settings import optim_wrapper_subclass, read_optim_wrapper_cfg
from accelkit.integrations.mmengine.optim_wrapper import AccelkitOptimWrapper


def adopt_built(wrapper: Any, settings: Any) -> Any:
    """What MMEngine's ``build_optim_wrapper`` returned, on accelkit: an
    :class:`AccelkitOptimWrapper`, or an ``OptimWrapperDict`` whose wrappers are (one a
    several-optimizer constructor built as ``OptimWrapper`` is moved onto accelkit by
    :func:`adopt`), with the clipping, AMP and accumulation the Accelerator was built with."""
    from mmengine.optim import OptimWrapperDict

    if not isinstance(wrapper, OptimWrapperDict):
        if not isinstance(wrapper, AccelkitOptimWrapper):
            raise ConfigError(
                f"optim_wrapper built a {type(wrapper).__name__}, which accelkit cannot drive; "
                "build an OptimWrapper (or an OptimWrapperDict of them)"
            )
        return wrapper
    if settings is not None and not settings.several:
        raise ConfigError(
            "optim_wrapper's constructor built an OptimWrapperDict (several optimizers) from a "
            "config the Runner read as one optimizer: give the several-optimizer config "
            "without a top-level 'optimizer' (its constructor and one entry per optimizer)"
        )
    for name, inner in wrapper.items():
        built = {"accumulative_counts": inner._accumulative_counts}
        plain = isinstance(inner, AccelkitOptimWrapper)
        adopted = adopt(inner)
        if not plain and settings is not None:
            _, read = read_optim_wrapper_cfg(
                dict(optimizer=adopted.optimizer, clip_grad=_clip_cfg(adopted), **built)
            )
            for key in ("max_grad_norm", "max_grad_value", "precision"):
                if getattr(read, key) != getattr(settings, key):
                    raise ConfigError(
                        f"optim_wrapper[{name!r}], built by the constructor, has {key}="
                        f"{getattr(read, key)!r} where the Accelerator was built with "
                        f"{getattr(settings, key)!r} (from the config's entries): give "
                        "every entry its optimizer wrapper config (type, clip_grad, "
                        "accumulative_counts) as the constructor builds it"
                    )
        if settings is not None and adopted._accumulative_counts > settings.accumulation_steps:
            raise ConfigError(
                f"optim_wrapper[{name!r}] accumulates over {adopted._accumulative_counts} "
                f"micro-batches, more than the {settings.accumulation_steps} the Accelerator "
                "was built for from the config: set accumulative_counts in the config's entries"
            )
    return wrapper


def _clip_cfg(wrapper: OptimWrapper) -> dict | None:
    clip = dict(getattr(wrapper, "clip_grad_kwargs", None) or {})
    if not clip:
        return None
    clip["type"] = "norm" if wrapper.clip_func is torch.nn.utils.clip_grad_norm_ else "value"
    return clip


def adopt(wrapper: OptimWrapper) -> AccelkitOptimWrapper:
    """A wrapper a several-optimizer constructor built without accelkit, moved onto it.

    ``OptimWrapper`` and its subclasses become their :func:`on_accelkit` class in place (the
    same object, its arguments kept); what accelkit's backend does instead (AMP, a library's
    own wrapper) is refused, as for ``optim_wrapper=dict(type=...)``."""
    if isinstance(wrapper, AccelkitOptimWrapper):
        return wrapper
    cls = (
        AccelkitOptimWrapper
        if type(wrapper) is OptimWrapper
        else optim_wrapper_subclass(type(wrapper))
    )
    wrapper.__class__ = cls
    wrapper.accelerator = None
    wrapper._model = None
    return wrapper  # type: ignore[return-value]
