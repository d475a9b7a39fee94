"""Every ```python block of docs/**/*.md runs, each in its own process, CPU only (one-process
blocks forked from an interpreter that imported torch once: ``docs_forkserver``;
``ACCELKIT_DOCS_FRESH=1`` starts a fresh interpreter for each, as a user runs it).

Marker convention (an HTML comment on the last non-blank line before the opening fence; it does
not show when the page is rendered)::

    <!-- doc-test: skip -->                 not run (a fragment, or needs what CI lacks)
    <!-- doc-test: requires=cuda,deepspeed --> run only if CUDA / these modules are present
    <!-- doc-test: nproc=2 -->              run on 2 processes with torch.distributed.run (gloo)
    <!-- doc-test: nproc=2 argv=fsdp|ddp --> ...once per value, given as the script's argument
    <!-- doc-test: timeout=300 -->          seconds before the block counts as hung (default 180)
    <!-- doc-test: slow -->                 marked slow: out of the default test run (as nproc>1 is)

Options combine (``<!-- doc-test: nproc=2 timeout=300 -->``); ``<!-- skip-test -->`` is accepted
as a synonym of ``skip``. Each block is self-contained: it runs in a new temporary directory with
no state from the blocks before it. A page whose examples build on each other carries the line
``<!-- doc-test: session -->`` (anywhere outside a fence): its blocks then run in order, in one
interpreter, as one test; a block of a session page marked ``nproc=N`` runs there too, and also
alone on N processes (a script the page says runs under ``accelkit run``). A failure names the
file and the line of the block, and the line numbers of a traceback are the page's own.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DEFAULT_TIMEOUT_S = 180
PYTHON_INFO = {"python", "py", "python3"}
MARKER = re.compile(r"^<!--\s*(doc-test:(?P<opts>.*?)|(?P<skip>skip-test))\s*-->$")
SESSION = re.compile(r"^<!--\s*doc-test:\s*session\s*-->$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclasses.dataclass
class DocBlock:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: bool = False
    requires: tuple[str, ...] = ()
    nproc: int = 1
    timeout: int = DEFAULT_TIMEOUT_S
    #: the page runs as one session (``<!-- doc-test: session -->``)
    session: bool = False
    #: marked ``slow`` (``<!-- doc-test: slow -->``), like every nproc > 1 block
    slow: bool = False
    #: the script's argument, one run per value (``argv=fsdp|ddp``); a run has one at most
    argv: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{_display(self.path)}:{self.line}"

    @property
    def label(self) -> str:
        """The test's id: where, and the script's arguments when it has some."""
        return f"{self.where} {' '.join(self.argv)}".strip()


def _display(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def parse_marker(text: str, where: str) -> dict:
    """Options of a marker line, or {} when the line is no marker."""
    match = MARKER.match(text.strip())
    if not match:
        return {}
    if match.group("skip"):
        return {"skip": True}
    options: dict = {}
    for token in match.group("opts").split():
        key, _, value = token.partition("=")
        if key in ("skip", "slow") and not value:
            options[key] = True
        elif key == "requires" and value:
            options["requires"] = tuple(v for v in value.split(",") if v)
        elif key == "argv" and value:
            options["argv"] = tuple(value.split("|"))
        elif key in ("nproc", "timeout") and value.isdigit():
            options[key] = int(value)
        else:
            raise ValueError(f"{where}: unknown doc-test option {token!r}")
    return options


def extract_blocks(path: Path) -> list[DocBlock]:
    """The fenced python blocks of one page, with the options of the marker before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[DocBlock] = []
    previous = ""  # last non-blank line outside a fence
    session = False
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            if SESSION.match(lines[i].strip()):
                session = True
            elif lines[i].strip():
                previous = lines[i]
            i += 1
            continue
        fence, info = match.group("fence"), match.group("info").strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = FENCE.match(lines[i])
            if (
                close
                and close.group("fence")[0] == fence[0]
                and len(close.group("fence")) >= len(fence)
                and not close.group("info").strip()
            ):
                break
            body.append(lines[i])
            i += 1
        else:
            raise ValueError(f"{_display(path)}:{start + 1}: unclosed code fence")
        i += 1
        language = info.split()[0].lower() if info else ""
        if language in PYTHON_INFO:
            where = f"{_display(path)}:{start + 1}"
            indent = len(match.group("indent"))
            code = "\n".join(line[indent:] if line[:indent].isspace() else line for line in body)
            blocks.append(DocBlock(path, start + 1, code + "\n", **parse_marker(previous, where)))
        previous = lines[start]
    for block in blocks:
        block.session = session
    return blocks


