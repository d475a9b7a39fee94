"""``accelkit plan``'s logic: ask every registered backend for its memory estimate and pick one.

The model is built on the meta device (no memory, no download) and traced there
(:func:`accelkit.benchmark.memory.model_stats`); each backend answers the
``accelkit_estimate_memory`` hook, and may propose variants of itself (offload) that are
estimated too. A configuration fits when its per-GPU peak is at most ``(1 - headroom)`` of the
GPU's memory and, for offload, the host memory of all its processes fits the same way. The
recommendation is the configuration with the lowest stated relative step time among those
that fit, the smaller peak, then the fewer libraries to install, breaking ties. An estimate may say it was made at another precision
(``"precision"``: the backend does not run the one asked for, e.g. Gemini has no ``-mixed``) and
carry a ``"note"``: such a row is shown, with its note, and never recommended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from accelkit.benchmark.memory import GiB, model_stats


@dataclass
class PlanRequest:
    model: str
    gpus: int = 1
    gpu_memory: int = 80 * GiB
    cpu_memory: int | None = None
    precision: str = "bf16-mixed"
    batch: int | None = None
    seq: int | None = None
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    headroom: float = 0.1
    batch_factory: str | None = None
    backends: list[str] | None = None
    #: also estimate ``fsdp`` on every (dp_replicate, dp_shard, tp) mesh of the GPUs
    mesh: bool = False
    #: pipeline stages: each backend that runs pipelines is estimated per stage, on
    #: ``gpus / pp`` GPUs a stage, with the bubble of ``microbatches`` (default ``2 * pp``)
    pp: int = 1
    microbatches: int | None = None


@dataclass
class Candidate:
    backend: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)
    estimate: dict[str, Any] = field(default_factory=dict)
    fits: bool = False
    why_not: str = ""
    note: str = ""  # e.g. "library missing: pip install ..."
    #: the libraries the backend needs (fewer breaks a tie: torch DDP before a plugin's DDP)
    libraries: tuple[str, ...] = ()


def _estimate(host: Any, backend: str, stats: dict[str, Any], options: dict[str, Any]) -> Any:
    return host.pm.hook.accelkit_estimate_memory(
        backend=backend, model_stats=stats, options=options
    )


def _note(note: str, estimate: dict[str, Any]) -> str:
    """The candidate's note: a missing library, then what the estimate itself says."""
    return "; ".join(n for n in (note, estimate.get("note", "")) if n)


def _offers(spec: Any, precision: str) -> bool:
    """False for a precision beyond the five every backend maps (``fp8-mixed``) that the backend
    does not list: its estimator would answer for a precision it cannot run."""
    from accelkit.precision import PRECISIONS

    if precision in PRECISIONS:
        return True
    try:
        return precision in spec.load_class().capabilities.precisions
    except Exception:  # a plugin that fails to load cannot run it either
        return False


def pipeline_stage(
    estimate: dict[str, Any], stats: dict[str, Any], pp: int, microbatches: int
) -> dict[str, Any]:
    """A backend's estimate for the whole model on one stage's GPUs, turned into the heaviest
    stage's under ``pp`` stages of 1F1B: the split balances parameters, so a stage holds
    ``max(1/pp, largest block / P)`` of the model's state; its activations are those of its
    layers (1/pp) for up to ``min(pp, m)`` micro-batches of ``1/m`` of the batch in flight
    (the first stage's count); the step stretches by the bubble ``(pp-1)/(m+pp-1)``."""
    P = max(1, stats["params"])
    share = max(1 / pp, min(1.0, stats["largest_block"] / P))
    in_flight = min(pp, microbatches) / (pp * microbatches)
    out = dict(estimate)
    for key in ("params", "grads", "optimizer", "master", "host"):
        out[key] = int(estimate.get(key, 0) * share)
    out["activations"] = int(estimate["activations"] * in_flight)
    state = out["params"] + out["grads"] + out["optimizer"] + out["master"]
    old_state = sum(estimate.get(k, 0) for k in ("params", "grads", "optimizer", "master"))
    out["peak"] = int(state + max(0, estimate["peak"] - old_state) * in_flight)
    bubble = (pp - 1) / (microbatches + pp - 1)
    out["bubble_fraction"] = round(bubble, 4)
    out["pp"] = pp
    out["world_size"] = estimate.get("world_size", 1) * pp
    out["relative_step_time"] = round(estimate["relative_step_time"] / (1 - bubble), 3)
    note = f"pp={pp}, {microbatches} micro-batches: bubble {100 * bubble:.0f}% of a step"
    out["speed_note"] = "; ".join(n for n in (estimate.get("speed_note", ""), note) if n)
    out["formula"] = (
        f"stage = {share:.3g} x the model's state, activations x {in_flight:.3g}; "
        + estimate.get("formula", "")
    )
    out.pop("variants", None)
    return out


def _runs_pipelines(spec: Any) -> bool:
    try:
        return bool(spec.load_class().capabilities.pipeline_schedules)
    except Exception:  # a plugin that fails to load runs nothing
        return False


