"""Unknown keys of a native DeepSpeed config, at any depth, found with DeepSpeed's own parser.

DeepSpeed ignores a top-level key it does not read (``gradient_cliping: 0.5`` leaves clipping
at 1.0) and reports a nested one (``zero_optimization.stgae``) only when the engine is built,
as a pydantic dump. This runs DeepSpeed's config parser (``DeepSpeedConfig._initialize_params``)
on the user's config before anything is built:

* a top-level key is known when the parser reads it (recorded on a parse of an empty config),
  :data:`READ_ELSEWHERE`, or one of :data:`~accelkit_deepspeed.config.NATIVE_KEYS` (keys the
  engine reads itself);
* the sections DeepSpeed validates with its pydantic models (``zero_optimization``, ``bf16``,
  ``fp16``, the monitors, ``compile``, ...) are parsed one at a time, and each
  ``extra_forbidden`` error names its path and the nearest field of that model;
* the plain-dict sections the parser reads key by key (:data:`READ_SECTIONS`) are checked
  against the keys it read.

Only unknown keys are reported; a value DeepSpeed would reject (or HF's ``"auto"``) is left to
DeepSpeed. Imports DeepSpeed: the backend runs it in ``launch()``, which imports it anyway.
"""

from __future__ import annotations

import functools
import logging
import typing
from typing import Any

from accelkit.sdk import ConfigError, closest
from accelkit_deepspeed.config import NATIVE_KEYS

log = logging.getLogger("accelkit")

#: top-level keys DeepSpeed reads outside the parser (DeepSpeedConfig.__init__, its printout)
READ_ELSEWHERE = frozenset({"sequence_parallel_size", "vocabulary_size"})

#: sections the parser reads key by key from a plain dict (no pydantic model)
READ_SECTIONS = ("activation_checkpointing", "flops_profiler")


class _Reads(dict):
    """A dict that records which keys were looked up (and hands out recording children)."""

    def __init__(self, data: dict[str, Any], path: tuple[str, ...], seen: set[tuple[str, ...]]):
        super().__init__(data)
        self._path, self._seen = path, seen

    def _child(self, key: Any, value: Any) -> Any:
        self._seen.add((*self._path, key))
        if isinstance(value, dict) and not isinstance(value, _Reads):
            return _Reads(value, (*self._path, key), self._seen)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        return self._child(key, super().get(key, default))

    def __getitem__(self, key: Any) -> Any:
        return self._child(key, super().__getitem__(key))

    def __contains__(self, key: Any) -> bool:
        self._seen.add((*self._path, key))
        return super().__contains__(key)

    def keys(self) -> Any:
        owner = self

        class Keys:
            def __contains__(self, key: Any) -> bool:
                return key in owner

            def __iter__(self) -> Any:
                return iter(dict.keys(owner))

            def __len__(self) -> int:
                return dict.__len__(owner)

        return Keys()


def _parse(config: dict[str, Any]) -> set[tuple[str, ...]]:
    """Run DeepSpeed's parser on ``config``; return the key paths it read."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parser = DeepSpeedConfig.__new__(DeepSpeedConfig)  # no world size, mpu or batch checks
    parser.world_size, parser.global_rank = 1, 0
    seen: set[tuple[str, ...]] = set()
    parser._initialize_params(_Reads(config, (), seen))
    return seen


@functools.cache
def known_top_level_keys() -> frozenset[str]:
    """The top-level keys DeepSpeed's parser reads, and those its engine reads itself."""
    return frozenset(path[0] for path in _parse({})) | NATIVE_KEYS | READ_ELSEWHERE


def _model_of(annotation: Any) -> Any:
    """The pydantic model class inside a field's annotation (``Optional[Model]``), or None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _field_names(model: Any) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def _suggestion(model_name: str, loc: tuple[Any, ...]) -> str | None:
    """The nearest valid key to the unknown last element of ``loc`` inside model ``model_name``."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    models = {}
    pending = [DeepSpeedConfigModel]
    while pending:
        cls = pending.pop()
        models.setdefault(cls.__name__, cls)
        pending.extend(cls.__subclasses__())
    model = models.get(model_name)
    for part in loc[:-1]:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _model_of(model.model_fields[part].annotation)
    return closest(str(loc[-1]), _field_names(model)) if model is not None else None


def unknown_keys(config: dict[str, Any]) -> list[tuple[str, str | None]]:
    """Each unknown key of a native DeepSpeed config as (dotted path, nearest valid key)."""
    from pydantic import ValidationError

    found: list[tuple[str, str | None]] = []
    known = known_top_level_keys()
    for key, section in config.items():
        if key not in known:
            found.append((key, closest(key, known)))
            continue
        try:
            seen = _parse({key: section})
        except ValidationError as err:
            for error in err.errors():
                if error["type"] == "extra_forbidden":
                    loc = tuple(error["loc"])
                    path = ".".join(str(p) for p in (key, *loc))
                    found.append((path, _suggestion(err.title, loc)))
            continue
        except Exception:  # a value DeepSpeed rejects: its own error comes at setup
            continue
        if key in READ_SECTIONS and isinstance(section, dict):
            read = {path[1] for path in seen if len(path) == 2 and path[0] == key}
            for inner in section:
                if inner not in read:
                    found.append((f"{key}.{inner}", closest(inner, read)))
    return found


def check(owner: str, config: dict[str, Any] | None) -> None:
    """Raise :class:`~accelkit.errors.ConfigError` naming every unknown key of ``config``."""
    if not config:
        return
    try:
        found = unknown_keys(config)
    except Exception as err:  # another DeepSpeed's parser: leave the config to DeepSpeed
        log.debug("the native config's keys were not checked: %s", err)
        return
    if not found:
        return
    parts = [f"{path!r}" + (f" (did you mean {hint!r}?)" if hint else "") for path, hint in found]
    raise ConfigError(
        f"{owner}: the DeepSpeed config has unknown key(s) {', '.join(parts)}. DeepSpeed would "
        "ignore a top-level one silently and fail on a nested one only when the engine is "
        "built. Fix the spelling; DeepSpeed's configuration page lists every key."
    )
