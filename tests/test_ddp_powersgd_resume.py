"""``ddp`` with ``comm_hook="powersgd"`` resumes exactly: saved at step 25 of 50 (compressing
from step 2) and resumed on 2 gloo processes, steps 26-50 give the losses and final weights of
the uninterrupted run bit for bit, and both equal raw torch DDP with torch's PowerSGD hook.

The workload moves PowerSGD's state: a raw resume that copies torch's state by bucket index
(what accelkit did before the state was kept by parameter) diverges from step 26.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from accelkit.testing import run_ranks

HERE = Path(__file__).parent
KW = {"nproc": 2, "timeout": 300, "path": [HERE]}
SAVE_AT = 25


def _first_difference(mine: list[float], reference: list[float]) -> str:
    for i, (a, b) in enumerate(zip(mine, reference)):
        if a != b:
            return f"first differs at index {i}: {a!r} != {b!r}"
    return f"lengths {len(mine)} and {len(reference)}"


@pytest.mark.slow
def test_a_resumed_powersgd_run_is_bit_equal_to_the_uninterrupted_one(tmp_path):
    raw = run_ranks("powersgd_workers:raw", {}, **KW)
    saved = str(tmp_path / "ck")
    whole = run_ranks("powersgd_workers:ours", {"save": saved}, **KW)
    resumed = run_ranks("powersgd_workers:ours", {"load": saved}, **KW)
    for rank in range(2):
        want = raw[rank]
        assert whole[rank]["losses"] == want["losses"], (
            f"rank {rank}, uninterrupted: {_first_difference(whole[rank]['losses'], want['losses'])}"
        )
        tail = want["losses"][SAVE_AT:]
        assert resumed[rank]["losses"] == tail, (
            f"rank {rank}, resumed: {_first_difference(resumed[rank]['losses'], tail)}"
        )
        assert resumed[rank]["params"] == want["params"], f"rank {rank}: final weights differ"
    # the check can fail: restoring torch's state by bucket index does not give this run
    naive = run_ranks("powersgd_workers:raw", {"resume_by_index": True}, **KW)
    assert naive[0]["losses"][:SAVE_AT] == raw[0]["losses"][:SAVE_AT]
    assert naive[0]["losses"][SAVE_AT + 1 :] != raw[0]["losses"][SAVE_AT + 1 :]
