"""Checkpoint save/load throughput and memory: accelkit's portable format against torch.save /
torch.load and torch.distributed.checkpoint (DCP), on the same state, in one run.

The state is a stack of bias-free square Linear layers plus Adam's ``exp_avg`` and
``exp_avg_sq`` (filled by one real step): ``--gb`` GB in total (params + optimizer state).
Every repeat runs in a fresh subprocess that builds the state once, then, for each method in
turn (the order rotates every repeat), times

- **save** of model + optimizer state to ``--dir`` (each method's own layout; accelkit and DCP
  fsync their files by default, so the torch.save row fsyncs its file too, for the same
  durability; a ``torch.save (no fsync)`` figure is reported alongside);
- **load** of that checkpoint back into the same live objects, in place (what a resume does),
  checked for correctness against values recorded before the state was scrambled.

Reported: GB/s as the median over
repeats with the min-max spread; peak extra memory during the operation as (a) the process's
peak RSS above its RSS before the call (``VmHWM`` after resetting it through
``/proc/self/clear_refs``; counts file pages a method maps), and (b) the peak of anonymous
memory (``RssAnon``) sampled every 2 ms. Loads read from a warm page cache (dropping it needs
root); every method gets the same.

    python bench/checkpoint_io.py                        # 1 GB, 3 repeats, state on CUDA if any
    python bench/checkpoint_io.py --gb 2 --repeats 5 --dir /local/nvme --out ckpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

METHODS = ("accelkit", "torch", "dcp")  # also: accelkit-noverify (load without checksums)
WIDTH = 2048


# ---- the worker (one measurement, in its own process) -----------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Peak RSS (VmHWM, reset first) and sampled peak RssAnon above the level at start."""

    def __enter__(self) -> _Peak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.rss0 = _status("VmRSS")
        self.anon0 = _status("RssAnon")
        self.anon_peak = self.anon0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.anon_peak = max(self.anon_peak, _status("RssAnon"))
            time.sleep(0.002)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _status("RssAnon"))
        self.rss_extra = _status("VmHWM") - self.rss0 if self.hwm_reset else None
        self.anon_extra = self.anon_peak - self.anon0


def _build(gb: float, device: str):
    import torch

    per_layer = WIDTH * WIDTH
    layers = max(1, round(gb * 1e9 / 12 / per_layer))  # 4 bytes x (param + exp_avg + exp_avg_sq)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(
            *(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))
        )
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
            p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    opt.step()
    for p in model.parameters():
        p.grad = None
    nbytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    return model, opt, nbytes


def _fingerprint(model, opt) -> list[float]:
    out = []
    for p in model.parameters():
        state = opt.state[p]
        out += [float(p.view(-1)[7]), float(state["exp_avg"].view(-1)[-3]), float(state["step"])]
    return out


def _scramble(model, opt) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            for value in opt.state[p].values():
                value.zero_()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _save(method: str, model, opt, path: Path, *, fsync: bool = True) -> None:
    import torch

    if method.startswith("accelkit"):
        from accelkit.checkpoint import save

        save(None, path, {"model": model, "optimizer": opt}, rng=False, latest=False)
    elif method == "torch":
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path))
    else:
        raise ValueError(method)


def _load(method: str, model, opt, path: Path, device: str) -> None:
    import torch

    if method.startswith("accelkit"):
        from accelkit.checkpoint import load

        verify = method != "accelkit-noverify"
        load(None, path, {"model": model, "optimizer": opt}, rng=False, verify=verify)
    elif method == "torch":
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    else:
        raise ValueError(method)


