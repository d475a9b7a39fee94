"""The references the DeepSpeed backend is checked against. Imports nothing from accelkit.

* :func:`raw_deepspeed`: the same training written directly against DeepSpeed, with a DeepSpeed
  config written out by hand. The accumulation window follows accelkit's stated rule (a window
  closes after ``accumulation`` micro-batches or at the loader's last batch), driven through
  DeepSpeed's own ``set_gradient_accumulation_boundary``.
* :func:`raw_torch`: the same training in plain PyTorch: gradients averaged over ranks with
  ``all_reduce``, each micro-batch's loss divided by ``accumulation`` (the short last window
  too), ``clip_grad_norm_``, the optimizer, a LambdaLR. bf16-mixed / 16-mixed use
  ``torch.autocast`` (+ ``GradScaler``); bf16-true keeps bf16 weights with an fp32 master copy.

Both run in the processes the test launched (gloo, 1 or 2 ranks), on the data split by rank the
way ``DistributedSampler(shuffle=False)`` splits it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

SAMPLES, BATCH, IN, OUT = 28, 2, 8, 3  # 14 samples per rank on 2 ranks -> 7 micro-batches


class Net(torch.nn.Module):
    """Odd parameter counts, so ZeRO partitions are uneven."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 24)
        self.fc3 = torch.nn.Linear(24, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def dataset(seed: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, IN, generator=gen), torch.randn(SAMPLES, OUT, generator=gen)
    )


def ensure_process_group() -> None:
    """Join the launcher's gloo group (torchrun sets WORLD_SIZE) if nobody has yet."""
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")


