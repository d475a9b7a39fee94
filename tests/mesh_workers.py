"""Workers of tests/test_fsdp_mesh.py: a small transformer trained on an N-D mesh by accelkit's
``fsdp`` and by a raw-PyTorch reference (``init_device_mesh``, ``parallelize_module``,
``fully_shard``, ``MixedPrecisionPolicy``; nothing from accelkit) with the same mesh, plan,
precision, data and accumulation; the save/load jobs of the resume matrix; ``jobs`` runs several
of them in one launch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ, LAYERS = 64, 32, 4, 8, 2
STEPS, ACCUMULATION, BATCH, MAX_NORM = 3, 3, 4, 0.05


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.q_proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.k_proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.v_proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.o_proj = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        head = DIM // HEADS  # under tensor parallelism each rank holds HEADS / tp heads: -1
        q, k, v = (
            p(x).view(b, t, -1, head).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.attn = Attention()
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.up_proj = torch.nn.Linear(DIM, 4 * DIM)
        self.down_proj = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down_proj(F.gelu(self.up_proj(self.norm2(x))))


class TinyGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LossGPT(TinyGPT):
    """TinyGPT whose forward returns the loss: what ``accelkit bench`` trains."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return loss_of(super().forward, tokens)


def bench_model() -> tuple[torch.nn.Module, Any]:
    """``accelkit bench --model mesh_workers:bench_model``: the model and its batches."""

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor]:
        return (torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator),)

    return LossGPT(), make_batch


def batches(dp_rank: int, dp_world: int) -> list[torch.Tensor]:
    """Every micro-batch of the run; this data-parallel rank's rows."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (STEPS * ACCUMULATION, BATCH * dp_world, SEQ + 1), generator=g)
    return [d[dp_rank * BATCH : (dp_rank + 1) * BATCH] for d in data]


def loss_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()  # bf16-mixed: the loss in fp32, as accelkit's
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def full_params(model: torch.nn.Module) -> dict[str, list[float]]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().reshape(-1).tolist()
    return out


def _plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(LAYERS):
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"blocks.{i}.attn.{n}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.o_proj"] = RowwiseParallel()
        plan[f"blocks.{i}.up_proj"] = ColwiseParallel()
        plan[f"blocks.{i}.down_proj"] = RowwiseParallel()
    return plan


def _join(device: str) -> bool:
    """Join the process group unless a job before this one did; True if this call joined."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")
    return True


def _mp_policy(precision: str) -> Any:
    """What ``precision`` means on raw FSDP2: bf16 compute, fp32 master and reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert precision == "32-true", precision
    return MixedPrecisionPolicy()


def reference(
    replicate: int, shard: int, tp: int, device: str = "cpu", precision: str = "32-true"
) -> dict[str, Any]:
    """Raw PyTorch: the same mesh, plan, FSDP2 units, precision, accumulation and clipping."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    joined = _join(device)
    mesh = init_device_mesh(device, (replicate, shard, tp), mesh_dim_names=("r", "s", "t"))
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    if tp > 1:
        parallelize_module(model, mesh["t"], _plan())
    dp_mesh = mesh["r", "s"] if replicate > 1 else mesh["s"]
    policy = _mp_policy(precision)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = mesh["r"].get_local_rank() * shard + mesh["s"].get_local_rank()
    losses, norms = [], []
    data = [d.to(device) for d in batches(dp_rank, replicate * shard)]
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            last = micro == ACCUMULATION - 1
            model.set_requires_gradient_sync(last)
            loss = loss_of(model, data[step * ACCUMULATION + micro]) / ACCUMULATION
            loss.backward()
            mean = loss.detach().clone() * ACCUMULATION
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
        # the global norm: per mesh (tensor-parallel and plain parameters live on different
        # meshes), then combined; clip_grad_norm_ cannot mix meshes in one foreach
        params = [p for p in model.parameters() if p.grad is not None]
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
        parts = [torch.nn.utils.get_total_norm(g) for g in by_mesh.values()]
        parts = [n.full_tensor() if isinstance(n, DTensor) else n for n in parts]
        norm = torch.stack(parts).square().sum().sqrt()
        for group in by_mesh.values():  # clip mesh by mesh: one foreach cannot mix meshes
            torch.nn.utils.clip_grads_with_norm_(
                [p for p in params if any(p.grad is g for g in group)], MAX_NORM, norm
            )
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "norms": norms, "params": full_params(model)}
    if joined:
        dist.destroy_process_group()
    return out


