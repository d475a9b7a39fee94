"""accelkit beside its peers: raw PyTorch, Lightning Fabric, HF Accelerate and raw DeepSpeed,
training the same model on the same batches for the same number of steps.

Every side builds the same model from the same seed (the same initial weights), takes the same
four fixed batches in the same order, uses torch AdamW (lr 1e-4; fused on CUDA) and runs no
gradient clipping. The sides, one row each:

- ``raw``: the hand-written loop (autocast for bf16-mixed, ``backward``, ``step``,
  ``zero_grad(set_to_none=True)``), the reference every ratio is taken against;
- ``fabric``: ``lightning.Fabric(devices=1, precision=...)``, ``fabric.setup``, ``fabric.backward``;
- ``accelerate``: ``accelerate.Accelerator(mixed_precision=...)``, ``prepare``, ``backward``;
- ``accelkit``: the loop of accelkit's docs on ``accelkit.get("cuda" | "cpu", precision=...)``;
- ``zero1``, ``zero2``, ``zero3``: raw DeepSpeed ZeRO-k (``deepspeed.initialize`` with a config
  written out here, ``engine.backward``, ``engine.step``) beside accelkit's
  ``deepspeed_stage_k``, both in DeepSpeed's own ``bf16`` mode on the GPU (``bf16-true`` in
  accelkit's words), plus a raw-PyTorch row as the in-process reference.

Processes: raw, fabric, accelerate and accelkit live in one process (``main``); each ZeRO stage
gets a process of its own (DeepSpeed sets up a process group and keeps module-level state), with
its own raw-PyTorch row. Within a process every side is built and warmed up first, then
``--repeats`` rounds time ``--steps`` steps of each side in turn (one device sync at each end of
a block, none per step), each round starting at the next side, so drift of a shared machine falls
on every side alike. Ratios are taken within a round against that process's raw row; reported
are their median and min-max over rounds.

MFU: training FLOPs per token = 6 x non-embedding parameters + 12 x L x T x d (attention, PaLM
appendix B); the token and position tables do lookups, no matmul, and are not counted (the
output head, untied here, is). The peak is a dense matmul measured at the start (8192^3 bf16 on
a GPU, 1024^3 fp32 on the CPU) or ``--peak-tflops``; the log prints it. The MLP is
overhead-bound: no MFU, only its step time.

Memory on CUDA, per side: what the side keeps allocated after its warm-up (weights, optimizer
state, its framework's buffers) plus the largest rise above the process's allocation during its
own timed blocks. Every side's state is resident at once, so ``max_memory_allocated`` alone
would count the others' too.

    python bench/peers.py --out peers.json                          # GPU: gpt and mlp, all sides
    python bench/peers.py --device cpu --workloads tiny-gpt,mlp --steps 2 --repeats 2 --warmup 1
    python bench/peers.py --modes raw,fabric,accelkit,zero2 --workloads gpt

Lightning and HF Accelerate come with ``pip install 'accelkit[bench]'``; DeepSpeed with
``pip install accelkit-deepspeed``. A side whose library is missing is listed as not installed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from reference_gpt import GPT, flops_per_token
from torch import nn

MAIN_MODES = ("raw", "fabric", "accelerate", "accelkit")
ZERO_GROUPS = ("zero1", "zero2", "zero3")
ALL_MODES = MAIN_MODES + ZERO_GROUPS
#: the library each side needs, and how to get it
NEEDS = {
    "fabric": ("lightning", "pip install 'accelkit[bench]'"),
    "accelerate": ("accelerate", "pip install 'accelkit[bench]'"),
    "accelkit": ("accelkit", "pip install accelkit"),
    "deepspeed": ("deepspeed", "pip install accelkit-deepspeed"),
    "accelkit_deepspeed": ("accelkit_deepspeed", "pip install accelkit-deepspeed"),
}


# ---- the workloads --------------------------------------------------------------------------
class MLP(nn.Module):
    """4 x (Linear 256 -> 256, ReLU), MSE loss: so little compute that per-step overhead shows."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


