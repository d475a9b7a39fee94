"""``accelkit bench``: train one model on several backends and compare them side by side.

Each backend runs in its own process (a ``torchrun`` group for distributed ones with ``--nproc``)
on the same model, synthetic data and number of steps; repeats are interleaved round-robin across
backends. Reported per backend: step time (median and spread over repeats), samples or tokens per
second, MFU against a stated peak, peak memory, and the step-time ratio to raw PyTorch measured
in the same run (a baseline row added automatically). See docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EPILOG = """\
examples:
  accelkit bench --model tiny-gpt --backends cpu,ddp --nproc 2 --steps 5 --repeats 3
  accelkit bench --model gpt2-small --backends cuda,cuda+compile,fsdp,deepspeed_stage_2 \\
      --precision bf16-mixed --out result.json --plot chart.png
  accelkit bench --model mypkg.models:build --batch-factory mypkg.models:make_batch --backends cuda
  accelkit bench --model gpt-2048 --backends cuda+compile --precision bf16-mixed,fp8-mixed \
      --no-baseline       # fp8-mixed against bf16-mixed, interleaved; ratio and MFU per row

backend suffixes: +compile (setup(compile=True)), +ckpt (activation checkpointing).
backend options: --option KEY=VALUE (every accelkit row) or --option BACKEND:KEY=VALUE (that
backend's rows), repeatable; values are read as JSON, else as text. An N-D mesh on fsdp:
  accelkit bench --model mypkg.models:build --backends fsdp --nproc 4 \
      --option fsdp:dp_shard=2 --option fsdp:tp=2 --option fsdp:tp_plan=auto
'raw' and 'raw-ddp' name the raw-PyTorch baselines (added automatically unless --no-baseline);
'raw+compile' adds raw torch.compile, the baseline of every +compile row (raw,raw+compile,cuda,
cuda+compile puts accelkit's compile path beside raw torch.compile).
MFU: 6 x non-embedding parameters (+ 12 L T d attention per token for the GPTs) against the peak
printed under the table: a dense matmul in the row's compute dtype (bf16 for bf16-mixed, float8
e4m3 _scaled_mm for fp8-mixed) measured at the start, or --peak-tflops for every row.
--precision A,B,...: every accelkit row runs in each precision (the others labelled @B); a @B
row's "vs" cell is its step time over the same row's in A, taken within each round.
"""

DEFAULTS = {  # (steps, warmup, repeats) per built-in model
    "gpt2-small": (20, 5, 3),
    "gpt-2048": (10, 5, 3),
    "tiny-gpt": (20, 3, 3),
    "mlp": (100, 10, 3),
}


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "--model",
        required=True,
        help="gpt2-small, gpt-2048, tiny-gpt, mlp, or package.module:factory (your model)",
    )
    parser.add_argument(
        "--batch-factory",
        default=None,
        help="package.module:function(batch_size, generator) -> batch, for your own model",
    )
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated backend names (default: cpu,ddp on the CPU, cuda,ddp,fsdp on a GPU)",
    )
    parser.add_argument(
        "--precision",
        default=None,
        help="default: bf16-mixed on GPU, 32-true on CPU; a comma-separated list compares "
        "precisions (bf16-mixed,fp8-mixed: every accelkit row runs in each)",
    )
    parser.add_argument("--batch", type=int, default=None, help="samples per process and step")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (built-in GPTs)")
    parser.add_argument("--nproc", type=int, default=1, help="processes for distributed backends")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="[BACKEND:]KEY=VALUE",
        help="a backend option (accelkit.get(name, KEY=VALUE)); repeatable",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before timing")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="state the peak TFLOP/s per device for MFU (default: measure a large matmul)",
    )
    parser.add_argument(
        "--no-interleave",
        action="store_true",
        help="run each backend's repeats back to back, one backend in memory at a time",
    )
    parser.add_argument("--no-baseline", action="store_true", help="no raw-PyTorch row")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per process (default: the cores divided among a row's processes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per setup or repeat")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here (matplotlib)")
    parser.add_argument("--keep", default=None, help="keep the workers' folders and logs here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def unknown_backends(items: list[tuple[str, str, set[str]]]) -> str:
    """What is wrong with the names of ``--backends`` that no plugin registers or is known to
    provide ("" when every name is known), with the nearest valid name. A known backend that
    cannot run here is not an error: its row says why."""
    from accelkit import registry
    from accelkit._known_plugins import KNOWN_PLUGIN_BACKENDS
    from accelkit.benchmark.runner import RAW_DDP, RAW_SINGLE
    from accelkit.config import closest

    host = registry.host()
    host.ensure_loaded()
    valid = {*host.registry.names(), *KNOWN_PLUGIN_BACKENDS, RAW_SINGLE, RAW_DDP}
    problems = []
    for _, name, _ in items:
        if name in valid:
            continue
        hint = closest(name, valid)
        problems.append(f"{name!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
    if not problems:
        return ""
    return (
        f"unknown backend{'s' if len(problems) > 1 else ''} {', '.join(problems)}. "
        f"Valid: {', '.join(sorted(valid))} (`accelkit env` shows which run here)."
    )


def run(args: argparse.Namespace) -> int:
    if args.plot and not matplotlib_available():
        print(
            "accelkit bench: --plot needs matplotlib, which is not installed. Install it with "
            "`pip install 'accelkit[plot]'` (or `pip install matplotlib`), or leave out --plot.",
            file=sys.stderr,
        )
        return 2
    from accelkit.benchmark import runner

    try:
        options, backend_options = split_options(args.option)
    except ValueError as err:
        print(f"accelkit bench: {err}", file=sys.stderr)
        return 2
    device = runner.resolve_device(args.device)
    try:
        precisions = parse_precisions(
            args.precision or ("bf16-mixed" if device == "cuda" else "32-true")
        )
    except ValueError as err:
        print(f"accelkit bench: {err}", file=sys.stderr)
        return 2
    steps, warmup, repeats = DEFAULTS.get(args.model, (20, 3, 3))
    config = runner.BenchConfig(
        model=args.model,
        precision=precisions[0],
        compare_precisions=precisions[1:],
        batch=args.batch or _default_batch(args),
        steps=args.steps or steps,
        warmup=warmup if args.warmup is None else args.warmup,
        repeats=args.repeats or repeats,
        nproc=args.nproc,
        device=device,
        seq=args.seq,
        batch_factory=args.batch_factory,
        seed=args.seed,
        peak_tflops=args.peak_tflops,
        interleave=not args.no_interleave,
        baseline=not args.no_baseline,
        timeout_s=args.timeout,
        threads=args.threads,
        options=options,
        backend_options=backend_options,
    )
    if min(config.steps, config.repeats, config.batch, config.nproc) < 1 or config.warmup < 0:
        print("accelkit bench: --steps, --repeats, --batch, --nproc must be >= 1", file=sys.stderr)
        return 2
    backends = args.backends or ("cuda,ddp,fsdp" if device == "cuda" else "cpu,ddp")
    try:
        unknown = unknown_backends(runner.parse_backends(backends))
    except ValueError as err:
        print(f"accelkit bench: {err}", file=sys.stderr)
        return 2
    if unknown:  # before anything runs: a typo must not cost the whole benchmark
        print(f"accelkit bench: {unknown}", file=sys.stderr)
        return 2
    named = {name for _, name, _ in runner.parse_backends(backends)}
    stray = sorted(set(backend_options) - named)
    if stray:
        print(
            f"accelkit bench: --option names backend(s) {', '.join(map(repr, stray))}, which "
            f"--backends does not run ({backends})",
            file=sys.stderr,
        )
        return 2
    from tqdm.auto import tqdm

    with tqdm(
        total=1, unit="run", disable=args.no_progress, dynamic_ncols=True, file=sys.stderr
    ) as bar:
        try:
            result = runner.run(config, backends, progress=bar, keep_dir=args.keep)
        except ValueError as err:  # the model name or factory
            print(f"accelkit bench: {err}", file=sys.stderr)
            return 2
    print(render(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results: {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"chart: {args.plot}")
    return 0 if any(r["status"] == "ok" for r in result["results"]) else 1


def parse_precisions(text: str) -> list[str]:
    """``--precision bf16-mixed,fp8-mixed`` -> the canonical strings, each once, first the one
    the raw baseline runs."""
    from accelkit.precision import normalize_precision

    precisions = [normalize_precision(p.strip()) for p in text.split(",") if p.strip()]
    if not precisions:
        raise ValueError("--precision is empty")
    if len(set(precisions)) != len(precisions):
        raise ValueError(f"--precision names a precision twice: {text!r}")
    return precisions  # type: ignore[return-value]


def split_options(texts: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``--option`` values -> (options of every row, {backend: its rows' options})."""
    from accelkit.benchmark.runner import parse_option

    common: dict[str, Any] = {}
    per_backend: dict[str, dict[str, Any]] = {}
    for text in texts:
        backend, key, value = parse_option(text)
        (common if backend is None else per_backend.setdefault(backend, {}))[key] = value
    return common, per_backend


def _default_batch(args: argparse.Namespace) -> int:
    if ":" in args.model:
        return 8
    from accelkit.benchmark.workloads import BUILTIN

    return BUILTIN[args.model]().default_batch if args.model in BUILTIN else 8


def matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


# ---- rendering ----------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.0f} MiB"


def _flops(value: float) -> str:
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value / 1e6:.1f} MFLOP/s"


