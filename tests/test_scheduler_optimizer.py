"""The optimizer ``setup`` returns, LR schedulers on it, and the accumulation window's edges
(docs/architecture.md, "Semantics that hold on every backend": optimizer and scheduler,
accumulation, clipping)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import accelkit


def tiny_setup(accumulation: int = 1, **kwargs):
    accel = accelkit.get("cpu", accumulation_steps=accumulation, seed=0, **kwargs)
    model = torch.nn.Linear(3, 2)
    model, optimizer = accel.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    return accel, model, optimizer


def micro_batch(accel, model, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    loss = F.mse_loss(model(torch.randn(4, 3, generator=generator)), torch.zeros(4, 2))
    accel.backward(loss)
    return loss


def test_returned_optimizer_is_a_torch_optimizer_sharing_state():
    accel = accelkit.get("cpu")
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accel.setup(model, inner)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups is inner.param_groups
    assert optimizer.state is inner.state
    micro_batch(accel, model)
    accel.step()
    assert optimizer.state_dict()["state"][0]["step"] == 1
    # torch's own schedulers accept it (they reject non-Optimizer wrappers with a TypeError)
    for make in (
        lambda o: torch.optim.lr_scheduler.StepLR(o, 1),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
    ):
        make(optimizer)


def test_setup_rejects_a_non_optimizer_and_a_second_setup():
    accel = accelkit.get("cpu")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(accelkit.ConfigError, match="torch optimizers"):
        accel.setup(model, object())
    _, optimizer = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(accelkit.ConfigError, match="already set up"):
        accel.setup(model, optimizer)


def test_scheduler_is_stepped_once_per_applied_step_only():
    accel, model, optimizer = tiny_setup(accumulation=3)
    scheduler = accel.setup_scheduler(
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    )
    applied = []
    for i in range(8):
        micro_batch(accel, model, seed=i)
        applied.append(accel.step())
    # without a loader from setup_dataloader, windows close after exactly 3 micro-batches
    assert applied == [False, False, True, False, False, True, False, False]
    assert scheduler.last_epoch == 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.0 / 3)
    assert accel.applied_steps == 2


def test_optimizer_step_is_the_accelerator_step():
    accel, model, optimizer = tiny_setup(accumulation=2)
    scheduler = accel.setup_scheduler(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    )
    before = model.weight.detach().clone()
    micro_batch(accel, model)
    optimizer.step()  # inside the window: nothing is applied
    optimizer.zero_grad()
    assert torch.equal(model.weight, before)
    micro_batch(accel, model, seed=1)
    optimizer.step()
    optimizer.zero_grad()
    assert not torch.equal(model.weight, before)
    assert scheduler.last_epoch == 1
    with pytest.raises(accelkit.UnsupportedError, match="closure"):
        optimizer.step(lambda: 0.0)


def test_users_own_scheduler_step_warns_and_is_ignored():
    accel, model, optimizer = tiny_setup()
    scheduler = accel.setup_scheduler(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    )
    micro_batch(accel, model)
    accel.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
    with pytest.warns(UserWarning, match="accelkit steps this LR scheduler"):
        scheduler.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, then silent
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert scheduler.last_epoch == 1


def test_no_scheduler_order_warning_from_torch():
    """torch warns when scheduler.step() precedes optimizer.step(); accelkit's order is right."""
    accel, model, optimizer = tiny_setup()
    accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            micro_batch(accel, model, seed=i)
            accel.step()


