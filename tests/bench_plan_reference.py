"""Raw-PyTorch reference for tests/test_bench_plan.py (imports nothing from accelkit).

It is two things:

- a user model module as ``accelkit bench/plan --model bench_plan_reference:build`` loads it
  (``build()`` and ``make_batch(batch_size, generator)``);
- a script that measures, in a fresh process on the CPU, the peak memory one forward and
  backward of that model takes: the growth of the process's peak resident set (``VmHWM``, reset
  through ``/proc/self/clear_refs``) over its resident set just before the step. glibc returns
  large blocks to the system when they are freed, so for tensors of a few MB and more this
  follows the live tensor bytes.

    python bench_plan_reference.py rss 32-true 8   -> {"peak_bytes": ..., "grad_bytes": ...}
"""

from __future__ import annotations

import json
import re
import sys

import torch
import torch.nn.functional as F
from torch import nn

#: (vocab, width, layers, heads, seq): the small CPU shape and GPT-2 small for the GPU checks
SMALL = (4096, 256, 4, 4, 256)
GPT2 = (50304, 768, 12, 12, 1024)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Net(nn.Module):
    """A small GPT-like decoder; its forward returns the loss."""

    def __init__(self, shape: tuple[int, int, int, int, int] = SMALL) -> None:
        super().__init__()
        vocab, width, layers, heads, _seq = shape
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def build() -> nn.Module:
    return Net(SMALL)


def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return _tokens(SMALL, batch_size, generator)


#: (width, hidden, layers) of MeshNet: the model of the mesh estimates' hand counts
MESH_NET = (64, 256, 2)


class MeshBlock(nn.Module):
    """An MLP block whose Linear names the tensor-parallel auto plan shards (up column-wise,
    down row-wise)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width, hidden)
        self.down_proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class MeshNet(nn.Module):
    """Blocks of MeshBlock and a head the plan leaves whole; the forward returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        width, hidden, layers = MESH_NET
        self.blocks = nn.ModuleList(MeshBlock(width, hidden) for _ in range(layers))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def build_mesh_net() -> nn.Module:
    return MeshNet()


def make_mesh_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, MESH_NET[0], generator=generator),)


