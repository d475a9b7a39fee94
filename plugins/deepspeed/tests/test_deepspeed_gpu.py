"""The DeepSpeed backend on CUDA (issue 5's GPU part): fp16 and bf16 on ZeRO-2 and ZeRO-3 with
offload, against raw DeepSpeed in the same processes. Run on the GPU machine::

    python3 -m nox -s gpu -- plugins/deepspeed/tests/test_deepspeed_gpu.py

(1 GPU: one rank; 2 or more: two ranks over nccl.) The scenarios, references and checks are the
CPU tests' (dsk_worker / dsk_reference / dsk_accel), with ``device="cuda"``.
"""

from __future__ import annotations

import math

import pytest
import torch
from dsk_launch import run_ranks
from test_deepspeed_training import COMMON, assert_equal_to_raw_deepspeed, within

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _nproc() -> int:
    return min(2, torch.cuda.device_count())


def run(scenarios):
    return run_ranks(
        "dsk_worker:compare",
        {"scenarios": [dict(s, device="cuda") for s in scenarios]},
        nproc=_nproc(),
        device="cuda",
        timeout=900,
    )


def test_fp16_zero2_and_zero3_offload_skip_an_overflow_like_raw_deepspeed():
    base = dict(COMMON, precision="16-true", overflow_at=4)
    scenarios = [
        dict(base, stage=2),
        dict(base, stage=2, offload_optimizer=True),
        dict(base, stage=3, offload_optimizer=True, offload_param=True, zero_init=True),
    ]
    for results in run(scenarios):
        for s, result in zip(scenarios, results, strict=True):
            accel = result["accel"]
            assert accel["param_dtype"] == str(torch.float16), s
            assert accel["skipped"] == [False, True, False, False, False, False], s
            assert accel["norms"][1] == math.inf and accel["lrs"][0] == accel["lrs"][1], s
            assert_equal_to_raw_deepspeed(accel, result["deepspeed"])


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_bf16_zero2_and_zero3_offload_match_raw_deepspeed_and_pytorch(precision):
    base = dict(COMMON, precision=precision)
    scenarios = [
        dict(base, stage=2),
        dict(base, stage=2, offload_optimizer=True),
        dict(base, stage=3, offload_optimizer=True, offload_param=True, zero_init=True),
    ]
    for results in run(scenarios):
        for s, result in zip(scenarios, results, strict=True):
            accel = result["accel"]
            assert_equal_to_raw_deepspeed(accel, result["deepspeed"])
            problems = within(accel, result["torch"], precision)
            assert not problems, (s, problems[:5])


def test_16_mixed_zero2_overflow_backs_the_scale_off_like_torch():
    scenarios = [dict(COMMON, precision="16-mixed", overflow_at=4, stage=2, clip=None)]
    for results in run(scenarios):
        accel, ref = results[0]["accel"], results[0]["torch"]
        assert accel["skipped"] == [False, True, False, False, False, False]
        assert accel["scale"] == ref["scales"][-1] == 32768.0
        assert not within(accel, ref, "16-mixed")