def render(result: dict[str, Any]) -> str:
    """The terminal table (GitHub markdown, so it pastes into docs as it is)."""
    cfg, hw, peak = result["config"], result["hardware"], result["peak"]
    model = result["model"]
    rate_name = "tokens/s" if model["seq_len"] else "samples/s"
    peak_text = (
        f"{_flops(peak['tflops_per_device'] * 1e12)} {peak['devices']} ({peak['how']})"
        if peak.get("tflops_per_device")
        else f"unknown ({peak.get('how')})"
    )
    precisions = ", ".join(
        [cfg["precision"], *(f"@{p}" for p in cfg.get("compare_precisions", []))]
    )
    lines = [
        f"accelkit bench: {model['name']} ({model['description']}), {precisions}, "
        f"batch {cfg['batch']} per process, {cfg['steps']} steps x {cfg['repeats']} interleaved "
        f"repeats after {cfg['warmup']} warm-up steps",
        f"{hw['device_name'] or hw['device']}; torch {result['versions']['torch']}, "
        f"accelkit {result['versions']['accelkit']}; {result['date']}",
        f"MFU against {peak_text}",
        "",
        f"| backend | procs | ms/step median [min, max] | {rate_name} | MFU | peak memory | "
        "vs raw, median [min, max] |",
        "|---|---|---|---|---|---|---|",
    ]
    skipped = []
    for r in result["results"]:
        if r["status"] != "ok":
            skipped.append(f"- {r['label']}: {r['status']}: {r['reason']}")
            continue
        t = r["step_ms"]
        rate = r["tokens_per_s"] if model["seq_len"] else r["samples_per_s"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        over = r.get("overhead") or r.get("vs_precision")
        vs = (
            f"{over['median']:.3f} [{over['min']:.3f}, {over['max']:.3f}]"
            + ("" if over["vs"] in ("raw", "raw-ddp") else f" vs {over['vs']}")
            if over
            else ("baseline" if r["baseline"] else "-")
        )
        memory = _gib(r["peak_memory_bytes"]) + (" RSS" if r["memory_kind"] == "peak RSS" else "")
        lines.append(
            f"| {r['label']} | {r['world_size']} | {t['median']:.2f} [{t['min']:.2f}, {t['max']:.2f}] "
            f"| {rate:,.0f} | {mfu} | {memory} | {vs} |"
        )
    statement = (result.get("flops") or {}).get("statement")
    if statement:
        lines += ["", statement]
    if skipped:
        lines += ["", "not run here:", *skipped]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Two bar charts: step time (median, min-max whiskers) and peak memory per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if r["status"] == "ok"]
    labels = [
        r["label"] + (f"\n{r['world_size']} procs" if r["world_size"] > 1 else "") for r in rows
    ]
    medians = [r["step_ms"]["median"] for r in rows]
    low = [m - r["step_ms"]["min"] for m, r in zip(medians, rows, strict=True)]
    high = [r["step_ms"]["max"] - m for m, r in zip(medians, rows, strict=True)]
    memory = [r["peak_memory_bytes"] / 2**30 for r in rows]
    colors = ["#888888" if r["baseline"] else "#1f77b4" for r in rows]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4.5))
    bars = ax_time.bar(labels, medians, yerr=[low, high], capsize=4, color=colors)
    ax_time.set_ylabel("ms per step (median, min-max over repeats)")
    for bar, r in zip(bars, rows, strict=True):
        note = []
        if r.get("mfu") is not None:
            note.append(f"{100 * r['mfu']:.0f}% MFU")
        if r.get("overhead"):
            note.append(f"{r['overhead']['median']:.2f}x raw")
        if note:  # above the whisker, so the text never sits on the error bar
            ax_time.annotate(
                "\n".join(note),
                (bar.get_x() + bar.get_width() / 2, r["step_ms"]["max"]),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 3),
                textcoords="offset points",
            )
    ax_time.set_ylim(0, max(r["step_ms"]["max"] for r in rows) * 1.25 if rows else 1)
    ax_mem.bar(labels, memory, color=colors)
    kind = rows[0]["memory_kind"] if rows else ""
    ax_mem.set_ylabel(f"peak memory, GiB ({kind})")
    for ax in (ax_time, ax_mem):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    cfg, hw = result["config"], result["hardware"]
    fig.suptitle(
        f"{result['model']['name']}, {cfg['precision']}, batch {cfg['batch']} - "
        f"{hw['device_name'] or hw['device']} - torch {result['versions']['torch']} - "
        f"{result['date'][:10]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