def mesh_shard_bytes(shapes: list[tuple[int, int, int]]) -> list[dict[str, int]]:
    """:func:`mesh_share` on each ``(replicate, shard, tp)`` mesh, in one process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = [mesh_share(*shape) for shape in shapes]
    dist.destroy_process_group()
    return out


def mesh_share(replicate: int, shard: int, tp: int) -> dict[str, int]:
    """A rank's share under raw FSDP2 x TP on a (replicate, shard, tp) mesh (gloo, fp32) after
    one AdamW step: bytes of its local parameter, gradient and optimizer-state pieces."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (replicate, shard, tp), mesh_dim_names=("r", "s", "t"))
    torch.manual_seed(0)
    model = MeshNet()
    if tp > 1:
        plan: dict[str, object] = {}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.up_proj"] = ColwiseParallel()
            plan[f"blocks.{i}.down_proj"] = RowwiseParallel()
        parallelize_module(model, mesh["t"], plan)
    dp_mesh = mesh["r", "s"] if replicate > 1 else mesh["s"]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*make_mesh_batch(2, torch.Generator().manual_seed(0))).backward()

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    grads = sum(nbytes(local(p.grad)) for p in model.parameters())
    optimizer.step()
    states = [local(v) for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    out = {
        "params": sum(nbytes(local(p)) for p in model.parameters()),
        "grads": grads,
        "optimizer": sum(nbytes(t) for t in states),
    }
    return out


def build_gpt2() -> tuple[nn.Module, object]:
    """GPT-2 small with its batch factory (the ``(model, make_batch)`` form of a factory)."""
    return Net(GPT2), lambda b, g: _tokens(GPT2, b, g)


def _tokens(shape: tuple[int, ...], batch_size: int, generator: torch.Generator) -> tuple:
    vocab, seq = shape[0], shape[-1]
    idx = torch.randint(0, vocab, (batch_size, seq), generator=generator)
    return idx, torch.randint(0, vocab, (batch_size, seq), generator=generator)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def measure_rss(precision: str, batch_size: int) -> dict[str, int]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net(SMALL)
    batch = make_batch(batch_size, torch.Generator().manual_seed(0))
    mixed = precision == "bf16-mixed"

    def step(inputs: tuple[torch.Tensor, ...]) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = model(*inputs)
        loss.backward()

    step(tuple(t[:1, :8] for t in batch))  # first-call allocations (kernels, thread pools)
    model.zero_grad(set_to_none=True)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step(batch)
    peak = _status("VmHWM") - before
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    return {"peak_bytes": peak, "grad_bytes": grads}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def deepspeed_state(stage: int) -> dict[str, int]:
    """Raw DeepSpeed ZeRO-``stage`` on the CPU, one process, fp32, torch AdamW, one step: the
    bytes of the flat parameters, the fp32 master partitions and the optimizer state."""
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 1000))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    torch.manual_seed(0)
    model = Net(SMALL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, zero_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config
    )
    loss = engine(*make_batch(2, torch.Generator().manual_seed(0)))
    engine.backward(loss)
    engine.step()
    states = [
        v
        for state in zero_optimizer.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    return {
        "params": sum(nbytes(t) for t in zero_optimizer.bit16_groups_flat),
        "master": sum(nbytes(t) for t in zero_optimizer.single_partition_of_fp32_groups),
        "optimizer": sum(nbytes(t) for t in states),
    }


def fsdp_shard_bytes() -> dict[str, int]:
    """A rank's share under raw FSDP2 (blocks, then the root; gloo, fp32) after one AdamW step:
    bytes of its local parameter, gradient and optimizer-state shards (run on 2 ranks)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Net(SMALL)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*make_batch(2, torch.Generator().manual_seed(dist.get_rank()))).backward()

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    grads = sum(nbytes(local(p.grad)) for p in model.parameters())
    optimizer.step()
    states = [local(v) for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    out = {
        "params": sum(nbytes(local(p)) for p in model.parameters()),
        "grads": grads,
        "optimizer": sum(nbytes(t) for t in states),
    }
    dist.destroy_process_group()
    return out


def gpu_peak(config: str, batch_size: int, steps: int = 3) -> dict[str, int]:
    """``torch.cuda.max_memory_allocated`` of GPT-2 small in bf16-mixed with fused AdamW, over
    ``steps`` steps: ``cuda`` (the plain loop), ``ddp`` (DDP, one process, bucket views),
    ``fsdp`` (FSDP2, blocks then root, bf16 params / fp32 reduce) or ``deepspeed_stage_2``
    (DeepSpeed's torch_autocast section, ZeRO-2)."""
    import os

    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29800 + os.getpid() % 1000))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.manual_seed(0)
    model, make = build_gpt2()
    batch = tuple(t.to(device) for t in make(batch_size, torch.Generator().manual_seed(0)))
    autocast = config in ("cuda", "ddp")
    if config == "deepspeed_stage_2":
        import deepspeed

        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ds_config = {
            "train_micro_batch_size_per_gpu": batch_size,
            "zero_optimization": {"stage": 2},
            "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

        def step() -> None:
            engine.backward(engine(*batch))
            engine.step()
    else:
        if config == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            dist.init_process_group("nccl", device_id=device)
            model = model.to(device)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        elif config == "ddp":
            dist.init_process_group("nccl", device_id=device)
            model = torch.nn.parallel.DistributedDataParallel(
                model.to(device), device_ids=[0], gradient_as_bucket_view=True
            )
        else:
            model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    return {"peak_bytes": torch.cuda.max_memory_allocated(device)}


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "rss":
        print(json.dumps(measure_rss(sys.argv[2], int(sys.argv[3]))))
    elif command == "deepspeed_state":
        print(json.dumps(deepspeed_state(int(sys.argv[2]))))
    elif command == "gpu_peak":
        print(json.dumps(gpu_peak(sys.argv[2], int(sys.argv[3]))))
