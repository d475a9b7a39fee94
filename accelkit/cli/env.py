"""``accelkit env``: what is installed, what devices there are, and which backends are ready.

Versions come from ``importlib.metadata`` and plugins' ``accelkit_env_report`` hooks, so no
backend library (deepspeed, colossalai, ...) is imported to write this report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

READY = "ready"
#: installed, but this machine lacks what the backend declared it needs (a CUDA GPU, ...)
NOT_RUNNABLE = "installed, not runnable here"
LIBRARY_MISSING = "library missing"
FAILED = "failed to load"
NOT_INSTALLED = "not installed"

#: printed under the table when it shows install lines
INSTALL_NOTE = (
    "Install lines install into this Python; docs/getting-started.md (Install) says how to install "
    "from the accelkit repository."
)


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--check",
        action="store_true",
        help="also import each ready backend's class (slower: may import its library)",
    )


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.check:
        check_imports(report["backends"])
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
    return 0


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    import torch

    from accelkit import __version__

    cudnn = None
    if torch.backends.cudnn.is_available():
        cudnn = torch.backends.cudnn.version()
    return {
        "python": f"{platform.python_version()} ({platform.python_implementation()}, "
        f"{sys.platform} {platform.machine()})",
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda,
        "cudnn": cudnn,
        "accelkit": __version__,
        "pluggy": _dist_version("pluggy"),
        "safetensors": _dist_version("safetensors"),
    }


def devices() -> dict[str, Any]:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    cuda: list[dict[str, Any]] = []
    cuda_error = None
    try:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            cuda.append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
    except Exception as err:  # a broken driver must not break the report
        cuda_error = f"{type(err).__name__}: {err}"
    mps_backend = getattr(torch.backends, "mps", None)
    return {
        "cpu": {"cores": os.cpu_count(), "usable_cores": usable},
        "cuda": cuda,
        "cuda_error": cuda_error,
        "mps": bool(mps_backend and mps_backend.is_available()),
    }


def _factory_module(factory: Any) -> str | None:
    if isinstance(factory, str):
        return factory.partition(":")[0]
    return None


def _module_exists(module_name: str) -> bool:
    """Whether a module can be found, importing at most its parent packages (cheap)."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def plugins_and_backends() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from accelkit import registry
    from accelkit._known_plugins import KNOWN_PLUGIN_BACKENDS

    host = registry.host()
    host.ensure_loaded()

    libraries: dict[str, dict[str, Any]] = {}
    for impl in host.pm.hook.accelkit_env_report.get_hookimpls():
        try:
            libraries[impl.plugin_name] = dict(impl.function() or {})
        except Exception as err:
            libraries[impl.plugin_name] = {"error": f"{type(err).__name__}: {err}"}

    plugins = [
        {
            "name": record.name,
            "distribution": record.distribution,
            "version": record.version,
            "status": record.status,
            "error": record.error or None,
            "backends": record.backends,
            "libraries": libraries.get(record.name, {}),
        }
        for record in host.plugins
    ]

    backends: list[dict[str, Any]] = []
    for name in host.registry.names():
        spec = host.registry.get(name)
        entry: dict[str, Any] = {
            "name": name,
            "status": READY,
            "plugin": spec.plugin,
            "description": spec.description,
        }
        if spec.alias_of:
            entry["alias_of"] = spec.alias_of
        missing = spec.missing_libraries()
        module_name = _factory_module(spec.factory)
        not_runnable = spec.not_runnable_reason()
        entry.update(installed=not missing, runnable_here=not missing and not not_runnable)
        if not_runnable:
            entry["needs"] = not_runnable
        if missing:
            entry.update(status=LIBRARY_MISSING, missing=missing, install=spec.install or None)
        elif module_name and not _module_exists(module_name):
            entry.update(status=FAILED, reason=f"module {module_name!r} not found")
            entry.update(installed=False, runnable_here=False)
        elif not_runnable:
            entry.update(status=NOT_RUNNABLE, reason=not_runnable)
        backends.append(entry)

    registered = set(host.registry.names())
    failed = {
        p.distribution.replace("_", "-").lower(): p for p in host.plugins if p.status != "loaded"
    }
    for name, (dist, pip_line) in sorted(KNOWN_PLUGIN_BACKENDS.items()):
        if name in registered:
            continue
        record = failed.get(dist.lower())
        if record is not None:
            backends.append(
                {
                    "name": name,
                    "status": FAILED,
                    "plugin": record.name,
                    "reason": record.error,
                    "installed": False,
                    "runnable_here": False,
                }
            )
        else:
            backends.append(
                {
                    "name": name,
                    "status": NOT_INSTALLED,
                    "distribution": dist,
                    "install": pip_line,
                    "installed": False,
                    "runnable_here": False,
                }
            )
    return plugins, backends


