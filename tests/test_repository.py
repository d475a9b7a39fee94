"""The repository is self-contained: no tracked file names a path outside it.

A clone is all a reader has. A docstring citing a design note that lives elsewhere, or a doc
pointing at a directory of the machine it was written on, sends the reader nowhere; the design
contract is docs/architecture.md. The rule, for every text file ``git ls-files`` lists:

* no absolute path under the workspace folder that holds the checkout (``WORKSPACE_ROOT``
  below). The checkout's own absolute prefix is allowed only in the logs under
  ``bench/results/``, which record the tracebacks of the machine they ran on, verbatim;
* no path into the team's folder beside the checkout (``TEAM_FOLDER``), by a relative
  ``..`` path or by its notes and bench subfolders;
* no design note by the name the old contract had (``DESIGN_NOTE``), with or without a folder,
  unless that very file is tracked.

The names are assembled from parts, so that this file, which the rule checks too, does not
itself name them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAW_LOGS = "bench/results/"
WORKSPACE_ROOT = "/" + "work" + "/"
CHECKOUT_PREFIX = WORKSPACE_ROOT + "main/"
TEAM_FOLDER = "sha" + "red"
DESIGN_NOTE = "DES" + "IGN.md"

# a path starts a token: at the start of a line or after a space, quote, bracket, '=' or ':'
_START = r"(?:^|(?<=[\s`'\"(\[{<=:,]))"
WORKSPACE = re.compile(_START + re.escape(WORKSPACE_ROOT) + r"[^\s`'\"()\[\]{}<>,;]*", re.MULTILINE)
SHARED = re.compile(
    r"\.\./" + TEAM_FOLDER + r"\b|(?<![\w./-])" + TEAM_FOLDER + r"/(?:notes|bench)\b"
)
DESIGN = re.compile(r"(?<![\w./-])/?(?:[\w.-]+/)*" + re.escape(DESIGN_NOTE) + r"\b")


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
_W, _S, _D = WORKSPACE_ROOT, TEAM_FOLDER, DESIGN_NOTE
_UP = "." + "./"  # a parent-directory step, assembled like the names above


@pytest.mark.parametrize(
    ("text", "path", "expected"),
    [
        (f"see {_W}{_S}/{_D}", "README.md", [f"{_W}{_S}/{_D}"]),
        (f"the note at /home/me/{_D}", "README.md", [f"/home/me/{_D}"]),
        (f"shapes of `{_W}{_S}/bench/peers.py`", "bench/x.py", [f"{_W}{_S}/bench/peers.py"]),
        (f"semantics of {_D} (the counter)", "accelkit/a.py", [_D]),
        (f'{_D} "Discovery"', "tests/t.py", [_D]),
        (f"notes in {_UP}{_S}/notes/x.md", "docs/a.md", [f"{_UP}{_S}"]),
        (f"in {_S}/notes/x.md", "docs/a.md", [f"{_S}/notes"]),
        (f"File {_W}main/accelkit/a.py, line 3", "accelkit/a.py", [f"{_W}main/accelkit/a.py"]),
        (f'File "{_W}main/tests/t.py", line 3', "bench/results/x/run.log", []),
        (f'File "{_W}other/t.py", line 3', "bench/results/x/run.log", [f"{_W}other/t.py"]),
        ('docs/architecture.md, "The portable checkpoint"', "tests/t.py", []),
        (f"https://example.org{_W}page and {_S}_bench/x", "docs/a.md", []),
        (f"cwd=ROOT / 'work' / '{_S}'", "tests/t.py", []),
    ],
)
def test_outside_paths_flags_exactly_the_outside_paths(
    text: str, path: str, expected: list[str]
) -> None:
    assert outside_paths(text, path, tracked={"docs/architecture.md"}) == sorted(expected)


def test_a_tracked_design_file_may_be_cited() -> None:
    cited = f"docs/{DESIGN_NOTE}"
    assert outside_paths(f"see {cited}", "README.md", {cited}) == []
    assert outside_paths(f"see {cited}", "README.md", set()) == [cited]
