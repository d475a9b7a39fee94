"""Pipeline parallelism's split of a model into stages that keep the unsplit model's names, and
the initialisation that gives every stage a plain build's weights (used by
:mod:`accelkit.backends.pipelining`).

- :func:`plan_stages`: the module names of each stage from ``pipeline["split"]``;
- :func:`prune`: a structural copy of the model holding one stage's modules under their names
  (containers keep only their own keys; any other module becomes a :class:`PassThrough`);
- :func:`replay_init`: every module's initialisation in module order on every rank, each rank
  keeping its stage's modules.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from torch import nn

from accelkit.errors import ConfigError
from accelkit.pipeline import PipelineSettings

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


# ---- the split ------------------------------------------------------------------------------
def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_container(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost ModuleList / ModuleDict / Sequential holding parameters (the model's stack
    of blocks), the root itself when it is one."""
    for name, module in model.named_modules():
        if isinstance(module, _CONTAINERS) and _param_count(module) > 0:
            return name, module
    return None


def _balanced_cuts(weights: list[int], stages: int, head: int, tail: int) -> list[int]:
    """Contiguous split of ``weights`` into ``stages`` non-empty runs minimising the heaviest
    stage, the first stage carrying ``head`` more and the last ``tail`` more; returns the run
    lengths. Dynamic programming over (blocks, stages): the block counts are small."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: the lightest heaviest-stage for the first i blocks on s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                load = prefix[i] - prefix[j] + (head if s == 1 else 0)
                load += tail if s == stages else 0
                cost = max(best[s - 1][j], load)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    sizes, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def _path_children(model: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """The modules before and after ``path`` at every level from the root down to it (in
    registration order): the first stage takes those before, the last those after."""
    before, after = [], []
    parts = path.split(".") if path else []
    module, prefix = model, ""
    for part in parts:
        names = list(module._modules)
        index = names.index(part)
        before += [prefix + n for n in names[:index] if module._modules[n] is not None]
        after = [prefix + n for n in names[index + 1 :] if module._modules[n] is not None] + after
        module = module._modules[part]
        prefix += part + "."
    return before, after


def _expand(name: str, modules: dict[str, nn.Module]) -> list[str]:
    """``layers.0-3`` -> ``layers.0 ... layers.3`` (a range of a container's keys)."""
    match = re.fullmatch(r"(.*?)(\d+)-(\d+)", name)
    if match and name not in modules:
        prefix, first, last = match.group(1), int(match.group(2)), int(match.group(3))
        return [f"{prefix}{i}" for i in range(first, last + 1)]
    return [name]


def plan_stages(model: nn.Module, settings: PipelineSettings) -> list[list[str]]:
    """The module names each stage holds, in stage order, from ``settings.split``."""
    stages = settings.stages
    split = settings.split
    modules = dict(model.named_modules())
    if split == "auto":
        found = _block_container(model)
        if found is None:
            raise ConfigError(
                "pipeline: split='auto' found no ModuleList, ModuleDict or Sequential of blocks "
                "in the model; pass split as a list of module-name lists (one per stage) or as "
                "split points {'name': 'begin'}"
            )
        path, container = found
        prefix = f"{path}." if path else ""
        blocks = [prefix + k for k, v in container._modules.items() if v is not None]
        if len(blocks) < stages:
            raise ConfigError(
                f"pipeline: split='auto' found {len(blocks)} blocks in {path or 'the model'}, "
                f"fewer than the {stages} stages; lower pp (or stages_per_rank), or split by "
                "names"
            )
        before, after = _path_children(model, path)
        head = sum(_param_count(modules[n]) for n in before)
        tail = sum(_param_count(modules[n]) for n in after)
        sizes = _balanced_cuts([_param_count(modules[b]) for b in blocks], stages, head, tail)
        out, start = [], 0
        for size in sizes:
            out.append(blocks[start : start + size])
            start += size
        out[0] = before + out[0]
        out[-1] = out[-1] + after
        return out
    if isinstance(split, dict):
        return _split_at_points(model, split, stages)
    out = [[n for name in names for n in _expand(name, modules)] for names in split]
    unknown = [n for names in out for n in names if n not in modules]
    if unknown:
        raise ConfigError(f"pipeline: split names modules the model does not have: {unknown}")
    return out


def _split_at_points(model: nn.Module, points: dict[str, str], stages: int) -> list[list[str]]:
    """Cut the model's modules, in registration order, before (``begin``) or after (``end``)
    each named module; a module whose name is a prefix of a split point is opened up."""
    modules = dict(model.named_modules())
    unknown = [p for p in points if p not in modules]
    if unknown:
        raise ConfigError(f"pipeline: split points name modules the model does not have: {unknown}")

    def units(module: nn.Module, prefix: str) -> list[str]:
        out = []
        for name, child in module._modules.items():
            if child is None:
                continue
            full = prefix + name
            if any(p.startswith(full + ".") for p in points):
                out += units(child, full + ".")
            else:
                out.append(full)
        return out

    order = units(model, "")
    result: list[list[str]] = [[]]
    for name in order:
        if points.get(name) == "begin" and result[-1]:
            result.append([])
        result[-1].append(name)
        if points.get(name) == "end":
            result.append([])
    result = [r for r in result if r]
    if len(result) != stages:
        raise ConfigError(
            f"pipeline: the split points cut the model into {len(result)} stages, not {stages}"
        )
    return result


def check_cover(model: nn.Module, plan: list[list[str]]) -> None:
    """Every module with parameters is held by exactly one stage."""
    modules = dict(model.named_modules())
    owner: dict[int, int] = {}
    for stage, names in enumerate(plan):
        for name in names:
            for sub in modules[name].modules():
                if id(sub) in owner and owner[id(sub)] != stage:
                    raise ConfigError(
                        f"pipeline: module {name} is in stages {owner[id(sub)]} and {stage}; "
                        "each module belongs to one stage"
                    )
                owner[id(sub)] = stage
    missing = [
        name
        for name, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False)) and id(module) not in owner and name
    ]
    if missing:
        raise ConfigError(
            f"pipeline: the split leaves modules with parameters on no stage: {missing[:6]}"
        )