def session_block(blocks: list[DocBlock]) -> DocBlock:
    """One block that runs a session page's blocks in order, in one interpreter.

    Each block is compiled under the page's path, padded so that its line numbers are the
    page's; they run in the script's own globals (so that pickling by reference works).
    """
    runnable = [b for b in blocks if not b.skip]
    first = blocks[0]
    lines = []
    for block in runnable:
        source = "\n" * (block.line) + block.code
        lines.append(f"exec(compile({source!r}, {str(block.path)!r}, 'exec'), globals())")
    requires = tuple(dict.fromkeys(r for b in runnable for r in b.requires))
    return DocBlock(
        first.path,
        runnable[0].line if runnable else first.line,
        "\n".join(lines) + "\n",
        skip=not runnable,
        requires=requires,
        timeout=sum(b.timeout for b in runnable) or DEFAULT_TIMEOUT_S,
        session=True,
        slow=any(b.slow for b in runnable),  # a page with a block marked slow is a slow session
    )


def all_blocks() -> list[DocBlock]:
    return [b for page in sorted(DOCS.rglob("*.md")) for b in extract_blocks(page)]


def _missing(requires: tuple[str, ...]) -> list[str]:
    missing = []
    for requirement in requires:
        if requirement == "cuda":
            import torch

            if not torch.cuda.is_available() or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
                missing.append("cuda")
        elif importlib.util.find_spec(requirement) is None:
            missing.append(requirement)
    return missing


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: ``ACCELKIT_DOCS_FRESH=1``: every block in a fresh interpreter, as a user runs it (the default
#: forks each one-process CPU block from an interpreter that imported torch and accelkit once)
FRESH = "ACCELKIT_DOCS_FRESH"
_SERVER: list[Any] = []


def _fork_server(env: dict[str, str]) -> Any:
    """The docs fork server (``docs_forkserver``), started on first use; None where it cannot run."""
    if not _SERVER:
        from docs_forkserver import ForkServer

        try:
            _SERVER.append(ForkServer(env))
            atexit.register(_SERVER[0].close)
        except RuntimeError:
            _SERVER.append(None)
    return _SERVER[0]


def run_block(block: DocBlock, workdir: Path) -> subprocess.CompletedProcess:
    script = workdir / f"doc_{block.path.stem}_{block.line}.py"
    # blank lines first, so that a traceback's line numbers are the page's
    padding = "" if block.session else "\n" * block.line
    script.write_text(padding + block.code, encoding="utf-8")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "MPLBACKEND": "Agg",
        "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "default"),
    }
    if "cuda" not in block.requires:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if block.nproc == 1 and "cuda" not in block.requires and os.environ.get(FRESH) != "1":
        server = _fork_server(env)
        if server is not None:
            return server.run(script, block.argv, workdir, env, block.timeout)
    if block.nproc > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={block.nproc}",
            f"--master-port={_free_port()}",
            str(script),
            *block.argv,
        ]
    else:
        command = [sys.executable, str(script), *block.argv]
    return subprocess.run(
        command,
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=block.timeout,
        check=False,
    )


def _runs() -> list[DocBlock]:
    """What the tests run: every block, except that a session page is one block."""
    runs = []
    for page in sorted(DOCS.rglob("*.md")):
        blocks = extract_blocks(page)
        if blocks and blocks[0].session:
            runs.append(session_block(blocks))
            for block in blocks:  # a script the page says runs on N processes: there, alone
                if block.nproc > 1 and not block.skip:
                    runs.extend(_each_argv(dataclasses.replace(block, session=False)))
        else:
            runs.extend(run for block in blocks for run in _each_argv(block))
    return runs


def _each_argv(block: DocBlock) -> list[DocBlock]:
    """One run per value of the block's ``argv``."""
    if len(block.argv) <= 1:
        return [block]
    return [dataclasses.replace(block, argv=(value,)) for value in block.argv]


