"""Behaviour checks run inside launched processes (DeepSpeed is imported there, never in pytest's
process). Each function returns a dict of observations that the test asserts on."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

import torch
import torch.nn.functional as F

import accelkit


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SelfInitNet(Net):
    """Initialises its weights in __init__ through ``self.apply``, as GPT-style models do."""

    def __init__(self) -> None:
        super().__init__()
        self.apply(self._init)

    @staticmethod
    def _init(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.constant_(module.weight, 0.125)
            torch.nn.init.zeros_(module.bias)


def _error(fn: Any) -> str | None:
    try:
        fn()
    except Exception as err:  # the test asserts on the type name and message
        return f"{type(err).__name__}: {err}"
    return None


def zero_init_guard() -> dict[str, Any]:
    """ZeRO-3 init_module(): partitioned while built; silent writes refused; the fixes work."""
    import deepspeed

    accel = accelkit.get("deepspeed_stage_3", seed=0)
    out: dict[str, Any] = {"init_context": accel.capabilities.init_context}
    with accel.init_module():
        model = SelfInitNet()
    weight = model.fc1.weight
    out["partitioned"] = weight.numel() == 0 and tuple(weight.ds_shape) == (32, 8)
    # what the model's own __init__ wrote through self.apply() (DeepSpeed gathers there)
    with deepspeed.zero.GatheredParameters([weight, model.fc1.bias]):
        out["apply_in_init"] = [float(weight.min()), float(weight.max())]
    out["nn_init"] = _error(lambda: torch.nn.init.normal_(model.fc1.weight))
    out["data_write"] = _error(lambda: model.fc2.weight.data.fill_(1.0))
    out["inplace_method"] = _error(lambda: model.fc2.bias.add_(1.0))
    state = {k: torch.zeros(v.ds_shape) for k, v in model.state_dict(keep_vars=True).items()}
    out["load_state_dict"] = _error(lambda: model.load_state_dict(state))
    out["requires_grad_"] = _error(lambda: model.fc2.bias.requires_grad_(True))
    # the documented fix: write while gathered, rank 0's values broadcast to every rank
    with deepspeed.zero.GatheredParameters([model.fc2.weight], modifier_rank=0), torch.no_grad():
        model.fc2.weight.fill_(0.5)
    model, opt = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inner = accel.unwrap(model)
    out["class_after_setup"] = sorted({type(p).__name__ for p in inner.parameters()})
    # DeepSpeed's own per-parameter methods are handed back as they were, unwrapped
    out["wrapped_after_setup"] = sum(
        hasattr(v, "_accelkit_wrapped") for p in inner.parameters() for v in vars(p).values()
    )
    out["all_gather_is_deepspeeds"] = all(
        getattr(p.all_gather, "__module__", "").startswith("deepspeed") for p in inner.parameters()
    )
    full = accel.full_state_dict(model)
    out["gathered_write"] = sorted(set(full["fc2.weight"].reshape(-1).tolist()))
    out["fc1_after_setup"] = [float(full["fc1.weight"].min()), float(full["fc1.weight"].max())]
    x = torch.ones(2, 8)
    loss = model(x).square().mean()
    accel.backward(loss)
    out["stepped"] = opt.step()
    return out


def behaviour() -> dict[str, Any]:
    """Loader batch size, native configs as they are, schedulers, optimizer handling, errors."""
    out: dict[str, Any] = {}
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("accelkit").addHandler(Keep())

    # 1. micro batch from a loader set up before setup(); else the default with a log line
    data = torch.utils.data.TensorDataset(torch.randn(12, 8), torch.randn(12, 3))
    accel = accelkit.get("deepspeed", zero_stage=1, seed=0)
    loader = accel.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=3))
    out["foreign_optimizer"] = _error(
        lambda: accel.setup(Net(), torch.optim.SGD(Net().parameters(), lr=0.1))
    )
    net = Net()
    _model, _opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    out["micro_from_loader"] = accel.backend.engine.train_micro_batch_size_per_gpu()
    out["loader_len"] = len(loader)
    accel2 = accelkit.get("deepspeed", zero_stage=1, seed=0)
    net = Net()
    model2, opt2 = accel2.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    out["micro_default"] = accel2.backend.engine.train_micro_batch_size_per_gpu()
    out["default_logged"] = any("train_micro_batch_size_per_gpu=1" in r for r in records)

    # 2. the returned optimizer: a torch Optimizer; a torch scheduler changes DeepSpeed's lr
    out["is_optimizer"] = isinstance(opt2, torch.optim.Optimizer)
    sched = accel2.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5))
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    accel2.backward(F.mse_loss(model2(x), y))
    opt2.step()
    out["engine_lr_after_one_step"] = accel2.backend.engine.get_lr()[0]
    out["engine_scheduler"] = repr(accel2.backend.engine.lr_scheduler)
    out["sched_last_lr"] = sched.get_last_lr()[0]
    out["clip_by_hand"] = _error(lambda: accel2.clip_grad_norm(1.0))
    out["unwrap"] = type(accel2.unwrap(model2)).__name__
    out["autocast_is_noop"] = type(accel2.autocast()).__name__

    # 3. a native config, as a JSON file, precision taken from it; DeepSpeed's own optimizer
    native = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ds.json")
        with open(path, "w") as f:
            json.dump(native, f)
        accel3 = accelkit.get("deepspeed", path)
    out["native_settings"] = [accel3.precision, accel3.accumulation_steps, accel3.max_grad_norm]
    model3, opt3 = accel3.setup(Net())  # DeepSpeed builds the optimizer its config names
    engine = accel3.backend.engine
    out["native_engine"] = {
        "bf16": engine.bfloat16_enabled(),
        "gas": engine.gradient_accumulation_steps(),
        "clip": engine.gradient_clipping(),
        "micro": engine.train_micro_batch_size_per_gpu(),
        "bucket": engine.zero_reduce_bucket_size(),
        "inner": type(engine.optimizer.optimizer).__name__,
        "lr": opt3.param_groups[0]["lr"],
    }
    out["out_dtype"] = str(model3(torch.randn(4, 8)).dtype)  # fp32 inputs are cast to bf16
    accel4 = accelkit.get("deepspeed", native)
    net4 = Net()
    out["both_optimizers"] = _error(
        lambda: accel4.setup(net4, torch.optim.SGD(net4.parameters(), lr=0.1))
    )
    return out


def activation_checkpointing() -> dict[str, Any]:
    """setup(activation_checkpointing=True) under ZeRO-3: the same losses as without it."""
    losses = {}
    for checkpointing in (False, True):
        accel = accelkit.get("deepspeed_stage_3", seed=0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            Net(), torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 3))
        )
        model, opt = accel.setup(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            activation_checkpointing=checkpointing,
        )
        torch.manual_seed(1)
        x, y = torch.randn(4, 8), torch.randn(4, 3)
        run = []
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            accel.backward(loss)
            opt.step()
            run.append(float(loss))
        losses[str(checkpointing)] = run
        checkpointed = [
            m for m in accel.unwrap(model).modules() if getattr(m, "_accelkit_checkpointed", False)
        ]
        losses[f"blocks_{checkpointing}"] = len(checkpointed)
    return losses


def fp16_refused() -> dict[str, Any]:
    """On a device where DeepSpeed's accelerator reports no fp16 (the CPU of many machines),
    16-true fails at get() with the way out, not deep inside deepspeed.initialize."""
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    accelerator.is_fp16_supported = lambda self: False  # as on a CPU without AVX512-FP16
    return {
        "16-true": _error(lambda: accelkit.get("deepspeed", precision="16-true")),
        "16-mixed": _error(lambda: accelkit.get("deepspeed", precision="16-mixed")),
    }


def all_checks() -> dict[str, Any]:
    """Every check above in one process (one launch is most of a check's cost); fp16 last, as
    it patches DeepSpeed's accelerator class."""
    return {
        "guard": zero_init_guard(),
        "behaviour": behaviour(),
        "checkpointing": activation_checkpointing(),
        "fp16": fp16_refused(),
    }