def test_scheduler_built_on_the_original_optimizer_via_setup():
    accel = accelkit.get("cpu")
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.1)
    model, optimizer = accel.setup(model, inner, scheduler=scheduler)
    micro_batch(accel, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() has been overridden" from torch
        accel.step()
    assert scheduler.last_epoch == 1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


SCHEDULES = {
    "warm_restarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    "warmup_then_cosine": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
        ],
        milestones=[3],
    ),
    "chained": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        ]
    ),
    "two_on_one_optimizer": lambda o: [
        torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    ],
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_composite_and_several_schedulers_follow_torch(name):
    """Applied step k has the LR torch gives after k steps, skipped fp16 windows excluded,
    and the user's own step() calls (on any of them) change nothing."""
    expected = []
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    made = SCHEDULES[name](optimizer)
    for _ in range(8):
        optimizer.step()
        for scheduler in made if isinstance(made, list) else [made]:
            scheduler.step()
        expected.append(optimizer.param_groups[0]["lr"])

    accel = accelkit.get("cpu", precision="16-mixed")
    model = torch.nn.Linear(3, 2)
    model, optimizer = accel.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    made = SCHEDULES[name](optimizer)
    for scheduler in made if isinstance(made, list) else [made]:
        accel.setup_scheduler(scheduler)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(10):
            poison = float("inf") if i in (2, 6) else 1.0
            accel.backward(model(torch.ones(1, 3)).sum() * 1e-3 * poison)
            accel.step()
            for scheduler in made if isinstance(made, list) else [made]:
                scheduler.step()  # what a loop written for plain torch does: ignored
            if not accel.step_was_skipped:
                lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["step", "warmup_then_cosine"])
def test_scheduler_state_dict_is_torchs_and_saves(name, tmp_path):
    """A loop that saves ``sched.state_dict()`` itself (torch.save) keeps working, and a state
    loaded into a fresh adopted scheduler continues the schedule there."""

    def make(o):
        if name == "step":
            return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        return SCHEDULES["warmup_then_cosine"](o)

    raw_model = torch.nn.Linear(3, 2)
    raw_keys = set(make(torch.optim.SGD(raw_model.parameters(), lr=1.0)).state_dict())

    accel, model, optimizer = tiny_setup()
    scheduler = accel.setup_scheduler(make(optimizer))
    for i in range(2):
        micro_batch(accel, model, seed=i)
        accel.step()
    assert set(scheduler.state_dict()) == raw_keys
    torch.save(scheduler.state_dict(), tmp_path / "sched.pt")
    lr = optimizer.param_groups[0]["lr"]

    accel2, model2, optimizer2 = tiny_setup()
    resumed = accel2.setup_scheduler(make(optimizer2))
    resumed.load_state_dict(torch.load(tmp_path / "sched.pt", weights_only=False))
    optimizer2.param_groups[0]["lr"] = lr
    with pytest.warns(UserWarning, match="ignored"):
        resumed.step()  # still guarded after the load
    for i in range(2, 4):
        micro_batch(accel, model, seed=i)
        accel.step()
        micro_batch(accel2, model2, seed=i)
        accel2.step()
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])


def test_plateau_scheduler_is_left_to_the_user():
    """ReduceLROnPlateau needs a metric, so accelkit does not adopt it; its step() works."""
    accel, model, optimizer = tiny_setup()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not taken for a scheduler left unhanded
        for i in range(3):
            micro_batch(accel, model, seed=i)
            accel.step()
            plateau.step(1.0)
    assert optimizer.param_groups[0]["lr"] < 1.0
    with pytest.raises(accelkit.ConfigError, match=r"scheduler\.step\(metric\)"):
        accel.setup_scheduler(plateau)


def test_a_scheduler_not_handed_over_is_not_stepped_and_says_what_to_write():
    """accelkit no longer adopts a scheduler by watching its construction: one built on the
    set-up optimizer and not handed over is the loop's to step, and the first applied step
    says (once) how to hand it over."""
    accel, model, optimizer = tiny_setup()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    micro_batch(accel, model)
    with pytest.warns(FutureWarning, match=r"accel\.setup_scheduler\(scheduler\)"):
        accel.step()
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, and the loop's own step() is a real step
        micro_batch(accel, model, seed=1)
        accel.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
    accel.setup_scheduler(scheduler)  # handed over late: stepped from here on
    micro_batch(accel, model, seed=2)
    accel.step()
    assert optimizer.param_groups[0]["lr"] == 0.25