def _params() -> list:
    params = []
    for block in _runs():
        marks = []
        if block.skip:
            marks.append(pytest.mark.skip(reason="marked doc-test: skip"))
        if block.nproc > 1 or block.slow:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(block, id=block.label, marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_doc_block_runs(block: DocBlock, tmp_path: Path) -> None:
    missing = _missing(block.requires)
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)}")
    try:
        result = run_block(block, tmp_path)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{block.where}: the example did not finish within {err.timeout} s")
    if result.returncode != 0:
        tail = (result.stdout[-3000:] + "\n" + result.stderr[-6000:]).strip()
        what = "the page's examples (a doc-test session)" if block.session else "the example"
        pytest.fail(
            f"{block.where}: {what} exited with {result.returncode}; line numbers below are "
            f"the page's. (Mark a fragment <!-- doc-test: skip -->.)\n{tail}",
            pytrace=False,
        )


# ---- the runner itself: it must be able to fail ----------------------------------------------
def test_extractor_reads_fences_markers_and_lines(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n"  # 1
        "```python\n"  # 2
        "a = 1\n"  # 3
        "```\n"  # 4
        "<!-- doc-test: skip -->\n"  # 5
        "\n"  # 6
        "```py\n"  # 7
        "b = 2\n"  # 8
        "```\n"  # 9
        "````text\n"  # 10
        "<!-- skip-test -->\n"  # 11
        "```python\n"  # 12: inside a text fence, not a block
        "````\n"  # 13
        "<!-- doc-test: nproc=2 timeout=30 requires=cuda,foo slow -->\n"  # 14
        "```python title\n"  # 15
        "c = 3\n"  # 16
        "```\n"  # 17
        "```bash\n"  # 18
        "echo no\n"  # 19
        "```\n",  # 20
        encoding="utf-8",
    )
    blocks = extract_blocks(page)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (2, "a = 1\n", False),
        (7, "b = 2\n", True),
        (15, "c = 3\n", False),
    ]
    assert (blocks[2].nproc, blocks[2].timeout, blocks[2].requires) == (2, 30, ("cuda", "foo"))
    assert blocks[2].slow and not blocks[0].slow
    with pytest.raises(ValueError, match="unknown doc-test option"):
        parse_marker("<!-- doc-test: nprocs=2 -->", "x.md:1")


def test_a_failing_block_fails_and_names_its_line(tmp_path: Path) -> None:
    block = DocBlock(DOCS / "example.md", 42, "x = 1\nraise ValueError('boom')\n", timeout=60)
    result = run_block(block, tmp_path)
    assert result.returncode != 0 and "ValueError: boom" in result.stderr
    assert block.where == "docs/example.md:42"
    assert ", line 44," in result.stderr  # the page's line: fence at 42, code from 43


def test_a_session_page_runs_in_order_and_names_the_failing_line(tmp_path: Path) -> None:
    page = tmp_path / "session.md"
    page.write_text(
        "<!-- doc-test: session -->\n"  # 1
        "```python\n"  # 2
        "import pickle\n"  # 3
        "def double(v):\n"  # 4
        "    return 2 * v\n"  # 5
        "```\n"  # 6
        "<!-- doc-test: skip -->\n"  # 7
        "```python\n"  # 8
        "raise RuntimeError('skipped, never runs')\n"  # 9
        "```\n"  # 10
        "```python\n"  # 11
        "assert pickle.loads(pickle.dumps(double))(21) == 42\n"  # 12
        "print('shared state ok')\n"  # 13
        "```\n",  # 14
        encoding="utf-8",
    )
    block = session_block(extract_blocks(page))
    assert block.session and block.line == 2 and block.timeout == 2 * DEFAULT_TIMEOUT_S
    work = tmp_path / "work"
    work.mkdir()
    result = run_block(block, work)
    assert result.returncode == 0, result.stderr
    assert "shared state ok" in result.stdout

    page.write_text(page.read_text().replace("* v", "* w"), encoding="utf-8")
    result = run_block(session_block(extract_blocks(page)), work)
    assert result.returncode != 0 and "NameError" in result.stderr
    assert f'File "{page}", line 5' in result.stderr


