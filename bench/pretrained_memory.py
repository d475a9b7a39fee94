"""Peak host memory of loading pretrained weights into ``fsdp`` on 2 ranks: accelkit's
``load_pretrained`` (each rank reads its own byte ranges) beside the naive path (each rank loads
the whole state dict, then loads it into the model before sharding).

    torchrun --nproc-per-node 2 bench/pretrained_memory.py --gb 1 --dir /tmp/pretrained
    (or: python bench/pretrained_memory.py --gb 1, which launches both ranks itself)

The model is a stack of Linear layers (``--gb`` of fp32 weights), saved once as sharded
safetensors (``model-0000x-of-0000y.safetensors`` + index). Each rank reports its peak RSS above
its own baseline (after ``accelkit.get``, before the model is built), sampled every 5 ms, over
building, setting up and loading: the rank's own shard of the model is part of both figures.
Both paths run in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    def __enter__(self) -> Peak:
        self.base = self.peak = _rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def build(width: int, layers: int):
    import torch

    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))


def write_source(directory: Path, width: int, layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    index = {"metadata": {}, "weight_map": {}}
    for i in range(layers):
        name = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        tensor = torch.randn(width, width, generator=torch.Generator().manual_seed(i))
        save_file({f"{i}.weight": tensor}, directory / name)
        index["weight_map"][f"{i}.weight"] = name
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def rank_main(args: argparse.Namespace) -> None:
    import torch

    import accelkit

    accel = accelkit.get("fsdp", device="cpu", wrap_policy=torch.nn.Linear)
    source = Path(args.dir) / "source"
    if args.method == "accelkit":  # built on meta, sharded at setup, each rank reads its ranges
        with Peak() as peak:
            with accel.init_module():
                model = build(args.width, args.layers)
            model = accel.setup(model)
            after_setup = _rss() - peak.base
            with Peak() as load_peak:
                accel.load_pretrained(model, source)
        extra = {"after_setup": after_setup, "load_only": load_peak.extra}
    else:  # naive: the full state dict on every rank, into the full model, then sharded
        extra = {}
        from safetensors.torch import load_file

        with Peak() as peak:
            model = build(args.width, args.layers)
            state = {}
            for file in sorted(source.glob("model-*.safetensors")):
                state.update(load_file(file))
            model.load_state_dict(state)
            del state
            model = accel.setup(model)
    print(
        json.dumps({"rank": accel.rank, "method": args.method, "peak_extra": peak.extra, **extra})
    )
    accel.end_training()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="fp32 weights of the model")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--dir", default="/tmp/accelkit-pretrained-bench")
    parser.add_argument("--method", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    layers = args.layers or max(1, round(args.gb * 1e9 / (args.width * args.width * 4)))
    if args.method:
        args.layers = layers
        rank_main(args)
        return 0
    nbytes = layers * args.width * args.width * 4
    source = Path(args.dir) / "source"
    if not (source / "model.safetensors.index.json").is_file():
        write_source(source, args.width, layers)
    results = {}
    for method in ("accelkit", "naive"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               __file__, "--method", method, "--layers", str(layers), "--width",
               str(args.width), "--dir", args.dir]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        ranks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        ranks.sort(key=lambda r: r["rank"])
        results[method] = [r["peak_extra"] for r in ranks]
        if method == "accelkit":
            parts = [(r["after_setup"], r["load_only"]) for r in ranks]
            print(
                "accelkit, per rank: RSS after setup (its shard), peak of the load itself: "
                + "; ".join(f"{a / 1e9:.2f} GB, {b / 1e9:.2f} GB" for a, b in parts)
            )
    print(
        f"model: {nbytes / 1e9:.2f} GB fp32 ({layers} x Linear({args.width}, {args.width})), 2 ranks, fsdp on CPU"
    )
    for method, peaks in results.items():
        shown = ", ".join(f"{p / 1e9:.2f} GB ({p / nbytes:.2f} x model)" for p in peaks)
        print(f"{method:9s} peak RSS above baseline per rank: {shown}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model_bytes": nbytes, "peak_extra": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
