"""Development sessions: ``nox -s lint``, ``nox -s tests``, ``nox -s plugin-<name>`` (one per plugin
under plugins/), ``nox -s docs``, and ``nox -s gpu`` on a GPU machine.

The CPU sessions install the CPU build of torch 2.13 (``pip install torch==2.13.0``) before the
project, so that nothing pulls another build. ``nox -s gpu`` uses the running interpreter and the
torch it already has (the GPU image ships its own build and cannot download).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
#: plugin distributions, one folder each with its own pyproject.toml and tests/
PLUGINS = sorted(p.name for p in (ROOT / "plugins").glob("*") if (p / "pyproject.toml").is_file())
#: the README's test commands, minus the interpreter: the default tier and the full (slow) tier
TEST_COMMAND = ("-m", "pytest", "-q")
FULL_TIER_COMMAND = ("-m", "pytest", "-q", "-m", "slow and not gpu")

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _env() -> dict[str, str]:
    # DeepSpeed JIT-builds an op on first use; keep it in the workspace, across sessions.
    return {"TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions")}


def _install(session: nox.Session, *plugins: str) -> None:
    session.install(TORCH)
    editable = [arg for name in plugins for arg in ("-e", f"plugins/{name}")]
    session.install("-e", ".[test]", *editable, "-c", _constraints(session))


def _constraints(session: nox.Session) -> str:
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text(TORCH + "\n")
    return str(path)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def tests(session: nox.Session) -> None:
    """The README's test command: the default tier of the core and of every plugin."""
    _install(session, *PLUGINS)
    session.run("bash", "plugins/colossalai/install_colossalai.sh", "python", external=True)
    session.run("python", *TEST_COMMAND, *session.posargs, env=_env())


@nox.session(name="tests-full")
def tests_full(session: nox.Session) -> None:
    """The README's full tier: the slow multi-process matrices the default run leaves out."""
    _install(session, *PLUGINS)
    session.run("bash", "plugins/colossalai/install_colossalai.sh", "python", external=True)
    session.run("python", *FULL_TIER_COMMAND, *session.posargs, env=_env())


@nox.session
def docs(session: nox.Session) -> None:
    """Run the examples in docs/ (tests/test_docs.py)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", "tests/test_docs.py", *session.posargs, env=_env())


def _plugin_session(name: str) -> None:
    def plugin_tests(session: nox.Session) -> None:
        _install(session, name)
        if name == "colossalai":  # not a pip dependency (it pins torch<=2.5.1): its own recipe
            session.run("bash", "plugins/colossalai/install_colossalai.sh", "python", external=True)
        session.run("python", "-m", "pytest", "-q", f"plugins/{name}", *session.posargs, env=_env())

    plugin_tests.__doc__ = f"The tests of plugins/{name} with only that plugin installed."
    nox.session(name=f"plugin-{name}")(plugin_tests)


for _name in PLUGINS:
    _plugin_session(_name)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Tests marked ``gpu``, in the running interpreter with the torch it already has.

    Start nox with that interpreter: ``python3 -m nox -s gpu``. Installs accelkit and the plugins editable without dependencies or network
    (``--no-deps --no-build-isolation``): the GPU image has torch, pluggy, safetensors, tqdm,
    PyYAML and pytest; a backend library it lacks must be carried there as a wheel. NVIDIA Apex
    has no wheel: build it there from its source first (docs/backends/apex.md); without it the
    plugins/apex GPU tests skip, or fail with ``ACCELKIT_REQUIRE_APEX=1``.
    """
    python = sys.executable
    session.run(python, "-c", "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'")
    targets = [".", *(f"plugins/{name}" for name in PLUGINS)]
    editable = [arg for target in targets for arg in ("-e", target)]
    session.run(
        python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *editable
    )
    env = {**_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    session.run(python, "-m", "pytest", "-q", "-m", "gpu", *session.posargs, env=env)


@nox.session(name="gpu-colossalai", venv_backend="none")
def gpu_colossalai(session: nox.Session) -> None:
    """The ColossalAI plugin's GPU tests, in the running interpreter, from wheels in
    ``.whl/colossalai/`` (colossalai 0.5.0 and what its Booster imports: transformers 4.51.3,
    peft 0.13.2, tokenizers, huggingface_hub, galore_torch, contexttimer, bitsandbytes; about
    60 MB), installed ``--no-deps --no-index`` so the image's torch stays.
    """
    python = sys.executable
    session.run(python, "-c", "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'")
    wheels = sorted(str(p) for p in (ROOT / ".whl" / "colossalai").glob("*.whl"))
    if not wheels:
        session.error("no wheels in .whl/colossalai/ (see docs/backends/colossalai.md)")
    pip = (python, "-m", "pip", "install", "-q", "--no-deps")
    session.run(*pip, "--no-index", *wheels)
    session.run(*pip, "--no-build-isolation", "-e", ".", "-e", "plugins/colossalai")
    env = {**_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    session.run(
        python, "-m", "pytest", "-q", "-m", "gpu", "plugins/colossalai", *session.posargs, env=env
    )
