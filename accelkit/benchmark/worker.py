"""One benchmark row in its own process (or ``torchrun`` group): ``python -m
accelkit.benchmark.worker JOB.json``.

The worker builds the model for its backend (or the raw-PyTorch baseline), runs the warm-up
steps, writes ``ready.json`` and then waits. Each time the parent writes ``go-K`` in the job's
folder, it times ``steps`` steps (one device sync at each end, none per step) and writes
``result-K.json``; ``stop`` ends it. The parent drives every row in turn, so repeats of all rows
interleave in time and drift of a shared machine hits them alike. A failure is written to
``error.json`` with its reason; the parent lists the row as unavailable or failed.

The raw baseline uses plain torch only (no accelkit code in its step), so the overhead ratio
compares accelkit with the loop a user would write by hand.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accelkit.benchmark.workloads import ParamCount, count_params

POLL_S = 0.005


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def peak_rss_bytes() -> int:
    """The process's peak resident set size (VmHWM) on Linux; ru_maxrss elsewhere."""
    try:
        text = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]
    except (OSError, AttributeError):
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def low_dtype(precision: str) -> torch.dtype | None:
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


# ---- building the two kinds of row --------------------------------------------------------------
class Job:
    """What a row trains with: ``step()`` runs one optimizer step and returns the loss."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from accelkit.benchmark.workloads import get_workload

        self.spec = spec
        with torch.device("meta"):  # a user factory is called once to check it: on meta
            self.workload = get_workload(spec["model"], spec.get("batch_factory"), spec.get("seq"))
        self.world_size = 1
        self.rank = 0
        #: which batches this rank draws: the data-parallel rank (tensor-parallel ranks share)
        self.data_rank = 0
        self.data_world_size = 1
        self.device = torch.device("cpu")
        self.step: Callable[[], torch.Tensor]
        self.optimizer_kind = ""
        self.params = ParamCount(0, 0)

    def batches(self) -> list[Any]:
        """A few fixed batches, different on every rank, already on the device."""
        from accelkit.benchmark.workloads import move_batch

        gen = torch.Generator().manual_seed(1000 * self.spec["seed"] + self.data_rank)
        return [
            move_batch(self.workload.make_batch(self.spec["batch"], gen), self.device)
            for _ in range(4)
        ]

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        params = list(model.parameters())
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        self.optimizer_kind = "AdamW (fused)" if fused else "AdamW (foreach)"
        return torch.optim.AdamW(params, lr=1e-4, fused=fused or None)


def build_raw(job: Job) -> None:
    """The hand-written loop: autocast for -mixed, GradScaler for 16-mixed, a cast model for
    -true; DDP (gradient_as_bucket_view) when launched on several processes."""
    import torch.distributed as dist

    spec = job.spec
    distributed = spec["raw"] == "ddp"
    job.device = torch.device(spec["device"])
    if distributed:
        job.rank, job.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        job.data_rank, job.data_world_size = job.rank, job.world_size
        if job.device.type == "cuda":
            job.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(job.device)
        backend = "nccl" if job.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=job.device if backend == "nccl" else None)
    elif job.device.type == "cuda":
        job.device = torch.device("cuda", job.device.index or 0)  # set_device needs the index
        torch.cuda.set_device(job.device)
    precision = spec["precision"]
    if precision == "fp8-mixed":  # make_rows marks it unavailable; a hand-made job gets this
        raise ValueError("the raw baseline has no fp8-mixed loop (torchao's float8 is accelkit's)")
    low = low_dtype(precision)
    torch.manual_seed(spec["seed"])
    with job.device:
        model = job.workload.build()
    job.params = count_params(model)
    if precision in ("bf16-true", "16-true"):
        model = model.to(low)
    if spec.get("activation_checkpointing"):
        raise ValueError("the raw baseline has no activation checkpointing; compare without it")
    optimizer = job.make_optimizer(model)
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        ids = [job.device.index] if job.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    if spec.get("compile"):
        model.compile()
    mixed = precision.endswith("-mixed")
    scaler = torch.amp.GradScaler(job.device.type) if precision == "16-mixed" else None
    batches = job.batches()
    counter = [0]
    true_low = low if precision.endswith("-true") and low is not None else None
    from accelkit.benchmark.workloads import call_model

    def step() -> torch.Tensor:
        batch = batches[counter[0] % len(batches)]
        counter[0] += 1
        if true_low is not None:
            batch = _cast_floats(batch, true_low)
        with torch.autocast(job.device.type, dtype=low or torch.bfloat16, enabled=mixed):
            loss = call_model(model, batch)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    job.step = step


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast_floats(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_floats(v, dtype) for v in batch)
    return batch


def build_accelkit(job: Job) -> Any:
    """The loop of the docs: ``accelkit.get`` -> ``init_module`` -> ``setup`` -> accumulate,
    backward, step."""
    import accelkit
    from accelkit.benchmark.workloads import call_model

    spec = job.spec
    accel = accelkit.get(spec["backend"], precision=spec["precision"], **spec.get("options", {}))
    job.device, job.rank, job.world_size = accel.device, accel.rank, accel.world_size
    job.data_rank = accel.backend.data_parallel_rank
    job.data_world_size = accel.backend.data_parallel_world_size
    torch.manual_seed(spec["seed"])
    with accel.init_module():
        model = job.workload.build()
    job.params = count_params(model)
    optimizer = job.make_optimizer(model)
    kwargs: dict[str, Any] = {}
    if spec.get("compile"):
        kwargs["compile"] = True
    if spec.get("activation_checkpointing"):
        kwargs["activation_checkpointing"] = True
    model, optimizer = accel.setup(model, optimizer, **kwargs)
    batches = job.batches()
    counter = [0]

    def step() -> torch.Tensor:
        batch = batches[counter[0] % len(batches)]
        counter[0] += 1
        with accel.accumulate(model):
            loss = call_model(model, batch)
            accel.backward(loss)
            accel.step()
        return loss.detach()

    job.step = step
    return accel


# ---- the protocol with the parent ---------------------------------------------------------------
def wait_for_command(control: Path, index: int, parent_pid: int) -> str:
    go, stop = control / f"go-{index}", control / "stop"
    while True:
        if go.exists():
            return "go"
        if stop.exists():
            return "stop"
        if parent_pid and not _alive(parent_pid):
            return "stop"
        time.sleep(POLL_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "max_memory_allocated"
    return peak_rss_bytes(), "peak RSS"


def reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over ranks (one collective, outside the timed region)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def run_job(spec: dict[str, Any]) -> int:
    control = Path(spec["control"])
    rank = int(os.environ.get("RANK", "0"))
    started = time.perf_counter()
    try:
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        job = Job(spec)
        if spec.get("raw"):
            build_raw(job)
        else:
            build_accelkit(job)
        if job.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(job.device)
        for _ in range(spec["warmup"]):
            loss = job.step()
        sync(job.device)
    except Exception as err:
        if rank == 0:
            write_json(
                control / "error.json",
                {"phase": "setup", "reason": _reason(err), "trace": traceback.format_exc()[-3000:]},
            )
        return 1  # non-zero: torchrun stops the other ranks instead of leaving them waiting
    if job.rank == 0:
        write_json(
            control / "ready.json",
            {
                "params": job.params.total,
                "embedding_params": job.params.embedding,
                "tied": job.params.tied,
                "world_size": job.world_size,
                "data_parallel_world_size": job.data_world_size,
                "device": job.device.type,
                "device_name": device_name(job.device),
                "setup_s": time.perf_counter() - started,
                "threads": torch.get_num_threads(),
                "optimizer": job.optimizer_kind,
            },
        )
    index = 0
    parent = int(spec.get("parent_pid") or 0)
    while wait_for_command(control, index, parent) == "go":
        try:
            barrier()
            sync(job.device)
            start = time.perf_counter()
            for _ in range(spec["steps"]):
                loss = job.step()
            sync(job.device)
            elapsed = time.perf_counter() - start
            memory, kind = peak_memory(job.device)
            elapsed, memory, loss_value = reduce_max([elapsed, memory, float(loss)], job.device)
        except Exception as err:
            if job.rank == 0:
                write_json(
                    control / "error.json",
                    {
                        "phase": "run",
                        "reason": _reason(err),
                        "trace": traceback.format_exc()[-3000:],
                    },
                )
            return 1
        if job.rank == 0:
            write_json(
                control / f"result-{index}.json",
                {
                    "step_s": elapsed / spec["steps"],
                    "peak_memory": int(memory),
                    "memory_kind": kind,
                    "loss": loss_value,
                },
            )
        index += 1
    return 0


def _reason(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0][:400] if text else type(err).__name__


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


# ---- the matmul peak ------------------------------------------------------------------------------
def dense_matmul(n: int, dtype: torch.dtype, device: torch.device) -> Callable[[], Any]:
    """One n x n x n matmul in ``dtype``; a float8 dtype runs ``torch._scaled_mm`` (the kernel of
    torchao's float8 Linear: tensorwise scales, bf16 output, fast accumulation)."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(
            a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True
        )
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return lambda: a @ b


def measure_peak_flops(device_type: str, dtype_name: str, seconds: float = 2.0) -> dict[str, Any]:
    """Dense matmul FLOP/s: the ceiling MFU is stated against (n=8192 on CUDA, 1024 on CPU)."""
    dtype = getattr(torch, dtype_name)
    device = torch.device(device_type)
    n = 8192 if device.type == "cuda" else 1024
    matmul = dense_matmul(n, dtype, device)
    for _ in range(3):
        matmul()
    sync(device)
    iters, best = 1, float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            matmul()
        sync(device)
        per = (time.perf_counter() - start) / iters
        best = min(best, per)
        if per * iters < 0.05:
            iters *= 2
    return {
        "flops": 2 * n**3 / best,
        "how": f"measured: {n}x{n} {dtype_name} matmul on {device_name(device)}"
        + (" (torch._scaled_mm, fast accumulation)" if dtype.itemsize == 1 else ""),
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--peak":
        _, device_type, dtype_name, out = argv
        write_json(Path(out), measure_peak_flops(device_type, dtype_name))
        return 0
    spec = json.loads(Path(argv[0]).read_text())
    return run_job(spec)


if __name__ == "__main__":
    sys.exit(main())
