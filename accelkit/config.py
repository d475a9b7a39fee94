"""Turning what the user passed (dict, dataclass, YAML/JSON path, keyword options) into a
validated options dataclass, with errors that name the key and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from accelkit.errors import ConfigError


def load_config_source(config: Any) -> dict[str, Any]:
    """Return a plain dict from ``None``, a mapping, a dataclass instance, or a YAML/JSON path."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        text = path.read_text()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(f"config file {str(path)!r} is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {str(path)!r} must hold a mapping, not {type(data).__name__}"
            )
        return data
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if isinstance(config, typing.Mapping):
        return dict(config)
    raise ConfigError(
        f"config must be a dict, a dataclass, or a path to a YAML/JSON file, not {type(config).__name__}"
    )


def closest(name: str, candidates: typing.Iterable[str]) -> str | None:
    """The candidate nearest to a misspelt ``name``, for a "did you mean" in an error; or None."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_key_message(owner: str, key: str, valid: typing.Iterable[str]) -> str:
    valid = sorted(valid)
    hint = closest(key, valid)
    msg = f"{owner}: unknown option {key!r}."
    if hint:
        msg += f" Did you mean {hint!r}?"
    return msg + f" Valid options: {', '.join(valid) if valid else '(none)'}."


def _type_ok(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple, typing.Sequence, set, frozenset):
        return isinstance(value, (list, tuple, set, frozenset))
    if origin in (dict, typing.Mapping):
        return isinstance(value, typing.Mapping)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # hints we do not check (callables, protocols)


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def build_options(options_cls: type, owner: str, config: Any, overrides: dict[str, Any]):
    """Validate ``config`` merged with ``overrides`` against the dataclass ``options_cls``."""
    data = load_config_source(config)
    data.update(overrides)
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    hints = typing.get_type_hints(options_cls)
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(unknown_key_message(owner, key, fields))
        if not _type_ok(value, hints[key]):
            raise ConfigError(
                f"{owner}: option {key!r} must be {_describe(hints[key])}, got {value!r} "
                f"({type(value).__name__})"
            )
    try:
        return options_cls(**data)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{owner}: {err}") from err


def options_as_dict(options: Any) -> dict[str, Any]:
    """An options dataclass (or mapping) as a plain dict, for a native config or a report."""
    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options)
