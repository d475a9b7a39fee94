"""Workers of tests/test_plugin_sdk.py: a backend built on the SDK's FSDPBackend that records
what its ``on_wrapped`` hook saw."""

from __future__ import annotations

from typing import Any

import torch

import accelkit
from accelkit import sdk


class HookedFSDP(sdk.FSDPBackend):
    seen: Any = None

    def on_wrapped(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.seen = {
            "root_is_fsdp": isinstance(model, FSDPModule),
            "params_sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        }


class HookedPlugin:
    @accelkit.hookimpl
    def accelkit_register_backends(self, registry: Any) -> None:
        registry.add("hooked_fsdp", HookedFSDP)


def wrapped() -> dict[str, Any]:
    accelkit.register_plugin(HookedPlugin(), "hooked")
    accel = accelkit.get("hooked_fsdp")
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    _, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = dict(accel.backend.seen)
    seen["optimizer_holds_them"] = all(
        type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"]
    )
    accel.end_training()
    return seen
