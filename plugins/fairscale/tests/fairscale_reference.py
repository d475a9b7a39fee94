"""Raw references for the FairScale plugin tests: torch DDP, FairScale OSS + DDP, FairScale
ShardedDataParallel + OSS and FairScale FSDP, written as their own documentation shows them.

This module imports NOTHING from accelkit (nor from the accelkit-side test workers); its model,
data and loop are its own. It runs under ``torchrun`` (2 gloo processes on the CPU; nccl with
``cfg["device"] = "cuda"``) and returns, per run,
the rank-averaged loss of every micro-batch, the gradient norm of every optimizer step, and the
final full parameters.

The loop is the one accelkit promises (docs/architecture.md,
"Semantics that hold on every backend"): every micro-batch loss is divided by the
accumulation steps N; the optimizer steps after N micro-batches or at the loader's last batch,
whichever comes first (so a short last window is still scaled by 1/N); the window's earlier
micro-batches run under the wrapper's ``no_sync`` (unless ``cfg["no_sync"]`` is False); clipping and the reported norm use the
wrapper's own clip (``torch.nn.utils.clip_grad_norm_`` for DDP, ``OSS.clip_grad_norm``,
``FullyShardedDataParallel.clip_grad_norm_``).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IN, HIDDEN, OUT, DEPTH = 12, 16, 3, 3
SAMPLES, BATCH = 28, 2  # 14 samples per rank -> 7 micro-batches per epoch
SEED, LR = 4321, 0.05


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.blocks = torch.nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.out = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, IN, generator=generator)
    y = torch.randn(SAMPLES, OUT, generator=generator) * 3
    return torch.utils.data.TensorDataset(x, y)


def _loader() -> torch.utils.data.DataLoader:
    data = _data()
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)


def _init(device: str) -> None:
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _wrap(mode: str, model: torch.nn.Module, lr: float, cfg: dict[str, Any]) -> tuple[Any, Any]:
    from torch.nn.parallel import DistributedDataParallel

    device = cfg.get("device", "cpu")
    ddp_kwargs = {"device_ids": [torch.cuda.current_device()]} if device == "cuda" else {}
    if mode == "ddp":
        ddp = DistributedDataParallel(model, **ddp_kwargs)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr)
    if mode == "oss":
        from fairscale.optim import OSS

        ddp = DistributedDataParallel(model, **ddp_kwargs)
        return ddp, OSS(ddp.parameters(), optim=torch.optim.AdamW, lr=lr)
    if mode == "sdp":
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=lr)
        sdp = ShardedDataParallel(
            model, optimizer, reduce_buffer_size=cfg.get("reduce_buffer_size", 0)
        )
        return sdp, optimizer
    if mode == "fsdp":
        from fairscale.nn import FullyShardedDataParallel

        mixed = cfg.get("fsdp_mixed", False)
        kwargs = dict(
            compute_device=torch.device(device, torch.cuda.current_device())
            if device == "cuda"
            else torch.device("cpu"),
            bucket_cap_mb=25 if device == "cuda" else 0,  # gloo rejects FairScale's 2-D bucket
            mixed_precision=mixed,
            compute_dtype=torch.float16 if mixed else None,
            move_params_to_cpu=cfg.get("move_params_to_cpu", False),
        )
        for index in range(len(model.blocks)):  # one nested unit per block, then the root
            model.blocks[index] = FullyShardedDataParallel(model.blocks[index], **kwargs)
        fsdp = FullyShardedDataParallel(model, **kwargs)
        return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=lr)
    raise ValueError(mode)


def _clip(mode: str, model: Any, optimizer: Any, max_norm: float | None) -> torch.Tensor:
    limit = math.inf if max_norm is None else max_norm
    if mode == "ddp":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    if mode in ("oss", "sdp"):
        return optimizer.clip_grad_norm(limit)
    return model.clip_grad_norm_(limit)


def _full_params(mode: str, model: Any) -> dict[str, list[float]]:
    # FairScale's FSDP state_dict() gathers the full parameters on every rank
    state = model.state_dict() if mode == "fsdp" else model.module.state_dict()
    return {k: v.detach().float().flatten().tolist() for k, v in state.items()}


def train(
    mode: str,
    *,
    accumulation: int = 1,
    max_norm: float | None = None,
    epochs: int = 1,
    precision: str = "32-true",
    cfg: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run on this rank; returns losses (rank-averaged), norms and final parameters."""
    cfg = cfg or {}
    device = cfg.get("device", "cpu")
    _init(device)
    if cfg.get("shim"):
        import fairscale_cpu_shim

        fairscale_cpu_shim.apply()
    torch.manual_seed(SEED)
    # with move_params_to_cpu FairScale keeps the fp32 shards on the CPU: hand it a CPU model
    model = Net() if cfg.get("move_params_to_cpu") else Net().to(device)
    wrapped, optimizer = _wrap(mode, model, LR, cfg)
    autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    fsdp_casts = mode == "fsdp" and cfg.get("fsdp_mixed", False)
    scaler = None
    if precision == "16-mixed":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device)
    loader = _loader()
    losses, norms = [], []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        count = len(loader)
        micro = 0
        for index, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            micro += 1
            closes = micro == accumulation or index == count - 1
            skip_sync = not closes and cfg.get("no_sync", True)
            sync = wrapped.no_sync() if skip_sync else contextlib.nullcontext()
            with sync:
                if autocast_dtype is not None and not fsdp_casts:
                    with torch.autocast(device, dtype=autocast_dtype):
                        out = wrapped(x)
                else:
                    out = wrapped(x)
                loss = F.mse_loss(out.float(), y)
                divisor = accumulation
                if cfg.get("divide_by_window"):  # a rule accelkit does NOT follow (negative twin)
                    divisor = min(accumulation, count - (index - micro + 1))
                scaled = loss / divisor
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
            if not closes:
                continue
            micro = 0
            if fsdp_casts and cfg.get("grad_cast", True):
                # FairScale 0.4.13 at world size 1 leaves mixed-precision gradients in fp16 (its
                # _post_reduction_hook casts a temporary .data alias; at world size > 1 the
                # reduce-scattered shard is cast to fp32). AdamW then refuses them, so a raw
                # user casts them as FairScale does at world size > 1.
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None and p.grad.dtype != p.dtype:
                            p.grad = p.grad.to(p.dtype)
            if scaler is not None:
                scaler.unscale_(optimizer)
            if max_norm is not None or cfg.get("track_norm"):
                norms.append(float(_clip(mode, wrapped, optimizer, max_norm)))
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if mode == "sdp" and not cfg.get("optimizer_zero_grad"):
                wrapped.zero_grad(set_to_none=True)
            else:
                optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "norms": norms, "params": _full_params(mode, wrapped)}


def suite(runs: dict[str, dict[str, Any]], catch: bool = False) -> dict[str, Any]:
    """Several runs in one launch (each rebuilds its model from the same seed). With ``catch``,
    a run that raises is reported as ``{"error": ...}`` instead of failing the launch."""
    results = {}
    for name, kwargs in runs.items():
        if not catch:
            results[name] = train(**kwargs)
            continue
        try:
            results[name] = train(**kwargs)
        except Exception as err:
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    results["_rank"] = int(os.environ.get("RANK", "0"))
    return results
