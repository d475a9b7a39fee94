"""``apex``: the optimizer swap and the fused norms, against the fake apex on the CPU.

What is tested is accelkit's logic: which Apex class is built with which arguments, that param
groups and hyperparameters carry over, that what cannot carry over is refused, and that the
training loop drives the swapped optimizer as torch's. The fake implements Apex's update rules in
plain PyTorch; measured against torch's AdamW over 30 steps on this model (fp32, CPU): losses
8.5e-7 relative, parameters 1.1e-6 relative. Tolerance 1e-5; the negative twin (FusedAdam in
Adam's L2 mode against an AdamW reference with weight decay) is 0.86 off.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from apex_reference import batches, make_net, param_groups, train_raw

import accelkit
from accelkit.errors import ConfigError

TOL = 1e-5


def train_accel(accel, model, opt, data, scheduler=None):
    model, opt = accel.setup(model, opt, **({"scheduler": scheduler} if scheduler else {}))
    losses, norms = [], []
    for x, y in data:
        with accel.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accel.backward(loss)
            if accel.step() and accel.grad_norm is not None:
                norms.append(float(accel.grad_norm))
        losses.append(loss.item())
    return model, opt, {"losses": losses, "norms": norms}


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))


def last(apex, cls: str) -> dict:
    return [c for c in apex.CALLS if c["class"] == cls][-1]


def test_adamw_becomes_fused_adam_with_groups_and_hyperparameters(on_cpu):
    model = make_net()
    groups = param_groups(model, lr=3e-3)
    groups[1]["name"] = "no-decay"  # an entry accelkit does not know travels as it is
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.8, 0.95), eps=1e-7)
    accel = accelkit.get("apex")
    _, fused = accel.setup(model, opt)
    inner = fused.optimizer
    assert type(inner).__module__ == "apex.optimizers.fused_adam" and accel.backend.swaps == [
        "AdamW -> FusedAdam"
    ]
    call = last(on_cpu, "FusedAdam")
    assert call["kwargs"]["adam_w_mode"] is True and call["kwargs"]["set_grad_none"] is True
    assert call["kwargs"]["capturable"] is False and call["kwargs"]["master_weights"] is False
    # the same parameter objects, group by group, in order
    assert call["params"] == [[id(p) for p in g["params"]] for g in opt.param_groups]
    for new, old in zip(inner.param_groups, opt.param_groups, strict=True):
        assert new["lr"] == old["lr"] and new["betas"] == (0.8, 0.95) and new["eps"] == 1e-7
        assert new["weight_decay"] == old["weight_decay"] and new["bias_correction"] is True
    assert inner.param_groups[1]["name"] == "no-decay" and inner.param_groups[1]["lr"] == 1.5e-3
    assert inner.defaults["lr"] == 3e-3 and inner.defaults["betas"] == (0.8, 0.95)


@pytest.mark.parametrize(
    ("make", "adam_w_mode"),
    [
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01), False),
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, decoupled_weight_decay=True), True),
        (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-3)), True),
    ],
    ids=["adam-l2", "adam-decoupled", "adamw-tensor-lr"],
)
def test_adam_maps_onto_fused_adam_mode(on_cpu, make, adam_w_mode):
    model = make_net()
    _, fused = accelkit.get("apex").setup(model, make(model.parameters()))
    assert last(on_cpu, "FusedAdam")["kwargs"]["adam_w_mode"] is adam_w_mode
    lr = fused.optimizer.param_groups[0]["lr"]
    assert isinstance(lr, float) and lr == pytest.approx(1e-3)


def test_sgd_becomes_fused_sgd(on_cpu):
    model = make_net()
    opt = torch.optim.SGD(
        param_groups(model, lr=0.1), lr=0.1, momentum=0.9, dampening=0.0, nesterov=True
    )
    _, fused = accelkit.get("apex").setup(model, opt)
    call = last(on_cpu, "FusedSGD")
    assert call["kwargs"]["wd_after_momentum"] is False  # torch's order
    for new, old in zip(fused.optimizer.param_groups, opt.param_groups, strict=True):
        for key in ("lr", "momentum", "dampening", "weight_decay", "nesterov"):
            assert new[key] == old[key], key


@pytest.mark.parametrize(
    ("make", "option"),
    [
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.Adam(ps, maximize=True), "maximize"),
        (lambda ps: torch.optim.AdamW(ps, foreach=True), "foreach"),
        (lambda ps: torch.optim.AdamW(ps, fused=False), "fused"),
        (lambda ps: torch.optim.AdamW(ps, capturable=True), "capturable"),
        (lambda ps: torch.optim.Adam(ps, differentiable=True), "differentiable"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
    ],
)
def test_an_option_that_cannot_carry_over_fails_clearly(on_cpu, make, option):
    model = make_net()
    opt = make(model.parameters())
    with pytest.raises(
        ConfigError, match=rf"\({option}=.*cannot carry over.*fused_optimizer=False"
    ):
        accelkit.get("apex").setup(model, opt)
    assert not [c for c in on_cpu.CALLS if c["class"] in ("FusedAdam", "FusedSGD")]


def test_an_optimizer_without_twin_is_refused_or_kept(on_cpu):
    model = make_net()
    with pytest.raises(ConfigError, match=r"no fused Apex twin.*RMSprop.*FusedLAMB"):
        accelkit.get("apex").setup(model, torch.optim.RMSprop(model.parameters()))
    accel = accelkit.get("apex", fused_optimizer=False)
    _, kept = accel.setup(model, torch.optim.RMSprop(model.parameters()))
    assert type(kept.optimizer) is torch.optim.RMSprop and accel.backend.swaps == []


def test_an_apex_optimizer_is_kept_as_it_is(on_cpu):
    model = make_net()
    mine = on_cpu.optimizers.FusedAdam(model.parameters(), lr=1e-3, adam_w_mode=False)
    _, opt = accelkit.get("apex").setup(model, mine)
    assert opt.optimizer is mine


def test_a_stepped_optimizer_and_fused_sgd_on_bf16_are_refused(on_cpu):
    model = make_net()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with pytest.raises(ConfigError, match="already has state"):
        accelkit.get("apex").setup(model, opt)
    model = make_net()
    with pytest.raises(ConfigError, match="FusedSGD updates fp16 and fp32 parameters only"):
        accelkit.get("apex", precision="bf16-true").setup(
            model, torch.optim.SGD(model.parameters(), lr=0.1)
        )


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_swapped_optimizer_trains_like_torch_adamw(on_cpu, accumulation):
    """Same model, data and two param groups: raw torch AdamW vs accelkit 'apex' (FusedAdam),
    clipping at 0.5 (every step clipped), with and without accumulation."""
    data = batches(21)
    raw_model = make_net()
    ref = train_raw(
        raw_model,
        torch.optim.AdamW(param_groups(raw_model), lr=1e-2),
        data,
        max_norm=0.5,
        accumulation=accumulation,
    )
    model = make_net()
    accel = accelkit.get("apex", max_grad_norm=0.5, accumulation_steps=accumulation)
    model, opt, got = train_accel(
        accel, model, torch.optim.AdamW(param_groups(model), lr=1e-2), data
    )
    assert type(opt.optimizer).__name__ == "FusedAdam"
    assert rel(ref["losses"], got["losses"]) < TOL
    assert rel(ref["norms"], got["norms"]) < TOL
    for p, q in zip(raw_model.parameters(), model.parameters(), strict=True):
        assert (p - q).abs().max() <= TOL * p.abs().max()
    steps = {g["step"] for g in opt.optimizer.param_groups}
    assert steps == {len(ref["norms"])}  # one step per group, one per applied window


def test_negative_twin_l2_mode_is_far_from_adamw(on_cpu):
    data = batches(21)
    raw_model = make_net()
    ref = train_raw(raw_model, torch.optim.AdamW(param_groups(raw_model), lr=1e-2), data)
    model = make_net()
    _, _, got = train_accel(
        accelkit.get("apex"), model, torch.optim.Adam(param_groups(model), lr=1e-2), data
    )
    assert rel(ref["losses"], got["losses"]) > 100 * TOL


def test_fused_sgd_trains_like_torch_sgd(on_cpu):
    data = batches(12)
    raw_model = make_net()
    make = lambda m: torch.optim.SGD(param_groups(m, 0.05), lr=0.05, momentum=0.9)  # noqa: E731
    ref = train_raw(raw_model, make(raw_model), data)
    model = make_net()
    _, opt, got = train_accel(accelkit.get("apex"), model, make(model), data)
    assert type(opt.optimizer).__name__ == "FusedSGD"
    assert rel(ref["losses"], got["losses"]) < TOL


def test_schedulers_drive_the_fused_optimizer(on_cpu):
    """A scheduler built on the torch optimizer before setup is re-bound to the new one."""
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    accel = accelkit.get("apex")
    model, fused = accel.setup(model, opt, scheduler=before)
    for x, y in batches(3):
        accel.backward(F.mse_loss(model(x), y))
        accel.step()
    assert fused.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    assert fused.optimizer.param_groups[0]["initial_lr"] == 1e-2  # carried from the torch groups
    assert all(p.grad is None for p in model.parameters())  # Apex's zero_grad() has no argument


def test_fp16_overflow_skips_the_fused_step(on_cpu):
    """16-mixed on the CPU: an inf loss skips the step (the group's step stays), halves the scale."""
    model = make_net()
    accel = accelkit.get("apex", precision="16-mixed")
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = batches(1)[0]
    accel.backward(F.mse_loss(model(x), y) * 1e-3)
    accel.step()
    assert not accel.step_was_skipped
    step, scale = opt.optimizer.param_groups[0]["step"], accel.backend.precision.scaler.get_scale()
    weights = [p.detach().clone() for p in model.parameters()]
    accel.backward(F.mse_loss(model(x), y) * float("inf"))
    accel.step()
    assert accel.step_was_skipped
    assert opt.optimizer.param_groups[0]["step"] == step
    assert accel.backend.precision.scaler.get_scale() == scale / 2
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))


