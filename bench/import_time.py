"""What ``import accelkit`` adds to ``import torch``, measured in fresh interpreters.

Each repeat starts a new Python process that imports torch, then times ``import accelkit`` on
top of it (so torch's own import, which accelkit cannot change, is not counted), then times the
first ``accelkit.get("cpu")`` (entry points are read there, not at import). The report gives the
median and the spread over repeats, and which backend libraries ended up imported (none may be).

Examples::

    python bench/import_time.py
    python bench/import_time.py --repeats 11 --detail --out import.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

#: libraries that ``import accelkit`` must never import (plugins import them when used)
BACKEND_LIBRARIES = ("deepspeed", "colossalai", "apex", "fairscale", "mmengine")

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import accelkit
t2 = time.perf_counter()
after_import = sorted(m for m in %(libs)r if m in sys.modules)
accelkit.get("cpu")
t3 = time.perf_counter()
print(json.dumps({
    "torch_s": t1 - t0,
    "accelkit_s": t2 - t1,
    "first_get_s": t3 - t2,
    "backend_libraries_after_import": after_import,
    "backend_libraries_after_get": sorted(m for m in %(libs)r if m in sys.modules),
}))
"""


def probe_once(env: dict[str, str]) -> dict:
    code = PROBE % {"libs": BACKEND_LIBRARIES}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"probe failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def slowest_imports(env: dict[str, str], top: int) -> list[tuple[float, str]]:
    """Modules imported by ``import accelkit`` (torch already imported), by self time (ms)."""
    code = "import torch, sys; sys.stderr.write('--accelkit--\\n'); import accelkit"
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = out.stderr.split("--accelkit--\n", 1)[-1].splitlines()
    rows = []
    for line in lines:
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, name = (part.strip() for part in line.split("|"))
        self_us = self_us.replace("import time:", "").strip()
        rows.append((int(self_us) / 1e3, int(cumulative_us) / 1e3, name))
    rows.sort(reverse=True)
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--detail", action="store_true", help="list the slowest modules (-X importtime)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument(
        "--goal", type=float, default=1.0, help="seconds; exit 1 if the median exceeds it"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    runs = [probe_once(env) for _ in range(args.repeats)]
    summary = {}
    for key in ("torch_s", "accelkit_s", "first_get_s"):
        values = [r[key] for r in runs]
        summary[key] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "all": values,
        }
    leaked = sorted({m for r in runs for m in r["backend_libraries_after_import"]})
    leaked_get = sorted({m for r in runs for m in r["backend_libraries_after_get"]})

    import torch

    import accelkit

    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelkit": accelkit.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(
        f"python {meta['python']}, torch {meta['torch']}, accelkit {meta['accelkit']}, "
        f"{meta['cpus']} CPUs, {args.repeats} fresh processes"
    )
    print()
    print("| what | median s | min s | max s |")
    print("|---|---|---|---|")
    labels = {
        "torch_s": "import torch (for scale)",
        "accelkit_s": "import accelkit, after torch",
        "first_get_s": 'first accelkit.get("cpu") (reads entry points)',
    }
    for key, label in labels.items():
        s = summary[key]
        print(f"| {label} | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} |")
    print()
    print(f"backend libraries imported by `import accelkit`: {leaked or 'none'}")
    print(f"backend libraries imported after the first get('cpu'): {leaked_get or 'none'}")
    detail = []
    if args.detail:
        detail = slowest_imports(env, args.top)
        print()
        print("slowest modules under `import accelkit` (self ms, cumulative ms):")
        for self_ms, cumulative_ms, name in detail:
            print(f"  {self_ms:8.1f} {cumulative_ms:8.1f}  {name}")
    ok = summary["accelkit_s"]["median"] < args.goal and not leaked
    print()
    print(
        f"goal: import accelkit adds < {args.goal:.1f} s and imports no backend library: "
        + ("met" if ok else "NOT met")
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "meta": meta,
                    "summary": summary,
                    "backend_libraries_after_import": leaked,
                    "backend_libraries_after_get": leaked_get,
                    "slowest": detail,
                    "goal_met": ok,
                },
                f,
                indent=2,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
