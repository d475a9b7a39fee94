"""``accelkit convert --trust-pickle DS_DIR CKPT``: a raw DeepSpeed checkpoint into the portable format.

DeepSpeed writes one pickled file per data-parallel rank (``engine.save_checkpoint``); this
importer stitches each parameter's fp32 master and optimizer state back together from the ranks'
flat partitions and writes a world-size-1 portable checkpoint, which any backend then loads at
any world size -- with the optimizer state, which ``zero_to_fp32.py`` leaves out.

- ZeRO-1/2: each rank's ``param_slice_mappings`` says where each parameter's piece sits in its
  flat fp32 partition; a parameter is its pieces in rank order.
- ZeRO-3: each parameter of ``n`` elements is split in ``ceil(n / W)`` pieces, one per rank, laid
  one after another in each rank's flat sub-group partition in ``param_shapes`` order.
- ZeRO-0: the module's weights and, where the optimizer's integer ids match the module's
  parameters unambiguously, the optimizer state (fp32 masters from DeepSpeed's FP16 optimizers).

Weights are written as the fp32 masters (``param``); frozen parameters as stored; ``step`` per
parameter from its group's (``"step_granularity": "group"``). The files are pickles, read only
under ``trust_pickle`` and then by accelkit's restricted unpickler with the classes DeepSpeed's
checkpoints hold (:mod:`accelkit_deepspeed.pickles`), memory-mapped; each tensor is assembled
only when written, so memory stays near one parameter.

Pipeline checkpoints (a ``PipelineModule`` under ``PipelineEngine``) keep the weights in one file
per layer, ``layer_XX-model_states.pt``, under the layer's own names; the per-stage files
(``mp_rank_XX_model_states.pt``) hold no module. Layer ``XX``'s key ``k`` becomes ``XX.k``, the
name ``PipelineModule`` gives it, which is also the name in ``nn.Sequential`` of the same layers
(:mod:`accelkit_deepspeed.pipeline_import`). Tensor-parallel checkpoints (``mp_rank_01`` without
pipeline stages, or layer files with a ``model_XX`` part) are refused.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accelkit.sdk import CheckpointError, canonical_fqn, drop_callables, param_group_hyperparams

log = logging.getLogger("accelkit")

PICKLE_HINT = (
    "is a DeepSpeed checkpoint: its files are pickles. Pass --trust-pickle (trust_pickle=True) "
    "to read them with accelkit's restricted unpickler: tensors, plain containers, numpy values "
    "and the classes DeepSpeed's checkpoints hold, and no other global"
)
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def _tag_folder(path: Path, tag: str | None) -> Path | None:
    """The folder holding the model/optimizer files: ``path/<tag>``, ``path/<latest>``, or
    ``path`` itself."""
    if tag is not None:
        return path / tag
    latest = path / "latest"
    if latest.is_file():
        try:
            return path / latest.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
    return path


def _has_model_states(folder: Path | None) -> bool:
    return folder is not None and folder.is_dir() and any(folder.glob("*model_states.pt"))


class DeepSpeedImporter:
    """A DeepSpeed ``save_checkpoint`` directory (the one with ``latest``, or a tag folder)."""

    def detect(self, path: str | os.PathLike) -> bool:
        path = Path(path)
        return path.is_dir() and _has_model_states(_tag_folder(path, None))

    def convert(
        self,
        path: str | os.PathLike,
        dst: str | os.PathLike,
        *,
        trust_pickle: bool = False,
        strip_prefix: str | None = None,
        progress: bool | None = None,
        tag: str | None = None,
    ) -> Path:
        from accelkit.sdk import write_portable

        if not trust_pickle:
            raise CheckpointError(f"{path} {PICKLE_HINT}")
        folder = _tag_folder(Path(path), tag)
        if not _has_model_states(folder):
            raise CheckpointError(f"{path}: no DeepSpeed *_model_states.pt under {folder}")
        imported = read(folder, strip_prefix=strip_prefix)
        return write_portable(imported, dst, progress=progress)


def _load(path: Path) -> Any:
    from accelkit_deepspeed import pickles

    return pickles.load(path, pickles.import_allowlist(), mmap=True)


def _files(folder: Path, pattern: re.Pattern[str]) -> list[Path]:
    found: dict[int, Path] = {}
    for file in folder.iterdir():
        match = pattern.match(file.name)
        if match is None:
            continue
        if int(match.group(2)) != 0:
            raise CheckpointError(
                f"{folder}: {file.name} belongs to a tensor/pipeline-parallel run (mp_rank > 0); "
                "only data-parallel DeepSpeed checkpoints are imported"
            )
        found[int(match.group(1))] = file
    ranks = sorted(found)
    if ranks != list(range(len(ranks))):
        raise CheckpointError(
            f"{folder}: the per-rank files are for ranks {ranks}; some rank's file is missing"
        )
    return [found[r] for r in ranks]


def _name(name: str, strip_prefix: str | None) -> str:
    if strip_prefix and name.startswith(strip_prefix):
        name = name[len(strip_prefix) :]
    return canonical_fqn(name, strip_module_prefix=True)


def read(folder: Path, *, strip_prefix: str | None = None) -> Any:
    """What the checkpoint in ``folder`` holds, as :class:`accelkit.checkpoint.formats.importing.Imported`."""
    from accelkit.sdk import Imported
    from accelkit_deepspeed import pipeline_import

    if pipeline_import.is_pipeline(folder):
        tensors, objects = pipeline_import.read(folder, _load, strip_prefix=strip_prefix)
        stage0 = _load(folder / "mp_rank_00_model_states.pt")
        extras = _client_state(stage0, objects)
        steps = stage0.get("global_steps")
        return Imported(
            tensors, objects, extras, "import:deepspeed", steps if isinstance(steps, int) else None
        )
    optim_files = _files(folder, _OPTIM)
    model3_files = _files(folder, _MODEL3)
    main_file = folder / "mp_rank_00_model_states.pt"
    model_file = model3_files[0] if model3_files else main_file
    if not model_file.is_file():
        raise CheckpointError(f"{folder}: {model_file.name} is missing")
    model = _load(model_file)
    world = model.get("dp_world_size")
    if optim_files and isinstance(world, int) and world != len(optim_files):
        raise CheckpointError(
            f"{folder}: written by {world} data-parallel ranks, but {len(optim_files)} optimizer "
            "state files are there; a rank's file is missing"
        )
    tensors: dict[tuple[str, str, str], Any] = {}
    objects: dict[str, dict[str, Any]] = {"model": {"type": "module", "class": "(deepspeed)"}}
    module = model.get("module") or {}
    buffers = set(model.get("buffer_names") or [])
    for key in buffers:
        if key in module:
            tensors[("model", "buffer", _name(key, strip_prefix))] = module[key]
    if not optim_files:
        _stage0(model, module, buffers, tensors, objects, strip_prefix)
    else:
        optims = [_load(f)["optimizer_state_dict"] for f in optim_files]
        stage = int(getattr(optims[0].get("zero_stage"), "value", optims[0].get("zero_stage")))
        if stage == 3:
            if len(model3_files) != len(optim_files):
                raise CheckpointError(
                    f"{folder}: {len(optim_files)} optimizer files but {len(model3_files)} "
                    "ZeRO-3 model files"
                )
            models = [model] + [_load(f) for f in model3_files[1:]]
            _stage3(models, optims, tensors, objects, strip_prefix)
        else:
            _stage12(model, optims, tensors, objects, strip_prefix)
    if not any(obj == "model" for obj, _, _ in tensors):
        raise CheckpointError(
            f"{folder}: {model_file.name} holds no module weights and no layer files are there; "
            "nothing to import (a pipeline checkpoint keeps its weights in layer_XX-model_states.pt)"
        )
    extras = _client_state(model, objects)
    steps = model.get("global_steps")
    step = steps if isinstance(steps, int) else None
    return Imported(tensors, objects, extras, "import:deepspeed", step)


def _client_state(model: dict[str, Any], objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """accelkit's ``format="native"`` saves put schedulers and plain values in DeepSpeed's
    client state: they come along (the plain values as extras)."""
    client = model.get("accelkit")
    if not isinstance(client, dict):
        return {}
    for name, state in client.get("schedulers", {}).items():
        objects[name] = {
            "type": "scheduler",
            "class": "(imported)",
            "state": drop_callables(state, name),
        }
    return dict(client.get("extras", {}))


# ---- the optimizer description ------------------------------------------------------------------
def _family(keys: set[str], group: dict[str, Any]) -> str:
    if {"exp_avg", "exp_avg_sq"} <= keys:
        return (
            "adamw" if group.get("decoupled_weight_decay") or group.get("adam_w_mode") else "adam"
        )
    if "momentum_buffer" in keys:
        return "sgd"
    return "unknown"


def _optimizer_info(
    groups: list[dict[str, Any]], names: list[list[str]], keys: set[str], granularity: str
) -> dict[str, Any]:
    return {
        "type": "optimizer",
        "class": "(deepspeed)",
        "family": _family(keys, groups[0] if groups else {}),
        "model": "model",
        "step_granularity": granularity,
        "param_groups": [
            {"params": row, **param_group_hyperparams(group, "optimizer/param_groups")}
            for group, row in zip(groups, names)
        ],
        "scalar_state": {},
    }


def _step_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32)


@dataclass
class _Address:
    start: int
    numel: int


def _lazy(shape: tuple[int, ...], pieces: Any) -> Any:
    """A LazyTensor that concatenates ``pieces()`` (1-D) and reshapes when written."""
    from accelkit.sdk import LazyTensor

    def fetch() -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in pieces()])[: math.prod(shape)].reshape(shape)

    return LazyTensor(shape, getattr(pieces, "dtype", torch.float32), fetch)


# ---- ZeRO-1/2 ---------------------------------------------------------------------------------
def _stage12(
    model: dict[str, Any],
    optims: list[dict[str, Any]],
    tensors: dict[tuple[str, str, str], Any],
    objects: dict[str, dict[str, Any]],
    strip_prefix: str | None,
) -> None:
    param_shapes = model["param_shapes"]
    if any("param_slice_mappings" not in o for o in optims):
        raise CheckpointError(
            "this DeepSpeed checkpoint has no param_slice_mappings (DeepSpeed < 0.6); convert it "
            "with its zero_to_fp32.py (weights only)"
        )
    flats = [o["single_partition_of_fp32_groups"] for o in optims]
    states = [_base_states(o["base_optimizer_state"], len(param_shapes)) for o in optims]
    groups = _base_groups(optims[0]["base_optimizer_state"], len(param_shapes))
    names: list[list[str]] = []
    keys: set[str] = set()
    for g, shapes in enumerate(param_shapes):
        row = []
        for raw, shape in shapes.items():
            name = _name(raw, strip_prefix)
            row.append(name)
            shape = tuple(shape)
            where = [
                (r, o["param_slice_mappings"][g][raw])
                for r, o in enumerate(optims)
                if raw in o["param_slice_mappings"][g]
            ]
            numel = sum(int(a.numel) for _, a in where)
            if numel != math.prod(shape):
                raise CheckpointError(
                    f"{raw}: the ranks' slices hold {numel} elements, its shape {list(shape)} "
                    f"has {math.prod(shape)}"
                )

            flat_pieces = _slices([f[g] for f in flats], where)
            tensors[("model", "param", name)] = _lazy(shape, flat_pieces)
            for key, value in states[0][g].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    keys.add(key)
                    rank_values = [s[g][key] for s in states]
                    tensors[("optimizer", f"optim:{key}", name)] = _lazy(
                        shape, _slices(rank_values, where)
                    )
                elif key == "step":
                    keys.add(key)
                    tensors[("optimizer", "optim:step", name)] = _step_tensor(value)
        names.append(row)
    _frozen_whole(model, tensors, strip_prefix)
    objects["optimizer"] = _optimizer_info(groups, names, keys, "group")


def _slices(rank_tensors: list[torch.Tensor], where: list[tuple[int, Any]]) -> Any:
    """The pieces of one parameter: ``(rank, fragment_address)`` ranges of each rank's flat."""

    def pieces() -> list[torch.Tensor]:
        return [rank_tensors[r].reshape(-1).narrow(0, int(a.start), int(a.numel)) for r, a in where]

    pieces.dtype = rank_tensors[0].dtype  # type: ignore[attr-defined]
    return pieces


