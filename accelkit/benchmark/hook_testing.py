"""What a plugin's tests need to check its ``accelkit_estimate_memory`` hook by hand.

A bias-free ``Linear(1000, 1000)`` has exactly ``ONE_LINEAR_PARAMS`` parameters, so a test can
write every term as ``bytes per parameter x 1,000,000`` and compare it with what the hook
answers through the plugin manager, the way ``accelkit plan`` calls it. A hook must also answer
without importing its backend's library: :func:`peaks_in_fresh_interpreter` asks in a new
interpreter and reports what it imported. :func:`model_stats` (what the hook receives) is here
too, so a plugin's hook test imports its tools from this one module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from accelkit.benchmark.memory import model_stats
from accelkit.benchmark.workloads import Workload

__all__ = [
    "ONE_LINEAR",
    "ONE_LINEAR_PARAMS",
    "OneLinear",
    "estimate_through_hooks",
    "model_stats",
    "peaks_in_fresh_interpreter",
]

ONE_LINEAR_PARAMS = 1_000_000


class OneLinear(nn.Module):
    """Exactly 1,000,000 parameters; the loss is the mean square of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1000, 1000, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).square().mean()


ONE_LINEAR = Workload("one-linear", OneLinear, lambda b, g: (torch.randn(b, 1000, generator=g),))


def estimate_through_hooks(backend: str, stats: dict[str, Any], **options: Any) -> Any:
    """The registered plugins' answer for ``backend`` (one GPU, AdamW, the stats' precision,
    no backend options unless ``options`` says otherwise)."""
    from accelkit import registry
    from accelkit.benchmark.planning import _estimate

    host = registry.host()
    host.ensure_loaded()
    base = {
        "world_size": 1,
        "precision": stats["precision"],
        "optimizer": "adamw",
        "device_type": "cuda",
        "backend_options": {},
    }
    base.update(options)
    return _estimate(host, backend, stats, base)


def peaks_in_fresh_interpreter(
    backends: Sequence[str],
    libraries: Sequence[str],
    *,
    precision: str = "bf16-true",
    world_size: int = 2,
    python_path: Sequence[str] = (),
) -> tuple[dict[str, int], list[str]]:
    """Each backend's estimated peak for the ``mlp`` workload (batch 2, built on meta), asked in
    a new interpreter with every plugin loaded, and the modules of ``libraries`` (top-level
    names) imported there meanwhile: a hook that imports its library shows up in the second."""
    env = {k: v for k, v in os.environ.items() if k != "ACCELKIT_DISABLE_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([*python_path, *sys.path])
    request = dict(
        backends=list(backends), libraries=list(libraries), precision=precision, world=world_size
    )
    done = subprocess.run(
        [sys.executable, "-m", __name__, json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the child interpreter failed:\n{done.stderr[-3000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return answer["peaks"], answer["imported"]


def _child(request: dict[str, Any]) -> dict[str, Any]:
    from accelkit.benchmark.memory import model_stats
    from accelkit.benchmark.workloads import get_workload

    with torch.device("meta"):
        workload = get_workload("mlp")
    stats = model_stats(workload, 2, request["precision"])
    peaks = {}
    for name in request["backends"]:
        answer = estimate_through_hooks(name, stats, world_size=request["world"])
        peaks[name] = None if answer is None else answer["peak"]
    libraries = set(request["libraries"])
    imported = sorted(m for m in sys.modules if m.split(".")[0] in libraries)
    return {"peaks": peaks, "imported": imported}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
