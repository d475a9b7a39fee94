"""The raw-PyTorch side of the checkpoint tests: the workload, and the independent path that
gathers a full state to compare against. Imports nothing from accelkit (checked below), so a
bug in accelkit's checkpoint code cannot hide in the yardstick."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, WIDTH, HIDDEN, SEQ = 19, 6, 10, 5  # odd sizes: uneven FSDP shards
SAMPLES, GLOBAL_BATCH = 48, 8
LR = 0.02


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """Tied embedding/head, a frozen parameter, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = torch.nn.Parameter(torch.randn(WIDTH), requires_grad=False)
        self.register_buffer("pos", torch.randn(SEQ, WIDTH))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos + self.frozen
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Samples(torch.utils.data.Dataset):
    """Token sequences; each item also carries its index, so tests can see the data order."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(99)
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.tokens[index, :-1], self.tokens[index, 1:], index


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Model and optimizer state unsharded, through torch.distributed.checkpoint.state_dict
    (any wrapper: plain, DDP, FSDP2). Returns flat tensors and the param groups; a collective
    where a process group exists, complete on rank 0 only."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    distributed = dist.is_available() and dist.is_initialized()
    options = StateDictOptions(full_state_dict=True, cpu_offload=distributed)
    tensors: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is None:
        msd = get_model_state_dict(model, options=options)
        osd = {"state": {}, "param_groups": []}
    else:
        msd, osd = get_state_dict(model, optimizer, options=options)
    for key, value in msd.items():
        tensors[f"model/{key}"] = value.detach().clone().cpu()
    for fqn, per_param in osd.get("state", {}).items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{fqn}/{key}"] = value.detach().clone().cpu().reshape(value.shape)
    for group in osd.get("param_groups", []):
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()})
    return {"tensors": tensors, "param_groups": groups}


def dump(state: dict, path: Path) -> None:
    """Write a gathered state as <path>.safetensors + <path>.json (rank 0 calls this)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state["tensors"].items()}, f"{path}.safetensors")
    Path(f"{path}.json").write_text(json.dumps(state["param_groups"], default=str))


def undump(path: Path) -> dict:
    from safetensors.torch import load_file

    return {
        "tensors": load_file(f"{path}.safetensors"),
        "param_groups": json.loads(Path(f"{path}.json").read_text()),
    }


def assert_same_state(a: dict, b: dict, *, model_only: bool = False) -> None:
    """Bit for bit: the same keys, dtypes, shapes and values (== , not a tolerance)."""
    ta = {k: v for k, v in a["tensors"].items() if not model_only or k.startswith("model/")}
    tb = {k: v for k, v in b["tensors"].items() if not model_only or k.startswith("model/")}
    assert sorted(ta) == sorted(tb), sorted(set(ta) ^ set(tb))
    for key in ta:
        assert ta[key].dtype == tb[key].dtype, key
        assert ta[key].shape == tb[key].shape, key
        assert torch.equal(ta[key], tb[key]), f"{key} differs"
    if not model_only:
        assert a["param_groups"] == b["param_groups"]


def test_this_reference_imports_nothing_from_accelkit():
    import ast

    imported = set()
    for node in ast.walk(ast.parse(Path(__file__).read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert "torch" in imported  # the walk sees imports at all
    assert not any(name.split(".")[0] == "accelkit" for name in imported), imported