def rank_batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ensure_process_group()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    data = dataset(seed)
    sampler = torch.utils.data.DistributedSampler(data, world, rank, shuffle=False)
    return list(torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def windows_close(n_batches: int, accumulation: int) -> list[bool]:
    """accelkit's rule: close after ``accumulation`` micro-batches or at the last batch."""
    out, micro = [], 0
    for i in range(n_batches):
        micro += 1
        closes = micro >= accumulation or i == n_batches - 1
        out.append(closes)
        if closes:
            micro = 0
    return out


def window_length(closes: list[bool], index: int) -> int:
    """Length of the window the micro-batch at ``index`` belongs to."""
    start = index
    while start > 0 and not closes[start - 1]:
        start -= 1
    end = index
    while not closes[end]:
        end += 1
    return end - start + 1


def overflow_loss(loss: torch.Tensor, micro_index: int, overflow_at: int | None) -> torch.Tensor:
    return loss * float("inf") if micro_index == overflow_at else loss


# ---- raw DeepSpeed --------------------------------------------------------------------------
def _deepspeed_config(s: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": s["stage"]}
    if s.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if s.get("offload_param"):
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": s["accumulation"],
        "gradient_clipping": s.get("clip") or 0.0,
        "zero_optimization": zero,
        "steps_per_print": 2**62,
        "zero_allow_untested_optimizer": True,
    }
    if s.get("offload_optimizer"):
        config["zero_force_ds_cpu_optimizer"] = False
    precision = s["precision"]
    if precision == "bf16-mixed":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision == "16-mixed":
        config["torch_autocast"] = {"enabled": True, "dtype": "float16"}
    elif precision == "bf16-true":
        config["bf16"] = {"enabled": True}
    elif precision == "16-true":
        config["fp16"] = {"enabled": True}
    return config


def _ds_init(device: str) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", device)
    import deepspeed
    import deepspeed.ops

    if device == "cpu":
        # the shared-memory op serves DeepSpeed's inference all-reduce only; its JIT build is 100 s
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    return deepspeed


def raw_deepspeed(s: dict[str, Any]) -> dict[str, Any]:
    deepspeed = _ds_init(s.get("device", "cpu"))
    config = _deepspeed_config(s)
    torch.manual_seed(s["seed"])
    if s.get("zero_init"):
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Net()
    else:
        model = Net()
    client = make_optimizer(s["optimizer"], model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(client, lr_lambda)
    low = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(s["precision"])
    batches = rank_batches(s["seed"])
    closes = windows_close(len(batches), s["accumulation"])
    losses, norms, lrs, micro_index = [], [], [], 0
    for _ in range(s["epochs"]):
        for (x, y), close in zip(batches, closes):
            x, y = x.to(engine.device), y.to(engine.device)
            engine.set_gradient_accumulation_boundary(close)
            out = engine(x.to(low) if low else x).float()
            loss = overflow_loss(F.mse_loss(out, y), micro_index, s.get("overflow_at"))
            engine.backward(loss)
            losses.append(float(loss))
            micro_index += 1
            if close:
                engine.step()
                norm = engine.get_global_grad_norm()
                norms.append(None if norm is None else float(norm))
                if engine.was_step_applied():
                    scheduler.step()
                lrs.append(client.param_groups[0]["lr"])
    return {"losses": losses, "norms": norms, "lrs": lrs, "params": _ds_params(deepspeed, engine)}


def _ds_params(deepspeed: Any, engine: Any) -> dict[str, list[float]]:
    params = list(engine.module.named_parameters())
    gather = (
        deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
        if hasattr(params[0][1], "ds_id")
        else contextlib.nullcontext()
    )
    with gather:
        return {n: p.detach().float().reshape(-1).tolist() for n, p in params}


# ---- raw PyTorch ----------------------------------------------------------------------------
def raw_torch(s: dict[str, Any]) -> dict[str, Any]:
    ensure_process_group()
    precision = s["precision"]
    device = torch.device(s.get("device", "cpu"))
    torch.manual_seed(s["seed"])
    if s.get("zero_init"):
        # deepspeed.zero.Init allocates every tensor on the accelerator (so on CUDA the weights
        # are drawn from the CUDA generator, not the CPU one) and, with the bf16 section, in bf16
        previous = torch.get_default_dtype()
        if precision == "bf16-true":
            torch.set_default_dtype(torch.bfloat16)
        try:
            with device:
                model = Net()
        finally:
            torch.set_default_dtype(previous)
    else:
        model = Net().to(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if precision == "bf16-true":
        master = copy.deepcopy(model).float()  # fp32 master weights, stepped by the optimizer
        model = model.to(torch.bfloat16)  # what forward/backward run on
    else:
        master = model
    optimizer = make_optimizer(s["optimizer"], master.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    batches = rank_batches(s["seed"])
    closes = windows_close(len(batches), s["accumulation"])
    n = s["accumulation"]
    losses, norms, lrs, scales, micro_index = [], [], [], [], 0
    for epoch in range(s["epochs"]):
        epoch_start = epoch * len(batches)
        for (x, y), close in zip(batches, closes):
            x, y = x.to(device), y.to(device)
            with (
                torch.autocast(device.type, dtype=autocast)
                if autocast
                else contextlib.nullcontext()
            ):
                inputs = x.to(torch.bfloat16) if precision == "bf16-true" else x
                out = model(inputs).float()
            loss = overflow_loss(F.mse_loss(out, y), micro_index, s.get("overflow_at"))
            losses.append(float(loss))
            micro_index += 1
            # accelkit's rule divides every window by ``accumulation``; the "own_length" rule
            # (each window by its own length) is the negative twin the tests must tell apart
            scaled = loss / (
                window_length(closes, micro_index - 1 - epoch_start)
                if s.get("rule") == "own_length"
                else n
            )
            (scaler.scale(scaled) if scaler else scaled).backward()
            if precision == "bf16-true":  # accumulate the bf16 grads into the fp32 master
                for low, high in zip(model.parameters(), master.parameters()):
                    g = low.grad.float()
                    high.grad = g if high.grad is None else high.grad + g
                    low.grad = None
            if not close:
                continue
            for p in master.parameters():
                if world > 1:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            if scaler:
                scaler.unscale_(optimizer)
            norm = torch.nn.utils.get_total_norm([p.grad for p in master.parameters()])
            if s.get("clip"):
                torch.nn.utils.clip_grad_norm_(master.parameters(), s["clip"])
            applied = True
            if scaler:
                before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                applied = scaler.get_scale() >= before
                scales.append(scaler.get_scale())
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            norms.append(float(norm) if math.isfinite(float(norm)) else float("inf"))
            if applied:
                scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
            if precision == "bf16-true":
                with torch.no_grad():
                    for low, high in zip(model.parameters(), master.parameters()):
                        low.copy_(high)
    params = {n: p.detach().float().reshape(-1).tolist() for n, p in master.named_parameters()}
    return {"losses": losses, "norms": norms, "lrs": lrs, "params": params, "scales": scales}
