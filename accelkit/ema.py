"""Exponential moving average of a model's weights, kept where the weights are kept.

::

    model, opt = accel.setup(model, opt)
    ema = accelkit.EMA(model, decay=0.999, accelerator=accel)   # after setup: it mirrors the shards
    for batch in loader:
        ...
        if accel.step():          # True when the optimizer step was applied
            ema.update()
    with ema.swap(model):         # evaluate with the averaged weights, then put the live ones back
        evaluate(model)
    accel.save("ckpt/step-1000", {"model": model, "optimizer": opt, "ema": ema})

The update rule is ``ema.lerp_(weight, 1 - decay)`` for every parameter, that is
``ema + (1 - decay) * (weight - ema)``, what ``torch.optim.swa_utils.get_ema_multi_avg_fn``
computes (the same value, bit for bit, in fp32). The average starts from the weights at
construction. Buffers (BatchNorm statistics) are copied from the model at every update by
default (``buffers="copy"``, like ``AveragedModel(use_buffers=False)``); ``"average"`` averages
the floating-point ones too; ``None`` leaves them out.

Sharded backends: each rank averages only its own shard. A DTensor parameter (FSDP2) gets a
DTensor shadow with the same placements, and the update runs on the local pieces, with no
communication. In the portable checkpoint the EMA is a module object of its own whose tensors
carry the model's names (each rank writes its shard), so it loads at another world size or into
another backend's EMA. A counter ``num_updates`` is saved with it (for decay warm-up schedules).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from accelkit.checkpoint.format.fqn import module_tensors, user_module
from accelkit.errors import ConfigError, UnsupportedError

log = logging.getLogger("accelkit")

COUNTER_NAME = "num_updates"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (a view: writes go to the DTensor)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class EMA(torch.nn.Module):
    """Exponential moving average of ``model``'s parameters (and buffers).

    Args:
        model: the model returned by ``accel.setup`` (or any module).
        decay: a number in [0, 1], or a function of the number of updates so far returning one
            (a warm-up such as ``lambda n: min(0.999, (1 + n) / (10 + n))``).
        buffers: ``"copy"`` (default), ``"average"`` or None (see the module docstring).
        only_trainable: average only parameters with ``requires_grad`` (frozen ones are constant;
            leaving them out saves their memory, and they are then not in the checkpoint's EMA).
        dtype: keep the average in this floating dtype (``torch.float32`` over bf16 weights);
            default: the weights' dtype.
        accelerator: the Accelerator that set the model up, to see through its wrappers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        decay: float | Callable[[int], float] = 0.999,
        *,
        buffers: Literal["copy", "average"] | None = "copy",
        only_trainable: bool = False,
        dtype: torch.dtype | None = None,
        accelerator: Any = None,
    ) -> None:
        super().__init__()
        if buffers not in ("copy", "average", None):
            raise ConfigError(f"buffers must be 'copy', 'average' or None, got {buffers!r}")
        if not callable(decay):
            _check_decay(decay)
        if dtype is not None and not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating dtype, got {dtype}")
        backend = getattr(accelerator, "backend", accelerator)
        inner = user_module(model, backend)
        self._ema_decay = decay
        self._ema_buffers_mode = buffers
        self._ema_backend = backend
        #: (name, shadow, source); sources are the model's own tensors (this rank's shards)
        self._ema_params: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._ema_buffers: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        sharded = bool(getattr(getattr(backend, "capabilities", None), "sharded", False))
        for fqn, tensor, is_param, aliases in module_tensors(inner):
            if fqn == COUNTER_NAME or COUNTER_NAME in aliases:
                raise ConfigError(
                    f"EMA: the model has a tensor named {COUNTER_NAME!r}, which the EMA uses"
                )
            if is_param and only_trainable and not tensor.requires_grad:
                continue
            if not is_param and buffers is None:
                continue
            if tensor.device.type == "meta":
                raise ConfigError(
                    f"EMA: {fqn} is on the meta device; build the EMA after accel.setup()"
                )
            if is_param and sharded and tensor.numel() == 0 and not hasattr(tensor, "to_local"):
                raise UnsupportedError(
                    f"EMA: parameter {fqn} holds no elements on this rank: the backend "
                    f"{getattr(backend, 'name', '?')!r} partitions parameters outside DTensor, "
                    "and accelkit's EMA cannot see its shards yet"
                )
            detached = tensor.detach()
            use_dtype = dtype if (dtype is not None and detached.is_floating_point()) else None
            shadow = detached.clone() if use_dtype is None else detached.to(use_dtype, copy=True)
            if is_param:
                shadow = torch.nn.Parameter(shadow, requires_grad=False)
                self._ema_params.append((fqn, shadow, tensor))
            else:
                self._ema_buffers.append((fqn, shadow, tensor))
            for name in (fqn, *aliases):
                self._place(name, shadow, is_param)
        self.register_buffer(COUNTER_NAME, torch.zeros((), dtype=torch.int64, device="cpu"))

    def _place(self, fqn: str, tensor: torch.Tensor, is_param: bool) -> None:
        *path, leaf = fqn.split(".")
        owner: torch.nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                if hasattr(owner, part):
                    raise ConfigError(
                        f"EMA: the model's name {fqn!r} collides with an attribute of "
                        f"{type(owner).__name__}"
                    )
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        if hasattr(owner, leaf) and leaf not in owner._parameters and leaf not in owner._buffers:
            raise ConfigError(f"EMA: the model's name {fqn!r} collides with an EMA attribute")
        if is_param:
            owner.register_parameter(leaf, tensor)
        else:
            owner.register_buffer(leaf, tensor)

    # ---- averaging ----------------------------------------------------------------------------
    @property
    def decay(self) -> float:
        """The decay the next :meth:`update` uses."""
        if callable(self._ema_decay):
            value = float(self._ema_decay(int(self.num_updates)))
            _check_decay(value)
            return value
        return float(self._ema_decay)

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the current weights (call after an applied optimizer step)."""
        weight = 1.0 - self.decay
        groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for _, shadow, source in self._ema_params:
            s, p = _local(shadow.detach()), _local(source.detach())
            if p.dtype != s.dtype:
                p = p.to(s.dtype)
            pair = groups.setdefault((s.device, s.dtype), ([], []))
            pair[0].append(s)
            pair[1].append(p if p.device == s.device else p.to(s.device))
        for shadows, sources in groups.values():
            torch._foreach_lerp_(shadows, sources, weight)
        for _, shadow, source in self._ema_buffers:
            s, b = _local(shadow), _local(source.detach())
            if self._ema_buffers_mode == "average" and s.is_floating_point():
                s.lerp_(b.to(s.device, s.dtype), weight)
            else:
                s.copy_(b)
        self.num_updates += 1

    # ---- using the average --------------------------------------------------------------------
    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module | None = None) -> None:
        """Write the averaged weights into the model (its shards), replacing the live ones."""
        for shadow, target in self._pairs(model):
            _local(target.detach()).copy_(_local(shadow.detach()))

    @contextlib.contextmanager
    def swap(self, model: torch.nn.Module | None = None) -> Iterator[torch.nn.Module | None]:
        """Inside the block the model holds the averaged weights; after it, the live ones again,
        exactly (an optimizer step inside the block is not allowed: it would be undone)."""
        pairs = self._pairs(model)
        saved = [_local(t.detach()).clone() for _, t in pairs]
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for (_, target), old in zip(pairs, saved):
                    _local(target.detach()).copy_(old)

    def _pairs(self, model: torch.nn.Module | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(shadow, target) for every averaged tensor: the EMA's own model, or another model
        of the same architecture matched by name."""
        entries = self._ema_params + self._ema_buffers
        if model is None:
            return [(shadow, source) for _, shadow, source in entries]
        by_name = {}
        for fqn, tensor, _is_param, aliases in module_tensors(
            user_module(model, self._ema_backend)
        ):
            for name in (fqn, *aliases):
                by_name[name] = tensor
        missing = [name for name, _, _ in entries if name not in by_name]
        if missing:
            raise ConfigError(f"EMA: the model has no tensor(s) {', '.join(missing)}")
        return [(shadow, by_name[name]) for name, shadow, _ in entries]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedError(
            "the EMA holds weights, it does not run: use ema.swap(model) or ema.copy_to(model)"
        )

    def extra_repr(self) -> str:
        decay = "schedule" if callable(self._ema_decay) else self._ema_decay
        tensors = len(self._ema_params) + len(self._ema_buffers)
        return f"decay={decay}, tensors={tensors}, buffers={self._ema_buffers_mode}"


def _check_decay(decay: Any) -> None:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
        raise ConfigError(f"EMA decay must be a number in [0, 1], got {decay!r}")
