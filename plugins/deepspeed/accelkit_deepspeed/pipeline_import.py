"""``accelkit convert`` of a DeepSpeed *pipeline* checkpoint (``PipelineEngine.save_checkpoint``).

A pipeline checkpoint is laid out unlike a data-parallel one, which is why it has its own reader:

- ``layer_XX-model_states.pt``: layer ``XX``'s ``state_dict()`` under the layer's own names, one
  file per layer that has a ``state_dict`` (a function layer, such as a lambda, has none);
- ``mp_rank_SS_model_states.pt``: stage ``SS``'s engine state, with ``module: None``;
  ``checkpoint_parallel_dimensions`` gives the stage count;
- ZeRO-1/2: ``zero_pp_rank_D_mp_rank_SS_optim_states.pt`` per stage ``SS`` and data-parallel rank
  ``D``, whose ``param_slice_mappings`` name every trained parameter as ``PipelineModule`` does
  (``XX.key``); ZeRO-0: the stage's torch optimizer state in its ``mp_rank_SS`` file, by
  position.

Every tensor is named ``XX.key``: the name ``PipelineModule`` registers layer ``XX`` under, and
the name of the same layers in an ``nn.Sequential``. What cannot be mapped is refused rather
than guessed: a tied layer (``TiedLayerSpec``, registered under ``tied_modules.<key>``), a
tensor-parallel layer file, and a layer file that a stage's parameters need but that is missing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelkit.sdk import CheckpointError

log = logging.getLogger("accelkit")

_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")
_ANY_LAYER = re.compile(r"^layer_(\d+)-(.+)-model_states\.pt$")
_STAGE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LEADING_INDEX = re.compile(r"^(\d+)\.")

Loader = Callable[[Path], Any]


def is_pipeline(folder: Path) -> bool:
    """Whether ``folder`` was written by ``PipelineEngine`` (it has layer files)."""
    return any(_LAYER.match(f.name) or _ANY_LAYER.match(f.name) for f in folder.iterdir())


def read(
    folder: Path, load: Loader, *, strip_prefix: str | None = None
) -> tuple[dict[tuple[str, str, str], Any], dict[str, dict[str, Any]]]:
    """The tensors and object descriptions of the pipeline checkpoint in ``folder``."""
    from accelkit_deepspeed import importer

    layers = _layer_files(folder)
    stages = _stage_files(folder, load)
    optims = _optim_files(folder, len(stages))
    models = [load(f) for f in stages]
    buffers = {b for m in models for b in (m.get("buffer_names") or [])}
    tensors: dict[tuple[str, str, str], Any] = {}
    objects: dict[str, dict[str, Any]] = {
        "model": {"type": "module", "class": "(deepspeed PipelineModule)"}
    }
    trained: set[str] = set()
    if any(optims):
        if not all(optims):
            missing = [s for s, files in enumerate(optims) if not files]
            raise CheckpointError(
                f"{folder}: stages {missing} have no zero_pp_rank_*_mp_rank_XX_optim_states.pt "
                "files while the other stages have theirs; a stage's optimizer files are missing"
            )
        infos = []
        for stage, (model, files) in enumerate(zip(models, optims)):
            names = [raw for shapes in (model.get("param_shapes") or []) for raw in shapes]
            _check_mappable(folder, stage, names, layers)
            trained.update(names)
            stage_objects: dict[str, dict[str, Any]] = {}
            world = model.get("dp_world_size")
            if isinstance(world, int) and world != len(files):
                raise CheckpointError(
                    f"{folder}: stage {stage} was written by {world} data-parallel ranks, but "
                    f"{len(files)} of its optimizer files are there; a rank's file is missing"
                )
            states = [load(f)["optimizer_state_dict"] for f in files]
            # the module entries of a stage file are None: frozen parameters come from layers
            importer._stage12({**model, "module": {}}, states, tensors, stage_objects, strip_prefix)
            infos.append(stage_objects["optimizer"])
        objects["optimizer"] = _merged_info(folder, infos)
    weights = _layer_tensors(folder, layers, load, buffers, strip_prefix)
    for (obj, kind, name), value in weights.items():
        if kind == "buffer" or (obj, "param", name) not in tensors:
            tensors[(obj, kind, name)] = value
    if not any(optims):
        _zero0_optimizer(folder, models, layers, weights, tensors, objects, strip_prefix)
    if not weights and not trained:
        raise CheckpointError(f"{folder}: the pipeline checkpoint's layer files hold no tensors")
    return tensors, objects


# ---- the files ---------------------------------------------------------------------------------
def _layer_files(folder: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for file in folder.iterdir():
        if _LAYER.match(file.name):
            found[int(_LAYER.match(file.name).group(1))] = file  # type: ignore[union-attr]
        elif _ANY_LAYER.match(file.name):
            raise CheckpointError(
                f"{folder}: {file.name} is one tensor-parallel part of a layer "
                f"({_ANY_LAYER.match(file.name).group(2)}); "  # type: ignore[union-attr]
                "pipeline checkpoints with tensor parallelism are not imported: merge the "
                "parts with the model's own tools first"
            )
    return found


def _stage_files(folder: Path, load: Loader) -> list[Path]:
    found = {int(m.group(1)): f for f in folder.iterdir() if (m := _STAGE.match(f.name))}
    if 0 not in found:
        raise CheckpointError(f"{folder}: mp_rank_00_model_states.pt is missing")
    dims = load(found[0]).get("checkpoint_parallel_dimensions") or {}
    if int(dims.get("tp_degree", 1) or 1) > 1:
        raise CheckpointError(
            f"{folder}: written with tensor parallelism (tp_degree {dims['tp_degree']}); "
            "pipeline checkpoints with tensor parallelism are not imported"
        )
    stages = int(dims.get("pp_degree") or len(found))
    missing = [s for s in range(stages) if s not in found]
    if missing:
        names = ", ".join(f"mp_rank_{s:02d}_model_states.pt" for s in missing)
        raise CheckpointError(
            f"{folder}: a {stages}-stage pipeline checkpoint without {names}; a stage's file is "
            "missing"
        )
    return [found[s] for s in range(stages)]


def _optim_files(folder: Path, stages: int) -> list[list[Path]]:
    by_stage: list[dict[int, Path]] = [{} for _ in range(stages)]
    for file in folder.iterdir():
        match = _OPTIM.match(file.name)
        if match is None:
            continue
        stage = int(match.group(2))
        if stage >= stages:
            raise CheckpointError(
                f"{folder}: {file.name} names stage {stage} of a {stages}-stage pipeline"
            )
        by_stage[stage][int(match.group(1))] = file
    out = []
    for stage, found in enumerate(by_stage):
        ranks = sorted(found)
        if ranks != list(range(len(ranks))):
            raise CheckpointError(
                f"{folder}: stage {stage}'s optimizer files are for data-parallel ranks {ranks}; "
                "a rank's file is missing"
            )
        out.append([found[r] for r in ranks])
    return out


def _present(layers: dict[int, Path]) -> str:
    return ", ".join(str(i) for i in sorted(layers)) or "none"


def _check_mappable(folder: Path, stage: int, names: list[str], layers: dict[int, Path]) -> None:
    """Every parameter a stage trained belongs to a layer whose file is there."""
    for raw in names:
        match = _LEADING_INDEX.match(raw)
        if match is None:
            raise CheckpointError(
                f"{folder}: stage {stage} trains {raw!r}, which belongs to no layer index (a "
                "TiedLayerSpec layer, registered under tied_modules); its place in the unsplit "
                "model is not known, so this checkpoint is not imported"
            )
        index = int(match.group(1))
        if index not in layers:
            raise CheckpointError(
                f"{folder}: layer_{index:02d}-model_states.pt is missing: stage {stage} trained "
                f"{raw!r} (layer files present: {_present(layers)})"
            )


def _layer_tensors(
    folder: Path,
    layers: dict[int, Path],
    load: Loader,
    buffers: set[str],
    strip_prefix: str | None,
) -> dict[tuple[str, str, str], Any]:
    """Every layer file's tensors as ``XX.key``, in layer order (the stages' parameter order)."""
    import torch

    from accelkit_deepspeed.importer import _name

    out: dict[tuple[str, str, str], Any] = {}
    for index in sorted(layers):
        state = load(layers[index])
        if not isinstance(state, dict):
            raise CheckpointError(f"{layers[index]}: not a layer state dict")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            raw = f"{index}.{key}"
            kind = "buffer" if raw in buffers else "param"
            out[("model", kind, _name(raw, strip_prefix))] = value
    return out


# ---- the optimizer -----------------------------------------------------------------------------
def _merged_info(folder: Path, infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer over every stage: group ``g`` lists every stage's group-``g`` parameters in
    stage order; the stages' hyperparameters must agree (they step together)."""
    merged = dict(infos[0])
    groups = [dict(g) for g in infos[0]["param_groups"]]
    for stage, info in enumerate(infos[1:], start=1):
        if len(info["param_groups"]) != len(groups):
            raise CheckpointError(
                f"{folder}: stage {stage}'s optimizer has {len(info['param_groups'])} parameter "
                f"groups, stage 0's {len(groups)}"
            )
        for g, (mine, theirs) in enumerate(zip(groups, info["param_groups"])):
            settings = {k: v for k, v in theirs.items() if k != "params"}
            if settings != {k: v for k, v in mine.items() if k != "params"}:
                raise CheckpointError(
                    f"{folder}: parameter group {g} has other hyperparameters on stage {stage} "
                    "than on stage 0; one optimizer cannot describe both"
                )
            mine["params"] = [*mine["params"], *theirs["params"]]
    merged["param_groups"] = groups
    return merged