def accelkit_run(
    options: dict[str, Any],
    device: str = "cpu",
    precision: str = "32-true",
    meta: bool = False,
    compile: Any = False,
    heads: int | None = None,
) -> dict[str, Any]:
    """accelkit's loop; ``meta``: built inside ``accel.init_module()`` (on the meta device);
    ``heads``: claim another head count (a plan check's negative twin)."""
    import contextlib

    import accelkit

    accel = accelkit.get(
        "fsdp",
        device=device,
        precision=precision,
        accumulation_steps=ACCUMULATION,
        max_grad_norm=MAX_NORM,
        **options,
    )
    torch.manual_seed(0)
    with accel.init_module() if meta else contextlib.nullcontext():
        model = TinyGPT()
    for block in model.blocks if heads else ():
        block.attn.num_heads = heads
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), compile=compile)
    backend = accel.backend
    data = [
        d.to(device) for d in batches(backend.data_parallel_rank, backend.data_parallel_world_size)
    ]
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            with accel.accumulate(model):
                loss = loss_of(model, data[step * ACCUMULATION + micro])
                accel.backward(loss)  # accelkit divides by accumulation_steps
            # the loss is the same on the tp ranks of a replica: mean over the replicas only
            losses.append(float(accel.all_reduce(loss.detach(), "mean")))
            if accel.step():
                norms.append(float(accel.grad_norm))
            opt.zero_grad()
    out = {
        "losses": losses,
        "norms": norms,
        "params": full_params(model),
        "dp": [backend.data_parallel_rank, backend.data_parallel_world_size],
    }
    if compile:  # what torch.compile made: a run that compiled nothing would pass as eager
        from torch._dynamo.utils import counters

        out["graphs"] = int(counters["stats"]["unique_graphs"])
    accel.end_training()
    return out


def max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)


#: rows of every resume step's global batch, split evenly over the data-parallel ranks: the
#: same global step on every layout (1, 2 or 4 data-parallel ranks)
GLOBAL_ROWS = 8


def global_rows(step: int, dp_rank: int, dp_world: int) -> torch.Tensor:
    """This data-parallel rank's rows of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=g)
    n = GLOBAL_ROWS // dp_world
    return data[dp_rank * n : (dp_rank + 1) * n]


def _accelerator(options: dict[str, Any]) -> Any:
    """``{"backend": name, **options}`` (fsdp by default), on the CPU, clipping at MAX_NORM."""
    import accelkit

    options = dict(options)
    name = options.pop("backend", "fsdp")
    extra = {"device": "cpu"} if name in ("fsdp", "ddp") else {}
    return accelkit.get(name, max_grad_norm=MAX_NORM, **extra, **options)


def _train_step(accel: Any, model: Any, opt: Any, step: int) -> None:
    backend = accel.backend
    tokens = global_rows(step, backend.data_parallel_rank, backend.data_parallel_world_size)
    accel.backward(loss_of(model, tokens))
    accel.step()
    opt.zero_grad()


def save_job(options: dict[str, Any], path: str) -> dict[str, Any]:
    """Train 2 steps on this layout, save the portable checkpoint (model and optimizer), then
    train step 3: the full weights at the save and after step 3."""
    accel = _accelerator(options)
    torch.manual_seed(0)
    model = TinyGPT()
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        _train_step(accel, model, opt, step)
    accel.save(path, {"model": model, "optimizer": opt})
    out = {"params": full_params(accel.unwrap(model))}
    _train_step(accel, model, opt, 2)
    out["after"] = full_params(accel.unwrap(model))
    accel.end_training()
    return out


def load_job(
    options: dict[str, Any], path: str, keys: tuple[str, ...] = ("model", "optimizer")
) -> dict[str, Any]:
    """Load the checkpoint into a fresh model on this layout, then train step 3: the full
    weights right after the load and after step 3 (which AdamW's loaded state steers)."""
    accel = _accelerator(options)
    torch.manual_seed(1)  # other initial weights: the load must replace them
    model = TinyGPT()
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": opt}
    accel.load(path, {k: state[k] for k in keys})
    out = {"params": full_params(accel.unwrap(model))}
    _train_step(accel, model, opt, 2)
    out["after"] = full_params(accel.unwrap(model))
    accel.end_training()
    return out


def refused(job: dict[str, Any]) -> str:
    """Run a job that must fail: its error as ``"TypeName: message"`` ("" if it did not)."""
    try:
        globals()[job["run"]](**{k: v for k, v in job.items() if k != "run"})
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


def single_process(dp_world: int) -> dict[str, Any]:
    """Raw PyTorch on one process: the whole global batch (every data-parallel rank's rows)."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(0, 1) if dp_world == 1 else _global_batches(dp_world)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            loss = loss_of(model, data[step * ACCUMULATION + micro])
            (loss / ACCUMULATION).backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "params": full_params(model)}


def _global_batches(dp_world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return list(
        torch.randint(0, VOCAB, (STEPS * ACCUMULATION, BATCH * dp_world, SEQ + 1), generator=g)
    )


def jobs(jobs: list[dict[str, Any]]) -> list[Any]:
    """Several jobs in one launch (a 4-process start costs ~20 s here): each is
    ``{"run": "reference" | "accelkit_run" | ..., **its keyword arguments}``, run in order in
    one process group."""
    import torch.distributed as dist

    joined = _join(jobs[0].get("device", "cpu"))
    out = [globals()[job["run"]](**{k: v for k, v in job.items() if k != "run"}) for job in jobs]
    if joined and dist.is_initialized():
        dist.destroy_process_group()
    return out
