"""MMEngine's Runner on a ``gs://`` out_dir (the accelkit-gcs store plugin) as on ``s3://``: the
integration asks the store layer whether a path is object storage (``is_remote``) and which
store holds it, never for the ``s3://`` prefix. Against a real GCS JSON-API server
(fake-gcs-server on loopback); two epochs of a tiny model (max_keep_ckpts=1), in process, to
stay in the default tier.
"""

from __future__ import annotations

import re
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("mmengine")
pytest.importorskip("accelkit_gcs")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: Any, y: Any = None, mode: str = "tensor") -> Any:
        out = self.fc(x)
        return {"loss": torch.nn.functional.cross_entropy(out, y)} if mode == "loss" else [out]


@pytest.fixture(scope="module")
def gcs():
    from accelkit.testing.gcs_server import LocalGCSServer

    with LocalGCSServer(tempfile.mkdtemp(), bucket="ckpts") as running:
        yield running


def _runner(work_dir: Path, checkpoint: dict | None, **kwargs: Any) -> Any:
    from mmengine.model import BaseModel

    from accelkit.integrations.mmengine import AccelkitRunner

    class Model(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Net()

        def forward(self, x: Any, y: Any = None, mode: str = "tensor") -> Any:
            return self.net(x, y, mode)

    torch.manual_seed(0)
    return AccelkitRunner(
        model=Model(),
        work_dir=str(work_dir),
        experiment_name=f"{work_dir.parent.name}-{work_dir.name}",
        train_dataloader=dict(
            dataset=[dict(x=torch.randn(4), y=i % 2) for i in range(4)],
            batch_size=2,
            sampler=dict(type="DefaultSampler", shuffle=False),
            collate_fn=dict(type="default_collate"),
        ),
        train_cfg=dict(by_epoch=True, max_epochs=2),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        default_hooks=dict(checkpoint=checkpoint),
        log_level="WARNING",
        accelkit=dict(backend="cpu"),
        **kwargs,
    )


def test_a_gs_out_dir_saves_and_resumes_as_s3_does(gcs, tmp_path: Path, monkeypatch) -> None:
    from accelkit_gcs.bucket import GCSBucket

    from accelkit.errors import ConfigError
    from accelkit.integrations.mmengine import checkpoint as ckpt

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)  # backend_args alone reach it
    prefix = f"mm-{uuid.uuid4().hex[:8]}"
    hook = dict(type="CheckpointHook", interval=1, out_dir=f"gs://ckpts/{prefix}", save_best=None)
    hook.update(backend_args={"endpoint": gcs.endpoint}, max_keep_ckpts=1)
    trained = _runner(tmp_path / "run", hook)
    trained.train()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)  # load_from: the defaults
    url = f"gs://ckpts/{prefix}/run/epoch_2.pth"
    keys = sorted(o.key for o in GCSBucket("ckpts").list(f"{prefix}/"))
    names = [re.sub(r"\.[0-9a-f]{12}\.", ".<save>.", k) for k in keys]
    assert names == [
        f"{prefix}/run/epoch_2.pth/accelkit.json",
        f"{prefix}/run/epoch_2.pth/extra.<save>.json",
        f"{prefix}/run/epoch_2.pth/rank-00000.<save>.safetensors",
        f"{prefix}/run/latest",
    ], keys  # the store's objects and its latest; epoch_1 rotated out; no marker file
    assert (tmp_path / "run" / "last_checkpoint").read_text() == url
    assert ckpt.is_portable(url)  # asked of the gs store, not of the local disk

    resumed = _runner(tmp_path / "resumed", None, load_from=url, resume=True)
    resumed.train()  # epoch 2 of 2 is done: it only resumes
    want, got = trained.model.state_dict(), resumed.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    # the twins: a checkpoint whose manifest is gone is not one; MMEngine's .pth cannot go to gs
    GCSBucket("ckpts").delete([f"{prefix}/run/epoch_2.pth/accelkit.json"])
    assert not ckpt.is_portable(url)
    pth = dict(hook, save_format="pth")
    with pytest.raises(ConfigError, match=r"save_format='pth'.*gs://ckpts.*object storage"):
        _runner(tmp_path / "pth", pth).train()
