"""``apex`` in the portable checkpoint: FusedAdam's per-group step <-> torch's per-parameter step
(fake apex, CPU).

A run trained with torch AdamW resumes with FusedAdam and the reverse. Transfers are checked bit
for bit against the optimizers' own state (read straight from ``optimizer.state``, not through
accelkit's reader); loss curves after a resume against the uninterrupted run, within the floor
measured in test_apex_swap.py (fake FusedAdam vs torch AdamW: 8.5e-7 relative over 30 steps;
tolerance 1e-5). Negative twins: a resume whose step is not carried, and one without the
optimizer state, both leave that tolerance by orders of magnitude.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from apex_reference import batches, make_net, param_groups

import accelkit
from accelkit.errors import CheckpointError

TOL = 1e-5
DATA = batches(10)


def adamw(model):
    return torch.optim.AdamW(param_groups(model), lr=1e-2)


def build(name, make_opt=adamw, **options):
    accel = accelkit.get(name, **options)
    model = make_net()
    model, opt = accel.setup(model, make_opt(model))
    return accel, model, opt


def train(accel, model, data):
    losses = []
    for x, y in data:
        loss = F.mse_loss(model(x), y)
        accel.backward(loss)
        accel.step()
        losses.append(loss.item())
    return losses


def rel(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def state_by_name(model, opt):
    """{param name: {key: tensor}} from the optimizer's own state, plus each group's step."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            entry = {k: v.detach().clone() for k, v in opt.state.get(p, {}).items()}
            if "step" in group:  # Apex: one step per group
                entry["step"] = torch.tensor(float(group["step"]))
            out[names[id(p)]] = entry
    return out


def test_torch_adamw_resumes_in_fused_adam(on_cpu, tmp_path):
    accel, model, opt = build("cpu")
    uninterrupted = train(*build("cpu")[:2], DATA)
    first = train(accel, model, DATA[:6])
    saved = state_by_name(model, opt.optimizer)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})

    apex, model2, fused = build("apex")
    apex.load(tmp_path / "ck", {"model": model2, "optimizer": fused})
    assert type(fused.optimizer).__name__ == "FusedAdam"
    loaded = state_by_name(model2, fused.optimizer)
    for name, entry in saved.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[name][key], entry[key]), (name, key)
            assert loaded[name][key].dtype == torch.float32
        assert float(loaded[name]["step"]) == float(entry["step"]) == 6.0
        assert torch.equal(dict(model2.named_parameters())[name], weights[name])
    resumed = first + train(apex, model2, DATA[6:])
    assert rel(uninterrupted, resumed) < TOL


def test_negative_twins_a_resume_without_step_or_state_is_far_off(on_cpu, tmp_path):
    accel, model, opt = build("cpu")
    uninterrupted = train(*build("cpu")[:2], DATA)
    first = train(accel, model, DATA[:6])
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    apex, model2, fused = build("apex")
    apex.load(tmp_path / "ck", {"model": model2, "optimizer": fused})
    for group in fused.optimizer.param_groups:
        group["step"] = 0  # as if the step had not been carried: bias correction restarts
    no_step = first + train(apex, model2, DATA[6:])
    assert rel(uninterrupted, no_step) > 100 * TOL
    apex, model3, _ = build("apex")
    apex.load(tmp_path / "ck", {"model": model3})  # weights only
    no_state = first + train(apex, model3, DATA[6:])
    assert rel(uninterrupted, no_state) > 100 * TOL


def test_fused_adam_resumes_in_torch_adamw(on_cpu, tmp_path):
    apex, model, fused = build("apex")
    uninterrupted = train(*build("apex")[:2], DATA)
    first = train(apex, model, DATA[:6])
    saved = state_by_name(model, fused.optimizer)
    apex.save(tmp_path / "ck", {"model": model, "optimizer": fused})

    manifest = json.loads((tmp_path / "ck" / "accelkit.json").read_text())
    info = manifest["objects"]["optimizer"]
    assert info["family"] == "adamw" and info["step_granularity"] == "group"
    assert info["class"] == "apex.optimizers.fused_adam.FusedAdam"
    assert all("step" not in group for group in info["param_groups"])
    steps = [t for t in manifest["tensors"] if t["kind"] == "optim:step"]
    assert len(steps) == len(list(model.parameters())) and all(t["shape"] == [] for t in steps)

    accel, model2, opt = build("cpu")
    accel.load(tmp_path / "ck", {"model": model2, "optimizer": opt})
    loaded = state_by_name(model2, opt.optimizer)
    for name, entry in saved.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[name][key], entry[key]), (name, key)
        step = loaded[name]["step"]
        assert step.dim() == 0 and step.dtype == torch.float32 and float(step) == 6.0
    assert all("step" not in g for g in opt.optimizer.param_groups)
    resumed = first + train(accel, model2, DATA[6:])
    assert rel(uninterrupted, resumed) < TOL


