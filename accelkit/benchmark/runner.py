"""The parent side of ``accelkit bench``: one worker process (group) per row, interleaved repeats.

Every row (a backend, or the raw-PyTorch baseline) gets its own process, or a ``torchrun`` group
of ``--nproc`` processes for a distributed backend, so no row inherits another's allocator,
compiled code or process group. Rows start one after another; each builds its model, runs the
warm-up steps and waits. Then, for ``repeats`` rounds, the parent has each row time ``steps``
steps in turn, starting each round at the next row (round-robin), so slow drift of a shared
machine falls on every row alike. All rows stay resident meanwhile; ``interleave=False`` runs
each row's repeats back to back and ends it before the next starts (for a model that does not
fit several times in memory).

The per-row ratio to raw PyTorch is taken within a round (same time slot), then the median and
the spread over rounds are reported.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelkit.benchmark.workloads import ParamCount

RAW_SINGLE = "raw"
RAW_DDP = "raw-ddp"
#: what the raw baseline's hand-written loop runs (autocast, GradScaler, a cast model)
RAW_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
FP8_MIXED = "fp8-mixed"
FLAGS = ("compile", "ckpt")


@dataclass
class BenchConfig:
    model: str
    precision: str
    batch: int
    steps: int
    warmup: int
    repeats: int
    nproc: int = 1
    device: str = "auto"
    seq: int | None = None
    batch_factory: str | None = None
    seed: int = 0
    peak_tflops: float | None = None
    interleave: bool = True
    baseline: bool = True
    timeout_s: float = 900.0
    #: CPU threads per process (default: the cores divided among a row's processes)
    threads: int | None = None
    #: backend options for every accelkit row (``accelkit.get(name, **options)``)
    options: dict[str, Any] = field(default_factory=dict)
    #: backend name -> options for that backend's rows only (``--option fsdp:tp=2``)
    backend_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: more precisions (``--precision bf16-mixed,fp8-mixed``): every accelkit row runs again in
    #: each, labelled ``@precision``, its step time compared with the same row in ``precision``
    compare_precisions: list[str] = field(default_factory=list)


@dataclass
class Row:
    """One line of the result table."""

    label: str
    backend: str | None  # None for the raw baseline
    raw: str | None = None  # "single" or "ddp" for the baseline
    compile: bool = False
    activation_checkpointing: bool = False
    nproc: int = 1
    #: what ``accelkit.get`` receives besides the precision
    options: dict[str, Any] = field(default_factory=dict)
    #: one of ``BenchConfig.compare_precisions``; None: the run's ``precision``
    precision: str | None = None
    status: str = "pending"  # ok | unavailable | failed
    reason: str = ""
    ready: dict[str, Any] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    control: Path | None = None
    process: Any = None
    log: Any = None

    @property
    def runnable(self) -> bool:
        return self.status in ("pending", "ready")


def parse_option(text: str) -> tuple[str | None, str, Any]:
    """``[BACKEND:]KEY=VALUE`` -> (backend or None, key, value); the value is read as JSON
    (``2``, ``true``, ``{"a": 1}``), else kept as a string (``auto``)."""
    head = text.split("=", 1)[0]
    target, assignment = ("", text) if ":" not in head else text.split(":", 1)
    key, equals, raw = assignment.partition("=")
    if not equals or not key.strip():
        raise ValueError(
            f"--option {text!r}: expected KEY=VALUE or BACKEND:KEY=VALUE (e.g. fsdp:tp=2)"
        )
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return (target.strip() or None), key.strip(), value


def parse_backends(text: str) -> list[tuple[str, str, set[str]]]:
    """``cuda,cuda+compile,fsdp+ckpt`` -> [(label, name, flags)]; flags: compile, ckpt."""
    items = []
    for label in (part.strip() for part in text.split(",")):
        if not label:
            continue
        name, *flags = label.split("+")
        unknown = [f for f in flags if f not in FLAGS]
        if unknown:
            raise ValueError(
                f"{label!r}: unknown suffix {'+'.join(unknown)!r}; suffixes are +compile "
                "(setup(compile=True)) and +ckpt (activation checkpointing)"
            )
        items.append((label, name, set(flags)))
    if not items:
        raise ValueError("--backends is empty")
    return items


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_rows(config: BenchConfig, backends: str) -> list[Row]:
    """Rows for ``backends`` plus the raw baselines they compare with; rows that cannot run
    here get ``status="unavailable"`` and the reason, without starting a process."""
    from accelkit import registry
    from accelkit.errors import AccelkitError

    rows: list[Row] = []
    host = registry.host()
    for label, name, flags, precision in expand_precisions(parse_backends(backends), config):
        row = Row(label, None if name in (RAW_SINGLE, RAW_DDP) else name)
        row.precision = None if precision == config.precision else precision
        row.compile = "compile" in flags
        row.activation_checkpointing = "ckpt" in flags
        if name == RAW_SINGLE:
            row.raw = "single"
        elif name == RAW_DDP:
            row.raw, row.nproc = "ddp", config.nproc
            if config.nproc < 2:
                row.status, row.reason = "unavailable", "raw-ddp needs --nproc 2 or more"
        else:
            row.options = {**config.options, **config.backend_options.get(name, {})}
            if precision != FP8_MIXED:  # the fp8_* options reach the fp8-mixed rows only
                row.options = _without_fp8(row.options)
            if config.backend_options.get(name):
                shown = ", ".join(f"{k}={v}" for k, v in config.backend_options[name].items())
                row.label = f"{label} [{shown}]"
            try:
                spec = host.resolve(name)
                backend_class = spec.load_class()
                caps = backend_class.capabilities
                if row.options:  # a typo fails here, before a process starts
                    backend_class.parse_config(name, None, {**spec.defaults, **row.options})
            except AccelkitError as err:
                row.status, row.reason = "unavailable", str(err)
            except Exception as err:  # a plugin that fails to import: reported, not fatal
                row.status, row.reason = "unavailable", f"{type(err).__name__}: {err}"
            else:
                row.nproc = config.nproc if caps.distributed else 1
                if precision not in caps.precisions:
                    row.status = "unavailable"
                    row.reason = f"precision {precision!r} is not supported by {name!r}"
                elif row.compile and not caps.compile:
                    row.status, row.reason = "unavailable", f"{name!r} does not support compile"
                elif row.activation_checkpointing and not caps.activation_checkpointing:
                    row.status = "unavailable"
                    row.reason = f"{name!r} does not support activation checkpointing"
        rows.append(row)
    if config.baseline:
        have = {r.label for r in rows}
        if any(r.nproc == 1 and r.backend for r in rows) and RAW_SINGLE not in have:
            rows.insert(0, Row(RAW_SINGLE, None, raw="single"))
        if any(r.nproc > 1 and r.backend for r in rows) and RAW_DDP not in have:
            rows.insert(0, Row(RAW_DDP, None, raw="ddp", nproc=config.nproc))
    for row in rows:
        if (
            row.raw is not None
            and row.status == "pending"
            and config.precision not in RAW_PRECISIONS
        ):
            row.status = "unavailable"
            row.reason = (
                f"the raw baseline has no {config.precision} loop; compare precisions with "
                f"--precision bf16-mixed,{config.precision}"
            )
    return rows


def expand_precisions(
    items: list[tuple[str, str, set[str]]], config: BenchConfig
) -> list[tuple[str, str, set[str], str]]:
    """``(label, name, flags, precision)``: every row in ``config.precision``, then every accelkit
    row again in each of ``config.compare_precisions``, its label ending in ``@precision`` (the
    raw baselines run the first precision only)."""
    expanded = [(label, name, flags, config.precision) for label, name, flags in items]
    for precision in config.compare_precisions:
        expanded += [
            (f"{label} @{precision}", name, flags, precision)
            for label, name, flags in items
            if name not in (RAW_SINGLE, RAW_DDP)
        ]
    return expanded


def _without_fp8(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without the ``fp8_*`` ones, which only ``precision="fp8-mixed"`` accepts."""
    return {k: v for k, v in options.items() if not k.startswith("fp8_")}


