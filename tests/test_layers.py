"""The core's layers hold (issue 32; docs/architecture.md, "Layers").

Every module under ``accelkit/`` is parsed, not imported, and each of its imports becomes an
arrow: imports inside functions and under ``if TYPE_CHECKING:`` count too (a reader has to follow
them all), relative imports are resolved, and ``from pkg import name`` points at ``pkg.name`` when
that is a submodule, else at ``pkg`` itself. Importing a submodule runs its package's
``__init__`` as well, but that arrow is Python's, not the module's, and is left out.

The checks: no circle of imports; no arrow from a lower layer to a higher one; the backend
protocol stands on nothing of the checkpoint package; no core module imports an integration;
inside the checkpoint package, its folders keep their own order (``CHECKPOINT_LAYERS``: the
format at the bottom, the stores on it, the reading, the backend kit, the writing, the
converters, the package's face on top), and the format, the backend kit and the stores never
reach a save or load orchestration (``CHECKPOINT_NEVER``). Each checker is tried on a package
that breaks it first, so a pass means something.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "accelkit"

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first import}


def module_files(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement reaches (submodule candidates included)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(package: Path) -> Graph:
    modules = module_files(package)
    graph: Graph = {name: {} for name in modules}
    for module, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = imported_names(node, module, is_package)
            if isinstance(node, ast.ImportFrom):
                # ``from pkg import a, b``: the submodules a and b where they are, else pkg
                submodules = [n for n in names[:-1] if n in modules]
                names = submodules + ([names[-1]] if len(submodules) < len(names) - 1 else [])
            for name in names:
                while name and name not in modules:  # ``import pkg.mod.attr`` -> pkg.mod
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].setdefault(name, node.lineno)
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One circle of imports, as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def describe(cycle: list[str], graph: Graph) -> str:
    return "\n".join(f"  {a} -> {b} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle))


# ---- the layers, bottom first (docs/architecture.md, "Layers") -------------------------------------
#: modules named by their dotted prefix; the longest prefix that matches decides
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "protocol",
        (
            "accelkit.backend",
            "accelkit.errors",
            "accelkit.config",
            "accelkit.precision",
            "accelkit.float8",
            "accelkit.distributed",
            "accelkit.modules",
            "accelkit.pipeline",
            "accelkit.seed",
            "accelkit.log",
            "accelkit.version",
            "accelkit.lazy",
            "accelkit.hookspecs",
            "accelkit.backend_specs",
            "accelkit.registry",
            "accelkit._known_plugins",
        ),
    ),
    ("checkpoint format", ("accelkit.checkpoint",)),
    # the torch-native backends, and the estimates and workloads plugins build on
    (
        "backends",
        ("accelkit.backends", "accelkit.benchmark.memory", "accelkit.benchmark.workloads"),
    ),
    (
        "facade",
        (
            "accelkit.accelerator",
            "accelkit.api",
            "accelkit.data",
            "accelkit.wrappers",
            "accelkit.preemption",
            "accelkit.tracking",
            "accelkit.tracking_backends",
            "accelkit.log_values",
            "accelkit.ema",
            "accelkit.launcher",
            "accelkit.memory",
        ),
    ),
    (
        "top",
        (
            "accelkit",  # the package's public face re-exports the facade
            "accelkit.sdk",
            "accelkit.cli",
            "accelkit.integrations",
            "accelkit.benchmark",
            "accelkit.testing",
        ),
    ),
]


def layer_of(module: str) -> int:
    best = (-1, -1)  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), index)
    assert best[1] >= 0, f"{module} is in no layer: add it to LAYERS and to docs/architecture.md"
    return best[1]


# ---- inside the checkpoint package (docs/architecture.md, "The checkpoint package") ----------------
#: its folders, bottom first; a module imports only from its own folder and those below
CHECKPOINT_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "format",
        (
            "accelkit.checkpoint.format",
            "accelkit.checkpoint.profile",
            "accelkit.checkpoint.progress",
        ),
    ),
    ("store", ("accelkit.checkpoint.store",)),
    ("read", ("accelkit.checkpoint.read",)),
    ("shards", ("accelkit.checkpoint.shards",)),
    ("write", ("accelkit.checkpoint.write",)),
    ("formats", ("accelkit.checkpoint.formats",)),
    ("face", ("accelkit.checkpoint",)),
]
#: arrows the order above would allow but the design does not: (from, to, why)
CHECKPOINT_NEVER: list[tuple[str, str, str]] = [
    ("accelkit.checkpoint.shards", "accelkit.checkpoint.store", "the backend kit knows no store"),
    ("accelkit.checkpoint.read", "accelkit.checkpoint.write", "a reader never saves"),
]


def _prefix_layer(module: str, layers: list[tuple[str, tuple[str, ...]]]) -> int:
    best = (-1, -1)
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), index)
    return best[1]


def checkpoint_violations(graph: Graph, package: str = "accelkit") -> list[str]:
    """Arrows inside ``package``'s checkpoint package that go up its folders or break a never."""

    def named(prefix: str) -> str:
        return package + prefix[len("accelkit") :]

    layers = [(name, tuple(named(p) for p in prefixes)) for name, prefixes in CHECKPOINT_LAYERS]
    inside = named("accelkit.checkpoint")
    found = []
    for module, targets in sorted(graph.items()):
        if not (module == inside or module.startswith(inside + ".")):
            continue
        for target, line in sorted(targets.items()):
            if not (target == inside or target.startswith(inside + ".")):
                continue
            low, high = _prefix_layer(module, layers), _prefix_layer(target, layers)
            if high > low:
                found.append(
                    f"  {module} ({layers[low][0]}) -> {target} ({layers[high][0]}), line {line}"
                )
            for source, banned, why in CHECKPOINT_NEVER:
                source, banned = named(source), named(banned)
                if module.startswith(source + ".") and target.startswith(banned + "."):
                    found.append(f"  {module} -> {target}, line {line}: {why}")
    return found


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(ROOT)


