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


def check_wrap_policy(policy: Any) -> None:
    """Refuse, when options are parsed, a ``wrap_policy`` that :func:`wrap_blocks` cannot read.

    Shared by the FSDP-like backends (torch ``fsdp``, ``fairscale_fsdp``) so that both accept
    the same values with the same message."""
    if policy is None or isinstance(policy, (bool, type, str)) or callable(policy):
        return
    if isinstance(policy, Iterable) and all(isinstance(p, (type, str)) for p in policy):
        return
    raise ValueError(
        "option 'wrap_policy' must be True (the blocks of every ModuleList/Sequential stack), "
        "False/None (the root only), a module class or class name, a list of those, or a "
        f"predicate module -> bool; got {policy!r}"
    )


def wrap_blocks(model: torch.nn.Module, policy: Any, backend: str) -> list[torch.nn.Module]:
    """The submodules a ``wrap_policy`` makes their own sharded unit (before any tie check).

    True: the blocks of the outermost ModuleList/Sequential stacks; False/None: none; classes,
    class names (bare or ``module.QualName``) or a predicate otherwise. A class name that
    matches no module is an error naming ``backend``, since a typo would silently shard nothing.
    """
    from accelkit.errors import ConfigError

    if policy is None or policy is False:
        return []
    if isinstance(policy, (str, type)):
        wanted: list[Any] | None = [policy]
    else:
        wanted = list(policy) if isinstance(policy, Iterable) else None
    names = {p for p in wanted or () if isinstance(p, str)}
    if names:
        classes = tuple(p for p in wanted or () if isinstance(p, type))

        def matches(m: torch.nn.Module) -> bool:
            cls = type(m)
            qualified = f"{cls.__module__}.{cls.__qualname__}"
            return cls.__name__ in names or qualified in names or isinstance(m, classes)

        blocks = select_blocks(model, matches)
        found = {type(b).__name__ for b in blocks}
        found |= {f"{type(b).__module__}.{type(b).__qualname__}" for b in blocks}
        missing = sorted(names - found)
        if missing:
            raise ConfigError(
                f"{backend}: wrap_policy names {missing} but the model has no such modules"
            )
    else:
        blocks = select_blocks(model, policy if wanted is None else wanted)
    if policy is True:  # default: only the outermost stacks' blocks
        inside = {id(m) for b in blocks for m in b.modules() if m is not b}
        blocks = [b for b in blocks if id(b) not in inside]
    return blocks


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