def precision_base_of(row: Row, rows: list[Row]) -> Row | None:
    """The row a ``@precision`` row is compared with: the same backend, suffixes and options in
    the run's first precision."""
    if row.precision is None:
        return None
    for other in rows:
        if (
            other.precision is None
            and other.backend == row.backend
            and other.status == "ok"
            and (other.compile, other.activation_checkpointing)
            == (row.compile, row.activation_checkpointing)
            and _without_fp8(other.options) == _without_fp8(row.options)
            and other.nproc == row.nproc
        ):
            return other
    return None


def baseline_of(row: Row, rows: list[Row]) -> Row | None:
    """The raw row this row is compared with: same process count, same compile flag if there
    is one, else the eager raw row (none for a ``@precision`` row: see precision_base_of)."""
    if row.raw is not None or row.precision is not None:
        return None
    kind = "ddp" if row.nproc > 1 else "single"
    device = row.ready.get("device")
    candidates = [
        r for r in rows if r.raw == kind and r.status == "ok" and r.ready.get("device") == device
    ]
    for candidate in candidates:
        if candidate.compile == row.compile:
            return candidate
    return next((c for c in candidates if not c.compile), None)


# ---- processes ------------------------------------------------------------------------------------
def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def launch(row: Row, config: BenchConfig, device: str, workdir: Path, index: int) -> None:
    row.control = workdir / f"row-{index:02d}"
    row.control.mkdir(parents=True)
    spec = {
        "label": row.label,
        "backend": row.backend,
        "raw": row.raw,
        "compile": row.compile,
        "activation_checkpointing": row.activation_checkpointing,
        "model": config.model,
        "batch_factory": config.batch_factory,
        "seq": config.seq,
        "batch": config.batch,
        "precision": row.precision or config.precision,
        "steps": config.steps,
        "warmup": config.warmup,
        "seed": config.seed,
        "device": device,
        "control": str(row.control),
        "options": row.options,
        "parent_pid": os.getpid(),
        "threads": config.threads,
    }
    spec_path = row.control / "job.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    module = ["-m", "accelkit.benchmark.worker", str(spec_path)]
    if row.nproc > 1:
        if "OMP_NUM_THREADS" not in os.environ:
            threads = config.threads or max(1, _cpu_count() // row.nproc)
            env["OMP_NUM_THREADS"] = str(threads)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(row.nproc), *module]
    else:
        command = [sys.executable, *module]
    row.log = open(row.control / "log.txt", "w")  # noqa: SIM115 (closed in finish())
    row.process = subprocess.Popen(
        command, stdout=row.log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd()
    )


