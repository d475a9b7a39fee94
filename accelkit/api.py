"""``accelkit.get``: name + config -> a ready :class:`~accelkit.accelerator.Accelerator`."""

from __future__ import annotations

import dataclasses
from typing import Any

from accelkit import distributed, registry
from accelkit.accelerator import Accelerator
from accelkit.backend import Settings, check_precision_supported
from accelkit.errors import ConfigError
from accelkit.log import configure
from accelkit.pipeline import PipelineSettings, resolve_pipeline
from accelkit.seed import seed_everything


def get(
    name: str = "auto",
    config: Any = None,
    *,
    precision: str | None = None,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    seed: int | None = None,
    track_grad_norm: bool = False,
    max_grad_value: float | None = None,
    **options: Any,
) -> Accelerator:
    """Build the accelerator for backend ``name``.

    Args:
        name: a registered backend (``accelkit env`` lists them), or ``"auto"``.
        config: backend options as a dict, a dataclass, a YAML/JSON path, or a backend's native
            config (a DeepSpeed JSON dict is accepted as is).
        precision: ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true``, or
            ``fp8-mixed`` (float8 Linear layers through torchao; cpu, cuda, ddp, fsdp); None
            takes the backend's native config, else ``32-true``.
        accumulation_steps: micro-batches per optimizer step.
        max_grad_norm: clip the total gradient norm to this inside ``step()``.
        seed: seed everything (and dataloader workers) before anything is built.
        track_grad_norm: compute ``accel.grad_norm`` even without clipping.
        max_grad_value: clamp every gradient element to ``[-v, v]`` inside ``step()`` (before
            ``max_grad_norm``); refused where the backend's library owns the gradients.
        **options: backend options, overriding ``config``. Two are read here for every backend:
            ``pp`` (pipeline stages, a mesh dimension beside ``dp_replicate``/``dp_shard``/``tp``)
            and ``pipeline`` (``dict(schedule=, microbatches=, stages_per_rank=, split=)``);
            a backend without pipeline parallelism refuses ``pp > 1``, naming those with it.
    """
    resolved = resolve(
        name,
        config,
        precision=precision,
        accumulation_steps=accumulation_steps,
        max_grad_norm=max_grad_norm,
        seed=seed,
        track_grad_norm=track_grad_norm,
        max_grad_value=max_grad_value,
        **options,
    )
    canonical, backend_options, settings = resolved.name, resolved.options, resolved.settings
    if seed is not None:
        seed_everything(seed)
    configure()
    backend = resolved.backend_class(canonical, backend_options, settings)
    if settings.max_grad_value is not None and not backend.capabilities.manual_clip:
        raise ConfigError(
            f"backend {canonical!r} partitions the gradients inside its library's step, which "
            "offers no clipping by value: max_grad_value is not available there. Use "
            "max_grad_norm, or a backend whose gradients are whole before the step (cpu, cuda, "
            "ddp, fsdp)."
        )
    _refuse_one_process_backend_under_launcher(canonical, backend.capabilities)
    backend.launch()
    return Accelerator(backend)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What :func:`get` checked before it built anything: the backend class, the canonical name,
    the validated options and the final settings."""

    backend_class: type
    name: str
    options: Any
    settings: Settings


def resolve(
    name: str = "auto",
    config: Any = None,
    *,
    precision: str | None = None,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    seed: int | None = None,
    track_grad_norm: bool = False,
    max_grad_value: float | None = None,
    **options: Any,
) -> Resolved:
    """Every check :func:`get` makes of its arguments (the name, the options, the precision
    against the capabilities these options give), without building or launching the backend:
    a ``ConfigError`` here is one ``get`` raises with the same arguments. The conformance suite
    asks it whether each precision a backend advertises is accepted with its options."""
    host = registry.host()
    spec = host.resolve(name)
    backend_cls = spec.load_class()
    other = backend_cls.select_backend()
    if other is not None:  # "auto": a backend that picks another
        return resolve(
            other,
            config,
            precision=precision,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
            seed=seed,
            track_grad_norm=track_grad_norm,
            max_grad_value=max_grad_value,
            **options,
        )
    canonical = spec.alias_of or spec.name
    overrides = {**spec.defaults, **options}
    pipeline = resolve_pipeline(overrides.pop("pp", None), overrides.pop("pipeline", None))
    backend_options = backend_cls.parse_config(name, config, overrides)
    if pipeline is not None:
        _check_pipeline_supported(
            canonical,
            pipeline,
            backend_cls.capabilities_for(backend_options),
            backend_cls.pipeline_refusal(backend_options),
        )
    settings = Settings(
        precision=backend_cls.parse_precision(name, precision),
        accumulation_steps=accumulation_steps,
        max_grad_norm=max_grad_norm,
        seed=seed,
        track_grad_norm=track_grad_norm,
        max_grad_value=max_grad_value,
        pipeline=pipeline,
    )
    settings = backend_cls.resolve_settings(name, backend_options, settings)
    # here, after resolve_settings (a native config may name the precision): a precision the
    # backend does not list must not run as something else
    check_precision_supported(
        name, settings.precision or "32-true", backend_cls.capabilities_for(backend_options)
    )
    return Resolved(backend_cls, canonical, backend_options, settings)


def pipeline_backends() -> list[str]:
    """The registered backends (their libraries installed) that run pipelines."""
    names = []
    for spec in registry.host().registry.specs():
        if spec.alias_of or spec.missing_libraries():
            continue
        try:
            if spec.load_class().capabilities.pipeline_schedules:
                names.append(spec.name)
        except Exception:  # a broken plugin is reported by `accelkit env`, not here
            continue
    return names


def _check_pipeline_supported(
    name: str, pipeline: PipelineSettings, capabilities: Any, refusal: str | None = None
) -> None:
    """Refuse ``pp > 1`` where the backend has no pipeline, or not this schedule; ``refusal``
    is the backend's own reason where these options rule its pipeline out."""
    schedules = capabilities.pipeline_schedules
    if not schedules and refusal:
        raise ConfigError(f"backend {name!r}: pp={pipeline.pp} cannot run: {refusal}")
    if not schedules:
        others = pipeline_backends()
        raise ConfigError(
            f"backend {name!r} has no pipeline parallelism, so pp={pipeline.pp} cannot run on "
            "it. Backends with pipeline parallelism: "
            + (", ".join(others) if others else "none installed")
            + ". Or leave pp out (pp=1)."
        )
    if pipeline.schedule not in schedules:
        raise ConfigError(
            f"backend {name!r} with these options does not run the {pipeline.schedule!r} "
            f"pipeline schedule; it runs: {', '.join(schedules)}"
        )


