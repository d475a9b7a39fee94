"""What slows a training step while a checkpoint is written beside it: the step time in windows
with a background load, each against the idle windows either side of it, in one process.

On a GPU the step is ``checkpoint_io.py``'s ``square`` workload (a stack of 2048 x 2048 Linears
with per-parameter Adam: about a thousand small kernels, so the step is bound by the Python
thread that launches them, the case most sensitive to anything else in the process). On a CPU
(``--workload tiny``, the default there) it is the CPU's equivalent: 64 Linears of 32 x 32 with
per-parameter Adam on one torch thread, so the step is all Python and dispatch, beside a state
of ``--gb`` GB held in buffers. The loads write (or read) the same number of bytes as the
state:

- ``accelkit-async``: accelkit's asynchronous save, steady state (its staging already pinned;
  the stall happens before the window opens), written by its writer process (the default);
- ``accelkit-async-threads``: the same save written by threads of the training process
  (``ACCELKIT_ASYNC_WRITER=threads``);
- ``thread-pwrite``: one niced Python thread ``pwrite``s a pinned copy of the state in 8 MiB
  pieces with early writeback, then fsyncs (the syscalls release the GIL);
- ``thread-hash``: one niced thread XXH3-hashes that copy in 4 MiB pieces (GIL released);
- ``gil-ticks``: one thread that wakes every millisecond for a few microseconds of Python,
  for as long as the accelkit save took: the cost of GIL hand-offs alone;
- ``process-write``: another process (no torch) writes as many bytes from its own memory, in
  8 MiB pieces with early writeback, then fsyncs: the machine-wide cost (page cache, memory
  bandwidth, disk), with nothing shared with the training process;
- ``process-direct``: the same with ``O_DIRECT`` (no page cache).

Each repeat visits every load in a rotated order; a load's ratio is the median step time in
its window over the median of the two idle windows around it. Printed: the median ratio over
repeats with its min-max, and each load's duration.

    python bench/write_interference.py --gb 2 --repeats 3 --out interference.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

LOADS = (
    "accelkit-async",
    "accelkit-async-threads",
    "thread-pwrite",
    "thread-hash",
    "gil-ticks",
    "process-write",
    "process-direct",
)
PIECE = 8 << 20

#: the writing process of ``process-write`` / ``process-direct``: stdlib only, so it starts in
#: milliseconds and shares nothing with the trainer but the machine
_CHILD = r"""
import ctypes, mmap, os, sys
nbytes, path, direct = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
piece = 8 << 20
buf = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
buf.write(os.urandom(piece))
libc = ctypes.CDLL("libc.so.6")
flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
print("ready", flush=True)
sys.stdin.readline()
fd = os.open(path, flags, 0o644)
done = 0
while done < nbytes:
    n = os.pwritev(fd, [buf], done)
    if not direct:
        libc.sync_file_range(fd, ctypes.c_int64(done), ctypes.c_int64(n), 2)
    done += n
