"""Pipeline parallelism on the torch-native backends (``fsdp``, ``ddp``) through
``torch.distributed.pipelining``: the split, the initialisation, the stages and the schedule.

What accelkit adds to torch's pipelining (docs/pipeline.md):

- the split keeps the unsplit model's names: each stage is a structural copy of the user's model
  holding only its own modules (containers keep their keys; a module held elsewhere becomes a
  pass-through), so checkpoints are keyed as without a pipeline;
- the same initial weights at every stage count: the model is built on meta, then every
  module's initialisation is replayed in module order on every rank (drawing the random numbers
  a plain build draws), each rank keeping only its stage's modules;
- the loss arithmetic: each micro-batch loss is divided once, by micro-batches x accumulation
  steps, and torch's schedules run with ``scale_grads=False`` (their own scaling divides the
  gradients of the window's earlier calls again);
- the loss of the step on every rank, a clipping norm over every stage, and weights tied across
  stages (an embedding and its output layer) kept equal with their gradients summed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accelkit.backends.pipeline_split import (
    WRITTEN_ELSEWHERE,
    PassThrough,
    check_cover,
    plan_stages,
    prune,
    replay_init,
)
from accelkit.errors import ConfigError, UnsupportedError
from accelkit.pipeline import V_SHAPED, PipelineSettings, split_microbatches

__all__ = ["PassThrough", "PipelineParallel", "PipelinedModule", "PipelineRunner"]

log = logging.getLogger("accelkit")


# ---- tied weights across stages -----------------------------------------------------------
@dataclass
class CrossStageTie:
    """One parameter that modules of several pipeline ranks share (an embedding and its output
    layer): the canonical name (the first in module order), this rank's name for it, and the
    group of the ranks holding it at this rank's data-parallel position."""

    canonical: str
    local: str | None
    group: Any = None
    first_holder: bool = False


def cross_stage_ties(
    model: nn.Module, plan: list[list[str]], settings: PipelineSettings
) -> list[tuple[str, list[str], list[int]]]:
    """``(canonical name, member names, pipeline ranks holding it)`` for each parameter that
    modules of more than one pipeline rank share."""
    stage_of: dict[str, int] = {}
    for stage, names in enumerate(plan):
        for name in names:
            stage_of[name] = stage

    def stage_holding(module_name: str) -> int | None:
        best = None
        for name, stage in stage_of.items():
            if module_name == name or module_name.startswith(name + "."):
                best = stage
        return best

    groups: dict[int, list[str]] = {}
    for mname, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is not None:
                groups.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        ranks = sorted(
            {
                settings.rank_of_stage(s)
                for m in members
                if (s := stage_holding(m.rsplit(".", 1)[0] if "." in m else "")) is not None
            }
        )
        if len(ranks) > 1:
            out.append((members[0], members, ranks))
    return out


# ---- the module setup returns ---------------------------------------------------------------
class PipelinedModule(nn.Module):
    """What ``setup`` returns under pipeline parallelism: this rank's part of the model under
    the unsplit model's names (``.module``). It cannot be called: run the step with
    ``accel.forward_backward``."""

    #: the checkpoint's user_module() looks through it (accelkit.checkpoint.fqn)
    holds_pipeline_stages = True

    def __init__(self, local: nn.Module, runner: PipelineRunner) -> None:
        super().__init__()
        self.module = local
        # not a submodule: the stages hold the same modules under wrappers
        self.__dict__["runner"] = runner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedError(
            "this model is split into pipeline stages (pp > 1), so no rank can run model(x): "
            "call `loss = accel.forward_backward(model, x, target=y, loss_fn=...)` for the "
            "training step (forward, loss and backward over every stage), then accel.step()"
        )


# ---- the schedule -------------------------------------------------------------------------------
def _schedule_class(name: str) -> Any:
    from torch.distributed import pipelining

    cls = getattr(pipelining, "Schedule" + name, None)
    if cls is None:
        raise UnsupportedError(
            f"pipeline: torch {torch.__version__} has no {name!r} schedule "
            f"(torch.distributed.pipelining.Schedule{name}); pick another schedule"
        )
    return cls


