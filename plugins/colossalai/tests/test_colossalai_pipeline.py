"""ColossalAI's HybridParallelPlugin pipeline behind ``accel.forward_backward`` (issue 48).

The same training twice on 2 gloo processes (2 stages, a tiny Llama, fp32, ZeRO-0, SGD with
momentum, 2 steps of 8 sequences in 4 micro-batches): raw ColossalAI (cai_pipe_raw.py, no
accelkit: ``booster.execute_pipeline`` then ``optimizer.step()``) and accelkit
(cai_pipe_accel.py: ``accelkit.get("colossalai_hybrid", pp=2, ...)``, ``forward_backward`` then
``step``). The loss (raw: on the last stage only; accelkit: on both) and the weights each stage
holds, by their Hugging Face names, must be equal bit for bit (measured: 0, for 1F1B and the
interleaved schedule). ``model(...)`` outside ``forward_backward`` is refused, naming it.

Refusals, in the default tier (in ``get()``, before ColossalAI is imported).
"""

from __future__ import annotations

import pytest

import accelkit
from accelkit.sdk import ConfigError
from accelkit.testing import run_ranks

ENV = {"PYTHONWARNINGS": "ignore"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "style"), [("1F1B", "1f1b"), ("Interleaved1F1B", "interleaved")]
)
def test_forward_backward_equals_raw_execute_pipeline(schedule, style):
    raw = run_ranks("cai_pipe_raw:train", {"style": style}, nproc=2, env=ENV, timeout=900)
    ours = run_ranks("cai_pipe_accel:train", {"schedule": schedule}, nproc=2, env=ENV, timeout=900)
    assert raw[0]["losses"] == [None, None]  # ColossalAI's loss lives on the last stage
    for rank in range(2):
        assert ours[rank]["losses"] == raw[1]["losses"]
        assert ours[rank]["weights"] == raw[rank]["weights"]
        assert ours[rank]["dp"] == [0, 1]
        assert "forward_backward" in ours[rank]["call_error"]
    assert set(ours[0]["weights"]).isdisjoint(ours[1]["weights"])  # each stage its own layers
    assert ours[0]["norms"] == ours[1]["norms"]


def test_zero_2_with_pp_is_refused_with_colossalais_reason():
    with pytest.raises(ConfigError, match="zero stage must be 0 or 1 when using pipeline"):
        accelkit.get("colossalai_hybrid", {"zero_stage": 2}, precision="bf16-true", pp=2)


def test_pipeline_options_colossalai_cannot_take_are_refused():
    with pytest.raises(ConfigError, match="Shardformer policy"):
        accelkit.get("colossalai_hybrid", pp=2, pipeline=dict(split=[["a"], ["b"]]))
    with pytest.raises(ConfigError, match="does not run the 'GPipe'"):
        accelkit.get("colossalai_hybrid", pp=2, pipeline=dict(schedule="GPipe"))
    with pytest.raises(ConfigError, match="pipeline stages are accelkit's own option, pp"):
        accelkit.get("colossalai_hybrid", {"pp_size": 2})


@pytest.mark.slow
def test_a_colossalai_pipeline_checkpoint_loads_into_fsdp_bit_equal(tmp_path):
    """``accel.save`` under ``colossalai_hybrid`` with ``pp=2`` writes an ordinary portable
    checkpoint (each stage its layers, by their Hugging Face names): ``fsdp`` on 2 ranks loads
    it, and the whole state gathered back through torch's ``get_model_state_dict`` /
    ``get_optimizer_state_dict`` equals what the stages held in ColossalAI at the save, weights
    and momentum, bit for bit. Negative twin: a rank file removed fails the load naming it."""
    import shutil

    path = tmp_path / "pp2"
    ranks = run_ranks("cai_pipe_accel:train", {"save_to": str(path)}, nproc=2, env=ENV, timeout=900)
    saved = {**ranks[0]["saved"], **ranks[1]["saved"]}
    assert len(saved) == len(ranks[0]["saved"]) + len(ranks[1]["saved"])
    loaded = run_ranks("cai_pipe_accel:load_fsdp", {"path": str(path)}, nproc=2, timeout=900)
    assert loaded[0] == saved

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    victim = sorted(broken.glob("rank-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(Exception, match=victim.name):
        run_ranks("cai_pipe_accel:load_fsdp", {"path": str(broken)}, nproc=2, timeout=900)
