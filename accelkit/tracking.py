"""Experiment tracking: ``accel.log(metrics, step)`` on the main rank, to CSV, TensorBoard,
Weights & Biases, MLflow, or a plugin's tracker; and throughput helpers (samples and tokens per second, model FLOPs utilisation).

::

    accel.init_trackers("runs/exp1", trackers=["csv", "tensorboard"], config={"lr": 3e-4})
    ...
    accel.log({"loss": loss, "lr": sched.get_last_lr()[0]}, step=step)
    ...
    accel.end_training()

Only global rank 0 writes; the other ranks return at once (their tensors are never read, so
``log`` costs them no host sync). A value that differs per rank must be reduced first
(``accel.all_reduce(loss, "mean")``) on every rank, before ``log``.

A tracker is any object with ``log(metrics: dict[str, float], step: int) -> None``, and
optionally ``log_hparams(config: dict) -> None``, ``finish() -> None``, ``log_images(images:
dict[str, Image], step)`` and ``log_histograms(histograms: dict[str, Histogram], step)`` (values
wrapped in :class:`Image` / :class:`Histogram` in ``accel.log`` go there). Plugins add trackers
by name through the ``accelkit_loggers`` hook, returning ``{name: factory}``; a factory is called
as ``factory(directory, config=config, **kwargs)`` on rank 0 only.

A tracker built by name with a ``run_id`` attribute is resumable: :func:`tracker_state` is the
stateful object to checkpoint, and after a load its factory gets ``resume_run_id=`` the saved id.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import numbers
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from accelkit.errors import ConfigError, PluginMissingError
from accelkit.log_values import Histogram, Image

log = logging.getLogger("accelkit")

#: the Accelerator that logs (``Any``: the facade imports this module)
_Accelerator = Any


# ---- built-in trackers ---------------------------------------------------------------------------
class CSVTracker:
    """``<directory>/metrics.csv``: one row per ``log`` call, a column per metric name.

    A metric name first seen after rows were written widens the table (the file is rewritten
    with the new header; older rows leave that column empty). An existing file is continued, so
    a resumed run appends to the curve of the run it resumes. Rows are flushed as written: a
    killed run leaves every logged row readable.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        config: Mapping[str, Any] | None = None,
        *,
        filename: str = "metrics.csv",
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / filename
        self.columns: list[str] = ["step"]
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f), None)
            if header and header[0] == "step":
                self.columns = header
        self._file = open(self.path, "a", newline="")  # noqa: SIM115 (open for the run)
        self._writer = csv.writer(self._file)
        if self._file.tell() == 0:
            self._writer.writerow(self.columns)
            self._file.flush()
        if config:
            self.log_hparams(config)

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        """``<directory>/hparams.json`` (values that JSON cannot hold are written as text)."""
        text = json.dumps(dict(config), indent=1, sort_keys=True, default=str)
        (self.directory / "hparams.json").write_text(text + "\n")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        new = [name for name in metrics if name not in self.columns]
        if new:
            self._widen(new)
        row = [step] + [_csv_value(metrics.get(name)) for name in self.columns[1:]]
        self._writer.writerow(row)
        self._file.flush()

    def _widen(self, names: list[str]) -> None:
        self._file.close()
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))[1:]
        self.columns = self.columns + names
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.columns)
            for row in rows:
                writer.writerow(row + [""] * (len(self.columns) - len(row)))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="")  # noqa: SIM115 (open for the run)
        self._writer = csv.writer(self._file)

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


def _csv_value(value: float | None) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


class TensorBoardTracker:
    """TensorBoard event files in ``<directory>/tensorboard`` (needs ``pip install
    'accelkit[tensorboard]'``)."""

    def __init__(
        self, directory: str | os.PathLike, config: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise PluginMissingError(
                "the 'tensorboard' tracker needs the tensorboard package: "
                "pip install 'accelkit[tensorboard]'"
            ) from err
        self.log_dir = Path(directory) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), **kwargs)
        self._config = dict(config or {})

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        self._config.update(config)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        if self._config:  # hparams with the last value of each metric, as TensorBoard shows them
            simple = {
                k: v if isinstance(v, (int, float, str, bool)) else str(v)
                for k, v in self._config.items()
            }
            self.writer.add_hparams(simple, {}, run_name=".")
        self.writer.close()


def _wandb_tracker(directory: str | os.PathLike, **kwargs: Any) -> Any:
    """Weights & Biases (``pip install 'accelkit[wandb]'``); see accelkit.tracking_backends."""
    from accelkit.tracking_backends import WandbTracker

    return WandbTracker(directory, **kwargs)


