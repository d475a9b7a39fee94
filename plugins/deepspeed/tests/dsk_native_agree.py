"""Native DeepSpeed loads where only rank 1's file is bad (issue 35, "no unbounded wait").

One launch: native saves (ZeRO-2 and ZeRO-3), their native loads (the positive twins), then loads
of copies in which rank 0 damaged one file that only rank 1 reads: a flipped byte in its ZeRO
optimizer states, a code-running gadget in its model states (ZeRO-3 has one per rank), its
optimizer file removed. Every job runs on a process group whose timeout is ``group_timeout``, so
a rank left waiting in DeepSpeed's collectives fails with gloo's timeout instead of the clear
error, and a regression fails fast instead of hanging.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dsk_ckpt import train

from accelkit.testing.pickle_gadgets import gadgets

KEYS = ("model", "optimizer")
#: (name, ZeRO stage, rank 1's file, how it is damaged)
DAMAGES = (
    ("flipped byte z2", 2, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "flip"),
    ("flipped byte z3", 3, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "flip"),
    ("gadget z3", 3, "zero_pp_rank_1_mp_rank_00_model_states.pt", "gadget"),
    ("missing z3", 3, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "remove"),
)


def flip_tensor_byte(file: Path) -> int:
    """Flip one byte in the middle of the largest tensor record's data (not its zip headers);
    return its offset."""
    with zipfile.ZipFile(file) as archive:
        member = max(archive.infolist(), key=lambda m: m.file_size)
    with open(file, "r+b") as raw:
        raw.seek(member.header_offset + 26)
        name_len, extra_len = (int.from_bytes(raw.read(2), "little") for _ in range(2))
        offset = member.header_offset + 30 + name_len + extra_len + member.file_size // 2
        raw.seek(offset)
        byte = raw.read(1)[0]
        raw.seek(offset)
        raw.write(bytes([byte ^ 0xFF]))
    return offset


def damage(source: Path, target: Path, file_name: str, how: str, marker: str) -> dict[str, Any]:
    """A copy of ``source`` with rank 1's ``file_name`` damaged ``how``."""
    shutil.copytree(source, target)
    (file,) = target.rglob(file_name)
    if how == "remove":
        file.unlink()
        return {}
    if how == "gadget":
        state = torch.load(file, weights_only=False)  # the test's own file
        state["hook"] = gadgets(marker)["os.system"][0]
        torch.save(state, file)
        return {}
    flip_tensor_byte(file)
    # the damage is real, and torch alone would not see it: the file still loads
    torch.load(file, weights_only=False)
    return {"loads_under_torch": True}


def run(root: str, marker: str, group_timeout: float) -> dict[str, Any]:
    base = Path(root)
    options = {"timeout": group_timeout}
    out: dict[str, Any] = {}
    for stage in (2, 3):
        native = str(base / f"native-z{stage}")
        out[f"save z{stage}"] = train(
            "save", stage=stage, steps=2, save_at=2, save_to=native, save_format="native",
            options=options,
        )  # fmt: skip
        out[f"load z{stage}"] = train(
            "load", stage=stage, steps=2, load_from=native, load_format="native",
            load_keys=KEYS, options=options,
        )  # fmt: skip
    for name, stage, file_name, how in DAMAGES:
        target = base / name.replace(" ", "-")
        made: dict[str, Any] = {}
        if dist.get_rank() == 0:
            made = damage(base / f"native-z{stage}", target, file_name, how, marker)
        dist.barrier()
        out[name] = train(
            name, stage=stage, steps=2, load_from=str(target), load_format="native",
            load_keys=KEYS, options=options,
        )  # fmt: skip
        out[name].update(made)
    out["marker"] = Path(marker).exists()
    return out