def _log_tail(row: Row, lines: int = 15) -> str:
    try:
        text = (row.control / "log.txt").read_text(errors="replace")  # type: ignore[operator]
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _wait(row: Row, name: str, timeout_s: float) -> dict[str, Any] | None:
    """Wait for ``name`` in the row's folder; on an error file, a dead process or a timeout,
    mark the row and return None."""
    assert row.control is not None
    target, error = row.control / name, row.control / "error.json"
    deadline = time.monotonic() + timeout_s
    while True:
        if target.exists():
            return json.loads(target.read_text())
        if error.exists():
            info = json.loads(error.read_text())
            row.status = "unavailable" if info.get("phase") == "setup" else "failed"
            row.reason = info.get("reason", "failed")
            return None
        if row.process is not None and row.process.poll() is not None:
            time.sleep(0.2)  # a last file may land just after the exit
            if target.exists() or error.exists():
                continue
            row.status = "failed"
            tail = _log_tail(row, 3).replace("\n", " | ")
            row.reason = f"worker exited with code {row.process.returncode}: {tail[-400:]}"
            return None
        if time.monotonic() > deadline:
            row.status, row.reason = "failed", f"no answer within {timeout_s:.0f} s"
            return None
        time.sleep(0.01)


def finish(row: Row, timeout_s: float = 60.0) -> None:
    if row.control is not None:
        (row.control / "stop").touch()
    if row.process is not None:
        try:
            row.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            row.process.kill()
            row.process.wait()
    if row.log is not None:
        row.log.close()
        row.log = None


def await_ready(row: Row, config: BenchConfig) -> None:
    ready = _wait(row, "ready.json", config.timeout_s)
    if ready is None:
        finish(row)
        return
    row.ready, row.status = ready, "ready"


