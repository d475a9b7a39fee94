"""The independent gathers the checkpoint tests compare bit for bit. Imports nothing from accelkit.

* :func:`deepspeed_state`: DeepSpeed's own full views -- ``safe_get_full_fp32_param`` and
  ``safe_get_full_optimizer_state`` (one all-reduce per parameter), the low-precision weights
  under ``GatheredParameters`` (ZeRO-3), and the base optimizer's ``step`` values;
* :func:`torch_state`: a plain module's and torch optimizer's own tensors (``full_tensor()`` for
  FSDP2's DTensors).

Both return ``{"weights", "lp", "exp_avg", "exp_avg_sq": {name: [floats]}, "steps": [...]}``:
``weights`` are the fp32 master weights (the parameters where there is no master), ``steps``
the distinct step values held.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

KEYS = ("exp_avg", "exp_avg_sq")


def _flat(tensor: torch.Tensor) -> list[float]:
    return tensor.detach().float().reshape(-1).cpu().tolist()


def deepspeed_state(engine: Any) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params = list(engine.module.named_parameters())
    zero3 = hasattr(params[0][1], "ds_id")
    gather = (
        deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
        if zero3
        else contextlib.nullcontext()
    )
    out: dict[str, Any] = {"weights": {}, "lp": {}, **{k: {} for k in KEYS}}
    with gather:
        out["lp"] = {n: _flat(p) for n, p in params}
    wrapper = engine.optimizer
    base = getattr(wrapper, "optimizer", wrapper)
    has_state = any(bool(s) for s in base.state.values())  # the same on every rank
    if has_state and getattr(wrapper, "_hp_optimizer_states_linked", True) is False:
        # ZeRO-1/2 link their per-parameter optimizer views at the first step (DeepSpeed's
        # own load_checkpoint does not relink): link them as that step would
        wrapper._lazy_init_hp_params_optimizer_state()
    # ZeRO-0 with bf16/fp16 weights: DeepSpeed's unfused FP16 optimizer keeps one fp32 copy
    # per parameter (fp32_groups next to fp16_groups)
    copies = {}
    for lows, highs in zip(
        getattr(wrapper, "fp16_groups", []), getattr(wrapper, "fp32_groups", [])
    ):
        copies.update({id(low): high for low, high in zip(lows, highs)})
    for name, p in params:
        if not p.requires_grad:
            out["weights"][name] = out["lp"][name]
            continue
        master = safe_get_full_fp32_param(p)
        if master is None:  # ZeRO-0: whole tensors, the torch optimizer's state keyed by them
            held = copies.get(id(p), p)
            out["weights"][name] = _flat(held)
            for key in KEYS:
                if key in base.state.get(held, {}):
                    out[key][name] = _flat(base.state[held][key])
            continue
        out["weights"][name] = _flat(master)
        for key in KEYS:
            if has_state:  # a collective: every rank takes this branch or none does
                out[key][name] = _flat(safe_get_full_optimizer_state(p, key))
    out["steps"] = sorted(
        {float(s["step"]) for s in base.state.values() if isinstance(s, dict) and "step" in s}
    )
    grad_scaler = getattr(wrapper, "torch_autocast_gradscaler", None)  # 16-mixed
    loss_scaler = getattr(wrapper, "loss_scaler", None)  # 16-true: DeepSpeed's own
    if grad_scaler is not None:
        out["scale"] = float(grad_scaler.get_scale())
    elif loss_scaler is not None and getattr(loss_scaler, "dynamic", False):
        out["scale"] = float(loss_scaler.cur_scale)
    return out


def torch_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    module = model
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module

    def full(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    out: dict[str, Any] = {"weights": {}, "lp": {}, **{k: {} for k in KEYS}}
    steps = set()
    for name, p in module.named_parameters():
        out["weights"][name] = out["lp"][name] = _flat(full(p))
        state = optimizer.state.get(p, {})
        for key in KEYS:
            if key in state:
                out[key][name] = _flat(full(state[key]))
        if "step" in state:
            steps.add(float(state["step"]))
    out["steps"] = sorted(steps)
    return out
