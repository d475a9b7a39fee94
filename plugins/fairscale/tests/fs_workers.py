"""The accelkit side of the FairScale plugin tests: the same workload as the raw reference
(``fairscale_reference.py``), defined again here (the two share no code), trained through
``accelkit.get(...)``. Runs under ``torchrun`` on 2 gloo processes."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

IN, HIDDEN, OUT, DEPTH = 12, 16, 3, 3
SAMPLES, BATCH = 28, 2
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


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, IN, generator=generator)
    y = torch.randn(SAMPLES, OUT, generator=generator) * 3
    return torch.utils.data.TensorDataset(x, y)


def build(backend: str, *, shim: bool = False, **get_kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """accelerator, model, optimizer, loader (the model built from SEED after get())."""
    if shim:
        import fairscale_cpu_shim

        fairscale_cpu_shim.apply()
    import accelkit

    accel = accelkit.get(backend, **get_kwargs)
    torch.manual_seed(SEED)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accel.setup(model, optimizer)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    return accel, model, optimizer, accel.setup_dataloader(loader)


def train(
    backend: str,
    *,
    accumulation: int = 1,
    max_norm: float | None = None,
    epochs: int = 1,
    precision: str = "32-true",
    options: dict[str, Any] | None = None,
    shim: bool = False,
    track_norm: bool = False,
    use_accumulate: bool = True,
) -> dict[str, Any]:
    accel, model, optimizer, loader = build(
        backend,
        shim=shim,
        precision=precision,
        accumulation_steps=accumulation,
        max_grad_norm=max_norm,
        track_grad_norm=track_norm,
        **(options or {}),
    )
    losses, norms = [], []
    for _ in range(epochs):
        for x, y in loader:
            if use_accumulate:
                with accel.accumulate(model):
                    loss = F.mse_loss(model(x), y)
                    accel.backward(loss)
            else:
                loss = F.mse_loss(model(x), y)
                accel.backward(loss)
            if accel.step() and (max_norm is not None or track_norm):
                norms.append(float(accel.grad_norm))
            losses.append(accel.all_reduce(loss.detach(), "mean").item())
    state = accel.full_state_dict(model)
    return {
        "losses": losses,
        "norms": norms,
        "params": {k: v.detach().float().flatten().tolist() for k, v in state.items()},
        "applied_steps": accel.applied_steps,
        "optimizer_class": type(optimizer.optimizer).__name__,
        "units": sum(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()),
        "local_numel": sum(p.numel() for p in model.parameters()),
    }


def suite(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, kwargs in runs.items():
        try:
            results[name] = train(**kwargs)
        except Exception as err:  # reported per run, so one failure names itself
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    results["_rank"] = int(os.environ.get("RANK", "0"))
    return results


# ---- checkpoints --------------------------------------------------------------------------------
def _param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _to_json_state(per_param: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            key: (v.detach().float().flatten().tolist() if isinstance(v, torch.Tensor) else v)
            for key, v in sorted(values.items())
        }
        for name, values in per_param.items()
    }


def _fsdp_full_optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every original parameter's optimizer state, rebuilt in test code from each rank's flat
    shards (all-gathered with raw torch) and FairScale's ``local_metadata_dict()``.

    Not FairScale's ``gather_full_optim_state_dict``: in 0.4.13 it returns the last state key's
    values for every key on the CPU (it all-gathers each key into one reused buffer and keeps
    ``x.cpu()``, which on the CPU is that buffer), replaces the live optimizer's tensor ``step``
    with an int (the next AdamW step then fails), and fails at world size 1."""
    import torch.distributed as dist
    from fairscale.nn import FullyShardedDataParallel

    units = [m for _, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]
    metadata = model.local_metadata_dict()["param_metadata"]
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for unit, meta in zip(units, metadata):
        prefix = meta["fsdp_path"]
        for param, info in zip(unit.params, meta["params"].values()):
            names = [f"{prefix}.{n}" if prefix else n for n in info["names"]]
            for key, value in optimizer.state[param].items():
                if value.dim() == 0:
                    for name in names:
                        out.setdefault(name, {})[key] = value
                    continue
                parts = [torch.empty_like(value) for _ in range(world)]
                dist.all_gather(parts, value.contiguous())
                full = torch.cat(parts)[: sum(info["numels"])]
                for name, piece in zip(names, full.split(info["numels"])):
                    out.setdefault(name, {})[key] = piece
    return _to_json_state(out)