def _mlflow_tracker(directory: str | os.PathLike, **kwargs: Any) -> Any:
    """MLflow (``pip install 'accelkit[mlflow]'``); see accelkit.tracking_backends."""
    from accelkit.tracking_backends import MLflowTracker

    return MLflowTracker(directory, **kwargs)


BUILTIN_TRACKERS: dict[str, Callable[..., Any]] = {
    "csv": CSVTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": _wandb_tracker,
    "mlflow": _mlflow_tracker,
}


def tracker_factories() -> dict[str, Callable[..., Any]]:
    """Built-in trackers, then those plugins add through the ``accelkit_loggers`` hook."""
    from accelkit import registry

    host = registry.host()
    host.ensure_loaded()
    factories = dict(BUILTIN_TRACKERS)
    for result in host.pm.hook.accelkit_loggers():
        for name, factory in (result or {}).items():
            if name in BUILTIN_TRACKERS:
                log.warning("a plugin's tracker %r is ignored: the name is built in", name)
                continue
            factories[name] = factory
    return factories


# ---- what Accelerator.log runs -------------------------------------------------------------------
class Trackers:
    """The trackers of one accelerator (built on rank 0 only; empty elsewhere).

    Stateful, for the checkpoint: ``state_dict()`` holds the run id of each resumable tracker
    (built by name, with a ``run_id``); after ``load_state_dict`` a later :func:`init_trackers`
    re-attaches to those runs, and trackers already built on other runs are rebuilt on them.
    """

    def __init__(self, trackers: list[Any], directory: Path | None) -> None:
        self.trackers = trackers
        self.directory = directory
        #: the name each tracker was built by (None: an object passed in)
        self.names: list[str | None] = [None] * len(trackers)
        #: how to build each named tracker again: factory, directory, config, kwargs
        self._specs: dict[str, tuple[Callable[..., Any], Path, Any, dict[str, Any]]] = {}
        #: run id of each resumable tracker built by the last init_trackers, by name
        self._run_ids: dict[str, str] = {}
        #: run ids a checkpoint restored that no tracker has continued yet
        self._restored: dict[str, str] = {}
        self._warned: set[tuple[int, str]] = set()
        #: False until init_trackers ran (an object from tracker_state() alone logs nowhere)
        self.initialised = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not isinstance(metrics, Mapping):
            raise ConfigError(f"log() takes a dict of name -> number, got {type(metrics).__name__}")
        images = {k: v for k, v in metrics.items() if isinstance(v, Image)}
        histograms = {k: v for k, v in metrics.items() if isinstance(v, Histogram)}
        values = scalars(
            {k: v for k, v in metrics.items() if k not in images and k not in histograms}
        )
        for tracker in self.trackers:
            if values or not (images or histograms):
                tracker.log(values, step)
            for kind, media in (("images", images), ("histograms", histograms)):
                if media:
                    self._log_media(tracker, kind, media, step)

    def _log_media(self, tracker: Any, kind: str, media: dict[str, Any], step: int) -> None:
        method = getattr(tracker, f"log_{kind}", None)
        if method is not None:
            method(media, step)
        elif (id(tracker), kind) not in self._warned:
            self._warned.add((id(tracker), kind))
            log.warning(
                "tracker %s does not log %s; skipped: %s",
                type(tracker).__name__,
                kind,
                ", ".join(sorted(media)),
            )

    def run_ids(self) -> dict[str, str]:
        """The run id of each resumable tracker, by name (kept after ``finish``), and the
        restored ones no tracker continued yet."""
        for name, tracker in zip(self.names, self.trackers):
            run_id = getattr(tracker, "run_id", None)
            if name is not None and isinstance(run_id, str):
                self._run_ids[name] = run_id
        return {**self._restored, **self._run_ids}

    def state_dict(self) -> dict[str, Any]:
        return {"run_ids": self.run_ids()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = {str(k): str(v) for k, v in dict(state.get("run_ids") or {}).items()}
        self._restored.update(saved)
        for index, (name, tracker) in enumerate(zip(self.names, self.trackers)):
            if name is None or name not in saved or name not in self._specs:
                continue
            current = getattr(tracker, "run_id", None)
            if current == saved[name]:
                continue
            log.warning(
                "tracker %r started run %s before the checkpoint's run %s was restored; that "
                "run is closed and logging continues in %s (call auto_resume before "
                "init_trackers to start no extra run)",
                name,
                current,
                saved[name],
                saved[name],
            )
            finish = getattr(tracker, "finish", None)
            if finish is not None:
                finish()
            factory, directory, config, kwargs = self._specs[name]
            self.trackers[index] = factory(
                directory, config=config, resume_run_id=self._restored.pop(name), **kwargs
            )
        self.run_ids()

    def finish(self) -> None:
        self.run_ids()  # remembered for a save after end_training
        for tracker in self.trackers:
            finish = getattr(tracker, "finish", None)
            if finish is not None:
                finish()
        self.trackers = []
        self.names = []


def tracker_state(accel: _Accelerator) -> Trackers:
    """The accelerator's :class:`Trackers` (an empty one before :func:`init_trackers`), to put
    in the checkpoint's state so that a resumed job's trackers continue the same runs::

        state = {"model": model, "opt": opt, "trackers": tracker_state(accel)}
        accel.auto_resume("ckpt", state)
        accel.init_trackers("runs/exp1", ["wandb"])  # the saved run, or a new one
    """
    if accel._trackers is None:
        accel._trackers = Trackers([], None)
    return accel._trackers


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metric values as Python numbers: one-element tensors are read (a host sync), numpy
    scalars converted; anything else is refused with its name."""
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"log() takes a dict of name -> number, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise ConfigError(f"metric names are strings, got {name!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigError(
                    f"metric {name!r} is a tensor of {value.numel()} elements; log a scalar "
                    "(reduce it first, e.g. .mean())"
                )
            value = value.detach().float().item()
        elif hasattr(value, "item") and not isinstance(value, numbers.Number):
            value = value.item()  # numpy scalars
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"metric {name!r} must be a number, got {type(value).__name__}")
        out[name] = value if isinstance(value, int) else float(value)
    return out


def init_trackers(
    accel: _Accelerator,
    directory: str | os.PathLike,
    trackers: Iterable[str | Any] = ("csv",),
    *,
    config: Mapping[str, Any] | None = None,
    tracker_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> Trackers:
    """Build the named trackers (or take tracker objects) on rank 0; replaces earlier ones."""
    result = tracker_state(accel)  # reused: a checkpoint's state may hold it
    result.finish()
    result._run_ids = {}
    tracker_kwargs = dict(tracker_kwargs or {})
    names = list(trackers)
    factories = tracker_factories() if any(isinstance(t, str) for t in names) else {}
    unknown = [t for t in names if isinstance(t, str) and t not in factories]
    if unknown:
        raise ConfigError(
            f"unknown tracker(s) {', '.join(map(repr, unknown))}; available: "
            f"{', '.join(sorted(factories))} (plugins add more through the accelkit_loggers hook)"
        )
    extra = sorted(set(tracker_kwargs) - {t for t in names if isinstance(t, str)})
    if extra:
        raise ConfigError(f"tracker_kwargs names tracker(s) not in trackers: {', '.join(extra)}")
    built: list[Any] = []
    built_names: list[str | None] = []
    path = Path(directory)
    result._specs = {}
    if accel.is_main:
        for item in names:
            if isinstance(item, str):
                kwargs = dict(tracker_kwargs.get(item, {}))
                result._specs[item] = (factories[item], path, config, dict(kwargs))
                resume = result._restored.get(item)
                if resume is not None:
                    kwargs["resume_run_id"] = resume
                    log.info("tracker %r continues run %s", item, resume)
                built.append(factories[item](path, config=config, **kwargs))
                built_names.append(item)
                result._restored.pop(item, None)
            else:
                if not callable(getattr(item, "log", None)):
                    raise ConfigError(
                        f"a tracker needs a log(metrics, step) method; {type(item).__name__} "
                        "has none"
                    )
                if config and callable(getattr(item, "log_hparams", None)):
                    item.log_hparams(dict(config))
                built.append(item)
                built_names.append(None)
    result.trackers, result.names, result.directory = built, built_names, path
    result.initialised = True
    result.run_ids()
    return result


def log_metrics(accel: _Accelerator, metrics: Mapping[str, Any], step: int | None) -> None:
    if not accel.is_main:
        return
    trackers = accel._trackers
    if trackers is None or not trackers.initialised:
        if not accel._warned_no_trackers:
            accel._warned_no_trackers = True
            log.warning("accel.log(): no trackers; call accel.init_trackers(directory) first")
        return
    if step is None:
        step = accel.applied_steps
    trackers.log(metrics, int(step))


# ---- throughput ----------------------------------------------------------------------------------
#: dense peak FLOP/s of a device by (name fragment, dtype), from the vendors' data sheets
#: (tensor cores, no sparsity). The first fragment found in torch.cuda.get_device_name() wins.
PEAK_FLOPS: list[tuple[str, dict[torch.dtype, float]]] = [
    ("H200", {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 494.7e12}),
    ("H100 PCIe", {torch.bfloat16: 756.0e12, torch.float16: 756.0e12, torch.float32: 378.0e12}),
    ("H100", {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 494.7e12}),
    ("A100", {torch.bfloat16: 312.0e12, torch.float16: 312.0e12, torch.float32: 156.0e12}),
    ("L40S", {torch.bfloat16: 362.05e12, torch.float16: 362.05e12, torch.float32: 183.0e12}),
    ("A10G", {torch.bfloat16: 70.0e12, torch.float16: 70.0e12, torch.float32: 35.0e12}),
    ("V100", {torch.float16: 125.0e12, torch.float32: 15.7e12}),
]


def peak_flops(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16
) -> float | None:
    """Dense peak FLOP/s of one CUDA device for ``dtype`` (fp32 means TF32 tensor cores), or
    None where unknown (the CPU, an unlisted GPU): pass ``peak_flops=`` to
    :class:`Throughput` then."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, table in PEAK_FLOPS:
        if fragment in name:
            return table.get(dtype)
    return None


def transformer_flops_per_token(
    params: int, *, layers: int = 0, seq_len: int = 0, hidden: int = 0
) -> float:
    """Training FLOPs per token of a decoder-only transformer: ``6 * params`` for the matrix
    products forward and backward, plus ``12 * layers * seq_len * hidden`` for attention
    scores and their use (the causal mask is not discounted). ``params`` should leave out the
    embedding table, which costs a lookup, not a matrix product."""
    return 6.0 * params + 12.0 * layers * seq_len * hidden


def measure_flops(fn: Callable[[], Any]) -> int:
    """FLOPs torch counts while running ``fn()`` once (``torch.utils.flop_counter``): pass a
    function that runs forward and backward of one batch to get the FLOPs of a training step."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


class Throughput:
    """Samples, tokens and FLOPs per second over the last ``window`` updates.

    Call :meth:`update` once per step with what this process did in that step; rates are over
    the time between the oldest and newest update in the window (the first update only starts
    the clock). On a GPU, work is asynchronous: over a window of many steps the launch lag
    averages out; call ``torch.cuda.synchronize()`` before ``update`` for exact step times.
    ``world_size`` multiplies per-process counts into the job's totals (every rank is assumed
    to do the same work). MFU is achieved FLOP/s per device over ``peak_flops`` per device.
    """

    def __init__(
        self,
        *,
        window: int = 20,
        world_size: int = 1,
        peak_flops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if window < 2:
            raise ConfigError(f"window must be >= 2 updates, got {window}")
        self.world_size = world_size
        self.peak_flops = peak_flops
        self._clock = clock
        self._events: deque[tuple[float, float, float, float]] = deque(maxlen=window)

    def update(self, *, samples: float = 0, tokens: float = 0, flops: float = 0) -> None:
        self._events.append((self._clock(), float(samples), float(tokens), float(flops)))

    def compute(self) -> dict[str, float]:
        """``samples_per_s``, ``tokens_per_s`` (job totals), ``*_per_device``, ``flops_per_s``
        per device and ``mfu``; empty until two updates were made."""
        if len(self._events) < 2:
            return {}
        elapsed = self._events[-1][0] - self._events[0][0]
        if elapsed <= 0:
            return {}
        # what was done between the first and the last update: the first one's counts are work
        # finished before the window started
        samples, tokens, flops = (sum(e[i] for e in list(self._events)[1:]) for i in (1, 2, 3))
        out: dict[str, float] = {}
        if samples:
            out["samples_per_s_per_device"] = samples / elapsed
            out["samples_per_s"] = samples / elapsed * self.world_size
        if tokens:
            out["tokens_per_s_per_device"] = tokens / elapsed
            out["tokens_per_s"] = tokens / elapsed * self.world_size
        if flops:
            out["flops_per_s"] = flops / elapsed
            if self.peak_flops:
                out["mfu"] = flops / elapsed / self.peak_flops
        return {k: v for k, v in out.items() if math.isfinite(v)}
