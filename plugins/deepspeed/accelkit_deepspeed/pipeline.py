"""DeepSpeed's ``PipelineEngine`` behind ``accel.forward_backward`` (``pp > 1``).

DeepSpeed runs a pipeline only as a ``PipelineModule``: a list of layers applied one after the
other, cut into stages, trained by ``engine.train_batch(data_iter)`` (forward, backward *and*
the optimizer step over ``gradient_accumulation_steps`` micro-batches). accelkit maps its loop
onto it:

- **the model** is an ``nn.Sequential`` (its children run in order, as DeepSpeed's layers do);
  nested plain ``nn.Sequential`` children are flattened, so ``Sequential(embed,
  Sequential(*blocks), head)`` gives every block its own layer to balance. The user builds the
  whole model, so the initial weights are the plain build's at every stage count; the layers of
  other stages are released after setup.
- **the split**: ``"auto"`` is DeepSpeed's ``partition_method="parameters"``; a list of name
  lists (one per stage) or split points ``{"1.4": "begin"}`` become the stage boundaries.
- **names**: ``PipelineModule`` registers layer ``i`` as ``str(i)``; each layer is registered
  again under its name in the user's model, so the stage's parameters carry the unsplit names
  and the portable checkpoint is keyed by them.
- **the call**: the batch is cut into ``microbatches`` pieces, and ``train_batch`` runs over
  them with ``gradient_accumulation_steps = microbatches``: DeepSpeed divides each micro-batch
  loss by it once, and steps the optimizer. ``accel.step()`` that follows is then bookkeeping
  (schedulers, ``grad_norm``). So one ``forward_backward`` is one optimizer step:
  ``accumulation_steps > 1`` is refused (raise ``microbatches`` instead).
- **refused**: ZeRO-2/3 (DeepSpeed asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline
  parallelism"), weights shared between layers (``TiedLayerSpec`` is not mapped), activation
  checkpointing, several positional inputs or keyword inputs (the first layer takes one).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from accelkit.sdk import ConfigError, UnsupportedError, split_microbatches

#: the schedule DeepSpeed's PipelineEngine runs (its TrainSchedule)
SCHEDULES = ("1F1B",)
#: ZeRO stages PipelineEngine accepts
ZERO_STAGES = (0, 1)
ZERO_REFUSAL = (
    "DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3 ('ZeRO-2 and ZeRO-3 are incompatible "
    "with pipeline parallelism', deepspeed/runtime/pipe/engine.py): use zero_stage=0 or 1 with "
    "pp, or fsdp with pp for sharded parameters"
)


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in the order they run, each with its name in the model."""
    if not isinstance(model, nn.Sequential):
        raise UnsupportedError(
            f"deepspeed with pp: the model must be an nn.Sequential (DeepSpeed's PipelineModule "
            f"runs its layers one after the other), got {type(model).__name__}. Write it as "
            "nn.Sequential(embed, nn.Sequential(*blocks), head), or use fsdp or ddp with pp, "
            "whose split follows the module tree"
        )
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, seq: nn.Sequential) -> None:
        for name, child in seq._modules.items():  # named_children() drops a repeated module
            if child is None:
                continue
            if type(child) is nn.Sequential:
                walk(f"{prefix}{name}.", child)
            else:
                out.append((f"{prefix}{name}", child))

    walk("", model)
    if not out:
        raise ConfigError("deepspeed with pp: the nn.Sequential has no layers")
    return out


def check_untied(layers: list[tuple[str, nn.Module]]) -> None:
    """Refuse a parameter shared by two layers: PipelineModule would train two copies."""
    seen: dict[int, str] = {}
    for name, layer in layers:
        for pname, param in layer.named_parameters():
            other = seen.setdefault(id(param), f"{name}.{pname}")
            if other != f"{name}.{pname}" and not other.startswith(f"{name}."):
                raise UnsupportedError(
                    f"deepspeed with pp: {name}.{pname} is the same parameter as {other}; "
                    "weights tied across layers are not mapped onto DeepSpeed's TiedLayerSpec. "
                    "Untie them, or use fsdp with pp"
                )


def boundaries(split: Any, names: list[str], stages: int) -> list[int] | None:
    """The first layer index of every stage and the layer count (DeepSpeed's ``parts``), or None
    for ``"auto"`` (DeepSpeed balances parameters itself)."""
    if split == "auto":
        return None

    def under(layer: str, key: str) -> bool:
        return layer == key or layer.startswith(key + ".")

    if isinstance(split, Mapping):
        starts = {0}
        for key, where in split.items():
            hits = [i for i, n in enumerate(names) if under(n, key)]
            if not hits:
                raise ConfigError(f"pipeline split: no layer is named {key!r} or under it")
            starts.add(hits[0] if where == "begin" else hits[-1] + 1)
        parts = [*sorted(starts), len(names)]
    else:
        owner: list[int | None] = [None] * len(names)
        for stage, keys in enumerate(split):
            for key in keys:
                hits = [i for i, n in enumerate(names) if any(under(n, k) for k in _expand(key))]
                if not hits:
                    raise ConfigError(f"pipeline split: no layer is named {key!r} or under it")
                for i in hits:
                    owner[i] = stage
        missing = [names[i] for i, o in enumerate(owner) if o is None]
        if missing:
            raise ConfigError(f"pipeline split: layers {missing} are in no stage's list")
        if owner != sorted(owner):  # type: ignore[type-var]
            raise ConfigError(
                "pipeline split: DeepSpeed's stages are runs of consecutive layers; the lists "
                f"give {list(zip(names, owner))}"
            )
        parts = [owner.index(s) for s in range(stages) if s in owner] + [len(names)]
    if len(parts) != stages + 1 or any(a >= b for a, b in itertools.pairwise(parts)):
        raise ConfigError(
            f"pipeline split: {stages} non-empty stages of consecutive layers are needed; the "
            f"split gives stage starts {parts[:-1]} over layers {names}"
        )
    return parts