@dataclass
class PipelineRunner:
    """One rank's pipeline: its stage modules (wrapped for data parallelism), the schedule
    (built at the first call and again when the micro-batch shapes change), the loss rule."""

    settings: PipelineSettings
    stage_ids: tuple[int, ...]
    stage_modules: list[nn.Module]
    pp_group: Any
    pp_rank: int
    device: torch.device
    accumulation_steps: int
    scale_loss: Callable[[torch.Tensor], torch.Tensor]
    forward_context: Callable[[], contextlib.AbstractContextManager]
    ties: list[CrossStageTie] = field(default_factory=list)
    _schedules: dict[Any, tuple[Any, list[Any]]] = field(default_factory=dict)

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        return self.settings.stages - 1 in self.stage_ids

    def _schedule(self, key: Any, loss_fn: Callable[..., torch.Tensor]) -> tuple[Any, list[Any]]:
        from torch.distributed.pipelining import PipelineStage

        entry = self._schedules.get(key)
        if entry is not None:
            entry[0]._loss_fn = loss_fn
            return entry
        s = self.settings
        stages = [
            PipelineStage(m, i, s.stages, self.device, group=self.pp_group)
            for m, i in zip(self.stage_modules, self.stage_ids)
        ]
        cls = _schedule_class(s.schedule)
        kwargs = dict(n_microbatches=s.microbatches, loss_fn=loss_fn, scale_grads=False)
        schedule = cls(stages[0], **kwargs) if len(stages) == 1 else cls(stages, **kwargs)
        self._schedules = {key: (schedule, stages)}  # one shape at a time
        return schedule, stages

    def forward_backward(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        loss_fn: Callable[..., torch.Tensor] | None,
    ) -> torch.Tensor:
        s = self.settings
        # each piece must be equal: every micro-batch loss is divided by the same count
        for value in (*inputs, target, *kwargs.values()):
            split_microbatches(value, s.microbatches, "input" if value is not target else "target")
        divisor = s.microbatches * self.accumulation_steps
        # id(what the schedule got) -> the undivided loss; the schedule's shape inference calls
        # the loss function too, so only the losses it reports back are the step's
        raw: dict[int, torch.Tensor] = {}

        def loss_of(output: Any, y: Any) -> torch.Tensor:
            loss = output if loss_fn is None else loss_fn(output, y)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError(
                    "forward_backward: the loss of a micro-batch must be a one-element tensor; "
                    "pass loss_fn= that reduces the last stage's output to a scalar"
                )
            scaled = self.scale_loss(loss / divisor)
            raw[id(scaled)] = loss.detach().float().reshape(())
            return scaled

        if target is None:  # torch's last stage wants a target; the loss function ignores it
            first = next(v for v in (*inputs, *kwargs.values()) if isinstance(v, torch.Tensor))
            target = torch.zeros(first.shape[0], device=first.device)

        key = tuple(
            (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)
            for v in (*inputs, target, *kwargs.values())
        )
        schedule, _ = self._schedule(key, loss_of)
        args = inputs if self.holds_first else ()
        losses: list[torch.Tensor] = []
        with self.forward_context():
            schedule.step(
                *args,
                target=target if self.holds_last else None,
                losses=losses if self.holds_last else None,
                return_outputs=False,
                **kwargs,
            )
        mean = (
            torch.stack([raw[id(loss)] for loss in losses]).mean().to(self.device)
            if losses
            else torch.zeros((), device=self.device, dtype=torch.float32)
        )
        source = s.rank_of_stage(s.stages - 1)
        dist.broadcast(mean, group=self.pp_group, group_src=source)
        return mean

    # ---- the step: tied gradients, the norm over every stage --------------------------------
    def sum_tied_grads(self, params: dict[str, torch.Tensor]) -> None:
        """Add up the gradient of each cross-stage tied weight over its holders."""
        for tie in self.ties:
            if tie.local is None:
                continue
            p = params[tie.local]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=tie.group)

    def duplicate_params(self) -> set[str]:
        """Local names of tied weights another rank counts in the norm."""
        return {t.local for t in self.ties if t.local is not None and not t.first_holder}

    def total_norm(self, local_norm: torch.Tensor) -> torch.Tensor:
        """The 2-norm over every stage from this rank's (over its stage and data parallel
        peers): squares added over the pipeline group."""
        squared = local_norm.detach().to(self.device, torch.float32).square()
        dist.all_reduce(squared, group=self.pp_group)
        return squared.sqrt()


def build_tie_groups(
    ties: list[tuple[str, list[str], list[int]]],
    mesh: Any,
    pp_rank: int,
    local_names: set[str],
) -> list[CrossStageTie]:
    """One process group per tied weight and data-parallel position: the ranks holding the
    weight along the pipeline dimension. Every rank creates every group, in the same order."""
    out = []
    layout = mesh.mesh  # tensor of global ranks, pipeline dimension first
    me = dist.get_rank()
    flat = layout.reshape(layout.shape[0], -1)
    for canonical, members, ranks in ties:
        mine = None
        for column in range(flat.shape[1]):
            group_ranks = [int(flat[r, column]) for r in ranks]
            group = dist.new_group(group_ranks)
            if me in group_ranks:
                mine = group
        local = next((m for m in members if m in local_names), None)
        out.append(
            CrossStageTie(canonical, local, mine, first_holder=bool(ranks and ranks[0] == pp_rank))
        )
    return out