def test_a_session_script_marked_nproc_also_runs_alone_once_per_argv(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "recipe.md"
    page.parent.mkdir()
    page.write_text(
        "<!-- doc-test: session -->\n"
        "<!-- doc-test: nproc=2 argv=fsdp|ddp -->\n"
        "```python\n"
        "import sys\n"
        "backend = sys.argv[1] if len(sys.argv) > 1 else 'cpu'\n"
        "```\n"
        "```python\n"
        "print('then', backend)\n"
        "```\n",
        encoding="utf-8",
    )
    blocks = extract_blocks(page)
    assert blocks[0].argv == ("fsdp", "ddp") and blocks[0].nproc == 2
    session = session_block(blocks)  # the page in one process, the marked block included
    assert session.nproc == 1 and "backend = sys.argv" in session.code
    alone = [run for block in blocks if block.nproc > 1 for run in _each_argv(block)]
    assert [(run.argv, run.nproc, run.label.split()[-1]) for run in alone] == [
        (("fsdp",), 2, "fsdp"),
        (("ddp",), 2, "ddp"),
    ]
    work = tmp_path / "work"
    work.mkdir()
    single = dataclasses.replace(alone[1], nproc=1, code=alone[1].code + "print(backend)\n")
    result = run_block(single, work)  # the argument reaches the script
    assert result.returncode == 0 and result.stdout.strip() == "ddp", result.stderr


def test_the_docs_have_examples_and_the_plugin_example_is_run() -> None:
    blocks = all_blocks()
    pages = {b.path.relative_to(DOCS).as_posix() for b in blocks if not b.skip}
    assert {"getting-started.md", "semantics.md", "plugins.md"} <= pages
    plugin_blocks = [b for b in blocks if b.path.name == "plugins.md" and not b.skip]
    assert any("register_plugin(" in b.code and "accelkit.get(" in b.code for b in plugin_blocks)


def test_native_dtype_table_in_semantics_matches_the_code() -> None:
    """The precision table of semantics.md is NATIVE_DTYPES, row by row."""
    from accelkit.precision import NATIVE_DTYPES

    text = (DOCS / "semantics.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in NATIVE_DTYPES:
            rows[cells[0]] = tuple(cells[1:])
    expected = {k: (v.param, v.compute, v.master, v.reduce) for k, v in NATIVE_DTYPES.items()}
    assert rows == expected


def _first_cells(page: str, header_start: str) -> list[str]:
    """First cells of the markdown table whose header row starts with ``header_start``."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    cells = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells.append(line.strip("|").split("|")[0])
    return cells


def test_plugin_page_documents_every_capability_and_protocol_member() -> None:
    from accelkit.backend import Backend, Capabilities

    fields = {f.name for f in dataclasses.fields(Capabilities)}
    documented = {c.strip().strip("`") for c in _first_cells("plugins.md", "| field |")}
    assert documented == fields

    named = set()
    for cell in _first_cells("plugins.md", "| member |"):
        named |= {re.split(r"[(\s]", name)[0] for name in re.findall(r"`([^`]+)`", cell)}
    public = {name for name in vars(Backend) if not name.startswith("_")} | {"__init__"}
    assert public - named == set()


EDGE_SCRIPTS = {
    "exit-status": "import sys\nprint('out')\nsys.exit(3)\n",
    "exit-message": "import sys\nsys.exit('a message')\n",
    "exception": "print('before')\nraise ValueError('boom')\n",
    "atexit-status": "import atexit, os\natexit.register(lambda: (print('bye'), os._exit(7)))\n",
    "thread-joined": (
        "import threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('late'))).start()\n"
    ),
    "where-it-runs": (
        "import os, sys\nprint(sys.argv[1:], os.getcwd() == os.path.dirname(__file__),\n"
        "      os.environ.get('DOC_PROBE'), sys.path[0] == os.path.dirname(__file__))\n"
    ),
}


@pytest.mark.parametrize("name", sorted(EDGE_SCRIPTS))
def test_the_fork_server_runs_a_block_as_a_fresh_interpreter_does(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default runs blocks through the fork server: status, stdout and stderr's last line
    must be those of ``python script.py``, or the docs test could pass what a user's run fails."""
    block = DocBlock(DOCS / "edge.md", 1, EDGE_SCRIPTS[name], timeout=60, argv=("x",))
    monkeypatch.setenv("DOC_PROBE", "seen")
    results = {}
    for fresh in ("1", "0"):
        monkeypatch.setenv(FRESH, fresh)
        work = tmp_path / fresh
        work.mkdir()
        results[fresh] = run_block(block, work)
    assert _SERVER and _SERVER[0] is not None, "the fork server did not start"
    fresh, forked = results["1"], results["0"]
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:]


def test_a_block_past_its_timeout_is_stopped_and_the_next_runs(tmp_path: Path) -> None:
    hung = DocBlock(DOCS / "hung.md", 1, "import time\ntime.sleep(600)\n", timeout=2)
    with pytest.raises(subprocess.TimeoutExpired):
        run_block(hung, tmp_path)
    after = DocBlock(DOCS / "after.md", 1, "print('ran')\n", timeout=60)
    assert run_block(after, tmp_path).stdout == "ran\n"
