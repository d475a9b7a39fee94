"""``max_grad_value``: every gradient element clamped to [-v, v] inside ``step()`` (before
``max_grad_norm``), matching a raw loop with ``torch.nn.utils.clip_grad_value_`` on ``cpu`` (bit
for bit) and ``fsdp`` x2 (sharded gradients clamp element by element: within 1e-6 of one
process, the measured floor being 6e-8); refused at ``get()`` where the library owns the
gradients; MMEngine's ``clip_grad=dict(type='value')`` maps to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.testing import run_ranks

HERE = Path(__file__).parent
VALUE, NORM, STEPS = 0.02, 0.05, 4


def _data(rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=g) * 5, torch.randn(8, 2, generator=g)
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        out.append((x[rows], y[rows]))
    return out


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def raw(norm: float | None = None) -> list[torch.Tensor]:
    """Raw PyTorch: clamp by value, then (optionally) clip the norm, then step."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for x, y in _data():
        torch.nn.functional.mse_loss(net(x), y).backward()
        torch.nn.utils.clip_grad_value_(net.parameters(), VALUE)
        if norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), norm)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def ours(backend: str = "cpu", norm: float | None = None, **options) -> list[list[float]]:
    accel = accelkit.get(backend, max_grad_value=VALUE, max_grad_norm=norm, **options)
    net = _net()
    model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    for x, y in _data(accel.rank, accel.world_size):
        accel.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    out = [p.detach().reshape(-1).tolist() for p in params]
    accel.end_training()
    return out


@pytest.mark.parametrize("norm", [None, NORM], ids=["value", "value-then-norm"])
def test_cpu_clamps_like_a_raw_loop(norm):
    want = raw(norm)
    got = ours(norm=norm)
    assert all(g == w.reshape(-1).tolist() for g, w in zip(got, want))
    assert not all(g == w.reshape(-1).tolist() for g, w in zip(ours(norm=None), raw(NORM)))


def fsdp_job() -> list[list[float]]:
    return ours("fsdp", device="cpu")


@pytest.mark.slow  # 2 ranks under FSDP: 7-11 s
def test_fsdp_clamps_its_shards_like_one_process():
    ranks = run_ranks("test_clip_value:fsdp_job", nproc=2, timeout=300, path=[HERE])
    want = [w.reshape(-1).tolist() for w in raw()]
    for result in ranks:
        worst = max(abs(a - b) for g, w in zip(result, want) for a, b in zip(g, w))
        assert worst < 1e-6, worst


def test_refused_where_the_library_owns_the_gradients():
    pytest.importorskip("deepspeed")
    with pytest.raises(accelkit.ConfigError, match="max_grad_value is not available there"):
        accelkit.get("deepspeed_stage_2", max_grad_value=1.0)
    with pytest.raises(accelkit.ConfigError, match="max_grad_value must be a positive number"):
        accelkit.get("cpu", max_grad_value=0)
