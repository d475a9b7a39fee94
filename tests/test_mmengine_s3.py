"""MMEngine's CheckpointHook saving to ``s3://`` through the adapter, and resuming from there
(issue 36), against a real S3 server (tests/conftest.py).

The project is test_mmengine_checkpoint's tutorial. One run trains 3 epochs with checkpoints on
a local disk; another stops after epoch 2 with ``out_dir="s3://..."`` and ``backend_args`` (the
process's own AWS keys are wrong, so only ``backend_args`` can reach the store) and
``max_keep_ckpts=1``; a third resumes from the S3 checkpoint (``resume=True``,
``load_from="s3://..."``) and must end with the uninterrupted run's weights and losses.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mmengine")

from test_mmengine_checkpoint import TUTORIAL_PROJECT, _record, _run

S3_DRIVER = textwrap.dedent(
    """
    import json, sys
    from mm_tutorial import tutorial_cfg
    from accelkit.integrations.mmengine import AccelkitRunner

    for spec in json.loads(sys.argv[1]):
        cfg = tutorial_cfg(spec["work_dir"], spec["record"], **spec["kw"])
        cfg["default_hooks"]["checkpoint"].update(spec.get("checkpoint", {}))
        AccelkitRunner(**cfg, accelkit=dict(backend="cpu")).train()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three training runs in subprocesses; a loaded 2-core box is slow
def test_checkpoint_hook_saves_to_s3_and_resume_continues_exactly(s3, tmp_path: Path) -> None:
    import os

    root = tmp_path
    (root / "mm_tutorial.py").write_text(TUTORIAL_PROJECT)
    (root / "s3_driver.py").write_text(S3_DRIVER)
    _run(root, "s3_driver.py", [dict(name="whole", work_dir="whole")])

    backend_args = {
        "backend": "accelkit_s3",
        "endpoint_url": os.environ["AWS_ENDPOINT_URL"],
        "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
    }
    hook = {"out_dir": s3.url("mm"), "backend_args": backend_args, "max_keep_ckpts": 1}
    hook["save_best"] = None  # one series, so max_keep_ckpts is what the listing shows
    stop = dict(name="stop", work_dir="stop", kw=dict(stop_after_epoch=2), checkpoint=hook)
    _run(root, "s3_driver.py", [stop], env={"AWS_SECRET_ACCESS_KEY": "wrong"})
    assert s3.keys("mm/stop/epoch_2.pth") == [
        "mm/stop/epoch_2.pth/accelkit.json",
        "mm/stop/epoch_2.pth/extra.json",
        "mm/stop/epoch_2.pth/rank-00000.safetensors",
    ]
    assert not s3.keys("mm/stop/epoch_1.pth"), "max_keep_ckpts=1 removed the older one"
    last = (root / "stop" / "last_checkpoint").read_text()
    assert last == s3.url("mm/stop/epoch_2.pth")

    resumed = dict(
        name="resumed", work_dir="resumed", kw=dict(resume=True, load_from=last), checkpoint=hook
    )
    _run(root, "s3_driver.py", [resumed])
    whole, part = _record(root, "whole"), _record(root, "resumed")
    assert part["params"] == whole["params"]
    assert part["loss"] == whole["loss"][-len(part["loss"]) :]
    assert part["iters"] == whole["iters"][-len(part["iters"]) :]
    assert s3.keys("mm/resumed") == [
        "mm/resumed/epoch_3.pth/accelkit.json",
        "mm/resumed/epoch_3.pth/extra.json",
        "mm/resumed/epoch_3.pth/rank-00000.safetensors",
        "mm/resumed/latest",  # accelkit's pointer: accel.load("s3://.../mm/resumed") works too
    ]
    manifest = json.loads(
        s3.client()
        .get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/mm/resumed/epoch_3.pth/accelkit.json")[
            "Body"
        ]
        .read()
    )
    assert manifest["step"] == whole["iters"][-1] + 1  # MMEngine's meta iter: iterations done


@pytest.mark.slow
def test_pth_save_format_on_s3_is_refused_clearly(s3, tmp_path: Path) -> None:
    root = tmp_path
    (root / "mm_tutorial.py").write_text(TUTORIAL_PROJECT)
    (root / "s3_driver.py").write_text(S3_DRIVER)
    hook = {"out_dir": s3.url("mm"), "save_format": "pth", "save_best": None}
    with pytest.raises(AssertionError, match=r"save_format='pth'.*object storage"):
        _run(root, "s3_driver.py", [dict(name="pth", work_dir="pth", checkpoint=hook)])
    assert not s3.keys("mm")
