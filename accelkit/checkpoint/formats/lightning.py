"""Lightning's and Fabric's checkpoint layout: ``state_dict``, ``optimizer_states[i]``,
``lr_schedulers[i]``, ``epoch``, ``global_step``."""

from __future__ import annotations

from typing import Any

from accelkit.checkpoint.formats.importing import Imported, from_mapping


def is_lightning(checkpoint: dict[str, Any]) -> bool:
    """Whether a loaded ``torch.save`` dict is a Lightning (or Fabric) checkpoint."""
    return "pytorch-lightning_version" in checkpoint or (
        "state_dict" in checkpoint and "optimizer_states" in checkpoint
    )


def from_lightning(checkpoint: dict[str, Any], strip_prefix: str | None) -> Imported:
    """Lightning's layout: state_dict, optimizer_states[i], lr_schedulers[i], epoch, global_step."""
    mapping: dict[str, Any] = {"model": checkpoint["state_dict"]}
    for i, osd in enumerate(checkpoint.get("optimizer_states", [])):
        mapping["optimizer" if i == 0 else f"optimizer_{i}"] = osd
    for i, sched in enumerate(checkpoint.get("lr_schedulers", [])):
        mapping["scheduler" if i == 0 else f"scheduler_{i}"] = sched
    for key in ("epoch", "global_step"):
        if key in checkpoint:
            mapping[key] = checkpoint[key]
    imported = from_mapping(mapping, "import:lightning", strip_prefix)
    if "pytorch-lightning_version" in checkpoint:
        imported.extras["lightning_version"] = str(checkpoint["pytorch-lightning_version"])
    return imported