def make_plan(request: PlanRequest) -> dict[str, Any]:
    """The plan as a dict: model figures, one entry per configuration, the recommendation."""
    import torch

    from accelkit import registry
    from accelkit.benchmark.memory import OPTIMIZERS
    from accelkit.benchmark.workloads import get_workload

    if request.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {request.optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    with torch.device("meta"):
        workload = get_workload(request.model, request.batch_factory, request.seq)
    batch = request.batch or workload.default_batch
    stats = model_stats(workload, batch, request.precision, request.activation_checkpointing)
    host = registry.host()
    host.ensure_loaded()
    answering = {impl.plugin_name for impl in host.pm.hook.accelkit_estimate_memory.get_hookimpls()}
    pp = request.pp
    if pp < 1 or request.gpus % pp:
        raise ValueError(f"--pp {pp} must be >= 1 and divide --gpus {request.gpus}")
    microbatches = request.microbatches or 2 * pp
    base_options = {
        "world_size": request.gpus // pp,
        "precision": request.precision,
        "optimizer": request.optimizer,
        "device_type": "cuda",
        "mesh": request.mesh,
    }
    candidates: list[Candidate] = []
    silent: list[str] = []
    failed: list[str] = []
    for spec in host.registry.specs():
        if spec.alias_of is not None:
            continue
        if request.backends is not None and spec.name not in request.backends:
            continue
        if spec.plugin not in answering:
            silent.append(spec.name)
            continue
        if not _offers(spec, request.precision):
            continue  # fp8-mixed: the estimators know the five standard strings only
        if pp > 1 and not _runs_pipelines(spec):
            continue
        note = ""
        missing = spec.missing_libraries()
        if missing:
            note = f"needs {', '.join(missing)}: {spec.install}".strip(": ")
        options = {**base_options, "backend_options": dict(spec.defaults)}
        try:
            estimate = _estimate(host, spec.name, stats, options)
        except Exception as err:  # a plugin's estimator bug must not hide the other backends
            failed.append(f"{spec.name} ({type(err).__name__}: {err})")
            continue
        if estimate is None:
            continue
        if pp > 1:
            estimate = pipeline_stage(estimate, stats, pp, microbatches)
        candidates.append(
            Candidate(
                spec.name,
                spec.name,
                dict(spec.defaults),
                estimate,
                note=_note(note, estimate),
                libraries=spec.requires,
            )
        )
        for variant in estimate.get("variants", ()):
            variant_options = {**spec.defaults, **variant["options"]}
            result = _estimate(
                host, spec.name, stats, {**base_options, "backend_options": variant_options}
            )
            if result is not None and pp > 1:
                result = pipeline_stage(result, stats, pp, microbatches)
            if result is not None:
                label = f"{spec.name} {variant['label']}"
                candidates.append(
                    Candidate(
                        spec.name,
                        label,
                        variant_options,
                        result,
                        note=_note(note, result),
                        libraries=spec.requires,
                    )
                )
    budget = request.gpu_memory * (1 - request.headroom)
    for c in candidates:
        peak, host_bytes = c.estimate["peak"], c.estimate.get("host", 0)
        host_total = host_bytes * c.estimate.get("world_size", request.gpus)
        if peak > budget:
            c.why_not = f"needs {peak / GiB:.1f} GiB per GPU, {budget / GiB:.1f} GiB usable"
        elif request.cpu_memory and host_total > request.cpu_memory * (1 - request.headroom):
            c.why_not = f"needs {host_total / GiB:.1f} GiB of host memory"
        else:
            c.fits = True
    # a row estimated at another precision than asked (the backend lacks it) is shown, not picked
    fitting = [
        c
        for c in candidates
        if c.fits and c.estimate.get("precision", request.precision) == request.precision
    ]
    best = min(
        fitting,
        key=lambda c: (c.estimate["relative_step_time"], c.estimate["peak"], len(c.libraries)),
        default=None,
    )
    return {
        "request": {**request.__dict__, "batch": batch},
        "model": {
            "name": workload.name,
            "params": stats["params"],
            "trainable_params": stats["trainable_params"],
            "largest_block": stats["largest_block"],
            "blocks": stats["blocks"],
            "activation_bytes": stats["activation_bytes"],
        },
        "budget_per_gpu": budget,
        "candidates": candidates,
        "recommendation": best,
        "reason": _reason(best, fitting, candidates, request, budget),
        "no_estimate": silent,
        "failed_estimates": failed,
    }


def _reason(
    best: Candidate | None,
    fitting: list[Candidate],
    candidates: list[Candidate],
    request: PlanRequest,
    budget: float,
) -> str:
    if best is None:
        if not candidates:
            return "no backend gave an estimate"
        elsewhere = [c.label for c in candidates if c.fits]
        if elsewhere:
            return (
                f"{', '.join(elsewhere)} fit, but none of them runs {request.precision}: each "
                "was estimated at the precision its note names. Ask for that precision to "
                "compare it with the others."
            )
        smallest = min(candidates, key=lambda c: c.estimate["peak"])
        hints = []
        if not request.activation_checkpointing:
            hints.append("--activation-checkpointing")
        hints += ["a smaller --batch", "more GPUs", "an offload configuration"]
        return (
            f"nothing fits in {budget / GiB:.1f} GiB per GPU; the smallest is {smallest.label} at "
            f"{smallest.estimate['peak'] / GiB:.1f} GiB. Try {', '.join(hints)}."
        )
    spare = (budget - best.estimate["peak"]) / GiB
    text = (
        f"{best.label}: fits with {spare:.1f} GiB to spare per GPU and has the lowest expected "
        f"step time of the {len(fitting)} configurations that fit "
        f"({best.estimate.get('speed_note', '')})."
    )
    faster = [
        c
        for c in candidates
        if not c.fits and c.estimate["relative_step_time"] < best.estimate["relative_step_time"]
    ]
    if faster:
        text += " Faster ones that do not fit: " + ", ".join(c.label for c in faster) + "."
    return text
