"""Copies of what ``setup`` returns, and the returned optimizer passing for its own class.

Hooks deep-copy the model (MMEngine's EMAHook, a user's snapshot) and check the optimizer's class
(``isinstance(opt, torch.optim.SGD)``), so on accelkit both must behave as on the objects the user
built: a deep copy of the model runs the copy's weights, a copy or pickle of the optimizer is a
copy of the torch optimizer inside, and ``isinstance`` sees that optimizer's class. The MMEngine
reference is MMEngine's own Runner (``runner_worker(side="mmengine")`` imports nothing from
accelkit); the two-process runs use gloo.
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from torch import nn


# ---- plain accelkit ----------------------------------------------------------------------------
class AutocastProbe(nn.Module):
    """A model that records whether its forward ran under autocast (the precision policy)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.autocast_seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return self.lin(x)


def _set_up(precision: str = "32-true", accumulation: int = 1, optimizer: type = torch.optim.AdamW):
    import accelkit

    accel = accelkit.get("cpu", precision=precision, accumulation_steps=accumulation, seed=0)
    module = AutocastProbe()
    model, opt = accel.setup(module, optimizer(module.parameters(), lr=0.1))
    return accel, model, opt


def _train_micro_batch(accel, model, seed: int = 0) -> bool:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    accel.backward(model(x).square().mean())
    return accel.step()


def test_isinstance_sees_the_optimizer_class_and_step_still_goes_through_accelkit():
    from accelkit.wrappers import AcceleratedOptimizer

    accel, model, opt = _set_up(accumulation=2)
    assert isinstance(opt, torch.optim.AdamW)
    assert isinstance(opt, torch.optim.Optimizer)
    assert not isinstance(opt, torch.optim.SGD)
    # the boundary: type() and accelkit's own checks still see the wrapper
    assert type(opt) is AcceleratedOptimizer
    assert isinstance(opt, AcceleratedOptimizer)
    scheduler = accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    before = model.lin.weight.detach().clone()
    x = torch.randn(3, 4)
    accel.backward(model(x).square().mean())
    assert opt.step() is False  # an open window: opt.step() is accel.step(opt)
    assert torch.equal(model.lin.weight, before)
    accel.backward(model(x).square().mean())
    assert opt.step() is True
    assert not torch.equal(model.lin.weight, before)
    assert scheduler.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_deepcopy_of_a_set_up_model_runs_the_copy():
    _, model, opt = _set_up(precision="bf16-mixed")
    x = torch.randn(3, 4)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.lin.weight.zero_()
        copied.lin.bias.zero_()
    assert torch.equal(copied(x), torch.zeros(3, 2))  # the copy's weights, not the model's
    assert copied.autocast_seen[-1] is True  # still under the precision policy
    assert not torch.equal(model(x), torch.zeros(3, 2))
    assert model.lin.weight.abs().sum() > 0
    # the model and its optimizer copied together: the copy steps the copied parameters
    copied_model, copied_opt = copy.deepcopy((model, opt))
    assert type(copied_opt) is torch.optim.AdamW
    assert [id(p) for p in copied_opt.param_groups[0]["params"]] == [
        id(p) for p in copied_model.parameters()
    ]


def test_optimizer_copies_and_pickles_are_the_torch_optimizer_copied():
    accel, model, opt = _set_up()
    assert _train_micro_batch(accel, model)
    inner = opt.optimizer
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(copied) is torch.optim.AdamW
        assert copied.param_groups[0]["lr"] == 0.1
        assert torch.equal(
            copied.state_dict()["state"][0]["exp_avg"], inner.state[model.lin.weight]["exp_avg"]
        )
        assert all(p is not q for p, q in zip(copied.param_groups[0]["params"], model.parameters()))
    shallow = copy.copy(opt)
    assert type(shallow) is torch.optim.AdamW and shallow.state is inner.state
    # the pickle is the torch optimizer's own: it loads without accelkit
    assert pickle.dumps(opt) == pickle.dumps(inner)
    # the original still steps through the Accelerator
    assert _train_micro_batch(accel, model, seed=1) and accel.applied_steps == 2


def test_deepcopy_that_reaches_the_accelerator_is_refused():
    import accelkit

    accel, _, _ = _set_up()
    with pytest.raises(accelkit.UnsupportedError, match=r"Accelerator .* cannot be copied"):
        copy.deepcopy(accel)


