"""DeepSpeed's PipelineEngine behind ``accel.forward_backward`` (issue 48).

The same training twice on 2 gloo processes (2 stages): raw DeepSpeed (dsk_pipe_raw.py, no
accelkit: ``PipelineModule`` over the flattened layers, ``train_batch`` over each batch cut into
4 micro-batches) and accelkit (dsk_pipe_accel.py: ``accelkit.get("deepspeed", pp=2, ...)``, the
whole nested ``nn.Sequential`` handed to ``setup``, ``forward_backward`` then ``step``). Losses
and every stage's final weights must be equal bit for bit (measured: 0 at ZeRO-0 and ZeRO-1,
AdamW, 3 steps); the stage's names are the unsplit model's. The gradient norm accelkit computes
at ZeRO-0 (each stage's squares summed over the pipeline) equals the one DeepSpeed's ZeRO-1
optimizer computes, bit for bit, and both ranks report it.

Refusals, in the default tier (they happen in ``get()``, before DeepSpeed is imported).
"""

from __future__ import annotations

import pytest
from test_deepspeed_training import CPU_ENV

import accelkit
from accelkit.sdk import ConfigError
from accelkit.testing import run_ranks

#: DeepSpeed's layer i (the flattened network) -> its name in the nested nn.Sequential
NAMES = ["0", "1.0", "1.1", "1.2", "2", "3"]


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int], list[dict]]:
    out = {}
    for stage in (0, 1):
        out[("raw", stage)] = run_ranks(
            "dsk_pipe_raw:train_pipeline", {"stage": stage}, nproc=2, env=CPU_ENV, timeout=900
        )
        out[("accelkit", stage)] = run_ranks(
            "dsk_pipe_accel:train", {"stage": stage}, nproc=2, env=CPU_ENV, timeout=900
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_forward_backward_equals_raw_train_batch(runs, stage):
    raw, ours = runs[("raw", stage)], runs[("accelkit", stage)]
    assert [r["layers"] for r in raw] == [[0, 3], [3, 6]]
    for rank in range(2):
        assert ours[rank]["losses"] == raw[rank]["losses"]  # the same on both stages
        expected = {}
        for key, value in raw[rank]["weights"].items():
            index, _, rest = key.partition(".")
            expected[f"{NAMES[int(index)]}.{rest}"] = value
        assert ours[rank]["weights"] == expected
        assert ours[rank]["dp"] == [0, 1]
        assert "forward_backward" in ours[rank]["call_error"]
    assert ours[0]["norms"] == ours[1]["norms"]


@pytest.mark.slow
def test_the_zero0_grad_norm_spans_every_stage(runs):
    """accelkit's own norm at ZeRO-0 equals DeepSpeed's ZeRO-1 norm (its own computation)."""
    assert runs[("accelkit", 0)][0]["norms"] == runs[("accelkit", 1)][0]["norms"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_with_pp_are_refused_with_deepspeeds_reason(stage):
    with pytest.raises(ConfigError, match="ZeRO-2 and ZeRO-3 are incompatible with pipeline"):
        accelkit.get("deepspeed", zero_stage=stage, pp=2)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"accumulation_steps": 2}, r"raise pipeline\['microbatches'\] to 8"),
        ({"precision": "bf16-mixed"}, "torch autocast"),
        ({"pipeline": {"schedule": "GPipe"}}, "does not run the 'GPipe'"),
    ],
)
def test_what_deepspeeds_pipeline_cannot_do_is_refused(options, match):
    options = {"pipeline": {"microbatches": 4}, **options}
    with pytest.raises(ConfigError, match=match):
        accelkit.get("deepspeed", zero_stage=1, pp=2, **options)


def test_the_split_becomes_deepspeeds_stage_boundaries():
    from accelkit_deepspeed import pipeline
    from torch import nn

    net = nn.Sequential(
        nn.Linear(2, 2), nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]), nn.Linear(2, 2)
    )
    names = [name for name, _ in pipeline.layers_of(net)]
    assert names == ["0", "1.0", "1.1", "1.2", "1.3", "2"]
    assert pipeline.boundaries("auto", names, 2) is None
    assert pipeline.boundaries([["0", "1.0-1"], ["1.2-3", "2"]], names, 2) == [0, 3, 6]
    assert pipeline.boundaries({"1.2": "begin"}, names, 2) == [0, 3, 6]
    assert pipeline.boundaries({"1": "end"}, names, 2) == [0, 5, 6]
    with pytest.raises(ConfigError, match=r"layers \['2'\] are in no stage"):
        pipeline.boundaries([["0", "1"], []], names, 2)
    with pytest.raises(ConfigError, match="consecutive layers"):
        pipeline.boundaries([["0", "2"], ["1"]], names, 2)
    with pytest.raises(accelkit.sdk.UnsupportedError, match=r"must be an nn\.Sequential"):
        pipeline.layers_of(nn.Linear(2, 2))
    shared = nn.Linear(2, 2)
    with pytest.raises(accelkit.sdk.UnsupportedError, match="same parameter"):
        pipeline.check_untied(pipeline.layers_of(nn.Sequential(shared, nn.ReLU(), shared)))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_a_deepspeed_pipeline_checkpoint_loads_into_cpu_bit_equal(stage, tmp_path):
    """``accel.save`` under ``deepspeed`` with ``pp=2`` writes an ordinary portable checkpoint
    keyed by the unsplit names: ``cpu`` (one process, no pipeline) loads it into the plain
    ``nn.Sequential``, and its weights and AdamW moments equal what each stage gathered through
    DeepSpeed's own views at the save, bit for bit. Negative twin: a rank file removed fails
    the load, naming it, and leaves the model untouched."""
    import shutil

    import torch
    from dsk_pipe_accel import network

    path = tmp_path / "pp2"
    ranks = run_ranks(
        "dsk_pipe_accel:train",
        {"stage": stage, "save_to": str(path)},
        nproc=2,
        env=CPU_ENV,
        timeout=900,
    )
    expected = {}
    for rank in ranks:
        for key, value in rank["saved"].items():
            kind, _, rest = key.rpartition("/")
            index, _, tail = rest.partition(".")
            expected[f"{kind}/{NAMES[int(index)]}.{tail}"] = value
    accel = accelkit.get("cpu")
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = network()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    model, opt = accel.setup(model, opt)
    accel.load(path, {"model": model, "optimizer": opt})
    inner = accel.unwrap(model)
    loaded = {f"model/{k}": v.flatten().tolist() for k, v in inner.state_dict().items()}
    for name, param in inner.named_parameters():
        for moment in ("exp_avg", "exp_avg_sq"):
            state = opt.optimizer.state[param][moment]
            loaded[f"optimizer/{moment}/{name}"] = state.flatten().tolist()
    assert loaded == expected

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    victim = sorted(broken.glob("rank-*.safetensors"))[-1]
    victim.unlink()
    before = {k: v.clone() for k, v in inner.state_dict().items()}
    with pytest.raises(accelkit.sdk.CheckpointError, match=victim.name):
        accel.load(broken, {"model": model, "optimizer": opt})
    assert all(torch.equal(v, before[k]) for k, v in inner.state_dict().items())