def _refuse_one_process_backend_under_launcher(name: str, capabilities: Any) -> None:
    """A one-process backend under ``accelkit run``/torchrun/srun would run the whole job once
    per process, each copy writing the same checkpoints and logs: refuse, saying what to pick."""
    launched = distributed.launched_world_size()
    if launched <= 1 or capabilities.distributed:
        return
    raise ConfigError(
        f"backend {name!r} runs one process on one device, but this script was launched on "
        f"{launched} processes (WORLD_SIZE={launched}): each would run the whole job alone and "
        "write the same checkpoints. Pick a backend that spreads the job over the processes: "
        "'ddp' (or 'auto', which picks it under a launcher), 'fsdp', or a plugin's sharded "
        "backend (`accelkit env` lists them). Or launch one process: python train.py."
    )


def describe(name: str, config: Any = None, **options: Any) -> dict[str, Any]:
    """Capabilities and dtype table of backend ``name`` with ``config`` and ``options`` (as
    :func:`get` takes them; the name's defaults when none), without building it (docs,
    ``accelkit env``). The capabilities are the record ``accelkit.get(name, config, **options)``
    runs with: both come from ``Backend.capabilities_for``."""
    spec = registry.host().resolve(name)
    cls = spec.load_class()
    options = {k: v for k, v in options.items() if k not in ("pp", "pipeline")}
    parsed = cls.parse_config(name, config, {**spec.defaults, **options})
    return {
        "name": name,
        "capabilities": dataclasses.asdict(cls.capabilities_for(parsed)),
        "dtypes": {k: dataclasses.asdict(v) for k, v in cls.dtype_table.items()},
    }