def test_a_composite_over_schedulers_already_handed_over_is_refused():
    """SequentialLR steps its first part while it is built; that step would be a no-op on a
    part accelkit already guards, so the composite must be the one handed over."""
    accel, _model, optimizer = tiny_setup()
    warmup = accel.setup_scheduler(torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=2))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guarded part's step at construction, ignored
        both = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[2])
    with pytest.raises(accelkit.ConfigError, match="hand over only it"):
        accel.setup_scheduler(both)


@pytest.mark.parametrize("zero_grad_at", ["top", "bottom"])
def test_zero_grad_inside_an_open_window_keeps_gradients(zero_grad_at):
    """Both usual loop shapes (zero_grad first, or after step) accumulate the whole window."""
    accel, model, optimizer = tiny_setup(accumulation=3)
    raw = torch.nn.Linear(3, 2)
    raw.load_state_dict(accel.unwrap(model).state_dict())
    for i in range(3):
        if zero_grad_at == "top":
            optimizer.zero_grad()
        micro_batch(accel, model, seed=i)
        if i == 1:
            kept = model.weight.grad.clone()
            accel.zero_grad()  # the accelerator's own zero_grad: kept too
            assert torch.equal(model.weight.grad, kept)
        accel.step()
        if zero_grad_at == "bottom":
            optimizer.zero_grad()
    assert model.weight.grad is None  # zeroed when the window closed
    for i in range(3):
        generator = torch.Generator().manual_seed(i)
        (F.mse_loss(raw(torch.randn(4, 3, generator=generator)), torch.zeros(4, 2)) / 3).backward()
    with torch.no_grad():
        for p in raw.parameters():
            p -= p.grad
    assert torch.allclose(model.weight, raw.weight, rtol=1e-6, atol=0)
    assert torch.allclose(model.bias, raw.bias, rtol=1e-6, atol=0)


def test_zero_grad_outside_a_window_clears_gradients():
    accel, model, optimizer = tiny_setup(accumulation=1)
    micro_batch(accel, model)  # backward without step: no window is open
    optimizer.zero_grad()
    assert model.weight.grad is None


def test_two_optimizers_step_independently():
    accel = accelkit.get("cpu", accumulation_steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[1].parameters(), lr=0.1)
    model, opt_a, opt_b = accel.setup(model, opt_a, opt_b)
    sched_a = accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5))
    sched_b = accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt_b, step_size=1, gamma=0.5))
    w_a, w_b = model[0].weight.detach().clone(), model[1].weight.detach().clone()
    for _i in range(2):
        accel.backward(model(torch.randn(2, 3)).pow(2).mean())
        opt_a.step()
    assert not torch.equal(model[0].weight, w_a)
    assert torch.equal(model[1].weight, w_b)  # opt_b's window is still open
    assert (sched_a.last_epoch, sched_b.last_epoch) == (1, 0)
    for _ in range(2):
        opt_b.step()
    assert not torch.equal(model[1].weight, w_b)
    assert sched_b.last_epoch == 1


def test_grad_norm_is_a_lazy_tensor_equal_to_raw_clip():
    accel, model, _optimizer = tiny_setup(max_grad_norm=0.05)
    raw = torch.nn.Linear(3, 2)
    raw.load_state_dict(accel.unwrap(model).state_dict())
    micro_batch(accel, model)
    accel.step()
    generator = torch.Generator().manual_seed(0)
    F.mse_loss(raw(torch.randn(4, 3, generator=generator)), torch.zeros(4, 2)).backward()
    expected = torch.nn.utils.clip_grad_norm_(raw.parameters(), 0.05)
    assert isinstance(accel.grad_norm, torch.Tensor) and accel.grad_norm.dim() == 0
    assert float(accel.grad_norm) == pytest.approx(float(expected), rel=1e-6)
    assert float(expected) > 0.05  # clipping was active
    with torch.no_grad():
        for p in raw.parameters():
            p -= p.grad
    assert torch.allclose(model.weight, raw.weight, rtol=1e-6, atol=0)


