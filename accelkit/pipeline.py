"""Pipeline parallelism's settings: the ``pp`` degree and the ``pipeline=`` dict of
:func:`accelkit.get`, checked once here for every backend.

``pp`` is a mesh dimension beside ``dp_replicate``, ``dp_shard`` and ``tp``: the model is split
into stages, each held by ``world / pp`` ranks. This module only validates and describes; a
backend that runs pipelines lists its schedules in ``Capabilities.pipeline_schedules`` and
implements ``Backend.pipeline_forward_backward`` (docs/pipeline.md). It imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from accelkit.errors import ConfigError

#: every schedule name accelkit knows, in torch.distributed.pipelining's spelling
SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
#: schedules that run several stages on each rank
MULTI_STAGE = frozenset(SCHEDULES[2:])
#: schedules whose two stages per rank form a V (rank r holds stages r and 2*pp-1-r)
V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})
#: schedules that split each backward into an input and a weight part
ZERO_BUBBLE = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})

#: the names plugins see through accelkit.sdk
PIPELINE_SCHEDULES = SCHEDULES
ZERO_BUBBLE_SCHEDULES = ZERO_BUBBLE

_ALIASES = {s.lower(): s for s in SCHEDULES} | {
    "zbv": "ZBVZeroBubble",
    "interleavedzb": "InterleavedZeroBubble",
    "interleaved": "Interleaved1F1B",
    "dualpipe": "DualPipeV",
}
_KEYS = ("schedule", "microbatches", "stages_per_rank", "split")


@dataclass(frozen=True)
class PipelineSettings:
    """What ``accelkit.get(..., pp=N, pipeline=dict(...))`` asked for, resolved.

    ``microbatches``: micro-batches per ``forward_backward`` call (default ``2 * pp``; the batch
    must split into them evenly). ``stages_per_rank``: 1 for GPipe and 1F1B, 2 (default) or more
    for the interleaved schedules, exactly 2 for the V-shaped ones. ``split``: ``"auto"``, a
    list of module-name lists (one per stage), or split points ``{"layers.4": "begin", ...}``.
    """

    pp: int
    schedule: str = "1F1B"
    microbatches: int = 2
    stages_per_rank: int = 1
    split: Any = "auto"

    @property
    def stages(self) -> int:
        """Stages in all: ``pp * stages_per_rank``."""
        return self.pp * self.stages_per_rank

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``pp_rank`` runs, in the order the schedule expects."""
        if self.schedule in V_SHAPED:
            return (pp_rank, self.stages - 1 - pp_rank)
        return tuple(pp_rank + s * self.pp for s in range(self.stages_per_rank))

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        return next(r for r in range(self.pp) if stage in self.stage_ids(r))

    def bubble_fraction(self) -> float:
        """The idle share of a step in the textbook cost model (every forward and backward of
        a stage takes the same time): ``(pp - 1) / (v * m + pp - 1)`` for ``m`` micro-batches
        and ``v`` stages per rank; the zero-bubble schedules fill a third of it with the weight
        part of the backward (Qi et al., 2023), which this model does not count."""
        m, v = self.microbatches, self.stages_per_rank
        return (self.pp - 1) / (v * m + self.pp - 1)

    def describe(self) -> dict[str, Any]:
        """A JSON-able record (the checkpoint manifest's ``pipeline`` entry, ``accelkit plan``)."""
        return {**dataclasses.asdict(self), "split": _jsonable(self.split)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else repr(value)


def schedule_name(name: Any) -> str:
    """The canonical spelling of a schedule name, or a ConfigError listing them."""
    if isinstance(name, str) and name.replace("-", "").replace("_", "").lower() in _ALIASES:
        return _ALIASES[name.replace("-", "").replace("_", "").lower()]
    raise ConfigError(f"pipeline: unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")


def resolve_pipeline(pp: Any, pipeline: Any) -> PipelineSettings | None:
    """Check ``pp`` and ``pipeline`` as :func:`accelkit.get` took them; None when ``pp`` is 1 or
    absent (no pipeline: the ``pipeline`` dict is then checked and ignored, so one config can
    switch ``pp`` alone)."""
    if pp is None:
        pp = 1
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"option 'pp' (pipeline stages) must be an int >= 1, got {pp!r}")
    if pipeline is None:
        pipeline = {}
    if not isinstance(pipeline, Mapping):
        raise ConfigError(
            "option 'pipeline' must be a dict such as "
            "dict(schedule='1F1B', microbatches=8, split='auto'), got "
            f"{type(pipeline).__name__}"
        )
    unknown = sorted(set(pipeline) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"option 'pipeline' has unknown keys {unknown}; known: {', '.join(_KEYS)}"
        )
    schedule = schedule_name(pipeline.get("schedule", "1F1B"))
    microbatches = pipeline.get("microbatches", 2 * pp)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"pipeline: 'microbatches' must be an int >= 1, got {microbatches!r}")
    default_per_rank = 2 if schedule in MULTI_STAGE else 1
    per_rank = pipeline.get("stages_per_rank", default_per_rank)
    if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 1:
        raise ConfigError(f"pipeline: 'stages_per_rank' must be an int >= 1, got {per_rank!r}")
    if schedule not in MULTI_STAGE and per_rank != 1:
        raise ConfigError(
            f"pipeline: schedule {schedule!r} runs one stage per rank, got stages_per_rank="
            f"{per_rank}; use 'Interleaved1F1B' (or another interleaved schedule) for more"
        )
    if schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(
            f"pipeline: schedule {schedule!r} runs exactly 2 stages per rank (a V), got "
            f"stages_per_rank={per_rank}"
        )
    if schedule in MULTI_STAGE and per_rank < 2:
        raise ConfigError(
            f"pipeline: schedule {schedule!r} interleaves several stages per rank; "
            "stages_per_rank must be >= 2"
        )
    split = pipeline.get("split", "auto")
    _check_split(split, pp * per_rank)
    if pp == 1:
        return None
    return PipelineSettings(pp, schedule, microbatches, per_rank, split)


