"""The accelkit side of tests/test_pipeline.py: a loop with ``accel.forward_backward`` on
``fsdp`` or ``ddp`` with ``pp > 1``. The model is defined here again (the reference side,
tests/pipeline_reference.py, shares nothing with this one)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import accelkit

D = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(D, 2 * D)
        self.down_proj = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.tanh(self.up_proj(x)))


class Net(nn.Module):
    def __init__(self, n_layers: int = 8, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(D if tie else 8, D, bias=False)
        self.layers = nn.ModuleList(MLP() for _ in range(n_layers))
        self.head = nn.Linear(D, D if tie else 4, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _dataset(n_batches: int, batch: int, tie: bool) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    width_in, width_out = (D, D) if tie else (8, 4)
    xs, ys = [], []
    for _ in range(n_batches):
        xs.append(torch.randn(batch, width_in, generator=g))
        ys.append(torch.randn(batch, width_out, generator=g))
    return torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))


def _params(module: nn.Module) -> dict[str, list[float]]:
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().reshape(-1).tolist()
    return out


def train(
    *,
    backend: str,
    pp: int,
    pipeline: dict[str, Any],
    n_batches: int,
    batch: int,
    accumulation: int = 1,
    optimizer: str = "sgd",
    max_grad_norm: float | None = 1.0,
    n_layers: int = 8,
    tie: bool = False,
    options: dict[str, Any] | None = None,
    meta: bool = True,
    device: str = "cpu",
) -> dict[str, Any]:
    """``batch`` is one replica's batch; the loader holds ``n_batches`` global batches."""
    accel = accelkit.get(
        backend,
        pp=pp,
        pipeline=pipeline,
        accumulation_steps=accumulation,
        max_grad_norm=max_grad_norm,
        device=device,
        **(options or {}),
    )
    dp = accel.backend.data_parallel_world_size
    torch.manual_seed(0)
    with accel.init_module(empty_init=None if meta else False):
        model = Net(n_layers, tie)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    model, opt = accel.setup(model, opt)
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(_dataset(n_batches, batch * dp, tie), batch_size=batch),
        shuffle=False,
    )
    losses, norms = [], []
    for x, y in loader:
        loss = accel.forward_backward(model, x, target=y, loss_fn=nn.functional.mse_loss)
        losses.append(float(loss))
        if accel.step() and max_grad_norm is not None:
            norms.append(float(accel.grad_norm))
    try:
        model(x)
        refused = "no error"
    except accelkit.UnsupportedError as err:
        refused = str(err)
    full = {k: v.reshape(-1).tolist() for k, v in accel.full_state_dict(model).items()}
    other = Net(n_layers, tie)
    try:
        accel.setup(other, torch.optim.SGD(other.parameters(), lr=0.1), compile=True)
        refused += " | compile accepted"
    except accelkit.ConfigError as err:
        refused += f" | {err}"
    return {
        "full": full,
        "refused": refused,
        "losses": losses,
        "norms": norms,
        "params": _params(accel.unwrap(model)),
        "dp": [accel.backend.data_parallel_rank, dp],
    }


def train_schedules(*, schedules: list[str], microbatches: int, **kwargs: Any) -> dict[str, Any]:
    """:func:`train` once per schedule in one launch (one process group, a fresh accelerator
    and model each time): the schedule matrix costs one start-up per backend and stage count."""
    return {
        schedule: train(pipeline={"schedule": schedule, "microbatches": microbatches}, **kwargs)
        for schedule in schedules
    }


# ---- checkpoints across layouts -----------------------------------------------------------------
def _gathered(accel: Any, model: Any, opt: Any) -> dict[str, list[float]]:
    """This rank's weights and optimizer state by unsplit name, gathered with DTensor's own
    full_tensor (not through the checkpoint)."""
    local = accel.unwrap(model)
    out = {}
    names = {id(p): n for n, p in local.named_parameters()}
    for n, p in local.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[f"w/{n}"] = full.detach().reshape(-1).tolist()
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    full = value.full_tensor() if hasattr(value, "full_tensor") else value
                    out[f"{key}/{names[id(p)]}"] = full.detach().reshape(-1).float().tolist()
    out["lr"] = [float(g["lr"]) for g in opt.param_groups]
    return out


def _layout(backend: str, pp: int, options: dict[str, Any]) -> Any:
    extra = dict(options)
    if backend != "cpu":
        extra["device"] = "cpu"
    if pp > 1:
        extra.update(pp=pp, pipeline={"schedule": "1F1B", "microbatches": 4})
    return accelkit.get(backend, max_grad_norm=1.0, **extra)


def checkpoint_job(
    *,
    backend: str,
    pp: int,
    path: str,
    mode: str,
    options: dict[str, Any] | None = None,
    steps: int = 2,
    tie: bool = False,
) -> dict[str, Any]:
    """``mode="save"``: train ``steps`` batches, save (model, optimizer, loader), report the
    gathered state, then train one more batch. ``mode="load"``: build, load, report the state,
    train one more batch. Both report the weights after that batch."""
    accel = _layout(backend, pp, options or {})
    torch.manual_seed(0)
    with accel.init_module():
        model = Net(8, tie)
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    dp = accel.backend.data_parallel_world_size
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(_dataset(6, 8, tie), batch_size=8 // dp), shuffle=False
    )
    state = {"model": model, "optimizer": opt, "loader": loader}
    batches = iter(loader)
    if mode == "save":
        for _ in range(steps):
            x, y = next(batches)
            accel.forward_backward(model, x, target=y, loss_fn=nn.functional.mse_loss)
            accel.step()
        accel.save(path, state)
    else:
        accel.load(path, state)
        batches = iter(loader)  # the loader resumes after the saved position
    saved = _gathered(accel, model, opt)
    x, y = next(batches)
    loss = accel.forward_backward(model, x, target=y, loss_fn=nn.functional.mse_loss)
    accel.step()
    return {
        "state": saved,
        "next_loss": float(loss),
        "next_x": x.reshape(-1).tolist()[:4],
        "after": _gathered(accel, model, opt),
        "dp": [accel.backend.data_parallel_rank, dp],
    }


def try_load(*, backend: str, pp: int, path: str, n_layers: int) -> str:
    """Load into a fresh model of ``n_layers``: the error, or "loaded"."""
    accel = _layout(backend, pp, {})
    with accel.init_module():
        model = Net(n_layers)
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    try:
        accel.load(path, {"model": model, "optimizer": opt})
    except accelkit.CheckpointError as err:
        return str(err)
    return "loaded"


def initial(*, backend: str, pp: int, schedule: str = "1F1B") -> dict[str, Any]:
    """The weights right after setup of a model built on meta in init_module()."""
    accel = accelkit.get(backend, pp=pp, pipeline={"schedule": schedule}, device="cpu")
    torch.manual_seed(0)
    with accel.init_module():
        model = Net(8)
    model, _ = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return {"params": _params(accel.unwrap(model))}