def _zero0_optimizer(
    folder: Path,
    models: list[dict[str, Any]],
    layers: dict[int, Path],
    weights: dict[tuple[str, str, str], Any],
    tensors: dict[tuple[str, str, str], Any],
    objects: dict[str, dict[str, Any]],
    strip_prefix: str | None,
) -> None:
    """ZeRO-0: each stage file holds its torch optimizer's state by position. The stages' states
    are laid end to end (stage order is layer order) and matched by position and shape against
    the layer files' parameters; a count that the files cannot cover means a missing file."""
    from accelkit.sdk import optimizer_import, positional_names

    osds = [m.get("optimizer") for m in models]
    if not all(isinstance(o, dict) and "state" in o and "param_groups" in o for o in osds):
        log.warning(
            "%s: the pipeline stages' optimizer state is not saved with them; the weights are "
            "imported, the optimizer state is not, and a missing layer file cannot be told from "
            "a function layer",
            folder,
        )
        return
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    offset = 0
    for stage, osd in enumerate(osds):
        ids = [i for group in osd["param_groups"] for i in group["params"]]
        if ids != list(range(len(ids))):
            log.warning("%s: stage %d's optimizer ids are not positional", folder, stage)
            return
        for g, group in enumerate(osd["param_groups"]):
            shifted = [offset + i for i in group["params"]]
            if g < len(merged["param_groups"]):
                target = merged["param_groups"][g]
                mine = {k: v for k, v in target.items() if k != "params"}
                if mine != {k: v for k, v in group.items() if k != "params"}:
                    raise CheckpointError(
                        f"{folder}: parameter group {g} has other hyperparameters on stage "
                        f"{stage} than on stage 0; one optimizer cannot describe both"
                    )
                target["params"] = [*target["params"], *shifted]
            else:
                merged["param_groups"].append({**group, "params": shifted})
        for pid, state in osd["state"].items():
            merged["state"][offset + int(pid)] = state
        offset += len(ids)
    # a global parameter order: group by group, as positional_names reads the ids
    order = [i for group in merged["param_groups"] for i in group["params"]]
    renumber = {old: new for new, old in enumerate(order)}
    merged["state"] = {renumber[k]: v for k, v in merged["state"].items()}
    for group in merged["param_groups"]:
        group["params"] = [renumber[i] for i in group["params"]]
    params = {name: value for (_, kind, name), value in weights.items() if kind == "param"}
    if offset > len(params):
        raise CheckpointError(
            f"{folder}: the {len(osds)} stages' optimizers hold {offset} parameters, the layer "
            f"files only {len(params)}: a layer file is missing (layer files present: "
            f"{_present(layers)}; an index without a file is a function layer or a missing file)"
        )
    if len(merged["param_groups"]) > 1:
        log.warning(
            "%s: a ZeRO-0 pipeline optimizer with several parameter groups is matched by "
            "position only; the weights are imported, the optimizer state is not",
            folder,
        )
        return
    names = positional_names(params, merged)
    if names is None:
        log.warning(
            "%s: the ZeRO-0 pipeline optimizer's parameters cannot be matched to the layer files' "
            "names unambiguously; the weights are imported, the optimizer state is not",
            folder,
        )
        return
    objects["optimizer"] = optimizer_import("optimizer", merged, names, tensors, "model")
