"""What the Apex backends change at ``setup``: the optimizer for its fused Apex twin, and
(optionally) ``nn.LayerNorm`` / ``nn.RMSNorm`` for Apex's fused norms.

The optimizer swap keeps the user's param groups (the same parameter objects, in the same order)
and every hyperparameter of every group; a torch option Apex cannot honour is refused with a
``ConfigError`` naming it, never dropped. Group entries accelkit does not know (``initial_lr``
from a scheduler, a user's ``name``) are carried as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accelkit.sdk import ConfigError

log = logging.getLogger("accelkit")

#: torch options with no Apex equivalent: key -> (the value Apex's behaviour matches, why)
_NOT_CARRIED = {
    "amsgrad": (False, "Apex's fused Adam has no AMSGrad variant"),
    "maximize": (False, "Apex's fused optimizers only minimize"),
    "capturable": (False, "accelkit builds the non-capturable Apex optimizer"),
    "differentiable": (False, "Apex's fused kernels are not differentiable"),
    "foreach": (None, "it picks a torch implementation; Apex's kernel replaces it"),
    "fused": (None, "it picks a torch implementation; Apex's kernel replaces it"),
}
_ADAM_KEYS = {"params", "lr", "betas", "eps", "weight_decay", "decoupled_weight_decay"}
_SGD_KEYS = {"params", "lr", "momentum", "dampening", "weight_decay", "nesterov"}


def _number(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"{what} is a tensor of {value.numel()} elements; Apex takes a number"
            )
        return float(value.item())
    return float(value)


def is_apex_optimizer(opt: torch.optim.Optimizer) -> bool:
    return type(opt).__module__.split(".")[0] == "apex"


def _refuse_torch_only(backend: str, opt: torch.optim.Optimizer, group_index: int) -> None:
    cls = type(opt).__name__
    group = opt.param_groups[group_index]
    for key, (ok, why) in _NOT_CARRIED.items():
        if key in group and group[key] != ok and group[key] is not ok:
            raise ConfigError(
                f"backend {backend!r}: torch.optim.{cls}({key}={group[key]!r}) (param group "
                f"{group_index}) cannot carry over to Apex's fused {cls}: {why}. Drop {key}=, or "
                f"pass fused_optimizer=False to keep torch's {cls}"
            )


def _carried_extras(group: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """Group entries that are neither the optimizer's hyperparameters nor refused options."""
    return {k: v for k, v in group.items() if k not in known and k not in _NOT_CARRIED}


@dataclass
class AdamPlan:
    """How a torch Adam/AdamW maps onto Apex's FusedAdam (or DistributedFusedAdam)."""

    groups: list[dict[str, Any]]
    adam_w_mode: bool
    defaults: dict[str, Any] = field(default_factory=dict)


def adam_plan(backend: str, opt: torch.optim.Optimizer) -> AdamPlan:
    """Param groups and ``adam_w_mode`` of the fused twin of a torch ``Adam`` / ``AdamW``."""
    cls = type(opt)
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(f"not a torch Adam/AdamW: {cls.__name__}")
    modes = set()
    groups = []
    for g, group in enumerate(opt.param_groups):
        _refuse_torch_only(backend, opt, g)
        # torch >= 2.6 keeps it in every group (AdamW: True); older AdamW has no key
        modes.add(bool(group.get("decoupled_weight_decay", cls is torch.optim.AdamW)))
        where = f"{cls.__name__} param group {g}"
        groups.append(
            {
                "params": group["params"],
                "lr": _number(group["lr"], f"{where}: lr"),
                "betas": tuple(_number(b, f"{where}: betas") for b in group["betas"]),
                "eps": float(group["eps"]),
                "weight_decay": _number(group["weight_decay"], f"{where}: weight_decay"),
                "bias_correction": True,  # torch always corrects the moment estimates
                **_carried_extras(group, _ADAM_KEYS),
            }
        )
    if len(modes) != 1:
        raise ConfigError(
            f"backend {backend!r}: the param groups of {cls.__name__} disagree on "
            "decoupled_weight_decay; Apex's FusedAdam has one adam_w_mode for all groups"
        )
    d = opt.defaults
    defaults = {
        "lr": _number(d.get("lr", 1e-3), "lr"),
        "betas": tuple(_number(b, "betas") for b in d.get("betas", (0.9, 0.999))),
        "eps": float(d.get("eps", 1e-8)),
        "weight_decay": _number(d.get("weight_decay", 0.0), "weight_decay"),
    }
    return AdamPlan(groups, modes.pop(), defaults)


