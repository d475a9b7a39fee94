"""The mistakes of a first run get an error (or a log line) that says what to do, and leave
everything as it was: an optimizer that was never set up, ``setup()`` twice, a scheduler where
an optimizer belongs, ``load_pretrained`` before ``setup`` on fsdp, a one-process backend under
a launcher, a resume whose learning rate differs from the script's; and saves and loads show
progress on rank 0 when they are long (docs/getting-started.md, docs/semantics.md)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import accelkit
from accelkit.errors import ConfigError, UnsupportedError


@pytest.fixture
def accelkit_log(caplog):
    """The accelkit logger into caplog (it does not propagate to the root logger)."""
    logger = logging.getLogger("accelkit")
    saved = list(logger.handlers)
    logger.handlers.append(caplog.handler)
    yield caplog
    logger.handlers[:] = saved


def _set_up(lr: float = 1e-2):
    accel = accelkit.get("cpu", seed=0)
    raw = torch.nn.Linear(4, 1)
    given = torch.optim.SGD(raw.parameters(), lr=lr)
    model, opt = accel.setup(raw, given)
    return accel, raw, given, model, opt


def _train(accel, model, steps: int = 1) -> None:
    for _ in range(steps):
        accel.backward(model(torch.ones(2, 4)).sum())
        accel.step()


def test_step_with_an_optimizer_never_set_up_names_the_fix_and_changes_nothing():
    accel, raw, _, model, _ = _set_up()
    stranger = torch.optim.SGD(raw.parameters(), lr=1.0)
    accel.backward(model(torch.ones(2, 4)).sum())
    before = [p.detach().clone() for p in raw.parameters()]
    with pytest.raises(UnsupportedError, match=r"never set up.*accel\.setup\(model, opt\)"):
        accel.step(stranger)
    with pytest.raises(UnsupportedError, match="never set up"):
        accel.zero_grad(stranger)
    assert all(torch.equal(a, b) for a, b in zip(before, raw.parameters()))
    assert accel.applied_steps == 0 and raw.weight.grad is not None


def test_step_with_the_optimizer_given_to_setup_says_to_use_the_returned_one():
    accel, _, given, model, opt = _set_up()
    accel.backward(model(torch.ones(2, 4)).sum())
    with pytest.raises(UnsupportedError, match="pass the one setup\\(\\) returned"):
        accel.step(given)
    assert accel.applied_steps == 0
    assert accel.step(opt) and accel.applied_steps == 1  # the returned one steps


@pytest.mark.parametrize("backend", ["cpu", "ddp"])
def test_setup_twice_with_the_same_model_is_refused(backend):
    accel = accelkit.get(backend, seed=0)
    raw = torch.nn.Linear(4, 1)
    model, _ = accel.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    for again in (raw, model):
        with pytest.raises(ConfigError, match=r"already set up.*once per model"):
            accel.setup(again, torch.optim.SGD(raw.parameters(), lr=0.1))
    assert len(accel._optimizers) == 1  # the refused calls added nothing
    accel.free_memory()  # a fresh start: the same module may be set up again
    accel.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))


def test_a_scheduler_among_the_optimizers_points_to_setup_scheduler():
    accel = accelkit.get("cpu")
    raw = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(ConfigError, match=r"setup_scheduler\(sched\).*scheduler=sched"):
        accel.setup(raw, opt, sched)
    _, opt = accel.setup(raw, opt)  # nothing was set up by the refused call
    assert accel.setup_scheduler(sched) is sched


def test_load_pretrained_before_setup_on_fsdp_says_setup_first(tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.ones(3, 4), "bias": torch.ones(3)}, tmp_path / "model.safetensors")
    accel = accelkit.get("fsdp", seed=0)
    with accel.init_module():
        model = torch.nn.Linear(4, 3)
    with pytest.raises(UnsupportedError, match=r"setup\(model, opt\)` first") as err:
        accel.load_pretrained(model, tmp_path)
    assert "to_empty" not in str(err.value)
    assert model.weight.is_meta  # untouched
    model = accel.setup(model)
    accel.load_pretrained(model, tmp_path)
    assert torch.equal(model.weight.full_tensor(), torch.ones(3, 4))

    accel.save(tmp_path / "ck", {"model": model})
    with accel.init_module():
        fresh = torch.nn.Linear(4, 3)
    with pytest.raises(accelkit.CheckpointError, match=r"gets its storage in setup\(\)"):
        accel.load(tmp_path / "ck", {"model": fresh})  # accel.load says the same
    assert fresh.weight.is_meta


def test_a_one_process_backend_under_a_launcher_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for name in ("cpu", "cuda"):
        with pytest.raises(ConfigError, match=r"launched on 2 processes.*'ddp'") as err:
            accelkit.get(name)
        if name == "cpu":
            assert "python train.py" in str(err.value)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert accelkit.get("cpu").world_size == 1  # a launcher of one process is fine


def test_a_resume_at_another_learning_rate_says_which_won(tmp_path, accelkit_log):
    accel, _, _, model, opt = _set_up(lr=1e-2)
    _train(accel, model)
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})

    accel, _, _, model, opt = _set_up(lr=1e-2)  # the same rate: nothing to say
    accel.load(tmp_path / "ck", {"model": model, "optimizer": opt})
    assert "learning rate" not in accelkit_log.text

    accel, _, _, model, opt = _set_up(lr=5e-3)
    accel.load(tmp_path / "ck", {"model": model, "optimizer": opt})
    assert opt.param_groups[0]["lr"] == 1e-2  # the checkpoint's wins, as torch's load does
    message = accelkit_log.text
    assert "checkpoint's learning rate 0.01" in message and "not the 0.005" in message
    assert 'group["lr"] = 0.005' in message


def _scheduled(lr: float):
    accel, _, _, model, opt = _set_up(lr=lr)
    sched = accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    return accel, model, opt, {"model": model, "optimizer": opt, "scheduler": sched}


def test_a_resume_mid_schedule_is_explained_by_its_scheduler(tmp_path, accelkit_log):
    accel, model, opt, state = _scheduled(1e-2)
    _train(accel, model, steps=2)
    assert opt.param_groups[0]["lr"] == 2.5e-3  # the schedule moved the rate
    accel.save(tmp_path / "ck", state)

    accel, _, opt, state = _scheduled(1e-2)  # every restart: the same script again
    accel.load(tmp_path / "ck", state)
    assert opt.param_groups[0]["lr"] == 2.5e-3
    assert "learning rate" not in accelkit_log.text  # the loaded scheduler explains it

    accel, _, opt, state = _scheduled(5e-3)  # the script now builds another base rate
    accel.load(tmp_path / "ck", state)
    assert "checkpoint's learning rate 0.0025" in accelkit_log.text
    assert "not the 0.005" in accelkit_log.text

    accel, _, opt, state = _scheduled(1e-2)  # the same base rate, but the scheduler left out
    del state["scheduler"]
    accelkit_log.clear()
    accel.load(tmp_path / "ck", state)
    assert "checkpoint's learning rate 0.0025" in accelkit_log.text


def _save_and_load(tmp_path):
    accel, _, _, model, opt = _set_up()
    _train(accel, model)
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    accel.load(tmp_path / "ck", {"model": model, "optimizer": opt})


def test_saves_and_loads_show_a_bar_on_rank_zero_when_asked_or_large(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ACCELKIT_PROGRESS", "1")
    _save_and_load(tmp_path / "shown")
    err = capfd.readouterr().err
    assert "saving ck: 100%" in err and "loading ck: 100%" in err

    monkeypatch.delenv("ACCELKIT_PROGRESS")  # small: no bar
    _save_and_load(tmp_path / "small")
    assert "%|" not in capfd.readouterr().err

    monkeypatch.setenv("ACCELKIT_PROGRESS", "0")
    from accelkit.checkpoint import progress

    monkeypatch.setattr(progress, "PROGRESS_BYTES", 0)  # large, but turned off
    _save_and_load(tmp_path / "off")
    assert "%|" not in capfd.readouterr().err
    assert progress.rank_zero_bar(1 << 40, 1, "x") is None  # other ranks never show one


def test_an_fsdp_save_makes_no_deprecation_warning_of_accelkit(tmp_path):
    accel = accelkit.get("fsdp", seed=0)
    model = accel.setup(torch.nn.Linear(8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accel.save(tmp_path / "ck", {"model": model})
    ours = [w for w in caught if "accelkit" in w.filename]
    assert not ours, [str(w.message) for w in ours]
