"""``accelkit convert`` for ColossalAI's own sharded checkpoints (``booster.save_model(...,
shard=True)`` / ``booster.save_optimizer(..., shard=True)``).

Accepted layouts: a directory with ``model/`` (and optionally ``optimizer/``) inside, as
``booster.save_model(model, "ckpt/model", shard=True)`` and ``save_optimizer(optimizer,
"ckpt/optimizer", shard=True)`` leave it; or a model directory alone. A model directory holds
an index (``pytorch_model.bin.index.json`` or ``model.safetensors.index.json``) and its shards;
an optimizer directory ``pytorch_optim.bin.index.json``, ``pytorch_optim_group.bin`` and shards
of ``{parameter index: state}``. ``.bin`` files are pickles: they load only with
``trust_pickle``, and then through accelkit's restricted unpickler with what ColossalAI's
checkpoints hold: tensors, plain containers and numpy values. Optimizer parameter indices follow the model's parameters in order; they are
named by the model's floating-point tensors whose shapes match, and refused when that is not
unambiguous. Imports nothing from ColossalAI.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from accelkit.sdk import (
    CheckpointError,
    Imported,
    canonical_fqn,
    conversion_allowlist,
    optimizer_import,
    restricted_torch_load,
    write_portable,
)

MODEL_INDEXES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")
OPTIM_INDEX = "pytorch_optim.bin.index.json"
PICKLE_HINT = (
    "is a pickle (torch.save). Pass trust_pickle=True (--trust-pickle) to read it with "
    "accelkit's restricted unpickler: tensors, plain containers and numpy values, and no other "
    "global"
)
# The list: ``pickle_globals`` of the files ColossalAI 0.5's ``booster.save_model`` and
# ``save_optimizer`` write (``shard=True``: LowLevelZero stage 1 bf16 and 2 fp32, HybridParallel,
# TorchDDP) finds
# nothing beyond tensors and plain containers, so the SDK's conversion_allowlist() is it.
#: what to do about a shard the list refuses
REFUSED_HINT = (
    "accelkit reads ColossalAI's shards with a restricted unpickler that allows tensors, plain "
    "containers and numpy values, with or without trust_pickle, and nothing else. If you know "
    "where the checkpoint comes from and what else it holds, load it with ColossalAI's Booster "
    "in your own code and save it with accel.save (the portable format)"
)
BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def _model_dir(path: Path) -> Path | None:
    for candidate in (path / "model", path):
        if candidate.is_dir() and any((candidate / name).is_file() for name in MODEL_INDEXES):
            return candidate
    return None


def _load_file(path: Path, trust_pickle: bool) -> dict[Any, Any]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if not trust_pickle:
        raise CheckpointError(f"{path} {PICKLE_HINT}")
    return restricted_torch_load(path, conversion_allowlist(), hint=REFUSED_HINT, mmap=True)


def _read_index(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable checkpoint index ({err})") from err


def _model_state(directory: Path, trust_pickle: bool) -> dict[str, torch.Tensor]:
    index_path = next(directory / n for n in MODEL_INDEXES if (directory / n).is_file())
    weight_map: dict[str, str] = _read_index(index_path).get("weight_map", {})
    shards: dict[str, dict[Any, Any]] = {}
    state: dict[str, torch.Tensor] = {}
    for name, file in weight_map.items():
        if file not in shards:
            shard_path = directory / file
            if not shard_path.is_file():
                raise CheckpointError(f"{shard_path}: shard named by {index_path} is missing")
            shards[file] = _load_file(shard_path, trust_pickle)
        if name not in shards[file]:
            raise CheckpointError(f"{directory / file}: has no tensor {name!r} ({index_path})")
        state[name] = shards[file][name]
    return state


def _optimizer_state(directory: Path, trust_pickle: bool) -> dict[str, Any]:
    index_path = directory / OPTIM_INDEX
    index = _read_index(index_path)
    group_file = index.get("metadata", {}).get("param_groups")
    if not group_file:
        raise CheckpointError(f"{index_path}: names no param_groups file")
    groups = _load_file(directory / group_file, trust_pickle)
    states: dict[int, dict[str, Any]] = {}
    for file in dict.fromkeys(index.get("weight_map", {}).values()):
        shard_path = directory / file
        if not shard_path.is_file():
            raise CheckpointError(f"{shard_path}: shard named by {index_path} is missing")
        for pid, per_param in _load_file(shard_path, trust_pickle).items():
            states[int(pid)] = per_param
    return {"state": states, "param_groups": groups}


def _param_names(model: dict[str, torch.Tensor], osd: dict[str, Any]) -> list[str]:
    """Parameter index k of the optimizer -> the k-th floating tensor of the model state that is
    not a known buffer; every state tensor's shape must match its parameter's."""
    candidates = [
        name
        for name, value in model.items()
        if value.is_floating_point() and name.rsplit(".", 1)[-1] not in BUFFER_SUFFIXES
    ]
    ids = [pid for group in osd["param_groups"] for pid in group["params"]]
    if sorted(ids) != list(range(len(ids))) or len(ids) != len(candidates):
        raise CheckpointError(
            f"the optimizer has {len(ids)} parameters and the model {len(candidates)} "
            "floating-point tensors: its parameter indices cannot be named"
        )
    for pid, per_param in osd["state"].items():
        for key, value in per_param.items():
            expected = tuple(model[candidates[pid]].shape)
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != expected:
                raise CheckpointError(
                    f"optimizer state {key!r} of parameter {pid} has shape "
                    f"{list(value.shape)}, but {candidates[pid]} has {list(expected)}: the "
                    "parameters cannot be named"
                )
    return candidates


class ColossalAIImporter:
    """ColossalAI Booster sharded checkpoints (model and optimizer) -> the portable format."""

    def detect(self, path: str | os.PathLike) -> bool:
        return Path(path).is_dir() and _model_dir(Path(path)) is not None

    def convert(
        self,
        path: str | os.PathLike,
        dst: str | os.PathLike,
        *,
        trust_pickle: bool = False,
        strip_prefix: str | None = None,
        progress: bool | None = None,
    ) -> Path:
        root = Path(path)
        model_dir = _model_dir(root)
        if model_dir is None:
            raise CheckpointError(f"{root}: no ColossalAI model index ({', '.join(MODEL_INDEXES)})")
        model = _model_state(model_dir, trust_pickle)
        tensors: dict[tuple[str, str, str], Any] = {}
        for name, value in model.items():
            if strip_prefix and name.startswith(strip_prefix):
                name = name[len(strip_prefix) :]
            tensors[("model", "param", canonical_fqn(name, strip_module_prefix=True))] = value
        objects: dict[str, dict[str, Any]] = {"model": {"type": "module", "class": "(imported)"}}
        optim_dir = root / "optimizer" if model_dir != root else None
        if optim_dir is not None and (optim_dir / OPTIM_INDEX).is_file():
            osd = _optimizer_state(optim_dir, trust_pickle)
            names = _param_names(model, osd)
            if strip_prefix:
                names = [n[len(strip_prefix) :] if n.startswith(strip_prefix) else n for n in names]
            objects["optimizer"] = optimizer_import("optimizer", osd, names, tensors, "model")
        imported = Imported(tensors, objects, {}, "import:colossalai")
        return write_portable(imported, dst, progress=progress)