def test_pickled_model_is_the_plain_module_and_sets_up_again():
    import accelkit

    _, model, _ = _set_up(precision="bf16-mixed")
    loaded = pickle.loads(pickle.dumps(model))
    loaded(torch.randn(3, 4))
    assert loaded.autocast_seen[-1] is False  # the precision patch is not pickled
    again = accelkit.get("cpu", precision="bf16-mixed").setup(loaded)
    again(torch.randn(3, 4))
    assert again.autocast_seen[-1] is True


# ---- MMEngine ----------------------------------------------------------------------------------
def runner_worker(side: str, backend: str = "cpu", work_dir: str = "work_dirs/copy") -> dict:
    """Train with EMAHook and a hook that copies ``runner.model``, checks the optimizer's class and
    drives an MMEngine ParamScheduler built on it. ``side="mmengine"``: MMEngine's own Runner,
    nothing from accelkit imported; otherwise AccelkitRunner on ``backend``."""
    import torch.distributed as dist
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel, is_model_wrapper
    from mmengine.optim import LinearLR
    from mmengine.runner import Runner

    class Net(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

        def forward(self, x, y, mode="tensor"):
            out = self.net(x)
            return {"loss": nn.functional.cross_entropy(out, y)} if mode == "loss" else out

    def flat(module: nn.Module) -> list[float]:
        state = module.state_dict()
        return [v for k in sorted(state) for v in state[k].flatten().tolist()]

    class Probe(Hook):
        def __init__(self) -> None:
            self.rec: dict = {"lr": []}

        def before_train(self, runner) -> None:
            opt = runner.optim_wrapper.optimizer
            self.rec["isinstance_sgd"] = isinstance(opt, torch.optim.SGD)
            self.rec["copy_type"] = type(copy.deepcopy(opt)).__name__
            self.scheduler = LinearLR(opt, start_factor=0.25, by_epoch=False, begin=0, end=6)
            source = runner.model.module if is_model_wrapper(runner.model) else runner.model
            copied = copy.deepcopy(runner.model)
            module = copied.module if is_model_wrapper(copied) else copied
            pairs = list(zip(module.parameters(), source.parameters()))
            self.rec["copy_same_weights"] = all(torch.equal(a, b) for a, b in pairs)
            self.rec["copy_own_tensors"] = all(a is not b for a, b in pairs)
            x, y = torch.randn(2, 8), torch.zeros(2, dtype=torch.long)
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
                self.rec["copy_runs_its_weights"] = bool((copied(x, y) == 0).all())
                self.rec["source_untouched"] = bool(source(x, y).abs().sum() > 0)

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
            self.scheduler.step()
            self.rec["lr"].append(runner.optim_wrapper.optimizer.param_groups[0]["lr"])

        def after_run(self, runner) -> None:
            (ema,) = [h for h in runner.hooks if type(h).__name__ == "EMAHook"]
            source = runner.model.module if is_model_wrapper(runner.model) else runner.model
            self.rec["ema"] = flat(ema.ema_model.module)
            self.rec["params"] = flat(source)

    probe = Probe()
    torch.manual_seed(0)  # the model is built before the Runner seeds
    g = torch.Generator().manual_seed(0)
    data = [dict(x=torch.randn(8, generator=g), y=torch.tensor(i % 3)) for i in range(32)]
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    kwargs = dict(
        model=Net(),
        work_dir=work_dir,
        experiment_name=f"{side}_{backend}",
        train_dataloader=dict(
            dataset=data,
            batch_size=4,
            sampler=dict(type="DefaultSampler", shuffle=True),
            collate_fn=dict(type="default_collate"),
        ),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
        train_cfg=dict(by_epoch=True, max_epochs=2),
        custom_hooks=[dict(type="EMAHook", momentum=0.2), probe],
        default_hooks=dict(checkpoint=None),
        randomness=dict(seed=0),
        launcher="pytorch" if launched else "none",
        env_cfg=dict(dist_cfg=dict(backend="gloo")),
        log_level="WARNING",
    )
    if side == "mmengine":
        if launched:  # MMEngine's init_dist calls torch.cuda.set_device: join gloo first
            dist.init_process_group("gloo")
            wrapper = dict(
                type="MMDistributedDataParallel", broadcast_buffers=False, device_ids=None
            )
            kwargs["cfg"] = dict(model_wrapper_cfg=wrapper)
        runner = Runner(**kwargs)
    else:
        from accelkit.integrations.mmengine import AccelkitRunner

        runner = AccelkitRunner(accelkit=dict(backend=backend), **kwargs)
    runner.train()
    return probe.rec


def _check_against_mmengine(ours: dict, theirs: dict) -> None:
    assert theirs["isinstance_sgd"] and theirs["copy_type"] == "SGD"  # what users rely on
    assert theirs["copy_runs_its_weights"] and theirs["source_untouched"]
    assert ours == theirs


# the one difference, documented in docs/mmengine.md: that scheduler counts calls of the
# wrapper's step(), and accelkit steps the backend's optimizer
@pytest.mark.filterwarnings("ignore:Detected call of `scheduler.step\\(\\)` before")
def test_runner_model_copies_and_optimizer_class_as_in_mmengine_on_cpu(tmp_path):
    pytest.importorskip("mmengine")
    theirs = runner_worker("mmengine", work_dir=str(tmp_path / "mmengine"))
    ours = runner_worker("accelkit", "cpu", work_dir=str(tmp_path / "accelkit"))
    _check_against_mmengine(ours, theirs)


@pytest.mark.slow  # two launches of two processes: ~20 s on 2 cores
def test_runner_model_copies_and_optimizer_class_as_in_mmengine_on_two_ddp_processes(tmp_path):
    pytest.importorskip("mmengine")
    from accelkit.testing import run_ranks

    target = "test_optimizer_wrapper_copy:runner_worker"
    theirs = run_ranks(target, dict(side="mmengine", work_dir=str(tmp_path / "mm")))
    ours = run_ranks(target, dict(side="accelkit", backend="ddp", work_dir=str(tmp_path / "ak")))
    for rank in range(2):
        _check_against_mmengine(ours[rank], theirs[rank])


def ddp_copy_worker() -> dict:
    """Plain accelkit on ddp: what a deep copy of the model and of the optimizer give."""
    import accelkit

    accel = accelkit.get("ddp")
    module = nn.Linear(4, 2)
    model, opt = accel.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.parameters():
            p.zero_()
        x = torch.randn(3, 4)
        runs_copy = bool((copied(x) == 0).all())
        source_untouched = bool(model(x).abs().sum() > 0)
    copied_opt = copy.deepcopy(opt)
    return dict(
        model_type=type(copied).__name__,
        runs_copy=runs_copy,
        source_untouched=source_untouched,
        optimizer_type=type(copied_opt).__name__,
        pickled_type=type(pickle.loads(pickle.dumps(opt))).__name__,
        isinstance_sgd=isinstance(opt, torch.optim.SGD),
    )


def test_deepcopy_after_setup_on_two_ddp_processes():
    from accelkit.testing import run_ranks

    for out in run_ranks("test_optimizer_wrapper_copy:ddp_copy_worker"):
        assert out == dict(
            model_type="DistributedDataParallel",
            runs_copy=True,
            source_untouched=True,
            optimizer_type="SGD",
            pickled_type="SGD",
            isinstance_sgd=True,
        )


def test_runner_model_that_cannot_be_copied_says_what_to_do():
    pytest.importorskip("mmengine")
    import accelkit
    from accelkit.integrations.mmengine import AccelkitModelWrapper

    class Uncopyable(nn.Linear):  # as a DeepSpeed engine or an FSDP module refuses
        def __deepcopy__(self, memo: dict) -> None:
            raise TypeError("cannot pickle 'ProcessGroup' object")

    wrapper = AccelkitModelWrapper(accelerator=accelkit.get("cpu"), model=Uncopyable(2, 2))
    with pytest.raises(accelkit.UnsupportedError, match=r"copy\.deepcopy\(runner\.model\.module\)"):
        copy.deepcopy(wrapper)
    with pytest.raises(TypeError, match=r"pickle your model, runner\.model\.module"):
        pickle.dumps(wrapper)


def test_pickling_the_accelerator_is_refused_saying_what_to_do():
    import accelkit

    accel, _, _ = _set_up()
    with pytest.raises(TypeError, match=r"save a checkpoint with accel\.save\(\)"):
        pickle.dumps(accel)
    with pytest.raises(accelkit.UnsupportedError):
        copy.copy(accel)
