"""``accelkit.sdk`` is the one door for backend plugins (issue 20, "a declared plugin SDK").

A plugin package that imports ``accelkit.<module>`` directly ties itself to core internals that
may move; these tests read every plugin module's source (ast, nothing imported) and fail on such
an import, and check that every name the SDK declares exists and says what it is for.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import accelkit.sdk

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_MODULES = sorted(ROOT.glob("plugins/*/accelkit_*/**/*.py"))
ALLOWED = {"accelkit", "accelkit.sdk"}


def core_imports(path: Path) -> list[str]:
    """``line: module`` for each import of an accelkit module other than the allowed ones
    (``accelkit_<plugin>`` modules are the plugin's own and fine)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "accelkit":  # `from accelkit import checkpoint` is a submodule
                modules = [f"accelkit.{a.name}" for a in node.names if a.name != "hookimpl"]
                modules = [m for m in modules if m.split(".")[1] not in accelkit.__all__]
        else:
            continue
        found += [
            f"{node.lineno}: {m}"
            for m in modules
            if (m == "accelkit" or m.startswith("accelkit.")) and m not in ALLOWED
        ]
    return found


def test_the_check_sees_a_core_import(tmp_path):
    """The probe works: each way of reaching into core is reported, the SDK is not."""
    sample = tmp_path / "mod.py"
    sample.write_text(
        "import accelkit\n"
        "from accelkit.sdk import Backend\n"
        "from accelkit import hookimpl, ConfigError\n"
        "from accelkit.backend import Backend\n"
        "import accelkit.precision\n"
        "from accelkit import distributed\n"
        "def f():\n"
        "    from accelkit.checkpoint.shards.sharded import Slot\n"
    )
    assert core_imports(sample) == [
        "4: accelkit.backend",
        "5: accelkit.precision",
        "6: accelkit.distributed",
        "8: accelkit.checkpoint.shards.sharded",
    ]


def test_plugins_import_core_only_through_the_sdk():
    assert len(PLUGIN_MODULES) > 20  # the four plugins' packages were found
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in PLUGIN_MODULES
        if (found := core_imports(path))
    }
    assert offenders == {}, (
        "plugin modules import core modules; import these names from accelkit.sdk (add them "
        f"there if missing): {offenders}"
    )


@pytest.mark.parametrize("name", accelkit.sdk.__all__)
def test_every_sdk_name_resolves_and_says_what_it_is(name):
    value = getattr(accelkit.sdk, name)
    if inspect.isclass(value) or inspect.isfunction(value):
        doc = inspect.getdoc(value) or ""
        # a dataclass without a docstring gets its signature as __doc__
        assert doc.strip() and not doc.startswith(f"{value.__name__}("), f"{name} has no docstring"


def test_sdk_has_a_version_and_a_docstring():
    major, minor = accelkit.sdk.SDK_VERSION.split(".")
    assert int(major) >= 1 and int(minor) >= 0
    assert "backend authors" in (accelkit.sdk.__doc__ or "")
    with pytest.raises(AttributeError):
        accelkit.sdk.not_a_name  # noqa: B018


def test_importing_the_sdk_loads_no_core_module_nor_backend_library():
    """``import accelkit.sdk`` stays cheap: names load from their modules on first access."""
    code = (
        "import sys, accelkit.sdk\n"
        "heavy = ['deepspeed', 'colossalai', 'apex', 'fairscale', 'mmengine',\n"
        "         'accelkit.checkpoint', 'accelkit.benchmark', 'accelkit.backend']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