os.fsync(fd)
os.close(fd)
os.unlink(path)
"""


def _steps_for(step, sync, seconds: float, limit: int = 400) -> list[float]:
    out: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds and len(out) < limit:
        t = time.perf_counter()
        step()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _steps_while(step, sync, busy, limit: int = 2000) -> list[float]:
    out: list[float] = []
    while busy() and len(out) < limit:
        t = time.perf_counter()
        step()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _nice() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass


class _Loads:
    def __init__(self, model, opt, staging, directory: Path, nbytes: int) -> None:
        self.model, self.opt, self.staging = model, opt, staging
        self.dir, self.nbytes = directory, nbytes
        self.last_async_s = 1.0

    def start(self, name: str) -> tuple[Any, Any]:
        """Start ``name``; return (busy() -> bool, finish() -> None)."""
        return getattr(self, "_" + name.replace("-", "_"))()

    def _thread(self, target) -> tuple[Any, Any]:
        def run() -> None:
            _nice()
            target()

        thread = threading.Thread(target=run)
        thread.start()
        return thread.is_alive, thread.join

    def _accelkit_async(self, writer: str = "process"):
        from accelkit.checkpoint import save
        from accelkit.checkpoint.write import background

        os.environ["ACCELKIT_ASYNC_WRITER"] = writer  # read when the write starts
        path = self.dir / "async"
        save(
            None,
            path,
            {"model": self.model, "optimizer": self.opt},
            rng=False,
            latest=False,
            asynchronous=True,
        )
        started = time.perf_counter()

        def finish() -> None:
            background.wait()
            self.last_async_s = time.perf_counter() - started

        return (lambda: background.pending() is not None), finish

    def _accelkit_async_threads(self):
        return self._accelkit_async("threads")

    def _thread_pwrite(self):
        from accelkit.checkpoint.format.pinned import start_writeback

        view = memoryview(self.staging.numpy()).cast("B")

        def write() -> None:
            fd = os.open(self.dir / "pwrite.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for lo in range(0, len(view), PIECE):
                n = os.pwrite(fd, view[lo : lo + PIECE], lo)
                start_writeback(fd, lo, n)
            os.fsync(fd)
            os.close(fd)

        return self._thread(write)

    def _thread_hash(self):
        import xxhash

        view = memoryview(self.staging.numpy()).cast("B")

        def digest() -> None:
            h = xxhash.xxh3_128()
            for lo in range(0, len(view), 4 << 20):
                h.update(view[lo : lo + (4 << 20)])
            h.hexdigest()

        return self._thread(digest)

    def _gil_ticks(self):
        seconds = self.last_async_s

        def tick() -> None:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                time.sleep(0.001)
                sum(range(20))

        return self._thread(tick)

    def _process(self, direct: bool):
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CHILD,
                str(self.nbytes),
                str(self.dir / "child.bin"),
                "1" if direct else "0",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        return (lambda: child.poll() is None), child.wait

    def _process_write(self):
        return self._process(False)

    def _process_direct(self):
        return self._process(True)


def _tiny(gb: float, device: str):
    """A step of many tiny ops (all Python and dispatch) beside ``gb`` GB of saved buffers."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(64))).to(device)
    chunks = max(1, round(gb * 1e9 / (64 << 20)))
    for i in range(chunks):
        model.register_buffer(f"held{i}", torch.randn((64 << 20) // 4, device=device))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(4, 32, device=device)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    nbytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return model, opt, nbytes, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--idle-s", type=float, default=1.0, help="each idle window's length")
    parser.add_argument(
        "--workload",
        choices=("square", "tiny"),
        default=None,
        help="square on a GPU, tiny on a CPU",
    )
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    from checkpoint_io import _build

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    workload = args.workload or ("square" if device == "cuda" else "tiny")
    if workload == "square":
        model, opt, nbytes, step = _build(args.gb, device)
    else:
        model, opt, nbytes, step = _tiny(args.gb, device)
    staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    staging.random_(0, 255)
    loads = [name for name in args.loads.split(",") if name]
    directory = Path(args.dir or tempfile.mkdtemp(prefix="interference-"))
    directory.mkdir(parents=True, exist_ok=True)
    runner = _Loads(model, opt, staging, directory, nbytes)

    from accelkit.checkpoint import save
    from accelkit.checkpoint.write import background

    save(
        None,
        directory / "warm",
        {"model": model, "optimizer": opt},
        rng=False,
        latest=False,
        asynchronous=True,
    )  # the first save pins its staging; later ones are steady state
    background.wait()
    _steps_for(step, sync, 1.0)

    ratios: dict[str, list[float]] = {name: [] for name in loads}
    seconds: dict[str, list[float]] = {name: [] for name in loads}
    idle_ms: list[float] = []
    for repeat in range(args.repeats):
        order = loads[repeat % len(loads) :] + loads[: repeat % len(loads)]
        before = _steps_for(step, sync, args.idle_s)
        for name in order:
            busy, finish = runner.start(name)
            started = time.perf_counter()
            during = _steps_while(step, sync, busy)
            finish()
            took = time.perf_counter() - started
            after = _steps_for(step, sync, args.idle_s)
            idle = statistics.median(before + after)
            idle_ms.append(idle)
            ratio = statistics.median(during) / idle if during else float("nan")
            ratios[name].append(ratio)
            seconds[name].append(took)
            print(
                f"  repeat {repeat} {name:15s} {ratio:6.3f}x  ({len(during)} steps, "
                f"{took:.2f} s; idle step {idle:.2f} ms)",
                flush=True,
            )
            before = after

    print(
        f"\n{workload} step time under each load, against the idle windows beside it "
        f"({nbytes / 1e9:.2f} GB, {args.repeats} repeats, idle step "
        f"{statistics.median(idle_ms):.2f} ms on {device}):"
    )
    summary = {}
    for name in loads:
        rs = ratios[name]
        summary[name] = {
            "ratio": statistics.median(rs),
            "min": min(rs),
            "max": max(rs),
            "seconds": statistics.median(seconds[name]),
        }
        print(
            f"  {name:15s} {statistics.median(rs):6.3f}x [{min(rs):.3f}-{max(rs):.3f}]  "
            f"load {statistics.median(seconds[name]):.2f} s"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"bytes": nbytes, "loads": summary, "ratios": ratios}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
