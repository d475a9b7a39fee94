"""``setup(..., activation_checkpointing=..., compile=...)`` on ``cpu`` and ``ddp`` (issue 3, item 3:
"on every backend that supports it"; the ``fsdp`` side is in ``test_fsdp.py``).

Each run is checked three ways: the feature is really in force (a checkpointed block's forward
runs again in backward; the compiler backend is handed the model's graph), parameter names do
not change, and the numbers match a raw-PyTorch loop without either feature (written here, it
imports nothing from accelkit).

Tolerance, fixed before the first run: fp32 relative error <= 1e-5 (the issue's fp32 bound) for
every loss, grad norm and final weight. Measured on torch 2.13 CPU: 0 (bit-identical) for
checkpointing, for compile and for both, on ``cpu`` and on ``ddp`` with 2 gloo processes --
non-reentrant recomputation repeats the same kernels, and the recording compiler backend runs
the captured graph eagerly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from accelkit.testing import run_ranks

FEATURES, WIDTH, LAYERS, STEPS, BATCH = 6, 16, 3, 4, 4
SEED, LR, MAX_NORM = 321, 0.05, 0.5
FP32_RTOL = 1e-5


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class CountingBlock(Block):
    """Counts its forward calls (recomputation in backward calls it again). Not compiled."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


class Stack(torch.nn.Module):
    def __init__(self, block: type[Block] = Block) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(FEATURES, WIDTH)
        self.blocks = torch.nn.ModuleList(block() for _ in range(LAYERS))
        self.out = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def batches(rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randn(BATCH, FEATURES, generator=generator),
            torch.randn(BATCH, 1, generator=generator),
        )
        for _ in range(STEPS)
    ]


def initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return {k: v.clone() for k, v in Stack().state_dict().items()}


# ---- the raw reference: plain torch, no checkpointing, no compile ------------------------------
def raw_run(data: list, *, ddp: bool = False) -> dict[str, Any]:
    model = Stack()
    model.load_state_dict(initial_weights())
    trained = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for x, y in data:
        loss = F.mse_loss(trained(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "final": final}


# ---- the accelkit side -------------------------------------------------------------------------
def accelkit_run(backend: str, data: list, block: type[Block] = Block, **setup_kwargs: Any):
    import accelkit

    accel = accelkit.get(backend, max_grad_norm=MAX_NORM)
    model = Stack(block)
    model.load_state_dict(initial_weights())
    names = [n for n, _ in model.named_parameters()]
    model, _ = accel.setup(
        model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), **setup_kwargs
    )
    losses, norms = [], []
    for x, y in data:
        loss = F.mse_loss(model(x), y)
        accel.backward(loss)
        accel.step()
        losses.append(loss.item())
        norms.append(float(accel.grad_norm))
    own = accel.unwrap(model)
    final = {k: v.detach().clone() for k, v in own.state_dict().items()}
    return {
        "losses": losses,
        "norms": norms,
        "final": final,
        "names_kept": [n for n, _ in own.named_parameters()] == names,
        "checkpointed": [getattr(b, "_accelkit_checkpointed", False) for b in own.blocks],
        "head_checkpointed": getattr(own.out, "_accelkit_checkpointed", False),
        "compiled": model._compiled_call_impl is not None,
    }


def recording_compiler(graphs: list[int]) -> Any:
    """A torch.compile backend that records each graph it is given and runs it eagerly."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(
            sum(1 for n in gm.graph.nodes if n.op == "call_module" or n.op == "call_function")
        )
        return gm.forward

    return backend


def errors(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    def rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))

    weights = max(
        float((run["final"][k] - ref["final"][k]).norm() / ref["final"][k].norm())
        for k in ref["final"]
    )
    return {
        "loss": rel(run["losses"], ref["losses"]),
        "norm": rel(run["norms"], ref["norms"]),
        "weights": weights,
    }


def assert_within(errs: dict[str, float]) -> None:
    for key, value in errs.items():
        assert value <= FP32_RTOL, (key, value)


# ---- cpu ---------------------------------------------------------------------------------------
def test_cpu_activation_checkpointing_recomputes_blocks_and_keeps_the_numbers():
    data = batches()
    ref = raw_run(data)
    CountingBlock.calls = 0
    plain = accelkit_run("cpu", data, CountingBlock)
    calls_without = CountingBlock.calls
    CountingBlock.calls = 0
    run = accelkit_run("cpu", data, CountingBlock, activation_checkpointing=True)
    assert calls_without == LAYERS * STEPS
    assert CountingBlock.calls == 2 * LAYERS * STEPS  # each block's forward again in backward
    assert run["checkpointed"] == [True] * LAYERS and not any(plain["checkpointed"])
    assert run["names_kept"]
    assert_within(errors(plain, ref))
    assert_within(errors(run, ref))


def test_cpu_activation_checkpointing_by_class_and_by_predicate():
    data = batches()[:1]
    by_class = accelkit_run("cpu", data, activation_checkpointing=[Block])
    assert by_class["checkpointed"] == [True] * LAYERS
    head_only = accelkit_run(
        "cpu",
        data,
        activation_checkpointing=lambda m: isinstance(m, torch.nn.Linear) and m.out_features == 1,
    )
    assert head_only["checkpointed"] == [False] * LAYERS and head_only["head_checkpointed"]


def test_cpu_compile_after_checkpointing_keeps_names_and_numbers():
    torch._dynamo.reset()
    data = batches()
    ref = raw_run(data)
    graphs: list[int] = []
    run = accelkit_run(
        "cpu",
        data,
        compile={"backend": recording_compiler(graphs)},
        activation_checkpointing=True,
    )
    assert run["compiled"] and graphs, "the compiler backend was never called"
    assert run["checkpointed"] == [True] * LAYERS
    assert run["names_kept"]
    assert_within(errors(run, ref))
    torch._dynamo.reset()


# ---- ddp on 2 gloo processes -------------------------------------------------------------------
def ddp_worker() -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = batches(rank)
    ref = raw_run(data, ddp=True)
    out: dict[str, Any] = {}
    CountingBlock.calls = 0
    run = accelkit_run("ddp", data, CountingBlock, activation_checkpointing=True)
    out["checkpointing"] = errors(run, ref)
    out["recomputed_calls"] = CountingBlock.calls
    out["checkpointed"] = run["checkpointed"]
    out["names_kept"] = run["names_kept"]
    graphs: list[int] = []
    run = accelkit_run(
        "ddp", data, compile={"backend": recording_compiler(graphs)}, activation_checkpointing=True
    )
    out["compiled_and_checkpointed"] = errors(run, ref)
    out["compiled"] = run["compiled"]
    out["graphs"] = len(graphs)
    out["checkpointed_when_compiled"] = run["checkpointed"]
    out["ref_losses"] = ref["losses"]
    return out


@pytest.mark.slow  # 2 ranks compiling: 5-10 s
def test_ddp_activation_checkpointing_and_compile_keep_the_numbers():
    ranks = run_ranks("test_setup_features:ddp_worker", timeout=300)
    for rank, out in enumerate(ranks):
        assert out["recomputed_calls"] == 2 * LAYERS * STEPS, rank
        assert out["checkpointed"] == [True] * LAYERS and out["names_kept"]
        assert out["compiled"] and out["graphs"] > 0, "the compiler backend was never called"
        assert out["checkpointed_when_compiled"] == [True] * LAYERS
        assert_within(out["checkpointing"])
        assert_within(out["compiled_and_checkpointed"])
    assert ranks[0]["ref_losses"] != ranks[1]["ref_losses"]  # each rank trained on its own data