def _expand(key: str) -> list[str]:
    """``layers.0-3`` -> ``layers.0`` ... ``layers.3``."""
    match = re.fullmatch(r"(.*?)(\d+)-(\d+)", key)
    if match is None:
        return [key]
    prefix, low, high = match.group(1), int(match.group(2)), int(match.group(3))
    return [f"{prefix}{i}" for i in range(low, high + 1)]


@functools.cache
def _module_class() -> type:
    """A PipelineModule that takes its stage boundaries from accelkit when given."""
    from deepspeed.pipe import PipelineModule

    class AccelkitPipelineModule(PipelineModule):
        def __init__(self, *args: Any, parts: list[int] | None = None, **kwargs: Any) -> None:
            object.__setattr__(self, "_accelkit_parts", parts)
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:
            if self._accelkit_parts is None:
                return super()._partition_layers(method)
            self.parts = list(self._accelkit_parts)

    return AccelkitPipelineModule


class _LossSlot:
    """PipelineModule's ``loss_fn``: set per ``forward_backward`` call (DeepSpeed reads
    ``module.loss_fn(outputs, labels)`` on the last stage)."""

    def __init__(self) -> None:
        self.fn: Any = None

    def __call__(self, outputs: Any, labels: Any) -> torch.Tensor:
        return outputs if self.fn is None else self.fn(outputs, labels)


def build_module(model: nn.Module, pp: int, split: Any) -> tuple[nn.Module, list[str]]:
    """This rank's stage of ``model`` as a PipelineModule, its parameters under the model's
    names; the other stages' layers are moved to the meta device (released)."""
    layers = layers_of(model)
    check_untied(layers)
    names = [n for n, _ in layers]
    parts = boundaries(split, names, pp)
    if len(layers) < pp:
        raise ConfigError(f"deepspeed with pp={pp}: the model has only {len(layers)} layers")
    cls = _module_class()
    module = cls(
        layers=[layer for _, layer in layers],
        num_stages=pp,
        loss_fn=_LossSlot(),
        partition_method="parameters",
        parts=parts,
    )
    start, stop = module._local_start, module._local_stop
    held = {}
    for index in range(start, stop):
        held[index] = module._modules.pop(str(index))
    for index, layer in held.items():
        _register(module, names[index], layer)
    for index, (_, layer) in enumerate(layers):
        if not start <= index < stop:
            layer.to("meta")  # another stage's: its memory goes back
    return module, names


def _register(root: nn.Module, name: str, layer: nn.Module) -> None:
    *path, leaf = name.split(".")
    here = root
    for part in path:
        child = here._modules.get(part)
        if child is None:
            child = nn.Module()
            here.add_module(part, child)
        here = child
    here.add_module(leaf, layer)


def refuse_call(*args: Any, **kwargs: Any) -> Any:
    raise UnsupportedError(
        "pipeline parallel (deepspeed): no rank holds the whole model, so model(x) cannot run; "
        "call loss = accel.forward_backward(model, x, target=y, loss_fn=...) then accel.step()"
    )


def micro_batches(
    inputs: tuple[Any, ...], kwargs: dict[str, Any], target: Any, count: int
) -> list[tuple[Any, Any]]:
    """DeepSpeed's ``(inputs, labels)`` pairs: the first stage reads ``[0]``, the last ``[1]``."""
    if kwargs or len(inputs) != 1:
        raise UnsupportedError(
            "deepspeed with pp: forward_backward takes one positional input (DeepSpeed's first "
            f"layer receives one value), got {len(inputs)} and keywords {sorted(kwargs)}; pack "
            "them in a tuple the first layer unpacks"
        )
    xs = split_microbatches(inputs[0], count)
    if target is None:  # the last stage's output is the loss; DeepSpeed still wants labels
        ys = [torch.zeros(0) for _ in range(count)]
    else:
        ys = split_microbatches(target, count, "target")
    return list(zip(xs, ys))


def shapes(batch: list[tuple[Any, Any]]) -> Any:
    def shape(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype)
        if isinstance(value, (list, tuple)):
            return tuple(shape(v) for v in value)
        return None

    return shape(batch[0])


def stage_grad_norm(engine: Any) -> torch.Tensor:
    """The 2-norm of every stage's gradients (this stage's squares summed over the pipe group),
    for ZeRO-0 where DeepSpeed records none; gradients are reduced over data parallel already."""
    import torch.distributed as dist

    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if grads:
        local = torch.nn.utils.get_total_norm(grads).to(torch.float32) ** 2
    else:
        local = torch.zeros((), dtype=torch.float32, device=engine.device)
    dist.all_reduce(local, group=engine.grid.get_pipe_parallel_group())
    return local.sqrt()