def test_the_checker_finds_a_circle(tmp_path):
    """The negative twin: a package whose modules import each other around a circle, through a
    function-level import, a relative import and ``from pkg import submodule``."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import VALUE\n")
    (pkg / "c.py").write_text("import os\nfrom pkg import a\nVALUE = 1\n")
    (pkg / "d.py").write_text("from pkg.c import VALUE\n")  # on no circle
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b": 2}
    assert graph["pkg.sub.b"] == {"pkg.c": 1}
    assert graph["pkg.c"] == {"pkg.a": 2}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert describe(find_cycle(graph), graph).splitlines()[0] == "  pkg.a -> pkg.sub.b (line 2)"
    (pkg / "c.py").write_text("VALUE = 1\n")
    assert find_cycle(import_graph(pkg)) is None


def test_accelkit_has_no_import_circle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "modules of accelkit import each other around a circle:\n" + describe(
        cycle, graph
    )


def test_no_import_goes_up_a_layer(graph):
    upward = [
        f"  {module} ({LAYERS[layer_of(module)][0]}) -> {target} "
        f"({LAYERS[layer_of(target)][0]}), line {line}"
        for module, targets in sorted(graph.items())
        for target, line in sorted(targets.items())
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(upward)


def test_the_checker_finds_an_arrow_up_the_checkpoint_folders(tmp_path):
    """The negative twin: a copy of the package's shape in which the format imports the writer
    (inside a function) and the backend kit imports a store; both are named, and the clean
    arrows are not."""
    root = tmp_path / "fake" / "checkpoint"
    for folder in ("format", "store", "shards", "write"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root.parent / "__init__.py").write_text("")
    (root / "__init__.py").write_text("from fake.checkpoint.write import writer\n")
    (root / "format" / "manifest.py").write_text("def f():\n    from ..write import writer\n")
    (root / "store" / "posix.py").write_text("from fake.checkpoint.format import manifest\n")
    (root / "shards" / "fragments.py").write_text("from fake.checkpoint.store import posix\n")
    (root / "write" / "writer.py").write_text("from fake.checkpoint.shards import fragments\n")
    found = checkpoint_violations(import_graph(tmp_path / "fake"), package="fake")
    assert found == [
        "  fake.checkpoint.format.manifest (format) -> fake.checkpoint.write.writer (write), line 2",
        "  fake.checkpoint.shards.fragments -> fake.checkpoint.store.posix, line 1: "
        "the backend kit knows no store",
    ]


def test_the_checkpoint_folders_keep_their_order(graph):
    found = checkpoint_violations(graph)
    assert not found, "imports against the checkpoint package's folders:\n" + "\n".join(found)


def test_the_protocol_stands_on_nothing_of_the_checkpoint_package(graph):
    reached, todo = set(), ["accelkit.backend"]
    while todo:
        for target in graph[todo.pop()]:
            if target not in reached:
                reached.add(target)
                todo.append(target)
    assert not {m for m in reached if m.startswith("accelkit.checkpoint")}


def test_no_core_module_imports_an_integration(graph):
    found = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if not module.startswith("accelkit.integrations")
        for target in targets
        if target.startswith("accelkit.integrations")
    ]
    assert not found


def test_no_module_is_over_800_lines_without_saying_why():
    """A module over 800 lines states why at its top, in its docstring (``Over 800 lines: ...``)."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 800 and "Over 800 lines:" not in docstring:
            long.append(f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines")
    assert not long


def test_the_dense_checkpoint_default_is_there_once_a_backend_is_built():
    """The protocol gets its checkpoint default from the checkpoint package, which
    ``accelkit.get`` loads (the native plugin's importers live there): a backend built the usual
    way yields its dense fragments without anyone importing ``accelkit.checkpoint`` first."""
    import subprocess
    import sys

    code = (
        "import sys, torch, accelkit\n"
        "accel = accelkit.get('cpu')\n"
        "pieces = list(accel.backend.local_fragments({'model': torch.nn.Linear(2, 2)}))\n"
        "print(len(pieces), 'accelkit.checkpoint.shards.dense' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.split() == ["3", "True"]  # weight, bias, the module's ObjectInfo