def _sgd_twin(backend: str, opt: torch.optim.SGD, optimizers: Any) -> torch.optim.Optimizer:
    groups = []
    for g, group in enumerate(opt.param_groups):
        _refuse_torch_only(backend, opt, g)
        bf16 = [p for p in group["params"] if p.dtype == torch.bfloat16]
        if bf16:
            raise ConfigError(
                f"backend {backend!r}: Apex's FusedSGD updates fp16 and fp32 parameters only and "
                f"would silently skip the {len(bf16)} bf16 parameter(s) of param group {g}. Use "
                "a -mixed precision (fp32 parameters), or fused_optimizer=False to keep torch's SGD"
            )
        where = f"SGD param group {g}"
        groups.append(
            {
                "params": group["params"],
                "lr": _number(group["lr"], f"{where}: lr"),
                "momentum": float(group["momentum"]),
                "dampening": float(group["dampening"]),
                "weight_decay": _number(group["weight_decay"], f"{where}: weight_decay"),
                "nesterov": bool(group["nesterov"]),
                **_carried_extras(group, _SGD_KEYS),
            }
        )
    d = opt.defaults
    return optimizers.FusedSGD(
        groups,
        lr=_number(d["lr"], "lr"),
        momentum=float(d.get("momentum", 0.0)),
        dampening=float(d.get("dampening", 0.0)),
        weight_decay=_number(d.get("weight_decay", 0.0), "weight_decay"),
        nesterov=bool(d.get("nesterov", False)),
        wd_after_momentum=False,  # torch adds weight decay to the gradient before momentum
        set_grad_none=True,
    )


def fused_twin(backend: str, opt: torch.optim.Optimizer, apex: Any) -> torch.optim.Optimizer:
    """The Apex optimizer that replaces ``opt`` (``opt`` itself if it already is one)."""
    if is_apex_optimizer(opt):
        if getattr(opt, "master_weights", False):
            raise ConfigError(
                f"backend {backend!r}: FusedAdam(master_weights=True) keeps fp32 master weights "
                "outside its state, where accelkit's checkpoint cannot see them; use a -mixed "
                "precision (fp32 parameters) instead"
            )
        return opt
    cls = type(opt)
    name = cls.__name__
    if opt.state:
        raise ConfigError(
            f"backend {backend!r}: the {name} passed to setup() already has state (it was "
            "stepped); the swap to Apex's fused optimizer starts from its hyperparameters only. "
            "Call setup() before training, and restore state after it with accel.load()"
        )
    optimizers = apex.optimizers
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        plan = adam_plan(backend, opt)
        new = optimizers.FusedAdam(
            plan.groups, adam_w_mode=plan.adam_w_mode, set_grad_none=True, **plan.defaults
        )
        what = f"FusedAdam(adam_w_mode={plan.adam_w_mode})"
    elif cls is torch.optim.SGD:
        new = _sgd_twin(backend, opt, optimizers)
        what = "FusedSGD"
    else:
        raise ConfigError(
            f"backend {backend!r}: no fused Apex twin for {cls.__module__}.{name}. The swap "
            "covers torch.optim.Adam and AdamW (-> apex.optimizers.FusedAdam) and SGD (-> "
            "FusedSGD); torch has no LAMB, NovoGrad or Adagrad twin to swap: build "
            "apex.optimizers.FusedLAMB (or FusedNovoGrad, FusedAdagrad) yourself and pass it to "
            f"setup(), or pass fused_optimizer=False to keep {name}"
        )
    log.info(
        "%s: %s -> apex.optimizers.%s, %d param group(s)",
        backend,
        name,
        what,
        len(new.param_groups),
    )
    return new


# ---- fused norms ------------------------------------------------------------------------------------
@dataclass
class NormSwap:
    """Which norms were replaced, and which were kept with the reason."""

    swapped: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


def _twin_norm(module: nn.Module, normalization: Any) -> tuple[nn.Module | None, str]:
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return None, "it has hooks, which the fused module would not carry"
    if type(module) is nn.LayerNorm:
        if module.elementwise_affine and module.bias is None:
            return None, "LayerNorm(bias=False): Apex's FusedLayerNorm always has a bias"
        new = normalization.FusedLayerNorm(
            module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine
        )
        if module.elementwise_affine:
            new.weight, new.bias = module.weight, module.bias
        return new, ""
    if type(module) is getattr(nn, "RMSNorm", None):
        if module.eps is None:
            return None, (
                "RMSNorm(eps=None) takes the input dtype's machine epsilon; FusedRMSNorm needs "
                "a number (set eps= to swap it)"
            )
        new = normalization.FusedRMSNorm(
            module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine
        )
        if module.elementwise_affine:
            new.weight = module.weight
        return new, ""
    return None, ""


def swap_norms(model: nn.Module, apex: Any) -> NormSwap:
    """Replace every ``nn.LayerNorm`` / ``nn.RMSNorm`` (exact types) inside ``model`` in place.

    The fused module takes over the original ``Parameter`` objects, so parameter names, the
    optimizer's references and tied uses stay as they were; ``eps``, ``normalized_shape`` and
    ``elementwise_affine`` are copied. A module used at several places is replaced by one fused
    module everywhere.
    """
    result = NormSwap()
    done: dict[int, nn.Module] = {}
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):  # duplicates too
            if child is None:
                continue
            where = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) in done:
                setattr(parent, child_name, done[id(child)])
                continue
            new, why = _twin_norm(child, apex.normalization)
            if new is None:
                if why:
                    result.kept[where] = why
                continue
            new.train(child.training)
            done[id(child)] = new
            setattr(parent, child_name, new)
            result.swapped.append(where)
    if result.kept:
        log.info("fused norms: kept %s", "; ".join(f"{k} ({v})" for k, v in result.kept.items()))
    return result
