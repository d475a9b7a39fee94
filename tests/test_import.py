"""``import accelkit`` and the torch-native backends import no backend library (issue 2, "Also").

Each check runs in a fresh interpreter whose PYTHONPATH starts with stand-in packages named
deepspeed, colossalai, apex, fairscale and mmengine: whether or not the real libraries are
installed here, any import of one of those names lands in ``sys.modules`` and is seen, so the
test can fail on any machine. Installed accelkit plugins (accelkit-deepspeed, ...) are loaded
as usual: their registration must stay cheap too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ["deepspeed", "colossalai", "apex", "fairscale", "mmengine"]

REPORT = """
import json, sys
print("RESULT" + json.dumps(sorted(m for m in {heavy} if m in sys.modules)))
"""


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("heavy")
    for name in HEAVY:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text("__version__ = '0.0.0+stand-in'\n")
    return root


def heavy_modules_after(code: str, stand_ins: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stand_ins), os.getcwd()])}
    env.pop("ACCELKIT_DISABLE_PLUGINS", None)
    script = code + REPORT.format(heavy=HEAVY)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_stand_ins_are_seen_when_imported(stand_ins):
    """The probe works: importing a stand-in shows up (so an empty list below means something)."""
    assert heavy_modules_after("import deepspeed, mmengine\n", stand_ins) == [
        "deepspeed",
        "mmengine",
    ]


def test_import_accelkit_imports_no_backend_library(stand_ins):
    assert heavy_modules_after("import accelkit\n", stand_ins) == []


def test_cpu_training_step_imports_no_backend_library(stand_ins):
    code = """
import torch
import accelkit

accel = accelkit.get("cpu", precision="bf16-mixed", accumulation_steps=2, max_grad_norm=1.0)
model = torch.nn.Linear(4, 1)
model, opt = accel.setup(model, torch.optim.AdamW(model.parameters()))
loader = accel.setup_dataloader(
    torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
)
for (x,) in loader:
    with accel.accumulate(model):
        accel.backward(model(x).pow(2).mean())
        accel.step()
accelkit.describe("ddp")
"""
    assert heavy_modules_after(code, stand_ins) == []


def test_plugin_discovery_and_env_report_import_no_backend_library(stand_ins):
    """Loading every installed plugin and asking for versions reads metadata, not libraries."""
    code = """
from accelkit import registry

host = registry.host()
host.ensure_loaded()
host.env_report()
"""
    assert heavy_modules_after(code, stand_ins) == []