def run_repeat(row: Row, index: int, timeout_s: float) -> None:
    assert row.control is not None
    (row.control / f"go-{index}").touch()
    result = _wait(row, f"result-{index}.json", timeout_s)
    if result is None:
        finish(row)
        return
    row.results.append(result)


def peak_dtype(precision: str, device: str) -> str:
    """The matmul dtype whose peak a precision's MFU is stated against: bf16 (fp16) for the
    16-bit precisions and float8 (e4m3) for fp8-mixed on a GPU; fp32 on the CPU."""
    if device != "cuda":
        return "float32"
    if precision == "fp8-mixed":
        return "float8_e4m3fn"
    return {"bf": "bfloat16", "16": "float16"}.get(precision[:2], "float32")


def measure_peak(
    config: BenchConfig, device: str, workdir: Path, precision: str | None = None
) -> dict[str, Any]:
    """The FLOP/s ceiling MFU is stated against: given, or a matmul measured in a worker in the
    compute dtype of ``precision`` (default: the run's)."""
    if config.peak_tflops:
        return {"flops": config.peak_tflops * 1e12, "how": "given with --peak-tflops"}
    dtype = peak_dtype(precision or config.precision, device)
    out = workdir / f"peak-{dtype}.json"
    command = [sys.executable, "-m", "accelkit.benchmark.worker", "--peak", device, dtype, str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not out.exists():
        return {"flops": None, "how": f"measurement failed: {done.stderr.strip()[-300:]}"}
    return json.loads(out.read_text())


def run(
    config: BenchConfig, backends: str, progress: Any = None, keep_dir: str | None = None
) -> dict[str, Any]:
    """Run the benchmark; the result document (see :func:`summarize`)."""
    from accelkit.benchmark.workloads import get_workload

    device = resolve_device(config.device)
    import torch

    from accelkit.benchmark.workloads import count_params

    with torch.device("meta"):
        workload = get_workload(config.model, config.batch_factory, config.seq)
        # counted here, on meta: a worker's count misses parameters ZeRO-3 partitioned at build
        workload_params = count_params(workload.build())
    rows = make_rows(config, backends)
    workdir = Path(keep_dir or tempfile.mkdtemp(prefix="accelkit-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runnable = [r for r in rows if r.runnable]
    if progress is not None:
        progress.reset(total=len(runnable) * (1 + config.repeats))
    try:

        def tick(text: str) -> None:
            if progress is not None:
                progress.set_description_str(text, refresh=False)
                progress.update(1)

        if config.interleave:
            # setups overlap (imports, compilation); nothing is timed until every row is ready
            if progress is not None:
                progress.set_description_str(f"setting up {len(runnable)} rows")
            for i, row in enumerate(runnable):
                launch(row, config, device, workdir, i)
            for row in runnable:
                await_ready(row, config)
                tick(f"{row.label} ready")
            peaks = measure_peaks(config, device, workdir)  # on an idle machine: rows wait
            for round_index in range(config.repeats):
                live = [r for r in runnable if r.status == "ready"]
                if not live:
                    break
                shift = round_index % len(live)
                for row in live[shift:] + live[:shift]:
                    if progress is not None:
                        progress.set_description_str(f"round {round_index + 1}: {row.label}")
                    run_repeat(row, round_index, config.timeout_s)
                    tick(f"round {round_index + 1}: {row.label}")
        else:
            peaks = measure_peaks(config, device, workdir)
            for i, row in enumerate(runnable):
                if progress is not None:
                    progress.set_description_str(f"setting up {row.label}")
                launch(row, config, device, workdir, i)
                await_ready(row, config)
                tick(f"{row.label} ready")
                for round_index in range(config.repeats):
                    if row.status != "ready":
                        break
                    run_repeat(row, round_index, config.timeout_s)
                    tick(f"{row.label}: repeat {round_index + 1}")
                finish(row)
    finally:
        for row in runnable:
            finish(row)
        if keep_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for row in runnable:
        if row.status == "ready":
            row.status = "ok" if len(row.results) == config.repeats else "failed"
            if row.status == "failed" and not row.reason:
                row.reason = "some repeats did not finish"
    return summarize(
        config, device, workload, rows, peaks[config.precision], workload_params, peaks=peaks
    )


def measure_peaks(config: BenchConfig, device: str, workdir: Path) -> dict[str, dict[str, Any]]:
    """The peak of each precision of the run (one measurement per compute dtype)."""
    by_dtype: dict[str, dict[str, Any]] = {}
    peaks = {}
    for precision in (config.precision, *config.compare_precisions):
        dtype = peak_dtype(precision, device)
        if dtype not in by_dtype:
            by_dtype[dtype] = measure_peak(config, device, workdir, precision)
        peaks[precision] = by_dtype[dtype]
    return peaks


# ---- the result document ----------------------------------------------------------------------------
def _versions() -> dict[str, Any]:

    import torch

    from accelkit import __version__

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "accelkit": __version__,
    }
    # each plugin reports its own libraries through the accelkit_env_report hook
    from accelkit.registry import host

    found.update({k: v for k, v in host().env_report().items() if v})
    for record in host().plugins:
        found.setdefault(record.distribution, record.version)
    return found


def _hardware(device: str, rows: list[Row]) -> dict[str, Any]:
    names = {r.ready.get("device_name") for r in rows if r.ready.get("device") == device}
    names.discard(None)
    hardware = {
        "device": device,
        "device_name": sorted(names)[0] if names else None,
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": _cpu_count(),
        "platform": platform.platform(),
    }
    return hardware


def summarize(
    config: BenchConfig,
    device: str,
    workload: Any,
    rows: list[Row],
    peak: dict[str, Any],
    params: ParamCount | None = None,
    peaks: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The result document; ``params`` (the model's count, from the meta device) is what MFU
    counts, else each row's own count. ``peaks``: the peak of each precision of the run (a
    ``@precision`` row's MFU is stated against its own); ``peak`` is the first precision's."""
    peaks = peaks or {config.precision: peak}
    if params is None:  # each worker's own count (a ZeRO-3 row's misses what it partitioned)
        params = next((_count_of(r.ready) for r in rows if r.status == "ok"), None)
    results = []
    for row in rows:
        entry: dict[str, Any] = {
            "label": row.label,
            "backend": row.backend
            or f"raw PyTorch ({'DDP' if row.raw == 'ddp' else 'single device'})",
            "baseline": row.raw is not None,
            "compile": row.compile,
            "activation_checkpointing": row.activation_checkpointing,
            "nproc": row.nproc,
            "options": row.options,
            "precision": row.precision or config.precision,
            "status": row.status,
            "reason": row.reason or None,
        }
        if row.status == "ok":
            row_peak = peaks.get(row.precision or config.precision, peak)
            entry.update(_figures(config, workload, row, rows, row_peak, params))
        results.append(entry)
    return {
        "accelkit_bench": 1,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": _hardware(device, rows),
        "versions": _versions(),
        "config": {
            **{k: v for k, v in dataclasses.asdict(config).items() if k != "peak_tflops"},
            "device": device,
            "timing": "per repeat: time of `steps` steps / steps, one device sync at each end; "
            "warm-up excluded",
        },
        "peak": {
            "tflops_per_device": None if peak.get("flops") is None else peak["flops"] / 1e12,
            "how": peak.get("how"),
            "devices": "per GPU" if device == "cuda" else "the whole CPU (all cores, one process)",
        },
        "peaks": {
            precision: {
                "tflops_per_device": None if p.get("flops") is None else p["flops"] / 1e12,
                "how": p.get("how"),
            }
            for precision, p in peaks.items()
        },
        "model": {
            "name": workload.name,
            "description": workload.description,
            "seq_len": workload.seq_len,
            "params": None if params is None else params.total,
            "embedding_params": None if params is None else params.embedding,
            "non_embedding_params": None if params is None else params.non_embedding,
            "tied_embedding_params": None if params is None else params.tied,
        },
        "flops": _flops_statement(workload, params, peak, device, peaks),
        "results": results,
    }


def flops_rate(value: float) -> str:
    """``790.0 TFLOP/s``, ``17.0 GFLOP/s``: the unit that keeps the figure readable."""
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value / 1e6:,.1f} MFLOP/s"


def _count_of(ready: dict[str, Any]) -> ParamCount:
    from accelkit.benchmark.workloads import ParamCount

    total = int(ready.get("params", 0))
    return ParamCount(total, int(ready.get("embedding_params", 0)), int(ready.get("tied", 0)))


def _flops_statement(
    workload: Any,
    params: ParamCount | None,
    peak: dict[str, Any],
    device: str,
    peaks: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """How MFU is counted, in numbers and in words (the JSON keeps it; the table prints it)."""
    if params is None:
        return {"statement": "no row ran: nothing counted"}
    per_sample = workload.training_flops_per_sample(params.non_embedding)
    per_token = per_sample / workload.seq_len if workload.seq_len else None
    formula = workload.describe_flops(params.non_embedding)
    value = per_token if per_token is not None and formula.startswith("per token") else per_sample
    tied = f"; {params.tied:,} tied to a head, counted once as matmul work" if params.tied else ""
    where = "per GPU" if device == "cuda" else "the whole CPU"

    def peak_text(p: dict[str, Any]) -> str:
        flops = p.get("flops")
        return (
            f"{flops_rate(flops)} {where} ({p.get('how')})"
            if flops
            else f"unknown ({p.get('how')})"
        )

    statement = (
        f"MFU = training FLOP/s / peak. Training FLOPs {formula} = {value:,.0f} "
        f"({params.total:,} parameters in all, {params.embedding:,} of them embedding lookups, "
        f"not counted{tied}). Peak: {peak_text(peak)}."
    )
    others = [(k, p) for k, p in (peaks or {}).items() if p is not peak]
    if others:
        statement += "".join(f" Peak of the {k} rows: {peak_text(p)}." for k, p in others)
    return {
        "formula": formula,
        "counted_params": params.non_embedding,
        "per_sample": per_sample,
        "per_token": per_token,
        "statement": statement,
    }


def _figures(
    config: BenchConfig,
    workload: Any,
    row: Row,
    rows: list[Row],
    peak: dict[str, Any],
    model_params: ParamCount | None,
) -> dict[str, Any]:
    times = [r["step_s"] for r in row.results]
    median = statistics.median(times)
    world = int(row.ready.get("world_size", row.nproc))
    params = model_params or _count_of(row.ready)
    # tensor parallelism: the ranks of a tensor-parallel group share one batch
    samples = config.batch * int(row.ready.get("data_parallel_world_size", world)) / median
    figures: dict[str, Any] = {
        "world_size": world,
        "device": row.ready.get("device"),
        "params": params.total,
        "non_embedding_params": params.non_embedding,
        "optimizer": row.ready.get("optimizer"),
        "setup_s": row.ready.get("setup_s"),
        "step_ms": {
            "median": median * 1e3,
            "min": min(times) * 1e3,
            "max": max(times) * 1e3,
            "repeats": [t * 1e3 for t in times],
        },
        "samples_per_s": samples,
        "tokens_per_s": samples * workload.seq_len if workload.seq_len else None,
        "peak_memory_bytes": max(r["peak_memory"] for r in row.results),
        "memory_kind": row.results[-1]["memory_kind"],
        "loss": row.results[-1]["loss"],
    }
    flops = peak.get("flops")
    if flops:
        devices = world if row.ready.get("device") == "cuda" else 1
        achieved = workload.training_flops_per_sample(params.non_embedding) * samples
        figures["tflops"] = achieved / 1e12
        figures["mfu"] = achieved / (flops * devices)
    base = baseline_of(row, rows)
    if base is not None and len(base.results) == len(row.results):
        ratios = [
            mine["step_s"] / theirs["step_s"]
            for mine, theirs in zip(row.results, base.results, strict=True)
        ]
        figures["overhead"] = {
            "vs": base.label,
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
    other = precision_base_of(row, rows)
    if other is not None and len(other.results) == len(row.results):
        # within each round, like the overhead: the two precisions' step times, same slot
        ratios = [
            mine["step_s"] / theirs["step_s"]
            for mine, theirs in zip(row.results, other.results, strict=True)
        ]
        figures["vs_precision"] = {
            "vs": other.label,
            "precision": config.precision,
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
    if flops:
        figures["peak_tflops"] = flops / 1e12
    return figures
