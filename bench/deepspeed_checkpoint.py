"""accelkit's portable checkpoint against DeepSpeed's own ``save_checkpoint``/``load_checkpoint``,
on the same ZeRO engine in the same process (issue 6).

The engine is accelkit's ``deepspeed`` backend (default ZeRO-3, ``bf16-true``: bf16 weights, fp32
masters, AdamW state) on the GPT-2-small-shaped model of bench/deepspeed_gpt.py, trained
``--train-steps`` steps so the optimizer state exists. Each round saves and loads the same state
both ways, in alternating order:

* accelkit: ``accel.save(dir, {"model", "optimizer"})`` (every rank writes its fragments with
  SHA-256 checksums, fsyncs, rank 0 commits the manifest) and ``accel.load`` (every checksum
  verified);
* DeepSpeed: ``engine.save_checkpoint(dir)`` (torch.save pickles, no fsync) and
  ``engine.load_checkpoint(dir)``; and the same save followed by an fsync of its files, which is
  what accelkit's includes.

The comparison is wall time for the same state: per round, accelkit's seconds / DeepSpeed's
seconds (a barrier at each end of each timing), median [min, max] over the rounds; above 1 is
slower. The two formats write different bytes for that state (accelkit's holds the fp32
master, both Adam moments under portable names and the bf16 weights, plus checksums), so the
bytes each writes are reported beside the ratios, and GB/s = each side's own bytes / its own
wall time is only a disk-throughput figure, not a speed comparison. The loads read files just
written, so mostly from the page cache (dropping it needs root); the save figures include the
disk. After accelkit's load the next step's loss must equal the one after DeepSpeed's load (a
check, printed).

    python bench/deepspeed_checkpoint.py --out result.json            # 1 GPU, about a minute
    torchrun --nproc-per-node 2 bench/deepspeed_checkpoint.py --out r.json
    python bench/deepspeed_checkpoint.py --device cpu --layers 2 --width 64 --seq 32 \\
        --vocab 512 --heads 4 --batch 2 --repeats 1 --out /tmp/smoke.json
    python bench/deepspeed_checkpoint.py --summarize bench/results/<run>/ds-checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deepspeed_gpt as workload  # the model and the process group setup


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def _timed(fn: Any, device: torch.device) -> float:
    workload.sync(device)
    dist.barrier()
    start = time.perf_counter()
    fn()
    workload.sync(device)
    dist.barrier()
    return time.perf_counter() - start


def _fresh(path: Path) -> None:
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier()


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    import accelkit

    accel = accelkit.get(
        "deepspeed",
        zero_stage=args.stage,
        precision=args.precision,
        train_micro_batch_size_per_gpu=args.batch,
    )
    model = workload.new_model(args)
    model, opt = accel.setup(model, workload.optimizer(args, model))
    engine = accel.backend.engine
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)

    def train_step() -> float:
        loss = model(x, y)
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(loss)

    for _ in range(args.train_steps):
        train_step()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ds-ckpt-bench-"))
    if dist.get_world_size() > 1:  # every rank writes into rank 0's directory
        shared: list[Any] = [str(root)]
        dist.broadcast_object_list(shared, src=0)
        root = Path(shared[0])
    ours, theirs = root / "accelkit", root / "deepspeed"
    state = {"model": model, "optimizer": opt}
    rounds: list[dict[str, float]] = []
    sizes: dict[str, int] = {}
    for repeat in range(args.repeats):
        row: dict[str, float] = {}
        order = ["accelkit", "deepspeed"] if repeat % 2 == 0 else ["deepspeed", "accelkit"]
        for side in order:
            if side == "accelkit":
                _fresh(ours)
                row["accelkit_save_s"] = _timed(lambda: accel.save(ours, state), device)
                row["accelkit_load_s"] = _timed(lambda: accel.load(ours, state), device)
            else:
                _fresh(theirs)
                row["deepspeed_save_s"] = _timed(
                    lambda: engine.save_checkpoint(str(theirs), tag="bench"), device
                )
                row["deepspeed_fsync_s"] = _timed(lambda: _fsync_tree(theirs), device)
                row["deepspeed_load_s"] = _timed(
                    lambda: engine.load_checkpoint(str(theirs), tag="bench"), device
                )
        rounds.append(row)
        print(
            f"round {repeat}: "
            + "  ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in row.items()),
            flush=True,
        )
    sizes = {"accelkit": _size(ours), "deepspeed": _size(theirs / "bench")}
    # the check: the step after each load gives the same loss
    engine.load_checkpoint(str(theirs), tag="bench")
    loss_after_deepspeed = train_step()
    accel.load(ours, state)
    loss_after_accelkit = train_step()
    if dist.get_rank() == 0 and not args.keep:
        shutil.rmtree(root, ignore_errors=True)

    result = {
        "stage": args.stage,
        "precision": args.precision,
        "world_size": dist.get_world_size(),
        "bytes": sizes,
        "rounds": rounds,
        "loss_after_load": {"accelkit": loss_after_accelkit, "deepspeed": loss_after_deepspeed},
        "same_loss_after_load": loss_after_accelkit == loss_after_deepspeed,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    result.update(summarize(result))
    return result


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The comparison, from the per-round seconds and the bytes alone (so a committed result can
    be re-read): wall-time ratios accelkit / DeepSpeed for the same state, each side's seconds,
    and each side's GB/s of its own bytes."""
    rounds, sizes = result["rounds"], result["bytes"]

    def seconds(row: dict[str, float], key: str) -> float:
        if key == "deepspeed_durable_save_s":  # DeepSpeed's save plus the fsync accelkit's has
            return row["deepspeed_save_s"] + row["deepspeed_fsync_s"]
        return row[key]

    def ratio(ours: str, theirs: str) -> dict[str, float]:
        return _spread([seconds(r, ours) / seconds(r, theirs) for r in rounds])

    def rate(side: str, key: str) -> dict[str, float]:
        return _spread([sizes[side] / 1e9 / seconds(r, key) for r in rounds])

    keys = {
        "accelkit_save": ("accelkit", "accelkit_save_s"),
        "accelkit_load": ("accelkit", "accelkit_load_s"),
        "deepspeed_save_no_fsync": ("deepspeed", "deepspeed_save_s"),
        "deepspeed_save_fsync": ("deepspeed", "deepspeed_durable_save_s"),
        "deepspeed_load": ("deepspeed", "deepspeed_load_s"),
    }
    return {
        "wall_time_ratio": {  # accelkit seconds / DeepSpeed seconds, per round; > 1: slower
            "save_vs_durable_save": ratio("accelkit_save_s", "deepspeed_durable_save_s"),
            "save_vs_save_no_fsync": ratio("accelkit_save_s", "deepspeed_save_s"),
            "load": ratio("accelkit_load_s", "deepspeed_load_s"),
        },
        "seconds": {
            name: _spread([seconds(r, key) for r in rounds]) for name, (_, key) in keys.items()
        },
        "bytes_ratio": sizes["accelkit"] / sizes["deepspeed"],
        "gb_per_s_own_bytes": {name: rate(side, key) for name, (side, key) in keys.items()},
    }


