"""``ddp``'s ``comm_hook`` option on 2 gloo processes: fp16 compression and PowerSGD give
the weights of raw torch DDP with the same hook, bit for bit; PowerSGD's step count and factors
are in the checkpoint, so a resumed run keeps compressing where it stopped (exactly: see
test_ddp_powersgd_resume.py). torch's bf16 hook needs NCCL, so it
does not run on these gloo processes (the last test shows that and accelkit's refusal)."""

from __future__ import annotations

from pathlib import Path

import pytest

import accelkit
from accelkit.testing import run_ranks

HERE = Path(__file__).parent
KW = {"nproc": 2, "timeout": 300, "path": [HERE]}


@pytest.mark.parametrize(
    "hook",
    [
        pytest.param("fp16", marks=pytest.mark.slow),
        pytest.param("powersgd", marks=pytest.mark.slow),
    ],
)
def test_the_hook_gives_raw_ddps_weights(hook):
    try:
        want = run_ranks("comm_hook_workers:raw", {"hook": hook}, **KW)
    except Exception as err:  # the hook may not run on gloo: then accelkit's is not tested here
        pytest.skip(f"raw DDP with the {hook} hook does not run on gloo here: {str(err)[-200:]}")
    got = run_ranks("comm_hook_workers:ours", {"hook": hook}, **KW)
    for rank in range(2):
        assert got[rank]["params"] == want[rank], f"rank {rank}"
    plain = run_ranks("comm_hook_workers:ours", {"hook": None}, **KW)
    assert plain[0]["params"] != want[0]  # the hook changed the numbers: the check can fail


@pytest.mark.slow
def test_powersgd_state_resumes(tmp_path):
    saved = str(tmp_path / "ck")
    run_ranks("comm_hook_workers:ours", {"hook": "powersgd", "save": saved}, **KW)
    resumed = run_ranks("comm_hook_workers:ours", {"hook": "powersgd", "load": saved}, **KW)
    unbroken = run_ranks("comm_hook_workers:ours", {"hook": "powersgd"}, **KW)
    # the step count continues (a fresh state would restart the plain all-reduce warm-up)
    assert resumed[0]["powersgd_iter"] == unbroken[0]["powersgd_iter"] > 0
    assert resumed[0]["params"] == unbroken[0]["params"]  # and the run goes on bit for bit


def test_gloo_all_reduces_bf16_and_torchs_bf16_hook_needs_nccl():
    """What docs/backends/index.md says of comm_hook='bf16': gloo itself all-reduces bf16; torch's
    bf16 compression hook refuses a gloo group; accelkit refuses the option on the CPU at get()."""
    raw = run_ranks("comm_hook_workers:bf16_on_gloo", **KW)
    for result in raw:
        assert result["dtype"] == "torch.bfloat16" and result["sum"] == [3.0] * 4, result
        assert result["hook"] is not None and "NCCL" in result["hook"], result
    (refused,) = run_ranks(
        "comm_hook_workers:bf16_hook_through_accelkit", nproc=1, timeout=300, path=[HERE]
    )
    assert refused is not None and "needs CUDA with NCCL" in refused and "fp16" in refused


def test_a_bad_hook_name_is_refused():
    with pytest.raises(accelkit.ConfigError, match="comm_hook"):
        accelkit.get("ddp", comm_hook="int8")
