"""Finding NVIDIA Apex: for ``accelkit env`` without importing it here, and at ``get()`` for real.

Apex is built from its own source; whether it works depends on which of its compiled CUDA
extensions were built (and against which torch). ``accelkit env`` must not import backend
libraries into its own process, so :func:`env_report` locates apex and its extension modules
with ``importlib.util.find_spec`` (which reads the file system only) and, when apex is there,
imports it in a child interpreter to say whether it imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from accelkit.sdk import PluginMissingError

DOCS = "docs/backends/apex.md"
#: what to do when apex is missing (the registry prints it)
BUILD = f"build NVIDIA Apex from its source with its CUDA extensions, as {DOCS} describes"
INSTALL = (
    "NVIDIA Apex is not on the package registry (`pip install apex` installs an unrelated web "
    f"toolkit): {BUILD}"
)

#: compiled extension modules of Apex, the ones accelkit uses first
USED_BY = {
    "amp_C": "every fused optimizer (build flag --cuda_ext)",
    "fused_layer_norm_cuda": "fused_norm=True (build flag --cuda_ext)",
    "distributed_adam_cuda": "apex_distributed_adam (build flag --distributed_adam)",
}
OTHER_COMPILED = (
    "fused_adam_cuda",
    "distributed_lamb_cuda",
    "mlp_cuda",
    "fused_dense_cuda",
    "xentropy_cuda",
    "fast_layer_norm",
    "fused_weight_gradient_mlp_cuda",
)
COMPILED = (*USED_BY, *OTHER_COMPILED)

_MARK = "ACCELKIT_APEX_PROBE"
_CHILD = """
import importlib, importlib.util, json, sys
out = {"modules": {}}
try:
    import torch  # apex's extensions need libtorch loaded first
    import apex, apex.optimizers, apex.normalization
    from apex.multi_tensor_apply import multi_tensor_applier
    out["apex"] = "ok"
    out["file"] = apex.__file__
    out["multi_tensor_applier"] = bool(multi_tensor_applier.available)
except Exception as err:
    out["apex"] = f"{type(err).__name__}: {err}"
for name in json.loads(sys.argv[1]):
    if importlib.util.find_spec(name) is None:
        continue
    try:
        importlib.import_module(name)
        out["modules"][name] = "ok"
    except Exception as err:
        out["modules"][name] = f"{type(err).__name__}: {err}"[:300]
print(MARK + json.dumps(out))
""".replace("MARK", repr(_MARK))


def apex_location() -> Path | None:
    """The folder of the importable ``apex`` package, or None (nothing is imported)."""
    try:
        spec = importlib.util.find_spec("apex")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def is_nvidia_layout(root: Path) -> bool:
    """Whether the ``apex`` package at ``root`` looks like NVIDIA Apex (has ``apex.optimizers``)."""
    return (root / "optimizers" / "__init__.py").is_file()


def compiled_modules() -> list[str]:
    """Apex's compiled extension modules that can be found (not imported)."""
    found = []
    for name in COMPILED:
        try:
            if importlib.util.find_spec(name) is not None:
                found.append(name)
        except (ImportError, ValueError):
            pass
    return found


def _version() -> str | None:
    try:
        return metadata.version("apex")
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=8)
def _child_probe(root: str, path: tuple[str, ...]) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(list(COMPILED))],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"apex": f"probe failed: {type(err).__name__}: {err}", "modules": {}}
    for line in done.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"apex": f"probe exited with {done.returncode}: {tail[0][:300]}", "modules": {}}


def env_report() -> dict[str, Any]:
    """``{"apex": version, "apex imports": ..., "apex compiled modules": ...}`` for ``accelkit env``.

    Nothing of apex is imported into this process; when apex is found, a child interpreter
    imports it (about as long as one ``import torch``).
    """
    root = apex_location()
    if root is None:
        return {"apex": None}
    version = _version() or "version unknown"
    if not is_nvidia_layout(root):
        return {
            "apex": f"{version} at {root}: not NVIDIA Apex (no apex.optimizers; the registry's "
            "'apex' is an unrelated web toolkit)"
        }
    report: dict[str, Any] = {"apex": f"{version} (NVIDIA Apex at {root})"}
    probe = _child_probe(str(root), tuple(sys.path))
    status = probe.get("apex", "unknown")
    if status == "ok" and not probe.get("multi_tensor_applier", False):
        status = "yes, but amp_C is missing: the fused optimizers cannot run"
    elif status == "ok":
        status = "yes"
    else:
        status = f"no: {status}"
    report["apex imports"] = status
    modules = probe.get("modules", {})
    working = [name for name in COMPILED if modules.get(name) == "ok"]
    broken = {name: why for name, why in modules.items() if why != "ok"}
    text = ", ".join(working) if working else "none (built without --cuda_ext?)"
    if broken:
        text += "; found but not importable: " + "; ".join(f"{k}: {v}" for k, v in broken.items())
    missing = [name for name in USED_BY if name not in modules]
    if missing:
        text += "; missing: " + ", ".join(f"{m} (for {USED_BY[m]})" for m in missing)
    report["apex compiled modules"] = text
    return report


# ---- at get(): import for real, with errors that say what to build --------------------------------
def import_apex(backend: str, *, fused_norm: bool = False, distributed_adam: bool = False) -> Any:
    """Import NVIDIA Apex and check the compiled modules ``backend`` needs; return the module."""
    root = apex_location()
    if root is None:
        raise PluginMissingError(
            f"backend {backend!r} needs NVIDIA Apex, which is not installed. {INSTALL}"
        )
    if not is_nvidia_layout(root):
        raise PluginMissingError(
            f"backend {backend!r}: the 'apex' package at {root} is not NVIDIA Apex (it has no "
            "apex.optimizers; the registry's 'apex' is an unrelated web toolkit). Uninstall it "
            f"and {BUILD}"
        )
    try:
        apex = importlib.import_module("apex")
        importlib.import_module("apex.optimizers")
        importlib.import_module("apex.normalization")
        from apex.multi_tensor_apply import multi_tensor_applier
    except Exception as err:
        raise PluginMissingError(
            f"backend {backend!r}: NVIDIA Apex at {root} failed to import: "
            f"{type(err).__name__}: {err}. Its compiled extensions must be built against the "
            f"torch in use ({_torch_version()}); see {DOCS}"
        ) from err
    if not multi_tensor_applier.available:
        cause = getattr(multi_tensor_applier, "import_err", None)
        raise PluginMissingError(
            f"backend {backend!r}: NVIDIA Apex at {root} was built without its CUDA extensions "
            f"(importing amp_C failed: {cause}). Rebuild it with --cpp_ext --cuda_ext ({DOCS})"
        )
    if fused_norm and importlib.util.find_spec("fused_layer_norm_cuda") is None:
        raise PluginMissingError(
            f"backend {backend!r}: fused_norm=True needs Apex's fused_layer_norm_cuda module, "
            f"which this Apex build lacks (build flag --cuda_ext; {DOCS})"
        )
    if distributed_adam:
        try:
            importlib.import_module("apex.contrib.optimizers.distributed_fused_adam")
        except Exception as err:
            raise PluginMissingError(
                f"backend {backend!r} needs apex.contrib.optimizers.distributed_fused_adam, which "
                f"failed to import ({type(err).__name__}: {err}): build Apex with "
                f"--distributed_adam as well as --cuda_ext ({DOCS})"
            ) from err
    return apex


def _torch_version() -> str:
    import torch

    return f"torch {torch.__version__}, CUDA {torch.version.cuda}"
