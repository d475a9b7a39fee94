"""Rebuilding a user's optimizer, for a backend that swaps it for its library's own.

A ZeRO-1 backend (torch's ``ZeroRedundancyOptimizer``, FairScale's ``OSS``) builds a new
optimizer of the user's class over the same param groups: from ``type(opt)`` and its
``defaults``. ``defaults`` is not the constructor's signature, though (torch's ``AdamW``
inherits ``decoupled_weight_decay`` from ``Adam`` and refuses it as a keyword), and state already
in the user's optimizer would not follow into the new one. :func:`optimizer_recipe` does both
checks once, for every plugin.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from accelkit.errors import ConfigError


@dataclass(frozen=True)
class OptimizerRecipe:
    """What rebuilds a user's optimizer: ``cls(groups, **defaults)`` is a fresh copy of it.

    ``groups`` are new dicts (the same parameters and hyperparameters), so a wrapper that edits
    them leaves the user's optimizer alone; ``defaults`` holds only keywords ``cls`` accepts."""

    cls: type[torch.optim.Optimizer]
    groups: list[dict[str, Any]]
    defaults: dict[str, Any]


def optimizer_recipe(backend: str, optimizer: torch.optim.Optimizer) -> OptimizerRecipe:
    """The class, param groups and constructor keywords that rebuild ``optimizer``.

    Refuses (``ConfigError`` naming ``backend``) an optimizer that already has state: it has
    stepped or was loaded, and the rebuilt one would start from nothing."""
    if len(optimizer.state):
        raise ConfigError(
            f"{backend}: the optimizer already has state (it has stepped, or state was loaded). "
            f"The backend rebuilds it as its library's own, and that state would not follow. "
            "Pass a fresh optimizer to setup(), and load state after setup with accel.load()."
        )
    groups = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]
    return OptimizerRecipe(type(optimizer), groups, constructor_defaults(optimizer))


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The entries of ``optimizer.defaults`` that its class's ``__init__`` accepts as keywords
    (all of them where it takes ``**kwargs``)."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}