def _base_states(base: Any, groups: int) -> list[dict[str, Any]]:
    """The base optimizer's state of each group's flat partition (a torch state dict, or the
    list DeepSpeed writes with elastic checkpoints)."""
    if isinstance(base, list):
        return [dict(s) for s in base]
    state = base.get("state", {})
    out = []
    for g, group in enumerate(base.get("param_groups", [])[:groups]):
        ids = group.get("params", [g])
        out.append(dict(state.get(ids[0], {})) if ids else {})
    return out


def _base_groups(base: Any, groups: int) -> list[dict[str, Any]]:
    if isinstance(base, list):
        return [{} for _ in range(groups)]
    return list(base.get("param_groups", []))[:groups]


def _frozen_whole(
    model: dict[str, Any], tensors: dict[tuple[str, str, str], Any], strip_prefix: str | None
) -> None:
    """ZeRO-1/2's frozen parameters, whole on every rank: ``frozen_param_fragments`` where
    DeepSpeed wrote them, else the module's entries that are neither trained nor buffers."""
    fragments = dict(model.get("frozen_param_fragments") or {})
    trained = {raw for shapes in model["param_shapes"] for raw in shapes}
    buffers = set(model.get("buffer_names") or [])
    for raw, value in (model.get("module") or {}).items():
        if raw not in trained and raw not in buffers:
            fragments.setdefault(raw, value)
    for raw, value in fragments.items():
        tensors[("model", "param", _name(raw, strip_prefix))] = value


