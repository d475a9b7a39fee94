"""Workers of tests/test_rank_state.py: backends that keep state of their own per rank (how many
samples each rank saw) through the SDK's ``rank_state_dict`` / ``load_rank_state_dict``."""

from __future__ import annotations

from typing import Any

import torch

import accelkit
from accelkit import sdk


class Counting:
    """Saves a count and a tensor that differ per rank; records what a load hands back."""

    samples = 0
    restored: Any = None

    def rank_state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "mark": torch.full((3,), float(self.rank))}

    def load_rank_state_dict(self, states: Any, saved_world_size: int) -> None:
        self.restored = {
            "saved_world_size": saved_world_size,
            "states": {
                str(rank): {"samples": s["samples"], "mark": s["mark"].tolist()}
                for rank, s in states.items()
            },
        }


class CountingDDP(Counting, sdk.DDPBackend):
    options_class = sdk.DDPWrapOptions
    rank_state_on_resize = "refuse"  # the default of Backend (ddp itself drops)


class MergingDDP(CountingDDP):
    rank_state_on_resize = "merge"


class DroppingDDP(CountingDDP):
    rank_state_on_resize = "drop"


class CountingCPU(Counting, sdk.SingleDeviceBackend):
    def launch(self) -> None:
        self._device = torch.device("cpu")


class CountingPlugin:
    @accelkit.hookimpl
    def accelkit_register_backends(self, registry: Any) -> None:
        registry.add("counting", CountingDDP)
        registry.add("counting_merge", MergingDDP)
        registry.add("counting_drop", DroppingDDP)
        registry.add("counting_cpu", CountingCPU)


def register() -> None:
    """Register the backends in this process, once (the test fixtures forget them)."""
    try:
        accelkit.describe("counting_cpu")
    except accelkit.BackendNotFoundError:
        accelkit.register_plugin(CountingPlugin(), "counting")


def run(backend: str, save: str | None = None, load: str | None = None) -> dict[str, Any]:
    """Count ``10 * (rank + 1)`` samples and save; or load and report what came back."""
    register()
    accel = accelkit.get(backend)
    torch.manual_seed(100 if load else 0)  # other weights than the saved ones
    net = torch.nn.Linear(2, 1)
    model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = [p.detach().clone() for p in net.parameters()]
    out: dict[str, Any] = {"rank": accel.rank}
    if load:
        try:
            accel.load(load, {"model": model, "optimizer": opt})
            out["error"] = None
        except accelkit.CheckpointError as err:
            out["error"] = str(err)
        out["restored"] = accel.backend.restored
        out["weights_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    accel.backend.samples = 10 * (accel.rank + 1)
    if save:
        accel.save(save, {"model": model, "optimizer": opt})
    accel.end_training()
    return out
