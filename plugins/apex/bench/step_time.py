"""Step time of the GPT-2-small-shaped workload with Apex's FusedAdam against torch's own fused
AdamW, in one process on one GPU. A benchmark, not a test: it prints (and writes JSON), and
asserts only that the real NVIDIA Apex with its compiled ``amp_C`` is the one imported.

    python3 plugins/apex/bench/step_time.py [--precision bf16-mixed] [--repeats 7] [--out x.json]

Variants, all on the same initial weights (one model, deep-copied) and the same fixed batch:

- ``torch``: raw loop, ``torch.optim.AdamW(fused=True)``, autocast (the baseline);
- ``apex-raw``: raw loop, ``apex.optimizers.FusedAdam(adam_w_mode=True)`` (no accelkit);
- ``accelkit-cuda``: ``accelkit.get("cuda")`` with torch's fused AdamW (accelkit's own cost);
- ``accelkit-apex``: ``accelkit.get("apex")`` (the AdamW swapped for FusedAdam);
- ``accelkit-apex-norms``: the same with ``fused_norm=True`` (FusedLayerNorm).

Each repeat runs every variant (the order rotates between repeats): ``--warmup`` steps, then
``--steps`` timed steps between two ``torch.cuda.synchronize()``. Reported per variant: the
median ms/step over repeats, and the median over repeats of the per-repeat ratio to ``torch``
with its spread (min, max). Only ratios from one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from accelkit.benchmark.workloads import call_model, get_workload

VARIANTS = ("torch", "apex-raw", "accelkit-cuda", "accelkit-apex", "accelkit-apex-norms")


def check_real_apex():
    import amp_C
    import apex
    from apex.multi_tensor_apply import multi_tensor_applier

    fake = Path(__file__).resolve().parents[1] / "tests" / "fake_apex"
    assert not getattr(apex, "ACCELKIT_FAKE", False) and fake not in Path(apex.__file__).parents
    assert Path(amp_C.__file__).suffix == ".so" and multi_tensor_applier.available
    return apex


def raw_runner(model, make_opt, batch, dtype):
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None

    def step():
        with torch.autocast("cuda", dtype=dtype):
            loss = call_model(model, batch)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()

    return step


def accel_runner(name, model, batch, precision, **options):
    import accelkit

    accel = accelkit.get(name, precision=precision, **options)
    # torch's fused kernel on 'cuda'; on 'apex' the AdamW is swapped (a fused= flag is refused)
    fused = True if name == "cuda" else None
    model, _ = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused))

    def step():
        loss = call_model(model, batch)
        accel.backward(loss)
        accel.step()

    return step, accel


def time_steps(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "16-mixed"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    apex = check_real_apex()
    variants = args.variants.split(",")
    dtype = torch.bfloat16 if args.precision == "bf16-mixed" else torch.float16

    torch.manual_seed(0)
    workload = get_workload("gpt2-small", seq=args.seq)
    base = workload.build()
    batch = tuple(
        t.cuda() for t in workload.make_batch(args.batch, torch.Generator().manual_seed(0))
    )
    steps = {}
    for name in variants:
        model = copy.deepcopy(base).cuda()
        if name == "torch":
            steps[name] = raw_runner(
                model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), batch, dtype
            )
        elif name == "apex-raw":
            steps[name] = raw_runner(
                model,
                lambda ps: apex.optimizers.FusedAdam(
                    ps, lr=1e-4, adam_w_mode=True, weight_decay=0.01
                ),
                batch,
                dtype,
            )
        elif name == "accelkit-cuda":
            steps[name] = accel_runner("cuda", model, batch, args.precision)[0]
        elif name == "accelkit-apex":
            steps[name] = accel_runner("apex", model, batch, args.precision)[0]
        elif name == "accelkit-apex-norms":
            steps[name] = accel_runner("apex", model, batch, args.precision, fused_norm=True)[0]
        else:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    del base

    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
        for name in order:
            times[name].append(time_steps(steps[name], args.warmup, args.steps))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f}" for n in variants))

    rows = {}
    for name in variants:
        ratios = [t / b for t, b in zip(times[name], times["torch"])] if "torch" in times else []
        rows[name] = {
            "ms_per_step": statistics.median(times[name]),
            "ratio_to_torch": statistics.median(ratios) if ratios else None,
            "ratio_spread": [min(ratios), max(ratios)] if ratios else None,
            "repeats_ms": times[name],
        }
    print(
        f"\nGPT-2-small shape, batch {args.batch}, seq {args.seq}, {args.precision}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.repeats} repeats x "
        f"{args.steps} steps"
    )
    print(f"{'variant':<22}{'ms/step':>10}  ratio to torch fused AdamW, median [min, max]")
    for name, row in rows.items():
        ratio = row["ratio_to_torch"]
        spread = row["ratio_spread"]
        text = f"{ratio:.3f} [{spread[0]:.3f}, {spread[1]:.3f}]" if ratio is not None else "-"
        print(f"{name:<22}{row['ms_per_step']:>10.2f}  {text}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "workload": "gpt2-small",
                    "batch": args.batch,
                    "seq": args.seq,
                    "precision": args.precision,
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "apex": apex.__file__,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "repeats": args.repeats,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