def native_full_state(backend: str, model: Any, optimizer: Any) -> dict[str, Any]:
    """The full parameters and optimizer state gathered WITHOUT accelkit's checkpoint code:
    torch's state_dict for cpu/ddp, torch's get_model/optimizer_state_dict(full_state_dict) for
    fsdp (FSDP2), OSS.consolidate_state_dict for fairscale_oss/sdp, FairScale
    FSDP's state_dict() for the parameters and a test-side gather of the optimizer's flat shards
    (see _fsdp_full_optimizer_state). Optimizer state is None on ranks OSS does not hand it to."""
    import torch.distributed as dist

    inner_opt = optimizer.optimizer
    rank = dist.get_rank() if dist.is_initialized() else 0
    if backend == "fairscale_fsdp":
        params = {k: v.detach().float().flatten().tolist() for k, v in model.state_dict().items()}
        return {"params": params, "optim": _fsdp_full_optimizer_state(model, inner_opt)}
    if backend == "fsdp":  # torch FSDP2: torch's own full state dicts, keyed by name
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        params = get_model_state_dict(model, options=full)
        optim = get_optimizer_state_dict(model, inner_opt, options=full)["state"]
        return {
            "params": {k: v.detach().float().flatten().tolist() for k, v in params.items()},
            "optim": _to_json_state(optim),
        }
    user = model.module if hasattr(model, "module") else model
    params = {k: v.detach().float().flatten().tolist() for k, v in user.state_dict().items()}
    names = _param_names(user)
    if backend in ("fairscale_oss", "fairscale_sdp"):
        inner_opt.consolidate_state_dict(recipient_rank=0)
        if rank != 0:
            return {"params": params, "optim": None}
        state = inner_opt.state_dict()
    else:
        state = inner_opt.state_dict()
    order = [p for group in inner_opt.param_groups for p in group["params"]]
    per_param = {names[id(order[i])]: s for i, s in state["state"].items()}
    return {"params": params, "optim": _to_json_state(per_param)}


def ckpt_job(
    backend: str,
    *,
    total: int,
    save_at: int | None = None,
    save_to: str | None = None,
    load_from: str | None = None,
    options: dict[str, Any] | None = None,
    shim: bool = False,
    batch: int = BATCH,
    skew_step: bool = False,
    strict: bool = True,
    refused: bool = False,
) -> dict[str, Any]:
    """Train ``total`` steps (accumulation 1, clip 1.0); optionally load first (then continue
    from the saved step) and save after step ``save_at``. Records the losses and the full state
    gathered through the library's own path at the save and right after the load.

    ``skew_step``: the last parameter's torch ``step`` is one behind the others in the save.
    ``refused``: a load expected to fail returns its error and whether the live state (the
    library's own gather) is what it was before the load."""
    import accelkit

    if shim:
        import fairscale_cpu_shim

        fairscale_cpu_shim.apply()
    accel = accelkit.get(backend, max_grad_norm=1.0, **(options or {}))
    torch.manual_seed(SEED)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accel.setup(model, optimizer)
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(dataset(), batch_size=batch, shuffle=False)
    )
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    result: dict[str, Any] = {"losses": {}}
    step = 0
    if load_from:
        before = native_full_state(backend, model, optimizer) if refused else None
        try:
            accel.load(load_from, state, strict=strict)
        except Exception as err:
            if before is None:
                raise
            after = native_full_state(backend, model, optimizer)
            return {"error": f"{type(err).__name__}: {err}", "unchanged": after == before}
        step = state["step"]
        result["after_load"] = native_full_state(backend, model, optimizer)
    while step < total:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            accel.backward(loss)
            accel.step()
            result["losses"][step] = accel.all_reduce(loss.detach(), "mean").item()
            step += 1
            if step == save_at and save_to:
                state["step"] = step
                if skew_step:
                    last = optimizer.optimizer.param_groups[0]["params"][-1]
                    optimizer.optimizer.state[last]["step"] -= 1
                accel.save(save_to, state)
                result["at_save"] = native_full_state(backend, model, optimizer)
            if step >= total:
                break
    return result


def ckpt_jobs(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several checkpoint jobs in one launch, in order; an error is reported per job."""
    results: dict[str, Any] = {}
    for job in jobs:
        name = job.pop("name")
        try:
            results[name] = ckpt_job(**job)
        except Exception as err:
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    return results