def _check_split(split: Any, stages: int) -> None:
    if split == "auto":
        return
    if isinstance(split, Mapping):
        bad = [k for k, v in split.items() if not isinstance(k, str) or v not in ("begin", "end")]
        if bad:
            raise ConfigError(
                "pipeline: split points map a module name to 'begin' or 'end' "
                f"({{'layers.4': 'begin'}}); got {bad[0]!r}: {split[bad[0]]!r}"
            )
        if len(split) != stages - 1:
            raise ConfigError(
                f"pipeline: {stages} stages need {stages - 1} split points, got {len(split)}"
            )
        return
    if isinstance(split, (list, tuple)):
        if len(split) != stages or not all(
            isinstance(s, (list, tuple)) and all(isinstance(n, str) for n in s) for s in split
        ):
            raise ConfigError(
                f"pipeline: split as a list needs {stages} lists of module names (one per "
                "stage, e.g. [['embed', 'layers.0-3'], ['layers.4-7', 'head']]), got "
                f"{split!r}"
            )
        return
    raise ConfigError(
        "pipeline: split must be 'auto', a list of module-name lists (one per stage) or split "
        f"points {{'layers.4': 'begin'}}; got {split!r}"
    )


def split_microbatches(batch: Any, microbatches: int, what: str = "input") -> list[Any]:
    """``batch`` (a tensor, or lists, tuples and dicts of them; other values are repeated) cut
    into ``microbatches`` equal pieces along the first dimension. An uneven split is refused,
    naming the sizes: each micro-batch loss is divided by the same count, so unequal pieces
    would weigh samples unequally."""
    import torch

    def cut(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] % microbatches:
                raise ConfigError(
                    f"pipeline: the {what} batch has {value.shape[0]} samples, which "
                    f"{microbatches} micro-batches cannot split evenly; use a batch size that "
                    f"is a multiple of {microbatches} (a loader's short last batch: "
                    "drop_last=True), or change pipeline['microbatches']"
                )
            return list(value.chunk(microbatches))
        if isinstance(value, dict):
            parts = {k: cut(v) for k, v in value.items()}
            return [type(value)((k, p[i]) for k, p in parts.items()) for i in range(microbatches)]
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            columns = [cut(v) for v in value]
            return [type(value)(c[i] for c in columns) for i in range(microbatches)]
        return [value] * microbatches

    return cut(batch)