# ---- ZeRO-3 -----------------------------------------------------------------------------------
def _stage3(
    models: list[dict[str, Any]],
    optims: list[dict[str, Any]],
    tensors: dict[tuple[str, str, str], Any],
    objects: dict[str, dict[str, Any]],
    strip_prefix: str | None,
) -> None:
    world = len(optims)
    param_shapes = models[0]["param_shapes"]  # one OrderedDict per sub-group
    flats = [o["fp32_flat_groups"] for o in optims]
    base = optims[0]["optimizer_state_dict"]
    base_states = [o["optimizer_state_dict"].get("state", {}) for o in optims]
    groups = list(base.get("param_groups", []))
    sub_to_group: dict[int, int] = {}
    position = 0
    for g, group in enumerate(groups):
        for _ in group.get("params", []):
            sub_to_group[position] = g
            position += 1
    names: list[list[str]] = [[] for _ in groups] or [[]]
    keys: set[str] = set()
    for sub, shapes in enumerate(param_shapes):
        group = sub_to_group.get(sub, 0)
        offset = 0
        for raw, shape in shapes.items():
            shape = tuple(shape)
            numel = math.prod(shape)
            size = math.ceil(numel / world)
            name = _name(raw, strip_prefix)
            names[group].append(name)

            where = [(r, _Address(offset, size)) for r in range(world)]
            tensors[("model", "param", name)] = _lazy(
                shape, _slices([f[sub] for f in flats], where)
            )
            for key, value in base_states[0].get(sub, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    keys.add(key)
                    rank_values = [s[sub][key] for s in base_states]
                    tensors[("optimizer", f"optim:{key}", name)] = _lazy(
                        shape, _slices(rank_values, where)
                    )
                elif key == "step":
                    keys.add(key)
                    tensors[("optimizer", "optim:step", name)] = _step_tensor(value)
            offset += size
        if any(flat[sub].numel() != offset for flat in flats):
            raise CheckpointError(
                f"ZeRO-3 sub-group {sub}: the flat partitions do not hold the {offset} elements "
                "its parameters need per rank"
            )
    for raw, shape in (models[0].get("frozen_param_shapes") or {}).items():
        parts = [m["frozen_param_fragments"][raw] for m in models]
        tensors[("model", "param", _name(raw, strip_prefix))] = _joined(tuple(shape), parts)
    objects["optimizer"] = _optimizer_info(groups, names, keys, "group")


def _joined(shape: tuple[int, ...], parts: list[torch.Tensor]) -> Any:
    """A frozen ZeRO-3 parameter: the ranks' padded partitions, joined and cut to its shape."""
    from accelkit.sdk import LazyTensor

    def fetch() -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in parts])[: math.prod(shape)].reshape(shape)

    return LazyTensor(shape, parts[0].dtype, fetch)


