"""The DeepSpeed backend under MMEngine's Runner (issue 45): what it refuses, and the notes it
logs only where the user can act on them.

Each case runs in a process of its own (DeepSpeed never enters pytest's process, see
conftest.py); the project is a GAN-shaped MMEngine model with a several-optimizer constructor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mmengine")
pytest.importorskip("deepspeed")

PROJECT = textwrap.dedent(
    """
    import torch
    from torch import nn
    from mmengine.model import BaseModel
    from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapperDict
    from mmengine.registry import MODELS, OPTIM_WRAPPER_CONSTRUCTORS


    @OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
    class PerSubmodule:
        def __init__(self, optim_wrapper_cfg, paramwise_cfg=None):
            self.cfgs = optim_wrapper_cfg

        def __call__(self, model):
            return OptimWrapperDict(**{
                name: DefaultOptimWrapperConstructor(dict(cfg))(getattr(model, name))
                for name, cfg in self.cfgs.items()})


    @MODELS.register_module(force=True)
    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.generator = nn.Linear(4, 4)
            self.discriminator = nn.Linear(4, 1)

        def forward(self, x, mode="tensor"):
            out = self.discriminator(self.generator(x))
            return {"loss": out.square().mean()} if mode == "loss" else out


    def cfg(work_dir, optim_wrapper, batch_size=3):
        return dict(
            model=dict(type="Net"),
            work_dir=work_dir,
            train_dataloader=dict(dataset=[dict(x=torch.ones(4))] * 6, batch_size=batch_size,
                                  sampler=dict(type="DefaultSampler"),
                                  collate_fn=dict(type="default_collate")),
            train_cfg=dict(by_epoch=True, max_epochs=1),
            optim_wrapper=optim_wrapper,
            default_hooks=dict(checkpoint=None),
            log_level="WARNING",
            runner_type="AccelkitRunner",
            accelkit=dict(backend="deepspeed", config=dict(zero_stage=2)),
        )

    SEVERAL = dict(constructor="PerSubmodule",
                   generator=dict(optimizer=dict(type="SGD", lr=0.1)),
                   discriminator=dict(optimizer=dict(type="SGD", lr=0.1)))
    ONE = dict(optimizer=dict(type="SGD", lr=0.1))
    """
)


def _run(tmp_path: Path, script: str) -> dict:
    (tmp_path / "ds_project.py").write_text(PROJECT)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.mark.slow  # a fresh process importing MMEngine, DeepSpeed and ColossalAI: 15-65 s
def test_several_optimizers_are_refused_before_the_engine_is_built(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        """
        import json
        import torch.distributed as dist
        import ds_project
        import accelkit.integrations.mmengine
        from mmengine.registry import RUNNERS
        from accelkit.errors import UnsupportedError
        try:
            RUNNERS.build(ds_project.cfg("several", ds_project.SEVERAL))
            refused = None
        except UnsupportedError as err:
            refused = str(err)
        print(json.dumps(dict(refused=refused, group=dist.is_initialized())))
        """,
    )
    refused = result["refused"]
    assert refused is not None
    assert "backend 'deepspeed' cannot train several optimizers over one model" in refused
    assert "OptimWrapperDict: generator, discriminator" in refused
    can = refused.split("Backends that can: ")[1].split(";")[0].split(", ")
    assert {"cpu", "ddp", "fsdp"} <= set(can) and not any("deepspeed" in n for n in can), can
    assert not any(n.startswith("colossalai") for n in can), can
    assert result["group"] is False  # refused before the backend was built


@pytest.mark.slow  # trains DeepSpeed engines in a fresh process: 20-40 s
def test_micro_batch_note_only_where_the_user_sets_up_the_loader(tmp_path: Path) -> None:
    """Under the Runner, which builds the dataloader itself, DeepSpeed takes the loader's batch
    size and logs no note the user cannot act on; a loop of one's own that sets up the model
    before the loader still gets it."""
    result = _run(
        tmp_path,
        """
        import json, logging, io
        import torch
        import ds_project
        import accelkit, accelkit.integrations.mmengine
        from mmengine.registry import RUNNERS

        captured = io.StringIO()
        logging.getLogger("accelkit").addHandler(logging.StreamHandler(captured))
        runner = RUNNERS.build(ds_project.cfg("one", ds_project.ONE, batch_size=3))
        runner.train()
        under_runner = captured.getvalue()
        micro = runner.model.wrapped.train_micro_batch_size_per_gpu()
        captured.truncate(0)
        accel = accelkit.get("deepspeed", config=dict(zero_stage=2))
        model = torch.nn.Linear(4, 1)
        accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        own_loop = captured.getvalue()
        print(json.dumps(dict(under_runner=under_runner, micro=micro, own_loop=own_loop)))
        """,
    )
    assert result["micro"] == 3  # the Runner's loader's batch size, not DeepSpeed's default 1
    assert "train_micro_batch_size_per_gpu" not in result["under_runner"]
    assert "set up the dataloader before the model" in result["own_loop"]  # the negative twin
