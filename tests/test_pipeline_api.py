"""accel.forward_backward on a backend without a pipeline, and the checks of pp/pipeline= at get()
(one process, no pipeline run: docs/pipeline.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accelkit
from accelkit.errors import ConfigError
from accelkit.pipeline import PipelineSettings, resolve_pipeline, split_microbatches


def _build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_forward_backward_is_the_three_lines_it_replaces():
    """Bit-equal weights after two windows of accumulation 3 with a short last window, against
    the loop written with model(x), backward and step (the raw-torch reference: the same rule by
    hand)."""
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(30, 4), torch.randn(30, 1))
    accel = accelkit.get("cpu", accumulation_steps=3)
    model = _build()
    model, _ = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = accel.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=6), shuffle=False)
    losses = []
    for x, y in loader:  # 5 batches: a window of 3, then a short one of 2 closed by the loader
        losses.append(accel.forward_backward(model, x, target=y, loss_fn=nn.functional.mse_loss))
        accel.step()
    assert accel.applied_steps == 2
    batches = [(data.tensors[0][i : i + 6], data.tensors[1][i : i + 6]) for i in range(0, 30, 6)]
    ref = _build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(ref(x), y)
        ref_losses.append(loss.detach())
        (loss / 3).backward()
        if i % 3 == 2 or i == len(batches) - 1:
            ref_opt.step()
            ref_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    # the negative twin: a loop that divides by the wrong count is caught by the same comparison
    wrong = _build()
    wrong_opt = torch.optim.SGD(wrong.parameters(), lr=0.1)
    for x, y in batches[:3]:
        nn.functional.mse_loss(wrong(x), y).backward()
    wrong_opt.step()
    assert not torch.equal(next(wrong.parameters()), next(_build().parameters()))


def test_forward_backward_without_loss_fn_takes_the_output_as_the_loss():
    accel = accelkit.get("cpu")
    model = _build()
    model, _ = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(3, 4)

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x).square().mean()

    wrapped = Wrapped(_build())
    wrapped, _ = accel.setup(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))
    loss = accel.forward_backward(wrapped, x)
    assert loss.shape == () and wrapped.inner[0].weight.grad is not None
    with pytest.raises(ConfigError, match="needs loss_fn="):
        accel.forward_backward(model, x, target=torch.zeros(3, 1))
    with pytest.raises(ConfigError, match="one-element tensor"):
        accel.forward_backward(model, x)  # output of shape (3, 1) is not a loss


def test_pp_is_refused_where_the_backend_has_no_pipeline():
    with pytest.raises(ConfigError, match=r"'cpu' has no pipeline parallelism.*pp=2.*Backends "):
        accelkit.get("cpu", pp=2)
    # pp=1 with a pipeline dict is no pipeline: one config switches pp alone
    assert (
        accelkit.get("cpu", pp=1, pipeline=dict(schedule="gpipe")).backend.settings.pipeline is None
    )


@pytest.mark.parametrize(
    ("pp", "pipeline", "match"),
    [
        (0, None, "must be an int >= 1"),
        (True, None, "must be an int >= 1"),
        (2, "1F1B", "must be a dict"),
        (2, dict(schedul="1F1B"), r"unknown keys \['schedul'\]"),
        (2, dict(schedule="2F2B"), "unknown schedule '2F2B'; known: GPipe, 1F1B"),
        (2, dict(microbatches=0), "'microbatches' must be an int >= 1"),
        (2, dict(schedule="1F1B", stages_per_rank=2), "runs one stage per rank"),
        (2, dict(schedule="ZBV", stages_per_rank=3), "exactly 2 stages per rank"),
        (2, dict(split=[["a"]]), "needs 2 lists of module names"),
        (2, dict(split={"layers.2": "start"}), "'begin' or 'end'"),
        (2, dict(split={"layers.2": "begin", "layers.4": "begin"}), "need 1 split points"),
    ],
)
def test_bad_pipeline_options_are_refused_naming_the_fix(pp, pipeline, match):
    with pytest.raises(ConfigError, match=match):
        resolve_pipeline(pp, pipeline)


def test_pipeline_settings_resolve_defaults_and_stage_placement():
    loop = resolve_pipeline(4, dict(schedule="interleaved1f1b"))
    assert loop == PipelineSettings(4, "Interleaved1F1B", 8, 2, "auto")
    assert [loop.stage_ids(r) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    v = resolve_pipeline(2, dict(schedule="zbv"))
    assert [v.stage_ids(r) for r in range(2)] == [(0, 3), (1, 2)]
    assert v.rank_of_stage(3) == 0  # the last stage of a V is on the first rank
    one = resolve_pipeline(2, None)
    assert one.schedule == "1F1B" and one.microbatches == 4 and one.bubble_fraction() == 1 / 5


def test_split_microbatches_refuses_an_uneven_batch_naming_the_sizes():
    x = {"a": torch.arange(8), "b": [torch.arange(8), 3]}
    parts = split_microbatches(x, 4)
    assert [p["a"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parts[1]["b"][1] == 3
    with pytest.raises(ConfigError, match="has 6 samples, which 4 micro-batches"):
        split_microbatches(torch.zeros(6, 2), 4)


def test_plan_estimates_each_stage_and_the_bubble():
    """``accelkit plan --pp 2``: only backends that run pipelines, on gpus/pp GPUs a stage, the
    heaviest stage's state (half of gpt2-small's, its blocks are small), the 1F1B bubble."""
    from accelkit.benchmark.planning import PlanRequest, make_plan

    whole = make_plan(PlanRequest("gpt2-small", gpus=4, backends=["fsdp", "ddp", "cpu"]))
    staged = make_plan(PlanRequest("gpt2-small", gpus=8, pp=2, backends=["fsdp", "ddp", "cpu"]))
    rows = {c.label: c.estimate for c in staged["candidates"]}
    assert set(rows) == {"fsdp", "ddp"}  # cpu runs no pipeline
    base = {c.label: c.estimate for c in whole["candidates"]}
    for label, row in rows.items():
        assert row["world_size"] == 8 and row["pp"] == 2
        assert row["bubble_fraction"] == round(1 / 5, 4)  # (pp-1)/(m+pp-1), m = 2*pp
        assert abs(row["optimizer"] - base[label]["optimizer"] / 2) <= 1
        assert row["peak"] < base[label]["peak"]
        assert row["relative_step_time"] > base[label]["relative_step_time"]
    with pytest.raises(ValueError, match="must be >= 1 and divide --gpus 3"):
        make_plan(PlanRequest("gpt2-small", gpus=3, pp=2))


@pytest.mark.parametrize(
    ("backend", "options", "match"),
    [
        ("fsdp", dict(pipeline={"schedule": "zbv"}, reshard_after_forward=True),
         "reshard_after_forward=True gives wrong gradients"),
        ("ddp", dict(precision="16-mixed"), "'16-mixed' is not supported with pp > 1"),
        ("fsdp", dict(pipeline={"schedule": "Interleaved1F1B", "microbatches": 3}),
         "not a multiple of it"),
        ("ddp", dict(pipeline={"schedule": "DualPipeV", "microbatches": 2}),
         "needs at least 4 micro-batches"),
    ],
)  # fmt: skip
def test_what_a_pipeline_cannot_run_is_refused_at_get(backend, options, match):
    """Before any process joins (one process here: the refusal comes first)."""
    with pytest.raises(ConfigError, match=match):
        accelkit.get(backend, device="cpu", pp=2, **options)


# ---- the split and the initialisation, in one process -------------------------------------------
class _Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Stack(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(n))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _settings(pp: int, **pipeline):
    return resolve_pipeline(pp, pipeline)


def test_split_auto_names_and_points():
    from accelkit.backends.pipeline_split import plan_stages

    model = _Stack(6)
    assert plan_stages(model, _settings(2)) == [
        ["embed", "blocks.0", "blocks.1", "blocks.2"],
        ["blocks.3", "blocks.4", "blocks.5", "head"],
    ]
    # the embedding and the head count in the balance: the end stages take one block each
    assert plan_stages(model, _settings(4)) == [
        ["embed", "blocks.0"],
        ["blocks.1", "blocks.2"],
        ["blocks.3", "blocks.4"],
        ["blocks.5", "head"],
    ]
    names = _settings(2, split=[["embed", "blocks.0-1"], ["blocks.2-5", "head"]])
    assert plan_stages(model, names)[1] == ["blocks.2", "blocks.3", "blocks.4", "blocks.5", "head"]
    points = _settings(2, split={"blocks.4": "begin"})
    assert plan_stages(model, points) == [
        ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3"],
        ["blocks.4", "blocks.5", "head"],
    ]
    with pytest.raises(ConfigError, match="fewer than the 8 stages"):
        plan_stages(model, _settings(8))
    with pytest.raises(ConfigError, match=r"modules the model does not have: \['blocks.9'\]"):
        plan_stages(model, _settings(2, split=[["embed"], ["blocks.9"]]))


def test_a_split_that_leaves_parameters_out_is_refused():
    from accelkit.backends.pipeline_split import check_cover

    model = _Stack(2)
    with pytest.raises(ConfigError, match=r"on no stage: \['head'\]"):
        check_cover(model, [["embed", "blocks.0"], ["blocks.1"]])


def test_a_stage_keeps_the_unsplit_names_and_runs_the_model_forward():
    """Stage 0 then stage 1 of a pruned copy compute what the whole model does."""
    from accelkit.backends.pipeline_split import PassThrough, plan_stages, prune

    torch.manual_seed(0)
    model = _Stack(4)
    plan = plan_stages(model, _settings(2))
    first, last = (prune(model, names, root_params=i == 0) for i, names in enumerate(plan))
    assert [n for n, _ in last.named_parameters()][:2] == ["blocks.2.fc.weight", "blocks.2.fc.bias"]
    assert isinstance(last.embed, PassThrough) and len(last.blocks) == 2
    x = torch.randn(3, 4)
    assert torch.equal(last(_hidden(first, x)), model(x))


def _hidden(first, x):
    # stage 0's output is the hidden state: its head is a pass-through
    return first(x)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_meta_build_replayed_gives_every_stage_the_plain_build(pp):
    """No seed checkpoint: the same weights as a plain build with the same seed, bit for bit, at
    every stage count (each 'rank' here replays the whole init and keeps its stage)."""
    from accelkit.backends.fsdp import FSDPBackend, _Materializer
    from accelkit.backends.pipeline_split import plan_stages, prune, replay_init
    from accelkit.precision import Precision

    torch.manual_seed(0)
    plain = dict(_Stack(6).named_parameters())
    plan = plan_stages(_Stack(6), _settings(max(pp, 2))) if pp > 1 else [None]
    for stage in range(pp):
        created: list = []
        from accelkit.backends.fsdp import build_context

        torch.manual_seed(0)
        with build_context(True, torch.device("cpu"), Precision(), created):
            model = _Stack(6)
        assert all(p.is_meta for p in model.parameters())
        keep = set(plan[stage]) if pp > 1 else {n for n, _ in model.named_children()}
        replay_init(model, keep, _Materializer(model, torch.device("cpu")))
        part = prune(model, sorted(keep), root_params=stage == 0)
        for name, p in part.named_parameters():
            assert torch.equal(p, plain[name]), (pp, stage, name)
        others = [p for n, p in model.named_parameters() if not any(
            n == k or n.startswith(k + ".") for k in keep)]  # fmt: skip
        assert all(p.is_meta for p in others)  # the other stages' weights were dropped
    del FSDPBackend