def optimizer_slots(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], who: str
) -> list[list[list[str]]]:
    """The parameter names of every optimizer's groups; refuses what cannot be swapped."""
    names = {id(p): n for n, p in model.named_parameters()}
    slots = []
    for optimizer in optimizers:
        if len(optimizer.state):
            raise ConfigError(
                f"{who}: the optimizer already has state (it has stepped, or state was "
                "loaded). Sharding replaces the parameters, and that state would not follow. "
                "Pass a fresh optimizer to setup(), and load optimizer state after setup "
                "with accel.load()."
            )
        groups = []
        for group in optimizer.param_groups:
            unknown = [p for p in group["params"] if id(p) not in names]
            if unknown:
                raise ConfigError(
                    f"{who}: the optimizer holds {len(unknown)} parameter(s) that are not in "
                    "the model passed to setup(); build the optimizer from "
                    "model.parameters() of that model"
                )
            groups.append([names[id(p)] for p in group["params"]])
        slots.append(groups)
    return slots


def split_optimizers(
    optimizers: list[torch.optim.Optimizer],
    slots: list[list[list[str]]],
    params: dict[str, torch.Tensor],
) -> None:
    """Point each optimizer's groups at this rank's parameters, by name (a group may be left
    empty: the group structure is the same on every stage)."""
    for optimizer, groups in zip(optimizers, slots):
        for group, names in zip(optimizer.param_groups, groups):
            group["params"] = [params[n] for n in names if n in params]