def test_grad_norm_without_clipping_needs_tracking():
    accel, model, _ = tiny_setup()
    micro_batch(accel, model)
    accel.step()
    assert accel.grad_norm is None
    accel, model, _ = tiny_setup(track_grad_norm=True)
    micro_batch(accel, model)
    grads = [p.grad.clone() for p in model.parameters()]
    accel.step()
    assert float(accel.grad_norm) == pytest.approx(float(torch.nn.utils.get_total_norm(grads)))


def test_manual_clip_works_and_refuses_double_clipping():
    accel, model, _optimizer = tiny_setup()
    micro_batch(accel, model)
    grads = [p.grad.clone() for p in model.parameters()]
    norm = accel.clip_grad_norm(1e-3)
    assert float(norm) == pytest.approx(float(torch.nn.utils.get_total_norm(grads)))
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(clipped) == pytest.approx(1e-3, rel=1e-3)
    accel, model, _ = tiny_setup(max_grad_norm=1.0)
    micro_batch(accel, model)
    with pytest.raises(accelkit.ConfigError, match="max_grad_norm is set"):
        accel.clip_grad_norm(1.0)


def test_step_without_an_optimizer_says_what_to_do():
    accel = accelkit.get("cpu")
    accel.setup(torch.nn.Linear(2, 2))
    with pytest.raises(accelkit.UnsupportedError, match="no optimizer"):
        accel.step()


def test_backward_on_a_model_that_was_not_set_up_says_what_to_do():
    """Silent before: the loss backpropagated through a model no backend had wrapped."""
    accel = accelkit.get("cpu")
    raw = torch.nn.Linear(3, 2)
    loss = raw(torch.randn(4, 3)).square().mean()
    with pytest.raises(accelkit.UnsupportedError, match=r"accel\.setup\(model, optimizer\)"):
        accel.backward(loss)
    model, _ = accel.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    other = torch.nn.Linear(3, 2)
    with pytest.raises(accelkit.UnsupportedError, match="not set up"):
        accel.backward(other(torch.randn(4, 3)).sum(), model=other)
    accel.backward(model(torch.randn(4, 3)).sum(), model=model)  # the set-up one works


def test_applied_steps_continue_from_the_checkpoint(tmp_path):
    """After load, applied_steps counts on from the saved run (a resumed run logs and saves at
    the steps an uninterrupted one would); a checkpoint without the count leaves it alone."""
    import hashlib
    import json

    from accelkit.checkpoint.format.manifest import canonical_bytes

    accel, model, optimizer = tiny_setup()
    for i in range(3):
        micro_batch(accel, model, seed=i)
        accel.step()
    accel.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 99})

    resumed, model2, optimizer2 = tiny_setup()
    assert resumed.applied_steps == 0
    resumed.load(tmp_path / "ckpt", {"model": model2, "optimizer": optimizer2, "step": 0})
    assert resumed.applied_steps == 3  # the count, not the user's own "step"
    micro_batch(resumed, model2)
    resumed.step()
    assert resumed.applied_steps == 4

    manifest_path = tmp_path / "ckpt" / "accelkit.json"
    data = json.loads(manifest_path.read_text())
    del data["applied_steps"]  # as a checkpoint written before the count was saved
    data["checksum"] = hashlib.sha256(canonical_bytes(data)).hexdigest()
    manifest_path.write_text(json.dumps(data))
    old, model3, optimizer3 = tiny_setup()
    old.load(tmp_path / "ckpt", {"model": model3, "optimizer": optimizer3, "step": 0})
    assert old.applied_steps == 0
