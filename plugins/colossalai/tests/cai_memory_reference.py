"""Raw reference for the memory-estimate test: the bytes ColossalAI's LowLevelZero really holds.

Imports NOTHING from accelkit. Runs under ``torchrun`` (2 gloo processes): a LowLevelZeroPlugin
through ColossalAI's Booster, as its docs show it, on a model of odd-sized Linear layers (every
parameter padded at world size 2), one forward and backward, then one optimizer step. It reports,
per rank, the bytes of

- ``params``: the working parameters (numel x element size, without LowLevelZero's padding);
- ``grads``: every distinct storage behind the gradient store after backward (stage 1 keeps the
  all-reduced flat buckets, every rank's pieces; stage 2 the reduce-scattered shard);
- ``master``: the fp32 master shards the optimizer steps;
- ``optimizer``: AdamW's ``exp_avg`` and ``exp_avg_sq`` after the step (not the 0-d ``step``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from cai_reference import _cpu_workaround

#: odd sizes so that LowLevelZero pads (world size 2)
SIZES = [(37, 101), (101, 101), (101, 11)]


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(SIZES):
        layers.append(torch.nn.Linear(a, b))
        if i + 1 < len(SIZES):
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(cfg: dict[str, Any]) -> dict[str, int]:
    from colossalai.booster import Booster
    from colossalai.booster.plugin import LowLevelZeroPlugin

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = LowLevelZeroPlugin(
        stage=cfg["stage"], precision=cfg["precision"], overlap_communication=False
    )
    model, optimizer, *_ = Booster(plugin=plugin).boost(model, optimizer)
    low = {"bf16": torch.bfloat16}.get(cfg["precision"])
    x = torch.randn(4, SIZES[0][0], generator=torch.Generator().manual_seed(1))
    out = model(x.to(low) if low is not None else x)
    optimizer.backward(out.float().square().mean())
    grads = [
        g
        for store in optimizer.pg_to_grad_store.values()
        for group in store._grads_of_params.values()
        for pieces in group.values()
        for g in pieces
    ]
    result = {
        "params": _bytes(model.unwrap().parameters()),
        "grads": _storage_bytes(grads),
        "master": _bytes(p for g in optimizer.optim.param_groups for p in g["params"]),
    }
    optimizer.step()
    result["optimizer"] = _bytes(
        v
        for state in optimizer.optim.state.values()
        for key, v in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    optimizer.zero_grad()
    return result


def measure_all(cfgs: list[dict[str, Any]]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    _cpu_workaround()
    out = {cfg["name"]: measure(cfg) for cfg in cfgs}
    out["world_size"] = dist.get_world_size()
    dist.destroy_process_group()
    return out
