"""Plugin discovery (issue 2, item 7; docs/architecture.md, "Discovery").

Real throwaway plugin distributions -- each with its own pyproject.toml and an entry point of
group ``accelkit`` -- are pip-installed into a temporary directory, and fresh interpreters with
that directory on PYTHONPATH show what a user who ran ``pip install accelkit-<plugin>`` gets:
the plugin's backends by name, a broken plugin reported without breaking the others, a plugin
that tries to take a native name refused, ``ACCELKIT_DISABLE_PLUGINS=1``, and no entry point
read at ``import accelkit``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.0.1"

[project.entry-points.accelkit]
{entry} = "{package}"

[tool.setuptools]
packages = ["{package}"]
"""

GOOD_PLUGIN = '''\
"""A working plugin: registers names cheaply; its backend module loads when first built."""
import accelkit


@accelkit.hookimpl
def accelkit_register_backends(registry):
    registry.add(
        "toy",
        "accelkit_toyplug.backend:ToyBackend",
        aliases=("toy_alias",),
        description="a throwaway backend from a test",
    )


@accelkit.hookimpl
def accelkit_env_report():
    return {"toylib": "1.2.3"}
'''

GOOD_BACKEND = '''\
"""The backend class, imported only when a 'toy' accelerator is built."""
from accelkit.backend import Backend, SetupResult


class ToyBackend(Backend):
    def setup(self, model, optimizers, **kwargs):
        model.toy_was_here = True
        return SetupResult(model, optimizers)
'''

BROKEN_PLUGIN = """\
raise RuntimeError("brokenplug is broken on purpose")
"""

SHADOW_PLUGIN = '''\
"""A plugin that tries to take a native backend's name."""
import accelkit


@accelkit.hookimpl
def accelkit_register_backends(registry):
    registry.add("cpu", "accelkit_shadowplug:Nothing")
'''

PLUGINS = {
    "accelkit-toyplug": (
        "toyplug",
        "accelkit_toyplug",
        {"__init__.py": GOOD_PLUGIN, "backend.py": GOOD_BACKEND},
    ),
    # named like a plugin accelkit knows, so the error for its names can point at the failure
    "accelkit-apex": ("brokenplug", "accelkit_brokenplug", {"__init__.py": BROKEN_PLUGIN}),
    "accelkit-shadowplug": ("shadowplug", "accelkit_shadowplug", {"__init__.py": SHADOW_PLUGIN}),
}

