"""``colossalai_hybrid`` (HybridParallelPlugin) on a tiny Llama built from a config, 2 gloo
processes, against ColossalAI's Booster used directly (cai_reference.hybrid_runs).

Runs: tp_size=1 (data parallel over 2 ranks, torch DDP inside the plugin), tp_size=2 (tensor
parallel, data-parallel size 1: each rank reads every sample, so the sampler must shard by the
data-parallel rank, not the global one) and tp_size=1 with ZeRO-1 in bf16-true. Accumulation 2,
with no_sync inside the window on both sides. Measured: every loss equal (difference 0) -> EXACT.
"""

from __future__ import annotations

import pytest

pytest.importorskip("colossalai")
pytest.importorskip("transformers")

from cai_run import run_ranks

pytestmark = pytest.mark.slow

RUNS = [
    dict(name="tp1", tp_size=1),
    dict(name="tp2", tp_size=2),
    dict(name="tp1_zero1_bf16", tp_size=1, zero_stage=1, precision="bf16"),
]


@pytest.fixture(scope="module")
def results():
    reference = run_ranks("cai_reference:hybrid_runs", {"cfgs": RUNS})
    jobs = [
        {**run, "precision": "bf16-true" if run.get("precision") == "bf16" else None}
        for run in RUNS
    ]
    ours = run_ranks("cai_workers:hybrid_jobs", {"jobs": jobs})
    return reference, ours


@pytest.mark.parametrize("name", [r["name"] for r in RUNS])
def test_losses_equal_raw_booster(results, name):
    reference, ours = results
    for rank in (0, 1):
        assert ours[rank][name]["losses"] == reference[rank][name]["losses"]


def test_sampler_shards_by_data_parallel_rank(results):
    _reference, ours = results
    assert [ours[r]["tp1"]["dp"] for r in (0, 1)] == [[0, 2], [1, 2]]
    assert [ours[r]["tp2"]["dp"] for r in (0, 1)] == [[0, 1], [0, 1]]
    assert len(ours[0]["tp2"]["losses"]) == 8  # 16 samples, batch 2, one data-parallel rank
    assert ours[0]["tp2"]["applied"] == 4