@dataclass
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]
    #: (layers, seq, width) of a GPT: tokens/s and MFU are reported; None: samples/s only
    gpt: tuple[int, int, int] | None
    steps: int
    warmup: int


def _gpt(name: str, vocab: int, width: int, layers: int, heads: int, seq: int) -> Workload:
    def make_batch(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (
            torch.randint(0, vocab, (batch, seq), generator=gen),
            torch.randint(0, vocab, (batch, seq), generator=gen),
        )

    return Workload(
        name=name,
        description=f"GPT decoder, {layers} layers, width {width}, {heads} heads, sequence {seq}, "
        f"vocabulary {vocab}, untied head",
        build=lambda: GPT(vocab, width, layers, heads, seq),
        make_batch=make_batch,
        gpt=(layers, seq, width),
        steps=20,
        warmup=5,
    )


def _mlp() -> Workload:
    def make_batch(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(batch, 256, generator=gen), torch.randn(batch, 256, generator=gen)

    return Workload("mlp", "4 x (Linear 256->256, ReLU), MSE loss", MLP, make_batch, None, 200, 20)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gpt": lambda: _gpt("gpt", 50304, 768, 12, 12, 1024),  # GPT-2-small shape
    "tiny-gpt": lambda: _gpt("tiny-gpt", 512, 64, 2, 4, 64),  # for a CPU smoke run
    "mlp": _mlp,
}


def param_counts(model: nn.Module) -> dict[str, int]:
    """All parameters (shared once) and the embedding tables' (lookups, no matmul)."""
    unique = {id(p): p for p in model.parameters()}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    elsewhere = {
        id(p)
        for m in model.modules()
        if not isinstance(m, nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    total = sum(p.numel() for p in unique.values())
    embedding = sum(unique[i].numel() for i in tables - elsewhere)
    return {
        "params": total,
        "embedding_params": embedding,
        "non_embedding_params": total - embedding,
    }


@dataclass
class Side:
    mode: str
    label: str
    precision: str
    step: Callable[[tuple[torch.Tensor, ...]], torch.Tensor] | None = None
    keep: Any = None
    status: str = "pending"  # ok | not installed | failed
    reason: str = ""
    setup_s: float = 0.0
    resident: int = 0
    transient: int = 0
    build_peak: int = 0
    seconds: list[float] = field(default_factory=list)
    loss: float | None = None
    notes: list[str] = field(default_factory=list)


def new_model(workload: Workload, device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every side
    with torch.device(device):
        return workload.build()


def adamw(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)


def build_raw(workload: Workload, device: torch.device, precision: str, seed: int) -> Any:
    model = new_model(workload, device, seed)
    opt = adamw(model, device)
    mixed = precision == "bf16-mixed"

    def step(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, (model, opt)


def build_fabric(workload: Workload, device: torch.device, precision: str, seed: int) -> Any:
    import lightning as L

    fabric = L.Fabric(accelerator=device.type, devices=1, precision=precision)
    model = new_model(workload, device, seed)
    model, opt = fabric.setup(model, adamw(model, device))

    def step(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = model(*batch)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, (fabric, model, opt)


def build_accelerate(workload: Workload, device: torch.device, precision: str, seed: int) -> Any:
    from accelerate import Accelerator

    accelerator = Accelerator(
        mixed_precision="bf16" if precision == "bf16-mixed" else "no", cpu=device.type == "cpu"
    )
    model = new_model(workload, device, seed)
    model, opt = accelerator.prepare(model, adamw(model, device))

    def step(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = model(*batch)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, (accelerator, model, opt)


def build_accelkit(
    workload: Workload, device: torch.device, precision: str, seed: int, backend: str
) -> Any:
    import accelkit

    accel = accelkit.get(backend, precision=precision)
    model = new_model(workload, device, seed)
    model, opt = accel.setup(model, adamw(model, device))

    def step(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with accel.accumulate(model):
            loss = model(*batch)
            accel.backward(loss)
            accel.step()
        return loss

    return step, (accel, model, opt)


def deepspeed_config(stage: int, precision: str, batch: int) -> dict[str, Any]:
    """Raw DeepSpeed's config, written out by hand: ZeRO-k, bf16 section for bf16-true, no
    clipping (DeepSpeed clips at 1.0 unless told otherwise; no other side clips)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    if precision == "bf16-true":
        config["bf16"] = {"enabled": True}
    return config


def build_deepspeed(
    workload: Workload, device: torch.device, precision: str, seed: int, stage: int, batch: int
) -> Any:
    import deepspeed

    model = new_model(workload, device, seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=adamw(model, device),
        config=deepspeed_config(stage, precision, batch),
    )

    def step(batch_: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = engine(*batch_)
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine


# ---- one process: build every side, then interleaved rounds --------------------------------------
def global_flags() -> dict[str, Any]:
    """Process-wide settings a framework could change under the others' feet."""
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def sides_of(group: str, device: torch.device, workload: Workload, modes: list[str]) -> list[Side]:
    """The rows a process runs, with the precision each runs at."""
    gpu_gpt = device.type == "cuda" and workload.gpt is not None
    mixed = "bf16-mixed" if gpu_gpt else "32-true"
    accelkit_backend = "cuda" if device.type == "cuda" else "cpu"
    if group == "main":
        names = {
            "raw": "raw PyTorch",
            "fabric": "Lightning Fabric",
            "accelerate": "HF Accelerate",
            "accelkit": f"accelkit {accelkit_backend}",
        }
        return [Side(m, names[m], mixed) for m in MAIN_MODES if m in modes]
    stage = int(group[-1])
    ds = "bf16-true" if gpu_gpt else "32-true"
    return [
        Side("raw", "raw PyTorch", mixed),
        Side(f"deepspeed_zero{stage}", f"raw DeepSpeed ZeRO-{stage}", ds),
        Side(f"accelkit_deepspeed_stage_{stage}", f"accelkit deepspeed_stage_{stage}", ds),
    ]


def missing_library(mode: str) -> str | None:
    key = {"fabric": "fabric", "accelerate": "accelerate", "accelkit": "accelkit"}.get(mode)
    if mode.startswith("deepspeed_zero"):
        key = "deepspeed"
    elif mode.startswith("accelkit_deepspeed"):
        for need in ("deepspeed", "accelkit_deepspeed"):
            module, how = NEEDS[need]
            if not installed(module):
                return f"{module} is not installed ({how})"
        return None
    if key is None:
        return None
    module, how = NEEDS[key]
    return None if installed(module) else f"{module} is not installed ({how})"


def build_side(
    side: Side, workload: Workload, device: torch.device, args: argparse.Namespace
) -> Any:
    seed, precision = args.seed, side.precision
    if side.mode == "raw":
        return build_raw(workload, device, precision, seed)
    if side.mode == "fabric":
        return build_fabric(workload, device, precision, seed)
    if side.mode == "accelerate":
        return build_accelerate(workload, device, precision, seed)
    if side.mode == "accelkit":
        return build_accelkit(
            workload, device, precision, seed, "cuda" if device.type == "cuda" else "cpu"
        )
    if side.mode.startswith("deepspeed_zero"):
        return build_deepspeed(workload, device, precision, seed, int(side.mode[-1]), args.batch)
    if side.mode.startswith("accelkit_deepspeed_stage_"):
        backend = side.mode.removeprefix("accelkit_")
        return build_accelkit(workload, device, precision, seed, backend)
    raise ValueError(f"unknown side {side.mode!r}")


def run_workload(
    group: str, workload: Workload, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    steps = args.steps or workload.steps
    warmup = workload.warmup if args.warmup is None else args.warmup
    gen = torch.Generator().manual_seed(1000 + args.seed)
    batches = [tuple(t.to(device) for t in workload.make_batch(args.batch, gen)) for _ in range(4)]
    sides = sides_of(group, device, workload, args.modes)
    before = global_flags()
    cursor: dict[str, int] = {}

    def next_batch(side: Side) -> tuple[torch.Tensor, ...]:
        i = cursor.get(side.mode, 0)
        cursor[side.mode] = i + 1
        return batches[i % len(batches)]  # the same batches in the same order on every side

    for side in sides:
        reason = missing_library(side.mode)
        if reason:
            side.status, side.reason = "not installed", reason
            continue
        release(device)
        try:
            if device.type == "cuda":
                sync(device)
                torch.cuda.reset_peak_memory_stats(device)
                start_memory = torch.cuda.memory_allocated(device)
            started = time.perf_counter()
            side.step, side.keep = build_side(side, workload, device, args)
            for _ in range(warmup):
                loss = side.step(next_batch(side))
            sync(device)
            side.setup_s = time.perf_counter() - started
            if warmup:
                side.loss = float(loss.detach())
            if device.type == "cuda":
                side.resident = torch.cuda.memory_allocated(device) - start_memory
                side.build_peak = torch.cuda.max_memory_allocated(device) - start_memory
            side.status = "ready"
        except Exception as err:  # a side that cannot run is a finding, not the end of the run
            side.status, side.reason = "failed", f"{type(err).__name__}: {err}"[:500]
            side.notes.append(traceback.format_exc()[-1500:])
            side.step = side.keep = None
        now = global_flags()
        changed = {k: (before[k], v) for k, v in now.items() if v != before[k]}
        if changed:
            side.notes.append(f"changed process-wide settings (before, after): {changed}")
            before = now
    live = [s for s in sides if s.status == "ready"]
    for round_index in range(args.repeats):
        shift = round_index % max(1, len(live))
        for side in live[shift:] + live[:shift]:
            if side.status != "ready":
                continue
            try:
                sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                start = time.perf_counter()
                for _ in range(steps):
                    loss = side.step(next_batch(side))
                sync(device)
                side.seconds.append((time.perf_counter() - start) / steps)
                side.loss = float(loss.detach())
                if device.type == "cuda":
                    rise = torch.cuda.max_memory_allocated(device) - base
                    side.transient = max(side.transient, rise)
            except Exception as err:
                side.status, side.reason = "failed", f"{type(err).__name__}: {err}"[:500]
                side.notes.append(traceback.format_exc()[-1500:])
    for side in sides:
        if side.status == "ready":
            side.status = "ok" if len(side.seconds) == args.repeats else "failed"
        side.step = side.keep = None
    release(device)
    return {
        "steps": steps,
        "warmup": warmup,
        "sides": [side_record(s, device) for s in sides],
    }


def side_record(side: Side, device: torch.device) -> dict[str, Any]:
    record: dict[str, Any] = {
        "mode": side.mode,
        "label": side.label,
        "precision": side.precision,
        "status": side.status,
        "reason": side.reason or None,
        "setup_s": side.setup_s,
        "seconds": side.seconds,
        "loss": side.loss,
        "notes": side.notes,
    }
    if device.type == "cuda" and side.status == "ok":
        record["own_peak_memory_bytes"] = max(side.build_peak, side.resident + side.transient)
        record["resident_bytes"] = side.resident
    return record


def join_process_group(device: torch.device) -> None:
    """A process group of one for DeepSpeed, without a launcher."""
    import torch.distributed as dist

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    import deepspeed

    if device.type == "cpu":  # DeepSpeed's shm op serves its inference all-reduce: a 100 s build
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    from deepspeed.utils import logger

    logger.setLevel("WARNING")


def run_group(args: argparse.Namespace) -> int:
    """The child: one process group of sides, every workload in turn; JSON to --result."""
    device = torch.device(args.device if args.device == "cpu" else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out: dict[str, Any] = {"group": args.run_group, "workloads": {}, "error": None}
    try:
        if args.run_group != "main":
            join_process_group(device)
        for name in args.workloads:
            workload = WORKLOADS[name]()
            if args.run_group != "main" and workload.gpt is None:
                continue  # the DeepSpeed groups train the GPTs only
            out["workloads"][name] = run_workload(args.run_group, workload, device, args)
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"[:800]
        out["trace"] = traceback.format_exc()[-3000:]
    Path(args.result).write_text(json.dumps(out))
    return 0


# ---- the parent: the peak, the groups, the table ----------------------------------------------------
def measure_peak(device: str, seconds: float = 2.0) -> dict[str, Any]:
    """Dense matmul FLOP/s, the ceiling MFU is taken against."""
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    dtype, n = (torch.bfloat16, 8192) if dev.type == "cuda" else (torch.float32, 1024)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(dev)
    iters, best = 1, float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sync(dev)
        start = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync(dev)
        per = (time.perf_counter() - start) / iters
        best = min(best, per)
        if per * iters < 0.05:
            iters *= 2
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine()
    del a, b
    release(dev)
    return {
        "flops": 2 * n**3 / best,
        "how": f"measured: {n}x{n} {str(dtype).removeprefix('torch.')} matmul on {name}",
    }


def versions() -> dict[str, str | None]:
    import importlib.metadata as metadata

    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("lightning", "accelerate", "deepspeed", "accelkit", "accelkit-deepspeed"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def groups_for(modes: list[str]) -> list[str]:
    groups = ["main"] if any(m in MAIN_MODES for m in modes) else []
    return groups + [m for m in modes if m in ZERO_GROUPS]


def launch_group(group: str, args: argparse.Namespace, workdir: Path, port: int) -> dict[str, Any]:
    result = workdir / f"{group}.json"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run-group", group,
        "--result", str(result),
        "--device", args.device,
        "--workloads", ",".join(args.workloads),
        "--modes", ",".join(args.modes),
        "--batch", str(args.batch),
        "--repeats", str(args.repeats),
        "--seed", str(args.seed),
    ]  # fmt: skip
    if args.steps:
        command += ["--steps", str(args.steps)]
    if args.warmup is not None:
        command += ["--warmup", str(args.warmup)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT=str(port))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)  # every group is a process of its own, not a rank of a launcher's
    if args.device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    log = workdir / f"{group}.log"
    started = time.perf_counter()
    try:
        with open(log, "w") as handle:
            done = subprocess.run(
                command, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=args.timeout
            )
        returncode: int | None = done.returncode
    except subprocess.TimeoutExpired:
        returncode = None
    tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-12:])
    record: dict[str, Any] = {
        "returncode": returncode,
        "wall_s": time.perf_counter() - started,
        "log_tail": tail,
    }
    if result.exists():
        record.update(json.loads(result.read_text()))
    else:
        why = "timed out" if returncode is None else f"exited with code {returncode}"
        record["error"] = f"the {group} process {why} without a result"
    return record


def ratios(mine: list[float], theirs: list[float]) -> dict[str, Any] | None:
    if not mine or len(mine) != len(theirs):
        return None
    each = [a / b for a, b in zip(mine, theirs, strict=True)]
    return {"median": statistics.median(each), "min": min(each), "max": max(each), "rounds": each}


def summarize(
    args: argparse.Namespace, peak: dict[str, Any], groups: dict[str, Any]
) -> dict[str, Any]:
    """One table per workload: every side of every process, its figures and its ratios."""
    workloads: dict[str, Any] = {}
    for name in args.workloads:
        workload = WORKLOADS[name]()
        with torch.device("meta"):
            counts = param_counts(workload.build())
        entry: dict[str, Any] = {"description": workload.description, **counts, "rows": []}
        per_token = None
        if workload.gpt is not None:
            layers, seq, width = workload.gpt
            per_token = flops_per_token(counts["non_embedding_params"], layers, seq, width)
            entry["flops_per_token"] = per_token
            entry["flops_formula"] = (
                f"6 x {counts['non_embedding_params']:,} non-embedding parameters + 12 x L x T x d "
                f"(L={layers}, T={seq}, d={width}) = {per_token:,} training FLOPs per token"
            )
        for group, record in groups.items():
            done = (record.get("workloads") or {}).get(name)
            if done is None:
                continue
            sides = {s["mode"]: s for s in done["sides"]}
            raw = sides.get("raw")
            for side in done["sides"]:
                row = {**side, "process": group, "steps": done["steps"], "warmup": done["warmup"]}
                row.pop("seconds")
                if side["status"] == "ok":
                    row.update(figures(side, raw, sides, args, workload, per_token, peak))
                entry["rows"].append(row)
        workloads[name] = entry
    return {
        "peers_bench": 1,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "device_name": peak.get("device_name"),
        "versions": versions(),
        "config": {
            "batch": args.batch,
            "repeats": args.repeats,
            "steps": args.steps or "per workload (gpt 20, mlp 200)",
            "warmup": args.warmup if args.warmup is not None else "per workload (gpt 5, mlp 20)",
            "seed": args.seed,
            "modes": args.modes,
            "timing": "per round: wall time of `steps` steps / steps, one device sync at each end",
        },
        "peak": {
            "tflops": None if not peak.get("flops") else peak["flops"] / 1e12,
            "how": peak.get("how"),
        },
        "mfu_accounting": "training FLOPs per token = 6 x non-embedding parameters + 12 x L x T x d "
        "(attention, PaLM appendix B); token and position tables (lookups) not counted, the untied "
        "output head counted; MFU = FLOPs per token x tokens/s / peak",
        "processes": {
            g: {k: r.get(k) for k in ("returncode", "wall_s", "error", "log_tail")}
            for g, r in groups.items()
        },
        "workloads": workloads,
    }


def figures(
    side: dict[str, Any],
    raw: dict[str, Any] | None,
    sides: dict[str, Any],
    args: argparse.Namespace,
    workload: Workload,
    per_token: int | None,
    peak: dict[str, Any],
) -> dict[str, Any]:
    seconds = side["seconds"]
    median = statistics.median(seconds)
    samples = args.batch / median
    out: dict[str, Any] = {
        "step_ms": {
            "median": median * 1e3,
            "min": min(seconds) * 1e3,
            "max": max(seconds) * 1e3,
            "rounds": [s * 1e3 for s in seconds],
        },
        "samples_per_s": samples,
    }
    if workload.gpt is not None:
        tokens = samples * workload.gpt[1]
        out["tokens_per_s"] = tokens
        if peak.get("flops") and per_token:
            out["mfu"] = per_token * tokens / peak["flops"]
    if raw is not None and raw["status"] == "ok" and side["mode"] != "raw":
        out["vs_raw"] = ratios(seconds, raw["seconds"])
    if side["mode"].startswith("accelkit_deepspeed_stage_"):
        twin = sides.get(f"deepspeed_zero{side['mode'][-1]}")
        if twin is not None and twin["status"] == "ok":
            out["vs_raw_deepspeed"] = ratios(seconds, twin["seconds"])
    return out


def flops_rate(value: float) -> str:
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value / 1e6:,.1f} MFLOP/s"


def _spread(r: dict[str, Any] | None) -> str:
    return f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]" if r else "-"


def render(doc: dict[str, Any]) -> str:
    peak = doc["peak"]
    v = doc["versions"]
    lines = [
        f"bench/peers.py on {doc['device_name'] or doc['device']}, {doc['date']}",
        "versions: "
        + ", ".join(f"{k} {v[k]}" for k in v if v[k])
        + "; not installed: "
        + (", ".join(k for k in v if not v[k]) or "none"),
        f"batch {doc['config']['batch']}, {doc['config']['repeats']} interleaved rounds per process",
        "peak MFU is taken against: "
        + (
            f"{flops_rate(peak['tflops'] * 1e12)} ({peak['how']})"
            if peak["tflops"]
            else str(peak["how"])
        ),
        f"MFU accounting: {doc['mfu_accounting']}",
    ]
    for name, w in doc["workloads"].items():
        lines += [
            "",
            f"## {name}: {w['description']}",
            f"{w['params']:,} parameters, {w['non_embedding_params']:,} without the embedding "
            f"tables ({w['embedding_params']:,})"
            + (
                f"; {w['flops_formula']}" if w.get("flops_formula") else "; no MFU (overhead-bound)"
            ),
        ]
        if not w["rows"]:
            lines.append("no process ran this workload (the DeepSpeed processes train GPTs only)")
            continue
        rate = "tokens/s" if "flops_per_token" in w else "samples/s"
        lines += [
            "",
            f"| side | process | precision | ms/step median [min, max] | {rate} | MFU | own peak "
            "memory | vs raw PyTorch (same process) | vs raw DeepSpeed | last loss |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        skipped = []
        for r in w["rows"]:
            if r["status"] != "ok":
                skipped.append(f"- {r['label']} ({r['process']}): {r['status']}: {r['reason']}")
                continue
            t = r["step_ms"]
            value = r.get("tokens_per_s") or r["samples_per_s"]
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
            memory = r.get("own_peak_memory_bytes")
            mem = f"{memory / 2**30:.2f} GiB" if memory else "-"
            vs_raw = "reference" if r["mode"] == "raw" else _spread(r.get("vs_raw"))
            lines.append(
                f"| {r['label']} | {r['process']} | {r['precision']} | {t['median']:.3f} "
                f"[{t['min']:.3f}, {t['max']:.3f}] | {value:,.0f} | {mfu} | {mem} | {vs_raw} | "
                f"{_spread(r.get('vs_raw_deepspeed'))} | {r['loss']:.4f} |"
            )
        for r in w["rows"]:
            for note in r.get("notes") or []:
                if note.startswith("changed"):
                    lines.append(f"note: {r['label']}: {note}")
        if skipped:
            lines += ["", "not run:", *skipped]
    for group, p in doc["processes"].items():
        if p.get("error"):
            lines += ["", f"process {group}: {p['error']}", p.get("log_tail") or ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument(
        "--workloads",
        default=None,
        help="gpt, tiny-gpt, mlp (default: gpt,mlp on CUDA, tiny-gpt,mlp on CPU)",
    )
    p.add_argument(
        "--modes",
        default=",".join(ALL_MODES),
        help=f"sides to run, of {','.join(ALL_MODES)} (zeroK: raw DeepSpeed ZeRO-K beside accelkit "
        "deepspeed_stage_K in a process of their own)",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="timed steps per round and side")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after each side's build")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="state the peak instead of measuring it"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--keep", default=None, help="keep each process's log and JSON in this folder")
    p.add_argument("--run-group", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.workloads is None:
        args.workloads = "gpt,mlp" if args.device == "cuda" else "tiny-gpt,mlp"
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS] + [
        m for m in args.modes if m not in ALL_MODES
    ]
    if unknown:
        p.error(f"unknown workload or mode: {', '.join(unknown)}")
    if min(args.batch, args.repeats) < 1 or (args.steps is not None and args.steps < 1):
        p.error("--batch, --repeats and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_group:
        return run_group(args)
    if args.peak_tflops:
        peak: dict[str, Any] = {"flops": args.peak_tflops * 1e12, "how": "given with --peak-tflops"}
    else:
        peak = measure_peak(args.device)  # before any side runs: the machine is idle
    peak["device_name"] = (
        torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else platform.processor() or platform.machine()
    )
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="accelkit-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, Any] = {}
    for index, group in enumerate(groups_for(args.modes)):
        print(f"[{time.strftime('%H:%M:%S')}] process {group} ...", file=sys.stderr, flush=True)
        groups[group] = launch_group(group, args, workdir, 29600 + index)
    if args.keep is None:
        shutil.rmtree(workdir, ignore_errors=True)
    doc = summarize(args, peak, groups)
    print(render(doc))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"\nresults: {args.out}")
    ran = any(r["status"] == "ok" for w in doc["workloads"].values() for r in w["rows"])
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