# ---- fused norms ---------------------------------------------------------------------------------
def test_fused_norms_keep_names_parameters_and_eps(on_cpu):
    model = make_net()
    names = list(model.state_dict())
    params = dict(model.named_parameters())
    reference = copy.deepcopy(model)
    accel = accelkit.get("apex", fused_norm=True)
    swapped, _ = accel.setup(model, torch.optim.AdamW(model.parameters()))
    assert sorted(accel.backend.norms.swapped) == ["blocks.0.norm", "blocks.1.norm", "final"]
    assert type(swapped.blocks[0].norm).__name__ == "FusedLayerNorm"
    assert type(swapped.final).__name__ == "FusedRMSNorm"
    assert list(swapped.state_dict()) == names
    assert all(p is params[n] for n, p in swapped.named_parameters())
    kwargs = {c["class"]: c["kwargs"] for c in on_cpu.CALLS if "Norm" in c["class"]}
    assert kwargs["FusedLayerNorm"]["eps"] == 1e-6 and kwargs["FusedRMSNorm"]["eps"] == 1e-5
    assert kwargs["FusedLayerNorm"]["normalized_shape"] == (16,)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.allclose(swapped(x), reference(x), atol=1e-6)
    plain = make_net()
    kept, _ = accelkit.get("apex").setup(plain, torch.optim.AdamW(plain.parameters()))
    assert type(kept.final) is torch.nn.RMSNorm  # fused_norm is off by default


def test_norms_that_cannot_swap_are_kept_with_the_reason(on_cpu):
    shared = torch.nn.LayerNorm(8)
    model = torch.nn.ModuleDict(
        {
            "a": shared,
            "b": shared,  # one module at two places: one fused module at both
            "nobias": torch.nn.LayerNorm(8, bias=False),
            "noeps": torch.nn.RMSNorm(8),
            "plain": torch.nn.LayerNorm(8, elementwise_affine=False),
            "hooked": torch.nn.LayerNorm(8),
        }
    )
    model["hooked"].register_forward_hook(lambda *args: None)
    accel = accelkit.get("apex", fused_norm=True)
    out = accel.setup(model, torch.optim.AdamW(model.parameters()))[0]
    norms = accel.backend.norms
    assert out["a"] is out["b"] and type(out["a"]).__name__ == "FusedLayerNorm"
    assert out["a"].weight is shared.weight
    assert type(out["plain"]).__name__ == "FusedLayerNorm" and out["plain"].weight is None
    assert "bias=False" in norms.kept["nobias"] and "eps=None" in norms.kept["noeps"]
    assert "hooks" in norms.kept["hooked"]
    assert type(out["nobias"]) is torch.nn.LayerNorm