#: the attribute a stage's module carries: names of tensors another stage writes to checkpoints
#: (this one's copy of a weight tied across stages), read by accelkit.checkpoint
WRITTEN_ELSEWHERE = "_accelkit_written_elsewhere"


class PassThrough(nn.Module):
    """Stands for a module another stage holds: returns its first input unchanged, so the
    model's own forward runs on every stage."""

    def forward(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        return x


def prune(model: nn.Module, keep: list[str], root_params: bool) -> nn.Module:
    """A structural copy of ``model`` holding the modules named in ``keep`` (the same objects)
    under their names; containers drop the other keys, other modules become
    :class:`PassThrough`. The root's (and the path's) own parameters stay when ``root_params``
    (the first stage); buffers stay everywhere. A pass-through keeps the parameters its module
    shares with a kept one (a tied embedding on the last stage), under their own names: the
    weight is then named as in the unsplit model (``embed.weight``, alias ``head.weight``)."""
    kept = set(keep)
    modules = dict(model.named_modules())
    held = {id(p) for name in kept for p in modules[name].parameters()}

    def pass_through(child: nn.Module) -> nn.Module:
        stand_in = PassThrough()
        for pname, p in child._parameters.items():
            if p is not None and id(p) in held:
                stand_in._parameters[pname] = p
        return stand_in

    def on_path(name: str) -> bool:
        return any(k == name or k.startswith(name + ".") for k in kept) or name == ""

    def copy_of(module: nn.Module, prefix: str) -> nn.Module:
        new = copy.copy(module)
        new._modules = {}
        new._parameters = dict(module._parameters) if root_params else {}
        new._buffers = dict(module._buffers)
        for name, child in module._modules.items():
            full = prefix + name
            if child is None:
                new._modules[name] = None
            elif full in kept:
                new._modules[name] = child
            elif on_path(full):
                new._modules[name] = copy_of(child, full + ".")
            elif not isinstance(module, _CONTAINERS):
                new._modules[name] = pass_through(child)
        return new

    return copy_of(model, "")


# ---- initialisation ------------------------------------------------------------------------
def replay_init(model: nn.Module, keep: set[str], materializer: Any) -> None:
    """Give the modules in ``keep`` (whole subtrees) the weights a plain build draws: every
    module's initialisation runs in module order on this rank (the random stream advances as in
    a plain build), and the modules of other stages go back to meta as soon as they are done
    (those sharing a parameter with a kept module at the end). ``materializer`` is the fsdp
    backend's (``reset_parameters`` and a Transformers model's ``_init_weights``); peak memory
    is the kept modules plus one module."""
    names = {id(m): n for n, m in model.named_modules()}

    def kept(name: str) -> bool:
        return any(name == k or name.startswith(k + ".") for k in keep)

    def on_path(name: str) -> bool:
        return name == "" or any(k.startswith(name + ".") for k in keep)

    # modules tied to a kept module: their value is the kept one's, so they go last
    late_ids = {
        id(m)
        for group in materializer.ties
        if any(kept(names[id(member)]) for member, _ in group)
        for m, _ in group
    }
    late: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        materializer.materialize(module)
        for child in module.children():
            visit(child)
        materializer.finish(module)
        materializer.retie()
        name = names[id(module)]
        if kept(name) or on_path(name):
            return
        if any(id(sub) in late_ids for sub in module.modules()):
            late.append(module)
        else:
            module.to("meta")

    visit(model)
    materializer.verify()
    held = {id(p) for n, m in model.named_modules() if kept(n) for p in m.parameters(recurse=False)}
    for module in late:
        for sub in module.modules():
            for pname, p in list(sub._parameters.items()):
                if p is not None and id(p) not in held:
                    sub._parameters[pname] = nn.Parameter(p.detach().to("meta"), p.requires_grad)