def test_fused_adam_resumes_itself_bit_exact(on_cpu, tmp_path):
    apex, model, fused = build("apex")
    uninterrupted = train(*build("apex")[:2], DATA)
    first = train(apex, model, DATA[:6])
    apex.save(tmp_path / "ck", {"model": model, "optimizer": fused})
    again, model2, fused2 = build("apex")
    again.load(tmp_path / "ck", {"model": model2, "optimizer": fused2})
    assert first + train(again, model2, DATA[6:]) == uninterrupted
    # negative twin: the same resume without the optimizer state
    twin, model3, _ = build("apex")
    twin.load(tmp_path / "ck", {"model": model3})
    assert first + train(twin, model3, DATA[6:]) != uninterrupted


def test_steps_that_differ_within_a_group(on_cpu, tmp_path, caplog):
    """torch: a parameter that had no gradient for two steps has a smaller step than the rest of
    its group. Apex keeps one step per group: strict loading refuses, non-strict takes the
    largest and warns."""
    accel, model, opt = build("cpu")
    model.head.bias.requires_grad_(False)
    train(accel, model, DATA[:2])
    model.head.bias.requires_grad_(True)
    train(accel, model, DATA[2:6])
    assert float(opt.optimizer.state[model.head.bias]["step"]) == 4.0
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    apex, model2, fused = build("apex")
    with pytest.raises(
        CheckpointError, match=r"param group 1 holds parameters whose 'step' differ"
    ):
        apex.load(tmp_path / "ck", {"model": model2, "optimizer": fused})
    apex, model2, fused = build("apex")
    with caplog.at_level(logging.WARNING, logger="accelkit"):
        apex.load(tmp_path / "ck", {"model": model2, "optimizer": fused}, strict=False)
    assert [g["step"] for g in fused.optimizer.param_groups] == [6, 6]
    assert "taking the largest" in caplog.text
    assert "converting per-parameter steps into Apex's per-group step" in caplog.text


def test_a_checkpoint_before_the_first_step(on_cpu, tmp_path):
    apex, model, fused = build("apex")
    apex.save(tmp_path / "ck", {"model": model, "optimizer": fused})
    accel, model2, opt = build("cpu")
    accel.load(tmp_path / "ck", {"model": model2, "optimizer": opt})
    assert not opt.optimizer.state
    apex2, model3, fused3 = build("apex")
    apex2.load(tmp_path / "ck", {"model": model3, "optimizer": fused3})
    assert all("step" not in g for g in fused3.optimizer.param_groups)
    assert train(apex2, model3, DATA[:2]) == train(*build("apex")[:2], DATA[:2])


def test_the_loss_scale_travels_with_the_checkpoint(on_cpu, tmp_path):
    apex, model, fused = build("apex", precision="16-mixed")
    x, y = DATA[0]
    apex.backward(F.mse_loss(model(x), y) * float("inf"))  # an overflow halves the scale
    apex.step()
    train(apex, model, DATA[:3])
    scale = apex.backend.precision.scaler.get_scale()
    assert scale < 2.0**16
    apex.save(tmp_path / "ck", {"model": model, "optimizer": fused})
    again, model2, fused2 = build("apex", precision="16-mixed")
    again.load(tmp_path / "ck", {"model": model2, "optimizer": fused2})
    assert again.backend.precision.scaler.get_scale() == scale
    assert [g["step"] for g in fused2.optimizer.param_groups] == [
        g["step"] for g in fused.optimizer.param_groups
    ]


def test_sgd_momentum_round_trip(on_cpu, tmp_path):
    def sgd(model):
        return torch.optim.SGD(param_groups(model, 0.05), lr=0.05, momentum=0.9)

    accel, model, opt = build("cpu", sgd)
    train(accel, model, DATA[:4])
    saved = state_by_name(model, opt.optimizer)
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    apex, model2, fused = build("apex", sgd)
    apex.load(tmp_path / "ck", {"model": model2, "optimizer": fused})
    assert type(fused.optimizer).__name__ == "FusedSGD"
    loaded = state_by_name(model2, fused.optimizer)
    for name, entry in saved.items():
        assert torch.equal(loaded[name]["momentum_buffer"], entry["momentum_buffer"]), name


def test_bf16_state_becomes_fp32_in_fused_adam(on_cpu, tmp_path):
    accel, model, opt = build("cpu", precision="bf16-true")
    train(accel, model, DATA[:3])
    saved = state_by_name(model, opt.optimizer)
    assert saved["head.weight"]["exp_avg"].dtype == torch.bfloat16
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    apex, model2, fused = build("apex", precision="bf16-true")
    apex.load(tmp_path / "ck", {"model": model2, "optimizer": fused})
    loaded = state_by_name(model2, fused.optimizer)
    for name, entry in saved.items():
        assert loaded[name]["exp_avg"].dtype == torch.float32
        assert torch.equal(loaded[name]["exp_avg"], entry["exp_avg"].float()), name


def test_adamw_state_into_adam_mode_warns(on_cpu, tmp_path, caplog):
    accel, model, opt = build("cpu")
    train(accel, model, DATA[:2])
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    apex, model2, fused = build("apex", lambda m: torch.optim.Adam(param_groups(m), lr=1e-2))
    with caplog.at_level(logging.WARNING, logger="accelkit"):
        apex.load(tmp_path / "ck", {"model": model2, "optimizer": fused})
    assert "loading adamw state into a adam optimizer" in caplog.text
