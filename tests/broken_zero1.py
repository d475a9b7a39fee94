"""Negative twins of the ZeRO-1 worked example (docs/plugins.md, "Writing a sharded backend"):
three toy plugins, each with one bug the conformance suite must catch (tests/test_plugin_sdk.py
asserts that each fails its case). The example itself is imported from the file the test writes
from the docs' block (``zero1_example``)."""

from __future__ import annotations

from typing import Any

from zero1_example import Zero1Backend

import accelkit
from accelkit import sdk


class DropsOwnersNumbers(Zero1Backend):
    """Keeps only rank 0's non-tensor optimizer state: what a by-owner writer did when only rank
    0's optimizer record reached the manifest (issue 47's silent loss)."""

    def local_fragments(self, state: dict[str, Any]) -> Any:
        for item in super().local_fragments(state):
            optimizer = isinstance(item, sdk.ObjectInfo) and item.info.get("type") == "optimizer"
            if optimizer and self.rank != 0:
                item.info["scalar_state"] = {}
            yield item


class ChecksTheEmptyState(Zero1Backend):
    """Checks a load against the state of the optimizer ``setup`` returned, which is empty:
    ZeRO keeps it in ``zero.optim.state``, so another optimizer's checkpoint passes."""

    def check_load(self, reader: Any, state: dict[str, Any]) -> None:
        objects = sdk.classify_state(state)
        sdk.check_dense_load(self, reader, state, names=list(objects.modules))
        owners = sdk.param_owners(objects.modules, self)
        for name, zero in objects.optimizers.items():
            names, _ = sdk.param_group_names([g["params"] for g in zero.param_groups], owners)
            sdk.check_optimizer(reader, name, zero.param_groups, names, zero.state)


class AdvertisesFp8(sdk.DDPBackend):
    """Lists fp8-mixed on an options class without the fp8_* options that configure it."""

    capabilities = sdk.Capabilities(
        no_sync=True, distributed=True, precisions=(*sdk.PRECISIONS, "fp8-mixed")
    )
    options_class = sdk.DDPOptions


class BrokenPlugin:
    @accelkit.hookimpl
    def accelkit_register_backends(self, registry: Any) -> None:
        registry.add("zero1_drops_numbers", DropsOwnersNumbers)
        registry.add("zero1_empty_check", ChecksTheEmptyState)
        registry.add("ddp_fp8_without_options", AdvertisesFp8)