def report(result: dict[str, Any]) -> None:
    """Print the comparison: wall-time ratios first, then bytes, seconds and GB/s."""
    print(
        f"\n{result['device']}, ZeRO-{result['stage']} {result['precision']}, "
        f"world {result['world_size']}, {len(result['rounds'])} rounds"
    )
    print("wall time for the same state, accelkit / DeepSpeed per round (> 1: accelkit slower):")
    for key, value in result["wall_time_ratio"].items():
        print(f"  {key:24s} {value['median']:.3f} [{value['min']:.3f}, {value['max']:.3f}]")
    print(
        f"bytes written: accelkit {result['bytes']['accelkit'] / 1e9:.3f} GB, "
        f"DeepSpeed {result['bytes']['deepspeed'] / 1e9:.3f} GB "
        f"(accelkit {result['bytes_ratio']:.3f}x)"
    )
    print("seconds, median [min, max]; GB/s of each side's own bytes:")
    for key, value in result["seconds"].items():
        rate = result["gb_per_s_own_bytes"][key]
        print(
            f"  {key:24s} {value['median']:6.2f} s [{value['min']:.2f}, {value['max']:.2f}]"
            f"  {rate['median']:5.2f} GB/s"
        )
    print(f"same loss after either load: {result['same_loss_after_load']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--precision", default="bf16-true")
    p.add_argument("--repeats", type=int, default=3, help="interleaved save+load rounds")
    p.add_argument("--train-steps", type=int, default=2, help="steps before the first save")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--out", default="-")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--no-fused", dest="fused", action="store_false", help="unfused AdamW")
    p.add_argument("--summarize", metavar="JSON", help="print the comparison of a saved result")
    args = p.parse_args()
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        report({**saved, **summarize(saved)})
        return 0
    if args.device == "cpu" or not torch.cuda.is_available():
        args.fused = False
    device = workload.join_group(args.device)
    result = run(args, device)
    if dist.get_rank() == 0:
        report(result)
        text = json.dumps(result, indent=1)
        if args.out == "-":
            print(text)
        else:
            Path(args.out).write_text(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