def iter_stage_params(modules: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p


def check_microbatches_fit(settings: PipelineSettings) -> None:
    """torch's interleaved schedules run the micro-batches in rounds of ``pp``."""
    if settings.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and (
        settings.microbatches % settings.pp
    ):
        raise ConfigError(
            f"pipeline: {settings.schedule} runs micro-batches in rounds of pp={settings.pp}; "
            f"microbatches={settings.microbatches} is not a multiple of it"
        )
    if settings.schedule in V_SHAPED and settings.microbatches < settings.stages:
        raise ConfigError(
            f"pipeline: {settings.schedule} needs at least {settings.stages} micro-batches "
            f"(2 x pp), got {settings.microbatches}"
        )


# ---- what fsdp and ddp share ------------------------------------------------------------------
class PipelineParallel:
    """Mixed into the torch-native backends: ``setup`` under ``pp > 1``, the step's hooks.

    The backend provides ``mesh`` (a DeviceMesh whose first dimension is ``pp``),
    ``_wrap_stage(module, activation_checkpointing, compile)`` (data parallelism inside a
    stage: ``fully_shard`` or ``DistributedDataParallel``; returns the module the stage runs)
    and ``_materializer(model)`` (the meta-build initialiser)."""

    #: the pipeline schedules torch 2.13 offers; a missing class is reported at setup
    PIPELINE_SCHEDULES = (
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    )

    def replica_holders(self) -> tuple[int, int]:
        """Under pp only the ranks of one stage hold its tensors (pp is the outermost mesh
        dimension: a stage's ranks are consecutive)."""
        backend: Any = self
        if backend.settings.pipeline is None:
            return backend.rank, backend.world_size
        inner = backend.world_size // backend.settings.pipeline.pp
        return backend.rank % inner, inner

    @classmethod
    def resolve_settings(cls, name: str, options: Any, settings: Any) -> Any:
        """At ``get()``, before any process joins: what a pipeline cannot run with."""
        settings = super().resolve_settings(name, options, settings)  # type: ignore[misc]
        if settings.pipeline is None:
            return settings
        check_microbatches_fit(settings.pipeline)
        if settings.precision in ("16-mixed", "fp8-mixed"):
            raise ConfigError(
                f"pipeline: precision {settings.precision!r} is not supported with pp > 1 "
                "(16-mixed: each stage's loss scaler would skip steps on its own; fp8-mixed: "
                "not measured); use 'bf16-mixed' or '32-true'"
            )
        return settings

    def setup_pipeline(
        self,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        compile: Any = False,
        activation_checkpointing: Any = None,
    ) -> Any:
        from accelkit.backend import SetupResult

        backend: Any = self
        settings: PipelineSettings = backend.settings.pipeline
        if compile:
            raise ConfigError(
                f"{backend.name}: compile=True is not supported with pp > 1 yet (torch's "
                "pipeline stages run the stage modules eagerly here, untested compiled); leave "
                "compile out under pp"
            )
        mesh = backend.mesh
        pp_rank = mesh["pp"].get_local_rank()
        plan = plan_stages(model, settings)
        check_cover(model, plan)
        ids = settings.stage_ids(pp_rank)
        keep = {n for i in ids for n in plan[i]}
        slots = optimizer_slots(model, optimizers, backend.name)
        ties = cross_stage_ties(model, plan, settings)
        for optimizer in optimizers:  # the full model's parameters must not stay alive
            for group in optimizer.param_groups:
                group["params"] = []
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            materializer = backend._materializer(model)
            materializer.check(model)
            replay_init(model, keep, materializer)
        stage_modules = [prune(model, plan[i], root_params=i == 0) for i in ids]
        if len(stage_modules) > 1:
            owner: dict[int, int] = {}
            for index, module in zip(ids, stage_modules):
                for name, p in module.named_parameters():
                    if owner.setdefault(id(p), index) != index:
                        raise ConfigError(
                            f"pipeline: {name} is shared by stages {owner[id(p)]} and {index}, "
                            f"which both run on pipeline rank {pp_rank} ({settings.schedule}); "
                            "a weight tied across two stages of one rank is not supported: "
                            "use a schedule with one stage per rank (1F1B, GPipe) or untie it"
                        )
        runs = [backend._wrap_stage(m, activation_checkpointing, compile) for m in stage_modules]
        if len(ids) == 1:
            local = stage_modules[0]
        else:
            local = prune(model, sorted(keep), root_params=0 in ids)
            holder = stage_modules[ids.index(0)] if 0 in ids else stage_modules[0]
            if 0 in ids:
                local._parameters = dict(holder._parameters)
            local._buffers = dict(holder._buffers)
        params = dict(iter_stage_params([local]))
        split_optimizers(optimizers, slots, params)
        tie_groups = build_tie_groups(ties, mesh, pp_rank, set(params))
        # a tied weight's later holders keep a copy the first holder writes to checkpoints
        local.__dict__[WRITTEN_ELSEWHERE] = {
            t.local for t in tie_groups if t.local is not None and not t.first_holder
        }
        runner = PipelineRunner(
            settings=settings,
            stage_ids=ids,
            stage_modules=runs,
            pp_group=mesh["pp"].get_group(),
            pp_rank=pp_rank,
            device=backend.device,
            accumulation_steps=backend.settings.accumulation_steps,
            scale_loss=backend.precision.scale_loss,
            forward_context=backend.forward_context,
            ties=tie_groups,
        )
        log.info(
            "pipeline: rank %d runs stage(s) %s of %d (%s, %d micro-batches): %s",
            backend.rank,
            list(ids),
            settings.stages,
            settings.schedule,
            settings.microbatches,
            "; ".join(", ".join(plan[i][:3]) + (" ..." if len(plan[i]) > 3 else "") for i in ids),
        )
        return SetupResult(PipelinedModule(local, runner), optimizers)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Under pp: every stage's tensors, gathered whole (on the CPU) onto every rank."""
        if not isinstance(model, PipelinedModule):
            return super().full_state_dict(model)  # type: ignore[misc]
        from accelkit.checkpoint.format.fqn import canonical_fqn

        mine = {}
        for name, tensor in model.module.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor):
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                mine[canonical_fqn(name)] = full.detach().cpu()
        parts: list[Any] = [None] * dist.get_world_size(model.runner.pp_group)
        dist.all_gather_object(parts, mine, group=model.runner.pp_group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged

    # ---- the step -------------------------------------------------------------------------
    def pipeline_forward_backward(
        self,
        model: nn.Module,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        target: Any,
        loss_fn: Any,
        closes_window: bool,
    ) -> torch.Tensor:
        runner = _runner_of(model)
        if runner is None:
            raise UnsupportedError(
                "forward_backward under pp > 1 needs the model setup() returned (a "
                "PipelinedModule), not the module inside it"
            )
        return runner.forward_backward(inputs, kwargs, target, loss_fn)

    def pipeline_grad_norm(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        stage_norm: Callable[[Any, float | None], torch.Tensor],
        clip: Callable[[list[torch.Tensor], float, torch.Tensor], None],
    ) -> torch.Tensor:
        """The norm over every stage (a cross-stage tied weight counted once), then clipping
        every local gradient with it. ``stage_norm(optimizer-like, None)`` is the backend's
        norm over this rank's data-parallel peers."""
        runner = _runner_of(model)
        assert runner is not None
        duplicates = {id(p) for n, p in _named(model) if n in runner.duplicate_params()}
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        counted = [p for p in params if id(p) not in duplicates]

        class _Params:
            param_groups = [{"params": counted}]

        total = runner.total_norm(stage_norm(_Params(), None))
        if max_norm is not None and params:
            clip(params, max_norm, total)
        return total

    def sum_tied_grads(self, model: nn.Module | None) -> None:
        runner = _runner_of(model)
        if runner is not None and runner.ties:
            runner.sum_tied_grads(dict(_named(model)))


def _runner_of(model: nn.Module | None) -> PipelineRunner | None:
    return getattr(model, "runner", None) if isinstance(model, PipelinedModule) else None


def _named(model: nn.Module | None) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(model, PipelinedModule):
        yield from model.module.named_parameters()
