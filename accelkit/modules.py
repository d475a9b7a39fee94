"""Model transformations that several backends share: finding the repeated blocks of a model,
non-reentrant activation checkpointing, and compiling in place."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

#: what users pass for ``activation_checkpointing=`` and wrap policies
BlockPolicy = bool | Iterable[type] | Callable[[torch.nn.Module], bool] | None


def default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Children of every ``ModuleList`` / ``Sequential`` stack that hold parameters.

    That is where transformers and MLP stacks keep their repeated blocks.
    """
    blocks: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and module is not model:
            blocks.extend(c for c in module.children() if any(True for _ in c.parameters()))
    return blocks


def select_blocks(model: torch.nn.Module, policy: BlockPolicy) -> list[torch.nn.Module]:
    """Modules matched by ``policy``: True (default blocks), classes, or a predicate."""
    if policy is None or policy is False:
        return []
    if policy is True:
        return default_blocks(model)
    if callable(policy) and not isinstance(policy, type):
        return [m for m in model.modules() if m is not model and policy(m)]
    classes = tuple(policy) if not isinstance(policy, type) else (policy,)
    return [m for m in model.modules() if isinstance(m, classes) and m is not model]


def apply_activation_checkpointing(model: torch.nn.Module, policy: BlockPolicy) -> int:
    """Recompute the selected blocks' activations in backward (non-reentrant). Returns the count.

    The blocks' ``forward`` is patched in place, so parameter names do not change.
    """
    blocks = select_blocks(model, policy)
    for block in blocks:
        if getattr(block, "_accelkit_checkpointed", False):
            continue
        original = block.forward

        def forward(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return checkpoint(_original, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._accelkit_checkpointed = True
    return len(blocks)


def compile_in_place(module: torch.nn.Module, options: dict[str, Any] | None = None) -> None:
    """``module.compile()``: compiled, with the same object and the same state-dict keys."""
    module.compile(**(options or {}))
