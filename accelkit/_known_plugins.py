"""Install hints for plugin distributions accelkit knows of, and the helpers plugins use to write
their own install lines.

This is data for error messages only: no code branches on these names. The plugin distributions
are not on a package index yet; they install from this repository (docs/getting-started.md,
"Install"), so every line here names the interpreter that runs accelkit and, where accelkit runs
from a checkout, the plugin's folder by its absolute path: each line runs as printed.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

#: the repository root when accelkit runs from a checkout (an editable install), else None
_CHECKOUT = Path(__file__).resolve().parents[1]


def pip_install(*requirements: str) -> str:
    """``<this python> -m pip install <requirements>``: the interpreter that runs accelkit, so the
    line installs into the same environment even when it is not activated."""
    return " ".join([shlex.quote(sys.executable), "-m", "pip", "install", *requirements])


def installed_versions(*distributions: str) -> dict[str, str | None]:
    """``{distribution: its installed version, or None}`` from the package metadata, importing
    nothing: what a plugin's ``accelkit_env_report`` hook returns."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in distributions:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def checkout_path(relative: str) -> str:
    """``relative`` (a path inside the accelkit repository) made absolute when accelkit runs from
    a checkout that holds it; otherwise ``relative`` as it is, to run from the repository root."""
    path = _CHECKOUT / relative
    if (_CHECKOUT / "pyproject.toml").is_file() and path.exists():
        return shlex.quote(str(path))
    return relative


def from_checkout(line: str) -> str:
    """``line``, plus where to run it when it names repository paths relative to the root."""
    if " plugins/" in line:
        return f"{line}  (from the root of an accelkit checkout)"
    return line


#: backend name -> (distribution, install line)
KNOWN_PLUGIN_BACKENDS: dict[str, tuple[str, str]] = {}

#: distribution -> (folder under plugins/, its backend names)
_PLUGINS = {
    "accelkit-deepspeed": (
        "deepspeed",
        (
            "deepspeed",
            "deepspeed_stage_1",
            "deepspeed_stage_2",
            "deepspeed_stage_3",
            "deepspeed_stage_3_offload",
        ),
    ),
    "accelkit-apex": ("apex", ("apex", "apex_distributed_adam")),
    "accelkit-fairscale": ("fairscale", ("fairscale_fsdp", "fairscale_oss", "fairscale_sdp")),
    "accelkit-colossalai": (
        "colossalai",
        ("colossalai_gemini", "colossalai_zero", "colossalai_ddp", "colossalai_hybrid"),
    ),
}

#: what a plugin's install leaves to do: ColossalAI goes in without its torch pin (its script)
_AFTER = {
    "colossalai": lambda: (
        f"bash {checkout_path('plugins/colossalai/install_colossalai.sh')} "
        f"{shlex.quote(sys.executable)}"
    ),
}

for _dist, (_folder, _names) in _PLUGINS.items():
    _line = pip_install("-e", checkout_path(f"plugins/{_folder}"))
    if _folder in _AFTER:
        _line = f"{_line} && {_AFTER[_folder]()}"
    for _name in _names:
        KNOWN_PLUGIN_BACKENDS[_name] = (_dist, from_checkout(_line))