PROBE = r"""
import dataclasses, json, sys
from importlib import metadata

calls = []
real_entry_points = metadata.entry_points


def spy(*args, **kwargs):
    if kwargs.get("group") == "accelkit":  # torch reads its own groups when it is imported
        calls.append(kwargs.get("group"))
    return real_entry_points(*args, **kwargs)


metadata.entry_points = spy
import accelkit

out = {"groups_read_at_import": list(calls), "plugin_imported_at_import": "accelkit_toyplug" in sys.modules}
from accelkit import registry

host = registry.host()
host.ensure_loaded()
out["groups_read_at_load"] = list(calls)
out["backend_module_at_load"] = "accelkit_toyplug.backend" in sys.modules
out["plugins"] = [dataclasses.asdict(p) for p in host.plugins]
out["names"] = host.registry.names()
out["env"] = host.env_report()
for name in ["toy", "toy_alias", "cpu", "dpp", "apex"]:
    try:
        import torch

        accel = accelkit.get(name)
        model, opt = accel.setup(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        out[name] = {"backend": accel.name, "class": type(accel.backend).__name__, "toy": getattr(model, "toy_was_here", False)}
    except Exception as err:
        out[name] = {"error": type(err).__name__ + ": " + str(err)}
out["backend_module_after_get"] = "accelkit_toyplug.backend" in sys.modules
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    """The three plugins, built and pip-installed with --target into a temporary directory."""
    root = tmp_path_factory.mktemp("plugins")
    sources = []
    for dist, (entry, package, files) in PLUGINS.items():
        src = root / "src" / dist
        (src / package).mkdir(parents=True)
        (src / "pyproject.toml").write_text(
            PYPROJECT.format(dist=dist, entry=entry, package=package)
        )
        for name, text in files.items():
            (src / package / name).write_text(text)
        sources.append(str(src))
    target = root / "site"
    env = {**os.environ, "PIP_CACHE_DIR": str(root / "pip-cache"), "PIP_NO_INPUT": "1"}
    # offline with the setuptools of this environment; else pip fetches one into isolation
    offline = importlib.util.find_spec("setuptools") is not None
    build = ["--no-build-isolation", "--no-index"] if offline else []
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            *build,
            "--disable-pip-version-check",
            "--target",
            str(target),
            *sources,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"pip install of the test plugins failed:\n{proc.stderr[-4000:]}"
    return target


def probe(plugin_dir: Path, **env: str) -> dict:
    full_env = {**os.environ, "PYTHONPATH": str(plugin_dir)}
    full_env.pop("ACCELKIT_DISABLE_PLUGINS", None)
    full_env.update(env)
    proc = subprocess.run(  # cwd: not the source tree, so the plugins come first on sys.path
        [sys.executable, "-c", PROBE],
        env=full_env,
        cwd=plugin_dir.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.fixture(scope="module")
def discovered(plugin_dir) -> dict:
    return probe(plugin_dir)


def plugin_record(result: dict, name: str) -> dict:
    return next(p for p in result["plugins"] if p["name"] == name)


def test_installed_plugin_backend_works_by_name(discovered):
    assert discovered["toy"] == {"backend": "toy", "class": "ToyBackend", "toy": True}
    assert discovered["toy_alias"]["class"] == "ToyBackend"
    record = plugin_record(discovered, "toyplug")
    assert record["status"] == "loaded"
    assert record["distribution"] == "accelkit-toyplug"
    assert record["version"] == "0.0.1"
    assert record["backends"] == ["toy", "toy_alias"]
    assert discovered["env"]["toylib"] == "1.2.3"


def test_plugin_registers_names_without_importing_its_backend(discovered):
    assert discovered["backend_module_at_load"] is False
    assert discovered["backend_module_after_get"] is True


def test_broken_plugin_is_reported_and_others_still_work(discovered):
    record = plugin_record(discovered, "brokenplug")
    assert record["status"] == "failed"
    assert "RuntimeError: brokenplug is broken on purpose" in record["error"]
    assert record["distribution"] == "accelkit-apex"
    assert discovered["toy"]["class"] == "ToyBackend"
    assert discovered["cpu"]["class"] == "SingleDeviceBackend"
    # the error for an unknown name mentions the plugin that failed to load
    assert "brokenplug" in discovered["dpp"]["error"]
    assert "broken on purpose" in discovered["dpp"]["error"]
    # and the error for a name of that plugin says it is installed but failed, and why
    apex = discovered["apex"]["error"]
    assert apex.startswith("PluginMissingError: backend 'apex' comes from plugin 'accelkit-apex'")
    assert "installed but failed to load: RuntimeError: brokenplug is broken on purpose" in apex


def test_plugin_cannot_take_a_native_name(discovered):
    record = plugin_record(discovered, "shadowplug")
    assert record["status"] == "failed"
    assert "'cpu' is already registered" in record["error"]
    assert plugin_record(discovered, "native")["status"] == "loaded"
    assert discovered["cpu"]["class"] == "SingleDeviceBackend"


def test_native_backends_register_through_the_same_hooks(discovered):
    native = plugin_record(discovered, "native")
    assert native["distribution"] == "accelkit"
    assert {"cpu", "cuda", "mps", "ddp", "fsdp", "auto"} <= set(native["backends"])


def test_entry_points_are_not_read_at_import(discovered):
    assert discovered["groups_read_at_import"] == []
    assert discovered["plugin_imported_at_import"] is False
    assert discovered["groups_read_at_load"] == ["accelkit"]


def test_disable_plugins_leaves_only_the_native_backends(plugin_dir):
    result = probe(plugin_dir, ACCELKIT_DISABLE_PLUGINS="1")
    assert [p["name"] for p in result["plugins"]] == ["native"]
    assert "toy" not in result["names"]
    assert result["toy"]["error"].startswith("BackendNotFoundError: unknown backend 'toy'")
    assert result["cpu"]["class"] == "SingleDeviceBackend"
    assert result["groups_read_at_load"] == []  # not even looked up


def test_in_process_plugin_registration():
    """Notebooks and tests register a plugin object without an entry point."""
    import accelkit
    from accelkit.backends.single import SingleDeviceBackend

    class NotebookPlugin:
        @staticmethod
        @accelkit.hookimpl
        def accelkit_register_backends(registry):
            registry.add("notebook_cpu", SingleDeviceBackend, defaults={"device_index": None})

    accelkit.register_plugin(NotebookPlugin(), "notebook")
    from accelkit import registry

    record = next(p for p in registry.host().plugins if p.name == "notebook")
    assert record.status == "loaded" and record.backends == ["notebook_cpu"]
    assert registry.host().resolve("notebook_cpu").plugin == "notebook"


def test_backends_are_found_after_a_package_installs_the_importlib_metadata_backport():
    """mlflow imports importlib_metadata, whose finder then makes entry_points() return the
    backport's EntryPoint objects; accelkit must still load its plugins from them."""
    import subprocess
    import sys

    pytest.importorskip("importlib_metadata")
    code = (
        "import importlib_metadata, sys\n"
        "import accelkit\n"
        "accel = accelkit.get('cpu')\n"
        "print(type(importlib_metadata.entry_points(group='accelkit')).__module__, accel.backend.name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-1500:]
    assert result.stdout.split()[-1] == "cpu"
