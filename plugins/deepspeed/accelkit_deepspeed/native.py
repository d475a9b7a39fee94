"""DeepSpeed's own checkpoint format, when asked: ``accel.save(path, state, format="native")``.

The engine (model, fp32 masters, optimizer state) goes through ``engine.save_checkpoint`` /
``engine.load_checkpoint``; the rest of ``state`` (schedulers, the dataloader, other stateful
objects, plain values) rides in DeepSpeed's ``client_state``. It is pickled, as DeepSpeed's
files are, so loading it needs ``trust_pickle=True``, and even then every file DeepSpeed's
``load_checkpoint`` reads goes through accelkit's restricted unpickler with the classes
DeepSpeed's checkpoints hold (:mod:`accelkit_deepspeed.pickles`), never through DeepSpeed's
``torch.load(weights_only=False)``. ``accelkit convert --trust-pickle`` turns such a directory
into a portable checkpoint (:mod:`accelkit_deepspeed.importer`).

A native checkpoint holds one engine: with several models set up, ``state`` names the model (and
optimizer) of one of them, and only that engine's loss scale and counters go in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accelkit.sdk import (
    CheckpointError,
    UnsupportedError,
    classify_state,
    drop_callables,
    user_module,
)

CLIENT_KEY = "accelkit"


def _engine_parts(backend: Any, state: dict[str, Any]) -> tuple[Any, Any, list[str], list[str]]:
    """The engine whose model ``state`` holds, the state's objects, and that engine's names."""
    engines = list(backend.engines)
    if not engines:
        raise UnsupportedError(f"{backend.name}: call accel.setup() before a native save or load")
    objects = classify_state(state)
    inner = [user_module(m, backend) for m in objects.modules.values()]
    holding = [e for e in engines if any(m is e.module for m in inner)]
    if len(holding) > 1:
        raise UnsupportedError(
            f"{backend.name}: a native DeepSpeed checkpoint holds one engine, and state has the "
            f"models of {len(holding)}; save them with the portable format (the default), or "
            "one native checkpoint per model"
        )
    engine = holding[0] if holding else engines[0]
    modules = [n for n, m in objects.modules.items() if user_module(m, backend) is engine.module]
    optimizer = getattr(engine.optimizer, "optimizer", None)
    optimizers = [
        n for n, o in objects.optimizers.items() if o is engine.optimizer or o is optimizer
    ]
    strangers = [
        n for n in (*objects.modules, *objects.optimizers) if n not in (*modules, *optimizers)
    ]
    if strangers or len(modules) != 1:
        raise UnsupportedError(
            f"{backend.name}: a native DeepSpeed checkpoint holds the engine's model and "
            f"optimizer only (state has {strangers or 'no model'} besides); save the others "
            "with the portable format (the default)"
        )
    return engine, objects, modules, optimizers


@contextlib.contextmanager
def restricted_reads(engine: Any, path: str | os.PathLike) -> Iterator[None]:
    """For the duration, the files DeepSpeed's ``load_checkpoint`` reads go through accelkit's
    restricted unpickler: all of them go through ``engine.checkpoint_engine.load``, whose own
    reading is ``torch.load(weights_only=False)``. A universal checkpoint, which DeepSpeed
    reads with ``torch.load`` directly, is refused."""
    from accelkit_deepspeed import pickles

    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None or engine.load_universal_checkpoint():
        raise UnsupportedError(
            f"{path}: this engine reads checkpoints outside DeepSpeed's checkpoint engine "
            "(a universal checkpoint, or an engine without an optimizer), which accelkit cannot "
            "restrict; load a portable checkpoint instead (accelkit convert --trust-pickle)"
        )
    allowlist = pickles.native_allowlist()

    def load(path: str, map_location: Any = None) -> Any:
        return pickles.load(path, allowlist, map_location=map_location)

    checkpoint_engine.load = load  # the instance's, over its class's method
    try:
        yield
    finally:
        del checkpoint_engine.load


def save(
    backend: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    from accelkit_deepspeed.checkpoint import engine_state_of

    engine, objects, _, _ = _engine_parts(backend, state)
    client: dict[str, Any] = {
        "schedulers": {n: drop_callables(s.state_dict(), n) for n, s in objects.schedulers.items()},
        "statefuls": {n: s.state_dict() for n, s in objects.statefuls.items()},
        "extras": dict(objects.extras),
        "backend": engine_state_of(backend, engine),
    }
    engine.save_checkpoint(
        str(path),
        tag=tag,
        client_state={CLIENT_KEY: client},
        exclude_frozen_parameters=exclude_frozen_parameters,
    )
    return Path(path)


def load(
    backend: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
    trust_pickle: bool = False,
    tag: str | None = None,
) -> dict[str, Any]:
    if not trust_pickle:
        raise CheckpointError(
            f"{path}: a native DeepSpeed checkpoint is pickled. Pass trust_pickle=True to read "
            "it with accelkit's restricted unpickler (tensors, plain containers, numpy values and "
            "the classes DeepSpeed's checkpoints hold, and no other global), or convert it "
            "once with `accelkit convert --trust-pickle` and load the portable copy."
        )
    from accelkit_deepspeed.checkpoint import load_engine_state_of

    engine, objects, _, optimizers = _engine_parts(backend, state)
    with restricted_reads(engine, path):
        load_path, client = engine.load_checkpoint(
            str(path),
            tag=tag,
            load_module_strict=strict,
            load_optimizer_states=bool(optimizers),
            load_lr_scheduler_states=False,
        )
    if load_path is None:
        raise CheckpointError(f"{path}: DeepSpeed found no checkpoint to load there")
    saved = (client or {}).get(CLIENT_KEY, {})
    for group in ("schedulers", "statefuls"):
        mine = getattr(objects, group)
        for name, value in saved.get(group, {}).items():
            if name in mine:
                mine[name].load_state_dict(value)
            elif strict and name not in state:
                continue
    missing = [
        n
        for n in (*objects.schedulers, *objects.statefuls, *objects.extras)
        if n not in saved.get("schedulers", {})
        and n not in saved.get("statefuls", {})
        and n not in saved.get("extras", {})
    ]
    if missing and strict:
        raise CheckpointError(
            f"{path}: {missing} are not in this native checkpoint (pass strict=False to load "
            "what is there)"
        )
    for name in objects.extras:
        if name in saved.get("extras", {}):
            state[name] = saved["extras"][name]
    load_engine_state_of(backend, engine, saved.get("backend", {}))
    unconsumed: dict[str, Any] = {}
    for group in ("schedulers", "statefuls", "extras"):
        for name, value in saved.get(group, {}).items():
            if name not in state:
                unconsumed[name] = value
    return unconsumed