def measure(method: str, model, opt, nbytes: int, expected: list[float], args) -> dict[str, Any]:
    """Save, scramble, load back: one method on the live state."""
    path = Path(args.dir) / f"{method}-ckpt"
    result: dict[str, Any] = {"method": method, "bytes": nbytes}
    if method == "torch":  # the same write without durability, for reference
        started = time.perf_counter()
        _save("torch", model, opt, path, fsync=False)
        result["save_nofsync_s"] = time.perf_counter() - started
        os.remove(path)
    _sync(args.device)
    with _Peak() as peak:
        started = time.perf_counter()
        _save(method, model, opt, path)
        _sync(args.device)
        result["save_s"] = time.perf_counter() - started
    result.update(save_rss_extra=peak.rss_extra, save_anon_extra=peak.anon_extra)
    _scramble(model, opt)
    _sync(args.device)
    with _Peak() as peak:
        started = time.perf_counter()
        _load(method, model, opt, path, args.device)
        _sync(args.device)
        result["load_s"] = time.perf_counter() - started
    result.update(load_rss_extra=peak.rss_extra, load_anon_extra=peak.anon_extra)
    result["correct"] = _fingerprint(model, opt) == expected
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    return result


def worker(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One repeat: build the state once, then measure each method in the given order."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model, opt, nbytes = _build(args.gb, args.device)
    expected = _fingerprint(model, opt)
    return [measure(m, model, opt, nbytes, expected, args) for m in args.worker.split(",")]


# ---- the driver -----------------------------------------------------------------------------------------
def _summary(runs: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    rates = [r["bytes"] / 1e9 / r[key] for r in runs]
    return statistics.median(rates), min(rates), max(rates)


def _mb(values: list[Any]) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values) / 2**20:8.0f}" if values else "     n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state size: params + Adam state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=None, help="write all runs and the summary as JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    methods = [m for m in args.methods.split(",") if m]
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="accelkit-ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    started = time.time()
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
        workdir = base / f"r{repeat}"
        workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--worker", ",".join(order), "--gb", str(args.gb)]
        cmd += ["--dir", str(workdir), "--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        shutil.rmtree(workdir, ignore_errors=True)
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            raise SystemExit(f"repeat {repeat} failed")
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")][-1]
        for result in json.loads(line):
            method = result["method"]
            if not result["correct"]:
                raise SystemExit(f"{method}: the loaded state differs from the saved one")
            runs[method].append(result)
            print(
                f"repeat {repeat} {method:9s} save {result['save_s']:6.2f} s  "
                f"load {result['load_s']:6.2f} s",
                flush=True,
            )
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)

    import platform

    import torch

    size = runs[methods[0]][0]["bytes"] / 1e9
    print()
    print(
        f"state {size:.2f} GB (params + Adam exp_avg, exp_avg_sq; fp32) on {args.device}; "
        f"dir {base}; {args.repeats} interleaved repeats; torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs; {platform.node()}"
    )
    print("GB/s: median [min-max] over repeats. Extra memory (MB, median): peak RSS above the")
    print("start (incl. mapped file pages) / peak anonymous memory above the start.")
    header = (
        f"{'method':26s} {'save GB/s':>22s} {'load GB/s':>22s}  save MB rss/anon  load MB rss/anon"
    )
    print(header)
    summary: dict[str, Any] = {}
    for method in methods:
        rs = runs[method]
        save = _summary(rs, "save_s")
        load = _summary(rs, "load_s")
        summary[method] = {"save_gbps": save, "load_gbps": load}
        label = {
            "accelkit": "accelkit",
            "accelkit-noverify": "accelkit (load unverified)",
            "torch": "torch.save/load +fsync",
            "dcp": "DCP",
        }[method]
        print(
            f"{label:26s} {save[0]:8.2f} [{save[1]:5.2f}-{save[2]:5.2f}] "
            f"{load[0]:8.2f} [{load[1]:5.2f}-{load[2]:5.2f}]  "
            f"{_mb([r['save_rss_extra'] for r in rs])} {_mb([r['save_anon_extra'] for r in rs])}"
            f"  {_mb([r['load_rss_extra'] for r in rs])} {_mb([r['load_anon_extra'] for r in rs])}"
        )
        if method == "torch":
            nofsync = _summary(rs, "save_nofsync_s")
            summary["torch"]["save_nofsync_gbps"] = nofsync
            print(
                f"{'torch.save (no fsync)':26s} {nofsync[0]:8.2f} [{nofsync[1]:5.2f}-{nofsync[2]:5.2f}]"
            )
    print(f"total {time.time() - started:.0f} s")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
