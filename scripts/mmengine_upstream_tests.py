"""Run MMEngine's own runner, hook and AMP tests twice: as they are, and with ``AccelkitRunner``
in place of MMEngine's ``Runner`` (with ``--pth`` a third time, writing MMEngine's ``.pth``),
and print the counts per file and which tests differ, with the known reasons.

MMEngine's test suite is the most thorough description of what its ``Runner`` does; running it
with accelkit's Runner swapped in shows what an OpenMMLab user who sets
``runner_type='AccelkitRunner'`` would see differently (docs/mmengine.md lists each difference
with its reason; bench/results/*-mmengine-upstream-tests.txt holds a run's log).

Usage::

    git clone --branch v0.10.7 https://github.com/open-mmlab/mmengine SRC   # its tests only
    python scripts/mmengine_upstream_tests.py SRC            # or MMENGINE_SRC=SRC python ...
    python scripts/mmengine_upstream_tests.py SRC --set core tests/test_hooks/test_ema_hook.py

``SRC`` (the argument, else the ``MMENGINE_SRC`` environment variable) is a checkout of
MMEngine whose version matches the installed ``mmengine``: its ``tests/`` run against the
installed package, never the checkout's ``mmengine/`` (the script checks the versions agree).
The tests need ``pip install 'accelkit[mmengine-upstream]'`` (MMEngine plus ``parameterized``).
Nothing is written into ``SRC``; each run works in a temporary directory.

The swap (``ACCELKIT_SWAP_RUNNER=1``, or ``pth`` for ``--pth``'s run) is done by this file
loaded as a pytest plugin (``-p mmengine_upstream_tests``) before any test module is imported:
every ``mmengine`` module
that bound ``Runner`` (``mmengine.runner``, ``mmengine.runner.runner``,
``mmengine.testing.runner_test_case``, ...) and the ``RUNNERS`` registry's ``'Runner'`` entry
then give ``AccelkitRunner``; tests' own ``class X(Runner)`` subclass it. No ``accelkit``
section is given, so it trains on accelkit's default backend for the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the sets of MMEngine's test files compared (paths inside its checkout)
TEST_SETS: dict[str, list[str]] = {
    # the Runner, its checkpoints and hooks, AMP, RunnerTestCase (what downstream projects' tests
    # build Runners with). Left out: test_empty_cache_hook (CUDA only), test_profiler_hook (needs
    # pkg_resources, gone from setuptools >= 81), test_hook (Hook's methods on their own)
    "core": [
        "tests/test_runner/test_runner.py",
        "tests/test_runner/test_amp.py",
        "tests/test_hooks/test_checkpoint_hook.py",
        "tests/test_hooks/test_ema_hook.py",
        "tests/test_hooks/test_early_stopping_hook.py",
        "tests/test_hooks/test_logger_hook.py",
        "tests/test_hooks/test_param_scheduler_hook.py",
        "tests/test_hooks/test_runtime_info_hook.py",
        "tests/test_hooks/test_sampler_seed_hook.py",
        "tests/test_hooks/test_sync_buffers_hook.py",
        "tests/test_hooks/test_iter_timer_hook.py",
        "tests/test_testing/test_runner_test_case.py",
    ],
    # what reads a trained Runner's results: inferencers, test-time augmentation, log processing
    "toolchain": [
        "tests/test_infer/test_infer.py",
        "tests/test_hooks/test_prepare_tta_hook.py",
        "tests/test_runner/test_log_processor.py",
        "tests/test_model/test_test_aug_time.py",
    ],
}

_HOOK = "tests/test_hooks/test_checkpoint_hook.py::TestCheckpointHook::"
_RUNNER = "tests/test_runner/test_runner.py::TestRunner::"
_DIRECTORY = "epoch_N.pth is a directory by default"
#: why a test known to differ does (docs/mmengine.md, "Differences from MMEngine")
KNOWN_DIFFERENCES = {
    f"{_HOOK}test_after_val_epoch": "CheckpointHook(backend_args=dict(backend='petrel')) is "
    "refused with ConfigError before anything is written: accelkit does not write through Petrel",
    f"{_HOOK}test_with_runner_0_iter": f"osp.isfile(iter_N.pth): {_DIRECTORY}; with "
    "save_format='pth' it gets further, to torch.load of a best_*.pth, which stays a directory",
    f"{_HOOK}test_with_runner_1_epoch": f"osp.isfile(epoch_N.pth): {_DIRECTORY}; with "
    "save_format='pth' it gets further, to torch.load of a best_*.pth, which stays a directory",
    "tests/test_hooks/test_ema_hook.py::TestEMAHook::test_with_runner": "torch.load(epoch_2.pth): "
    f"{_DIRECTORY} (passes with save_format='pth')",
    f"{_RUNNER}test_build_optim_wrapper": "its OptimWrapperDict steps pass; its last builds a "
    "wrapper with accumulative_counts=2 on a Runner whose config accumulates over 1, refused at "
    "the call (the backend was built from the config's)",
    f"{_RUNNER}test_checkpoint": f"torch.load(epoch_3.pth): {_DIRECTORY} (passes with "
    "save_format='pth', its OptimWrapperDict save and resume included)",
    f"{_RUNNER}test_get_hooks_info": "the hook list shows AccelkitCheckpointHook where "
    "CheckpointHook was",
}

SWAP_ENV = "ACCELKIT_SWAP_RUNNER"
#: the runs compared: MMEngine's Runner, AccelkitRunner, and (--pth) AccelkitRunner writing .pth
MODES = {"mmengine": "0", "accelkit": "1", "accelkit-pth": "pth"}
RESULTS_ENV = "ACCELKIT_UPSTREAM_RESULTS"
OUTCOMES = ("passed", "failed", "skipped")


# ---- the pytest plugin (loaded in the pytest process with -p mmengine_upstream_tests) ---------
def pytest_configure(config) -> None:
    """Swap the Runner before pytest imports a test module."""
    if os.environ.get(SWAP_ENV) not in ("1", "pth"):
        return
    import mmengine.runner
    import mmengine.testing  # binds Runner at import: swapped below
    from mmengine.registry import RUNNERS

    original = mmengine.runner.Runner
    from accelkit.integrations.mmengine import AccelkitRunner

    swapped = AccelkitRunner if os.environ[SWAP_ENV] == "1" else _pth_runner(AccelkitRunner)
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "mmengine" and getattr(module, "Runner", None) is original:
            module.Runner = swapped
    RUNNERS._module_dict["Runner"] = swapped


def _pth_runner(base: type) -> type:
    """AccelkitRunner whose config's CheckpointHook writes MMEngine's single file
    (``save_format='pth'``) and reads it back (``trust_pickle=True``): what the tests that open
    ``epoch_N.pth`` as a file meet with that documented setting."""
    from accelkit.integrations.mmengine import AccelkitCheckpointHook

    class AccelkitRunnerPth(base):
        def __init__(self, *args, accelkit=None, **kwargs) -> None:
            section = dict(accelkit or kwargs.get("cfg", {}).get("accelkit") or {})
            section.setdefault("trust_pickle", True)
            super().__init__(*args, accelkit=section, **kwargs)

        def register_hooks(self, default_hooks=None, custom_hooks=None) -> None:
            super().register_hooks(default_hooks, custom_hooks)
            for hook in self._hooks:
                if isinstance(hook, AccelkitCheckpointHook):
                    hook.save_format = "pth"

    AccelkitRunnerPth.__name__ = AccelkitRunnerPth.__qualname__ = "AccelkitRunner"
    return AccelkitRunnerPth


_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report) -> None:
    """One outcome per test: a failure or error in any phase wins, else skipped, else passed."""
    previous = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and previous != "failed":
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and previous is None:
        _outcomes[report.nodeid] = "passed"


def pytest_collectreport(report) -> None:
    if report.failed:  # a module that does not import: every test in it is lost
        _outcomes[report.nodeid + "::<collection>"] = "failed"


def pytest_sessionfinish(session) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps(_outcomes, indent=1, sort_keys=True))


# ---- the driver -------------------------------------------------------------------------------
def _installed_mmengine(python: str) -> tuple[str, str]:
    out = subprocess.run(
        [python, "-c", "import mmengine; print(mmengine.__version__); print(mmengine.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    ).stdout.split("\n")
    return out[0], out[1]


def _checkout_version(src: Path) -> str:
    scope: dict[str, str] = {}
    exec((src / "mmengine" / "version.py").read_text(), scope)
    return scope["__version__"]


def run_pytest(src: Path, files: list[str], swap: str, log: Path, timeout: int) -> dict[str, str]:
    """Run ``files`` of ``src`` in one pytest process; the outcome of every test by node id."""
    results = log.with_suffix(".json")
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    env[SWAP_ENV] = swap
    # MMEngine 0.10 predates torch 2.6's weights_only default: its own torch.load of its own
    # .pth (message hub, HistoryBuffer) needs this on torch >= 2.6, in both runs alike
    env.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ in the checkout
    env[RESULTS_ENV] = str(results)
    # pytest (not python -m pytest): the checkout's root stays off sys.path, so its tests import
    # the installed mmengine; the test directories have no __init__.py, pytest prepends each
    command = [
        str(Path(sys.executable).with_name("pytest")),
        "-q",
        "-p",
        "mmengine_upstream_tests",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(src),
        f"--timeout={timeout}",
        "-W",
        "ignore::DeprecationWarning",
        # in path order, as MMEngine's CI runs tests/: some files register the same names
        *(str(src / f) for f in sorted(files)),
    ]
    with log.open("w") as out, tempfile.TemporaryDirectory(prefix="mmengine-tests-") as cwd:
        subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return json.loads(results.read_text()) if results.exists() else {}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def counts(outcomes: dict[str, str], file: str) -> str:
    mine = [o for n, o in outcomes.items() if file in ("total", _file_of(n))]
    return "/".join(str(mine.count(o)) for o in OUTCOMES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "src",
        nargs="?",
        default=os.environ.get("MMENGINE_SRC"),
        help="MMEngine checkout (default: $MMENGINE_SRC)",
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        choices=sorted(TEST_SETS),
        help="test sets to run (default: all)",
    )
    parser.add_argument("files", nargs="*", help="more test files inside the checkout")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test")
    parser.add_argument(
        "--pth",
        action="store_true",
        help="a third run: AccelkitRunner with CheckpointHook(save_format='pth') "
        "and trust_pickle=True (the tests that open epoch_N.pth as a file)",
    )
    parser.add_argument("--keep", type=Path, help="keep the pytest logs in this directory")
    args = parser.parse_args(argv)
    if not args.src:
        parser.error("give MMEngine's checkout as the argument or in MMENGINE_SRC")
    src = Path(args.src).resolve()
    if not (src / "tests").is_dir() or not (src / "mmengine" / "version.py").is_file():
        parser.error(f"{src} is not an MMEngine checkout (no tests/ or mmengine/version.py)")
    version, location = _installed_mmengine(sys.executable)
    if _checkout_version(src) != version:
        parser.error(
            f"the checkout is MMEngine {_checkout_version(src)} but {version} is installed "
            f"({location}): check out the tag v{version}"
        )
    sets = args.sets or ([] if args.files else sorted(TEST_SETS))
    chosen = {name: TEST_SETS[name] for name in sets}
    if args.files:
        chosen["extra"] = list(args.files)

    modes = ["mmengine", "accelkit", *(["accelkit-pth"] if args.pth else [])]
    logs = args.keep or Path(tempfile.mkdtemp(prefix="mmengine-upstream-"))
    logs.mkdir(parents=True, exist_ok=True)
    # paths on stderr: stdout is the shareable summary
    print(f"checkout {src}, installed {location}, pytest logs in {logs}", file=sys.stderr)
    import torch

    print(
        f"MMEngine {version}'s own tests (its checkout's tests/) against the installed "
        f"mmengine {version}, torch {torch.__version__}, python {sys.version.split()[0]}; "
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in every run"
    )
    print("counts are passed/failed/skipped (an error counts as failed)")
    for name, files in chosen.items():
        runs = {}
        for label in modes:
            start = time.monotonic()
            runs[label] = run_pytest(
                src, files, MODES[label], logs / f"{name}-{label}.log", args.timeout
            )
            print(f"[{name}] {label}: {time.monotonic() - start:.0f} s", flush=True)
        print(f"\n== {name}: {'file':<52}" + "".join(f" {label:>12}" for label in modes))
        for file in [*files, "total"]:
            cells = [counts(run, file) for run in runs.values()]
            print(f"   {file:<58}" + "".join(f" {c:>12}" for c in cells))
        plain = runs["mmengine"]
        for label, run in list(runs.items())[1:]:
            differing = sorted(n for n in set(plain) | set(run) if plain.get(n) != run.get(n))
            print(f"   {label} differs from mmengine in {len(differing)}:")
            for nodeid in differing:
                print(
                    f"     {nodeid}: {plain.get(nodeid, 'absent')} -> {run.get(nodeid, 'absent')}"
                )
                print(f"       {KNOWN_DIFFERENCES.get(nodeid, 'NOT A KNOWN DIFFERENCE')}")
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