def check_imports(backends: list[dict[str, Any]]) -> None:
    """Deep probe for ``--check``: import each ready backend's class (may import its library)."""
    from accelkit import registry

    host = registry.host()
    for entry in backends:
        if entry["status"] not in (READY, NOT_RUNNABLE):
            continue
        spec = host.registry.get(entry["name"])
        try:
            spec.load_class()
        except Exception as err:
            entry.update(
                status=FAILED,
                reason=f"{type(err).__name__}: {err}",
                installed=False,
                runnable_here=False,
            )


def collect() -> dict[str, Any]:
    from accelkit.backends.mesh import support_report

    plugins, backends = plugins_and_backends()
    return {
        "versions": versions(),
        "devices": devices(),
        "plugins": plugins,
        "backends": backends,
        "fsdp_mesh": support_report(),
    }


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
        for row in rows
    ]


def render(report: dict[str, Any]) -> str:
    lines = ["versions"]
    lines += _table(
        [[k, str(v if v is not None else "none")] for k, v in report["versions"].items()]
    )

    dev = report["devices"]
    lines.append("")
    lines.append("devices")
    rows = [["cpu", f"{dev['cpu']['usable_cores']} usable cores (of {dev['cpu']['cores']})"]]
    for gpu in dev["cuda"]:
        rows.append(
            [
                f"cuda:{gpu['index']}",
                f"{gpu['name']}, {gpu['memory_gib']} GiB, compute {gpu['capability']}",
            ]
        )
    if not dev["cuda"]:
        rows.append(["cuda", f"none ({dev['cuda_error']})" if dev["cuda_error"] else "none"])
    rows.append(["mps", "available" if dev["mps"] else "none"])
    lines += _table(rows)

    lines.append("")
    lines.append("plugins")
    rows = []
    for plugin in report["plugins"]:
        libs = ", ".join(
            f"{k} {v if v is not None else 'missing'}" for k, v in plugin["libraries"].items()
        )
        detail = plugin["error"] if plugin["status"] != "loaded" else ", ".join(plugin["backends"])
        rows.append(
            [
                plugin["name"],
                f"{plugin['distribution']} {plugin['version']}".strip(),
                plugin["status"],
                libs or "-",
                detail,
            ]
        )
    lines += _table(rows)

    lines.append("")
    lines.append("backends")
    rows = []
    for entry in report["backends"]:
        status = entry["status"]
        if status == READY:
            detail = (
                f"alias of {entry['alias_of']}" if entry.get("alias_of") else entry["description"]
            )
        elif status == LIBRARY_MISSING:
            detail = f"needs {', '.join(entry['missing'])}: {entry.get('install') or ''}".rstrip(
                ": "
            )
            if entry.get("needs"):
                detail += f"; and it {entry['needs']}"
        elif status == NOT_INSTALLED:
            detail = entry["install"]
        else:
            detail = entry.get("reason", "")
        if status == NOT_RUNNABLE:  # one cell: "installed, not runnable here: needs a CUDA GPU"
            rows.append([entry["name"], f"{status}: {detail}"])
        else:
            rows.append([entry["name"], status, detail])
    lines += _table_ragged(rows)
    if report.get("fsdp_mesh"):
        lines += [
            "",
            "fsdp mesh (N-D parallelism: accelkit.get('fsdp', dp_replicate=, dp_shard=, tp=))",
        ]
        lines += _table([[k, v] for k, v in report["fsdp_mesh"].items()])
    if any(e["status"] in (LIBRARY_MISSING, NOT_INSTALLED) for e in report["backends"]):
        lines += ["", INSTALL_NOTE]
    return "\n".join(lines)


def _table_ragged(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """A table whose rows may end early: the columns are aligned on the full rows."""
    full = [row for row in rows if len(row) == 3]
    widths = [max((len(row[i]) for row in full), default=0) for i in range(2)]
    name_width = max([widths[0], *(len(row[0]) for row in rows)], default=0)
    out = []
    for row in rows:
        if len(row) == 3:
            out.append(
                indent + "  ".join([row[0].ljust(name_width), row[1].ljust(widths[1]), row[2]])
            )
        else:
            out.append(indent + "  ".join([row[0].ljust(name_width), row[1]]))
    return out
