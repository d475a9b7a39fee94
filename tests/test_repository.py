"""The repository is self-contained: no tracked file names a path outside it.

A clone is all a reader has. A docstring citing a design note that lives elsewhere, or a doc
pointing at a directory of the machine it was written on, sends the reader nowhere; the design
contract is docs/architecture.md. The rule, for every text file ``git ls-files`` lists:

* no absolute path under ``/work/`` (a workspace outside the repository). The checkout's own
  ``/work/main/`` is allowed only in the logs under ``bench/results/``, which record the
  tracebacks of the machine they ran on, verbatim;
* no ``../shared`` and no ``shared/notes`` or ``shared/bench`` (the team's folders beside it);
* no ``DESIGN.md`` (with or without a folder) unless that very file is tracked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()  # it spells the patterns out
RAW_LOGS = "bench/results/"
CHECKOUT_PREFIX = "/work/main/"

# a path starts a token: at the start of a line or after a space, quote, bracket, '=' or ':'
_START = r"(?:^|(?<=[\s`'\"(\[{<=:,]))"
WORKSPACE = re.compile(_START + r"/work/[^\s`'\"()\[\]{}<>,;]*", re.MULTILINE)
SHARED = re.compile(r"\.\./shared\b|(?<![\w./-])shared/(?:notes|bench)\b")
DESIGN = re.compile(r"(?<![\w./-])/?(?:[\w.-]+/)*DESIGN\.md\b")


def outside_paths(text: str, path: str, tracked: set[str]) -> list[str]:
    """The paths outside the repository that ``text`` (the file ``path``) names, each once."""
    found = []
    for match in WORKSPACE.finditer(text):
        named = match.group(0)
        if path.startswith(RAW_LOGS) and named.startswith(CHECKOUT_PREFIX):
            continue
        found.append(named)
    found += [m.group(0) for m in SHARED.finditer(text)]
    for match in DESIGN.finditer(text):
        named = match.group(0).removeprefix("./")
        if named not in tracked:
            found.append(named)
    return sorted(set(found))


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [name for name in out.decode("utf-8").split("\0") if name]


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    tracked = _tracked_files()
    tracked_set = set(tracked)
    offenders = []
    for name in tracked:
        if name == THIS_FILE:
            continue
        file = ROOT / name
        if not file.is_file():  # deleted in the working tree, not yet in the index
            continue
        data = file.read_bytes()
        if b"\0" in data:  # binary (images)
            continue
        text = data.decode("utf-8", errors="replace")
        for line_no, line in enumerate(text.splitlines(), start=1):
            for named in outside_paths(line, name, tracked_set):
                offenders.append(f"{name}:{line_no}: {named}")
    assert not offenders, (
        "tracked files name paths outside the repository (cite docs/architecture.md for the "
        "design; name repository files relative to its root):\n" + "\n".join(offenders)
    )


# ---- the rule itself: it must flag what it is for, and only that -----------------------------
@pytest.mark.parametrize(
    ("text", "path", "expected"),
    [
        ("see /work/shared/DESIGN.md", "README.md", ["/work/shared/DESIGN.md"]),
        ("the note at /home/me/DESIGN.md", "README.md", ["/home/me/DESIGN.md"]),
        (
            "shapes of `/work/shared/bench/peers.py`",
            "bench/x.py",
            ["/work/shared/bench/peers.py"],
        ),
        ("semantics of DESIGN.md (the counter)", "accelkit/a.py", ["DESIGN.md"]),
        ('DESIGN.md "Discovery"', "tests/t.py", ["DESIGN.md"]),
        ("notes in ../shared/notes/x.md", "docs/a.md", ["../shared"]),
        ("in shared/notes/x.md", "docs/a.md", ["shared/notes"]),
        ("File /work/main/accelkit/a.py, line 3", "accelkit/a.py", ["/work/main/accelkit/a.py"]),
        ('File "/work/main/tests/t.py", line 3', "bench/results/x/run.log", []),
        ('File "/work/other/t.py", line 3', "bench/results/x/run.log", ["/work/other/t.py"]),
        ('docs/architecture.md, "The portable checkpoint"', "tests/t.py", []),
        ("https://example.org/work/page and shared_bench/x", "docs/a.md", []),
        ("cwd=ROOT / 'work' / 'shared'", "tests/t.py", []),
    ],
)
def test_outside_paths_flags_exactly_the_outside_paths(
    text: str, path: str, expected: list[str]
) -> None:
    assert outside_paths(text, path, tracked={"docs/architecture.md"}) == sorted(expected)


def test_a_tracked_design_file_may_be_cited() -> None:
    assert outside_paths("see docs/DESIGN.md", "README.md", {"docs/DESIGN.md"}) == []
    assert outside_paths("see docs/DESIGN.md", "README.md", set()) == ["docs/DESIGN.md"]
