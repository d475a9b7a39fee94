"""MMEngine's own checkpoint readers open accelkit checkpoints.

``mmengine.runner.load_checkpoint``, ``_load_checkpoint``, plain MMEngine's ``Runner.load_checkpoint``
/ ``resume`` / ``load_from``, ``CheckpointHook(published_keys=...)`` and the OpenMMLab inferencers
and ``init_*`` helpers all reach a local path through ``CheckpointLoader``'s ``''`` scheme, which
``torch.load``s a file. An AccelkitRunner checkpoint (``work_dirs/x/epoch_2.pth``) is a directory,
so that scheme is taken over here: a directory holding ``accelkit.json`` is read with accelkit's
reader (any backend, any world size, every checksum verified) into the dict MMEngine itself would
have saved; anything else goes to the loader that was registered before, unchanged.

It is registered when ``accelkit.integrations.mmengine`` is imported, which is what a config's
``custom_imports = dict(imports=['accelkit.integrations.mmengine'])`` does in ``Config.fromfile``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from mmengine.runner.checkpoint import CheckpointLoader

from accelkit.errors import CheckpointError
from accelkit.integrations.mmengine import checkpoint as ckpt

#: the prefix of MMEngine's local-path scheme (the fallback of every other prefix)
LOCAL_PREFIX = ""


def _apply_map_location(checkpoint: Any, map_location: Any) -> Any:
    """Move the CPU tensors of ``checkpoint`` where ``torch.load(map_location=...)`` would."""
    if map_location is None:
        return checkpoint
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu")
        if map_location is None:
            return checkpoint
    if callable(map_location) and not isinstance(map_location, (str, torch.device)):
        mover = map_location

        def move(t: torch.Tensor) -> torch.Tensor:
            storage = mover(t.untyped_storage(), "cpu")
            return t if storage is None else t.to(storage.device)
    else:
        device = torch.device(map_location)
        if device.type == "cpu":
            return checkpoint

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return move(obj)
        if isinstance(obj, dict):
            moved = type(obj)() if type(obj) is not dict else {}
            for k, v in obj.items():
                moved[k] = walk(v)
            return moved
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(checkpoint)


def load_accelkit_checkpoint(filename: str, map_location: Any = None) -> dict[str, Any]:
    """An accelkit checkpoint directory as MMEngine's ``torch.load`` of its ``.pth`` returns it:
    ``meta``, ``state_dict``, ``optimizer``, ``param_schedulers``, ``message_hub`` and what hooks
    saved (``ema_state_dict``). Whole tensors on the CPU unless ``map_location`` says otherwise."""
    return _apply_map_location(ckpt.read_as_mmengine(filename), map_location)


def _local_loader(fallback: Callable[..., Any] | None) -> Callable[..., Any]:
    def load_from_local(filename: str, map_location: Any = None) -> Any:
        # the name is MMEngine's: CheckpointLoader logs "Loads checkpoint by local backend"
        path = os.path.expanduser(filename)
        if os.path.isdir(path):
            if ckpt.is_portable(path):
                return load_accelkit_checkpoint(path, map_location)
            raise CheckpointError(
                f"{filename!r} is a directory without {ckpt.MANIFEST}: not an accelkit "
                "checkpoint (an unfinished save, or another tool's format, such as MMEngine's "
                "DeepSpeedStrategy, which its own strategy loads)"
            )
        if fallback is None:
            raise FileNotFoundError(f"{filename} can not be found.")
        return fallback(filename, map_location)

    load_from_local.accelkit_fallback = fallback  # type: ignore[attr-defined]
    return load_from_local


def register() -> None:
    """Make MMEngine's local-path scheme open accelkit checkpoints (idempotent).

    The loader registered before (MMEngine's ``load_from_local``, or one a project installed)
    keeps serving every path that is not an accelkit checkpoint directory.
    """
    current = CheckpointLoader._schemes.get(LOCAL_PREFIX)
    if hasattr(current, "accelkit_fallback"):
        return
    CheckpointLoader.register_scheme(LOCAL_PREFIX, _local_loader(current), force=True)
