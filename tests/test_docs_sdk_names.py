"""Every SDK name the docs mention resolves, and the passages for plugin authors name no core
helper that the SDK does not export (issue 47: docs/checkpoint.md named ``optimizer_param_names``
and ``optimizer_family``, which a plugin cannot import, and imported from ``accelkit.checkpoint``).

Read from the Markdown source, nothing executed: ``sdk.NAME`` / ``accelkit.sdk.NAME`` anywhere
in the docs and ``from accelkit.sdk import ...`` in their code must name :data:`accelkit.sdk.__all__`;
in the plugin-author passages (docs/plugins.md, docs/checkpoint.md "For backend authors",
docs/performance.md "Writing the hook for a plugin") a backticked name that a core module defines
at its top level must be an SDK name, or a member of the protocol a plugin implements or calls.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import accelkit
import accelkit.sdk
from accelkit.testing import conformance

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
#: (file, heading of the section, or None for the whole page) a plugin author reads
PLUGIN_PASSAGES = [
    ("docs/plugins.md", None),
    ("docs/checkpoint.md", "## For backend authors"),
    ("docs/performance.md", "## Writing the hook for a plugin"),
]
SDK_ATTRIBUTE = re.compile(r"(?<![\w./])(?:accelkit\.)?sdk\.(?!py\b)([A-Za-z_]\w*)")
SDK_IMPORT = re.compile(r"from accelkit\.sdk import (?:\(([^)]*)\)|([\w, ]+))")
#: names that coincide with a core definition but name something else in these passages
NOT_HELPERS = {
    "AcceleratedOptimizer": "named as the proxy classify_state takes off, not to be imported",
    "CheckpointReader": "the reader object the checkpoint hooks receive",
    "all_gather_object": "torch.distributed's",
    "model_stats": "the memory hook's argument (tests import it from hook_testing)",
    "tp_divisor": "a key of model_stats",
}
#: modules the docs' test code may import: the test tools a plugin's own tests use
TEST_TOOLS = ("accelkit.testing", "accelkit.benchmark.hook_testing")
BACKTICKED = re.compile(r"`(?:accelkit\.sdk\.|sdk\.)?([A-Za-z_]\w*)(?:\([^`]*\))?`")


def sdk_mentions(text: str) -> set[str]:
    """The names ``text`` takes from the SDK: ``sdk.X`` and ``from accelkit.sdk import X``."""
    names = set(SDK_ATTRIBUTE.findall(text))
    for parenthesized, inline in SDK_IMPORT.findall(text):
        group = parenthesized or inline
        names.update(n.strip() for n in group.replace("\n", ",").split(",") if n.strip())
    return names


def section(text: str, heading: str | None) -> str:
    if heading is None:
        return text
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def core_definitions() -> set[str]:
    """Public names defined at the top level of accelkit's core modules (not its test tools)."""
    names: set[str] = set()
    for path in (ROOT / "accelkit").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module.startswith(TEST_TOOLS):
            continue
        for node in ast.parse(path.read_text()).body:
            definition = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if definition and not node.name.startswith("_"):
                names.add(node.name)
    return names


def protocol_names() -> set[str]:
    """What a plugin implements or calls besides the SDK's names: the members of the classes it
    subclasses or gets (the backend protocol, the accelerator, the suite), the top-level API,
    the hooks."""
    from accelkit import hookspecs
    from accelkit.accelerator import Accelerator

    names = set(accelkit.__all__) | set(conformance.__all__)
    names |= {n for n in dir(hookspecs) if n.startswith("accelkit_")}
    classes = [Accelerator, conformance.BackendContract]
    classes += [v for n in accelkit.sdk.__all__ if isinstance(v := getattr(accelkit.sdk, n), type)]
    for cls in classes:
        names |= set(dir(cls)) | set(getattr(cls, "__dataclass_fields__", {}))
    return names


def helpers_outside_the_sdk(text: str, core: set[str], allowed: set[str]) -> list[str]:
    """Backticked names in ``text`` that a core module defines but a plugin cannot import."""
    known = set(accelkit.sdk.__all__) | allowed | set(NOT_HELPERS)
    # a plain lowercase word (`convert`, `host`) is prose or a key, not a helper's name
    found = {
        m
        for m in BACKTICKED.findall(text)
        if m in core and m not in known and ("_" in m.strip("_") or m[0].isupper())
    }
    return sorted(found)


def unresolved_sdk_names(text: str) -> list[str]:
    return sorted(n for n in sdk_mentions(text) if n not in accelkit.sdk.__all__)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_sdk_name_a_page_mentions_resolves(page):
    names = sdk_mentions(page.read_text())
    missing = unresolved_sdk_names(page.read_text())
    assert not missing, f"{page.name} names accelkit.sdk.{missing}, which the SDK lacks"
    for name in names:
        getattr(accelkit.sdk, name)


def test_the_plugin_passages_name_only_helpers_a_plugin_can_import():
    core, allowed = core_definitions(), protocol_names()
    offenders = {}
    for file, heading in PLUGIN_PASSAGES:
        text = section((ROOT / file).read_text(), heading)
        if found := helpers_outside_the_sdk(text, core, allowed):
            offenders[f"{file} {heading or ''}".strip()] = found
        imports = re.findall(r"^\s*from (accelkit\.[\w.]+) import", text, flags=re.M)
        bad = sorted({m for m in imports if m != "accelkit.sdk" and not m.startswith(TEST_TOOLS)})
        if bad:
            offenders[f"{file} {heading or ''} imports".strip()] = bad
    assert not offenders, (
        f"plugin-author docs name core helpers the SDK does not export: {offenders}; export them "
        "from accelkit.sdk or name the SDK's"
    )


def test_the_checks_see_what_issue_47_found():
    """Negative twin: the old passage of docs/checkpoint.md and a misspelt SDK name fail."""
    old = (
        "The helpers `classify_state`, `param_owners`, `optimizer_param_names`,\n"
        "`optimizer_family` and `tensor_fragments` do the naming. `sdk.optimizer_recipes(x)`\n"
    )
    found = helpers_outside_the_sdk(old, core_definitions(), protocol_names())
    assert found == ["optimizer_family", "optimizer_param_names"]
    assert unresolved_sdk_names(old) == ["optimizer_recipes"]
    assert unresolved_sdk_names("from accelkit.sdk import (\n    Fragment,\n    Nope,\n)") == [
        "Nope"
    ]
