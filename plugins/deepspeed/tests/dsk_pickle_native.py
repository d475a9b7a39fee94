"""accelkit's native DeepSpeed checkpoints with a code-running gadget planted in them.

Runs dsk_ckpt's jobs: a native save, a native load of it (the positive twin), then for each
gadget a copy of the checkpoint with the gadget planted (rank 0 plants, everyone waits) and a
native load of that copy under ``trust_pickle=True``, which must be refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dsk_ckpt import train

from accelkit.testing.pickle_gadgets import gadgets, persistent_id_module

#: where each gadget goes: the engine's model file (client state) or a ZeRO optimizer file
PLACES = {"model": "mp_rank_00_model_states.pt", "optimizer": "*optim_states.pt"}


def plant(source: str, target: str, gadget: str, place: str, marker: str) -> None:
    """A copy of the DeepSpeed checkpoint ``source`` with ``gadget`` (a name of
    :func:`~accelkit.testing.pickle_gadgets.gadgets`, or ``"persistent id"``) under a new key
    of the top dict of every file ``place`` names (ZeRO-3 has a model file per rank). Every
    rank's file, so that every rank refuses: a rank whose own file loads would wait for the
    others in DeepSpeed's collectives."""
    shutil.copytree(source, target)
    files = sorted(Path(target).rglob(PLACES[place])) or sorted(
        Path(target).rglob("*model_states.pt")
    )
    for file in files:
        state = torch.load(file, weights_only=False)  # the test's own file
        if gadget == "persistent id":
            torch.save(state, file, pickle_module=persistent_id_module(marker))
        else:
            state["hook"] = gadgets(marker)[gadget][0]
            torch.save(state, file)


def plant_all(plantings: list[dict[str, str]]) -> dict[str, Any]:
    """:func:`plant` for each ``{source, target, gadget, place, marker}`` (one process)."""
    for planting in plantings:
        plant(**planting)
    return {}


#: the gadgets a native load is given, and where
NATIVE_PLANTINGS = (
    ("os.system", "model"),
    ("nested in a dict", "optimizer"),
    ("persistent id", "model"),
)


def run(root: str, stage: int, marker: str) -> dict[str, Any]:
    """A native save, its native load (the positive twin), then native loads of copies with
    :data:`NATIVE_PLANTINGS`, each refused (``error`` in its result), and a model-only load of
    the last copy (refused at ZeRO-3)."""
    base = Path(root)
    native = str(base / "native")
    keys = ("model", "optimizer")
    out: dict[str, Any] = {
        "save": train("save", stage=stage, steps=2, save_at=2, save_to=native, save_format="native")
    }
    out["load"] = train(
        "load", stage=stage, steps=2, load_from=native, load_format="native", load_keys=keys
    )
    for gadget, place in NATIVE_PLANTINGS:
        target = str(base / f"{gadget}-{place}".replace(" ", "-"))
        if dist.get_rank() == 0:
            plant(native, target, gadget, place, marker)
        dist.barrier()
        out[f"{gadget} in the {place} file"] = train(
            gadget, stage=stage, steps=2, load_from=target, load_format="native", load_keys=keys
        )
    # ZeRO-3 without the optimizer: DeepSpeed would read every file with zero_to_fp32's
    # torch.load(weights_only=False), which runs the gadget; refused before anything is read
    out["model only"] = train(
        "model only", stage=stage, steps=2, load_from=target, load_format="native",
        load_keys=("model",),
    )  # fmt: skip
    out["marker"] = Path(marker).exists()
    return out