# ---- ZeRO-0 -----------------------------------------------------------------------------------
def _stage0(
    model: dict[str, Any],
    module: dict[str, Any],
    buffers: set[str],
    tensors: dict[tuple[str, str, str], Any],
    objects: dict[str, dict[str, Any]],
    strip_prefix: str | None,
) -> None:
    from accelkit.sdk import optimizer_import, positional_names

    weights = {k: v for k, v in module.items() if k not in buffers}
    for key, value in weights.items():
        tensors[("model", "param", _name(key, strip_prefix))] = value
    saved = model.get("optimizer")
    if not isinstance(saved, dict):
        return
    osd = saved.get("optimizer_state_dict", saved)
    if not (isinstance(osd, dict) and "state" in osd and "param_groups" in osd):
        return
    names = positional_names(weights, osd)
    if names is None:
        log.warning(
            "the ZeRO-0 optimizer's parameter ids cannot be matched to the module's names "
            "unambiguously; the weights are imported, the optimizer state is not"
        )
        return
    names = [_name(n, strip_prefix) for n in names]
    objects["optimizer"] = optimizer_import("optimizer", osd, names, tensors, "model")
    masters = saved.get("fp32_groups")
    if masters is not None:  # DeepSpeed's unfused FP16 optimizer: one fp32 master per parameter
        flat = [t for group in masters for t in group]
        for name, master in zip(names, flat, strict=True):
            tensors[("model", "param", name)] = master
