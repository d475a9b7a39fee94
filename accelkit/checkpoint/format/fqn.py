"""Canonical tensor names: the same parameter has the same name whatever wraps the model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

#: wrapper components removed wherever they appear in a name
WRAPPER_COMPONENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def canonical_fqn(name: str, *, strip_module_prefix: bool = False) -> str:
    """Drop wrapper components from ``name``.

    ``module.`` is a DDP/DataParallel prefix only at the front of a foreign state dict; inside a
    model it may be a real attribute, so it is stripped only when asked (importers ask).
    """
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    if strip_module_prefix:
        while len(parts) > 1 and parts[0] == "module":
            parts = parts[1:]
    return ".".join(parts)


def user_module(model: torch.nn.Module, backend: Any = None) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel / torch.compile wrappers.

    Unwrapped by type, so a user's own attribute called ``module`` is left alone. A backend with
    its own wrapper (an engine) overrides ``Backend.unwrap``; that is used when present.
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    inner = model
    while True:
        if isinstance(inner, (DistributedDataParallel, DataParallel)):
            inner = inner.module
        elif type(inner).__name__ == "OptimizedModule" and hasattr(inner, "_orig_mod"):
            inner = inner._orig_mod
        elif getattr(inner, "holds_pipeline_stages", False):  # pp > 1: this rank's part
            inner = inner.module
        else:
            break
    if backend is not None:
        from accelkit.backend import Backend

        if type(backend).unwrap is not Backend.unwrap:
            inner = backend.unwrap(inner)
    return inner


def module_tensors(
    module: torch.nn.Module,
) -> Iterator[tuple[str, torch.Tensor, bool, list[str]]]:
    """``(canonical fqn, tensor, is_parameter, aliases)`` for each distinct tensor of the module's
    state dict (parameters and persistent buffers). Tied tensors appear once; their other names
    are the aliases."""
    params = {id(p) for p in module.parameters()}
    # by name too: FSDP2 registers the unsharded tensors while a root module stays unsharded
    # (after a no_grad forward of a frozen model), but its state_dict returns the sharded ones
    param_names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    seen: dict[int, list[str]] = {}
    named_param: set[int] = set()
    order: list[tuple[str, torch.Tensor]] = []
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue  # extra state of a custom module; not a tensor
        if name in param_names:
            named_param.add(id(value))
        fqn = canonical_fqn(name)
        if id(value) in seen:
            seen[id(value)].append(fqn)
            continue
        seen[id(value)] = []
        order.append((fqn, value))
    for fqn, value in order:
        yield fqn, value, id(value) in params or id(value) in named_param, seen[id(value)]
