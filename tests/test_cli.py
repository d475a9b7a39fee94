"""The ``accelkit`` command line: env, run, demo and the command table.

Every command runs in a subprocess, as a user would run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables (the tests may run under one)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def accelkit(*args: str, env: dict[str, str] | None = None, timeout: float = 180, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "accelkit.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=cwd,
    )


def checkpoint_available() -> bool:
    import importlib

    try:
        return hasattr(importlib.import_module("accelkit.checkpoint"), "save")
    except ImportError:
        return False


# ---- the command table ---------------------------------------------------------------------------
def test_help_lists_commands_through_the_console_script():
    script = Path(sys.executable).with_name("accelkit")
    assert script.exists(), f"console script not installed next to {sys.executable}"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("env", "run", "demo"):
        assert f"    {command} " in out.stdout, out.stdout


def test_no_command_prints_help_and_fails():
    out = accelkit()
    assert out.returncode == 2
    assert "usage: accelkit" in out.stdout


# ---- env -----------------------------------------------------------------------------------------
def test_env_json_lists_native_backends_with_status():
    out = accelkit("env", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) >= {"versions", "devices", "plugins", "backends"}
    import torch

    assert report["versions"]["torch"] == torch.__version__
    assert report["devices"]["cpu"]["usable_cores"] >= 1
    statuses = {b["name"]: b["status"] for b in report["backends"]}
    allowed = {
        "ready",
        "installed, not runnable here",
        "library missing",
        "failed to load",
        "not installed",
    }
    for name in ("cpu", "ddp", "fsdp", "auto"):
        assert statuses.get(name) in allowed, (name, statuses)
    for name in ("cpu", "ddp", "auto"):
        assert statuses[name] == "ready", statuses
    native = [p for p in report["plugins"] if p["name"] == "native"]
    assert native and native[0]["status"] == "loaded"
    assert native[0]["libraries"]["torch"] == torch.__version__
    # what fsdp's N-D mesh can use in this torch (2.13: all of it)
    mesh = report["fsdp_mesh"]
    assert mesh["options"].startswith("dp_replicate, dp_shard, tp, tp_plan")
    assert mesh["tp"].startswith("available (parallelize_module")
    assert mesh["HSDP"].startswith("available") and mesh["device mesh"].startswith("available")


def test_env_says_when_this_torch_cannot_build_a_mesh(monkeypatch):
    import torch

    from accelkit.backends.mesh import support_report

    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    report = support_report()
    assert report["tp"] == "unavailable: this torch is built without torch.distributed"
    assert report["HSDP"].startswith("unavailable")


def test_env_text_shows_every_section():
    out = accelkit("env")
    assert out.returncode == 0, out.stderr
    for heading in ("versions", "devices", "plugins", "backends"):
        assert f"\n{heading}\n" in f"\n{out.stdout}", out.stdout
    assert "\nfsdp mesh (N-D parallelism" in out.stdout
    assert "torch" in out.stdout and "cpu" in out.stdout


def test_env_imports_no_backend_library():
    code = textwrap.dedent(
        """
        import contextlib, io, sys
        from accelkit.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["env", "--json"]) == 0
        heavy = {"deepspeed", "colossalai", "apex", "fairscale", "mmengine"}
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_env_reports_missing_library_broken_plugin_and_known_plugins():
    """In-process: a plugin whose backend needs an absent library, and one whose hook raises."""
    from accelkit import registry
    from accelkit._known_plugins import KNOWN_PLUGIN_BACKENDS
    from accelkit.cli import env
    from accelkit.hookspecs import hookimpl

    class NeedsLibrary:
        @hookimpl
        def accelkit_register_backends(self, registry):
            registry.add(
                "needs_lib",
                "accelkit_test_absent_module:Backend",
                requires=("accelkit_test_absent_library",),
                install="pip install accelkit-test-absent",
            )

        @hookimpl
        def accelkit_env_report(self):
            return {"accelkit_test_absent_library": None}

    class Broken:
        @hookimpl
        def accelkit_register_backends(self, registry):
            raise RuntimeError("boom from a broken plugin")

    class MissingModule:
        @hookimpl
        def accelkit_register_backends(self, registry):
            registry.add("no_module", "accelkit_test_absent_module:Backend")

    registry.reset()
    try:
        registry.register_plugin(NeedsLibrary(), "needs-library")
        registry.register_plugin(Broken(), "broken")
        registry.register_plugin(MissingModule(), "missing-module")
        report = env.collect()
    finally:
        registry.reset()
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["needs-library"]["status"] == "loaded"
    assert plugins["needs-library"]["libraries"] == {"accelkit_test_absent_library": None}
    assert plugins["broken"]["status"] == "failed"
    assert "boom from a broken plugin" in plugins["broken"]["error"]
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["needs_lib"]["status"] == "library missing"
    assert backends["needs_lib"]["missing"] == ["accelkit_test_absent_library"]
    assert backends["needs_lib"]["install"] == "pip install accelkit-test-absent"
    assert backends["no_module"]["status"] == "failed to load"
    assert "accelkit_test_absent_module" in backends["no_module"]["reason"]
    assert backends["cpu"]["status"] == "ready"
    for name, (_, pip_line) in KNOWN_PLUGIN_BACKENDS.items():
        if backends[name]["status"] == "not installed":
            assert backends[name]["install"] == pip_line
    text = env.render(report)
    assert "boom from a broken plugin" in text
    assert "pip install accelkit-test-absent" in text


def test_env_tells_installed_from_runnable_here(monkeypatch):
    """A backend that declares devices this machine lacks is installed but not runnable here,
    with the reason, in the JSON report and the text."""
    from accelkit import backend_specs, registry
    from accelkit.cli import env
    from accelkit.hookspecs import hookimpl

    class NeedsGpu:
        @hookimpl
        def accelkit_register_backends(self, registry):
            registry.add(
                "needs_gpu",
                "accelkit.backends.single:SingleDeviceBackend",
                devices=("cuda",),
                devices_reason="its kernels are CUDA only",
            )

    monkeypatch.setattr(backend_specs, "device_available", lambda device: device == "cpu")
    registry.reset()
    try:
        registry.register_plugin(NeedsGpu(), "needs-gpu")
        report = env.collect()
    finally:
        registry.reset()
    backends = {b["name"]: b for b in report["backends"]}
    entry = backends["needs_gpu"]
    assert entry["status"] == "installed, not runnable here", entry
    assert entry["installed"] is True and entry["runnable_here"] is False
    assert entry["reason"] == "needs a CUDA GPU (its kernels are CUDA only)"
    for name in ("cuda", "gpu", "mps"):  # the native single-device backends declare theirs
        assert backends[name]["status"] == "installed, not runnable here", backends[name]
    assert backends["cpu"]["status"] == "ready" and backends["cpu"]["runnable_here"] is True
    text = env.render(report)
    assert "installed, not runnable here: needs a CUDA GPU (its kernels are CUDA only)" in text


def test_env_on_this_machine_names_cuda_only_plugin_backends():
    """The plugins' own declarations, read without importing their libraries: on a machine
    without CUDA, FairScale's FSDP and Gemini are installed but not runnable here."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = accelkit("env", "--json")
    assert out.returncode == 0, out.stderr
    backends = {b["name"]: b for b in json.loads(out.stdout)["backends"]}
    for name in ("fairscale_fsdp", "colossalai_gemini"):
        if backends.get(name, {}).get("installed"):
            assert backends[name]["status"] == "installed, not runnable here", backends[name]
            assert backends[name]["reason"].startswith("needs a CUDA GPU"), backends[name]


def test_install_lines_run_as_printed():
    """Every plugin install line names this interpreter and paths that exist: pip on PATH may be
    another Python's, and the plugin distributions are not on a package index."""
    import shlex

    from accelkit._known_plugins import KNOWN_PLUGIN_BACKENDS

    root = Path(__file__).parents[1]
    for name, (_, line) in KNOWN_PLUGIN_BACKENDS.items():
        for command in line.split(" && "):
            words = shlex.split(command)
            if words[0] == "bash":
                assert Path(words[1]).is_file(), (name, line)
                assert words[2] == sys.executable, (name, line)
                continue
            assert words[:4] == [sys.executable, "-m", "pip", "install"], (name, line)
            assert words[4] == "-e" and Path(words[5], "pyproject.toml").is_file(), (name, line)
            assert Path(words[5]).resolve().parent == root / "plugins", (name, line)


# ---- run -----------------------------------------------------------------------------------------
TWO_RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist

assert os.environ["WORLD_SIZE"] == "2", os.environ["WORLD_SIZE"]
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
out = os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json")
with open(out, "w") as f:
    json.dump({"sum": value.item(), "argv": sys.argv[2:],
               "omp": os.environ.get("OMP_NUM_THREADS")}, f)
dist.destroy_process_group()
"""


def test_run_launches_two_ranks_that_all_reduce(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANK_SCRIPT)
    env = clean_env()
    env.pop("OMP_NUM_THREADS")
    # the script's own flags include a prefix of ours (--nproc) and one of ours exactly
    out = accelkit(
        "run",
        "--nproc-per-node",
        "2",
        str(script),
        str(tmp_path),
        "--nproc",
        "3",
        "--nnodes",
        "x",
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["sum"] == 3.0  # 1 + 2
        assert result["argv"] == ["--nproc", "3", "--nnodes", "x"]
        assert result["omp"] == "1"  # set when unset, as torchrun does


def test_run_returns_the_failing_rank_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    out = accelkit("run", "--nproc-per-node", "2", str(script))
    assert out.returncode == 3, out.stdout + out.stderr


def test_run_passes_multi_node_flags_to_torchrun():
    import argparse

    from torch.distributed import run as torchrun

    from accelkit.cli import run as run_command

    parser = argparse.ArgumentParser()
    run_command.add_parser(parser)
    args = parser.parse_args(
        [
            "--nnodes=2",
            "--node_rank",
            "1",
            "--nproc-per-node",
            "8",
            "--master-addr",
            "node0",
            "--master-port",
            "29501",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "node0:29400",
            "--rdzv-id",
            "job7",
            "--rdzv-conf",
            "timeout=60",
            "--max-restarts",
            "2",
            "-m",
            "pkg.train",
            "--lr",
            "1",
        ]
    )
    argv = run_command.torchrun_argv(args)
    parsed = torchrun.get_args_parser().parse_args(argv)
    assert parsed.nnodes == "2"
    assert parsed.node_rank == 1
    assert parsed.nproc_per_node == "8"
    assert parsed.master_addr == "node0"
    assert parsed.master_port == 29501
    assert parsed.rdzv_backend == "c10d"
    assert parsed.rdzv_endpoint == "node0:29400"
    assert parsed.rdzv_id == "job7"
    assert parsed.rdzv_conf == "timeout=60"
    assert parsed.max_restarts == 2
    assert parsed.module is True
    assert parsed.training_script == "pkg.train"
    assert parsed.training_script_args == ["--lr", "1"]


# ---- demo ----------------------------------------------------------------------------------------
def _check_demo(out, summary_path: Path, world_size: int, backend: str) -> dict:
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["backend"] == backend
    assert summary["world_size"] == world_size
    assert summary["last_loss"] < summary["first_loss"], summary
    assert summary["loss_went_down"] is True
    if checkpoint_available():
        assert summary["resume"] == "matches", summary
        assert summary["resume_max_abs_diff"] == 0.0
        assert "resume: matches uninterrupted run" in out.stdout
        assert Path(summary["checkpoint"], "accelkit.json").is_file()
    else:
        assert summary["resume"] == "unavailable", summary
        assert "checkpoint: unavailable" in out.stdout
    assert "accelkit demo summary" in out.stdout
    return summary


def test_demo_trains_saves_and_resumes_on_cpu(tmp_path):
    out = accelkit(
        "demo", "--steps", "20", "--resume-steps", "10", "--out", str(tmp_path), "--no-progress"
    )
    summary = _check_demo(out, tmp_path / "summary.json", 1, "cpu")
    assert summary["precision"] == "32-true"


def test_demo_shows_a_progress_bar(tmp_path):
    out = accelkit("demo", "--steps", "6", "--resume-steps", "0", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "training" in out.stderr and "6/6" in out.stderr, out.stderr


def test_demo_ddp_relaunches_on_two_processes(tmp_path):
    out = accelkit(
        "demo",
        "--backend",
        "ddp",
        "--nproc",
        "2",
        "--steps",
        "12",
        "--resume-steps",
        "6",
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    _check_demo(out, tmp_path / "summary.json", 2, "ddp")


def test_demo_refuses_a_single_process_backend_on_two_processes(tmp_path):
    out = accelkit(
        "demo", "--backend", "cpu", "--nproc", "2", "--steps", "2", "--out", str(tmp_path)
    )
    assert out.returncode != 0
    assert "launched on 2 processes" in out.stderr and "'ddp'" in out.stderr


def test_demo_unknown_backend_fails_with_the_registered_names(tmp_path):
    out = accelkit("demo", "--backend", "cpux", "--out", str(tmp_path))
    assert out.returncode == 2
    assert "Did you mean 'cpu'" in out.stderr


@pytest.fixture
def demo_probes(monkeypatch):
    """In-process backends for the demo's up-front checks: one needs a GPU, one trains only
    transformer models, one records the order of the demo's setup calls. No CUDA here."""
    from accelkit import backend_specs, registry
    from accelkit.backends.single import SingleDeviceBackend
    from accelkit.hookspecs import hookimpl

    calls: list[str] = []

    class OrderProbe(SingleDeviceBackend):
        def launch(self):
            self.name = "cpu"  # SingleDeviceBackend takes the device from its name
            super().launch()

        def setup(self, model, optimizers, **kwargs):
            calls.append("setup")
            return super().setup(model, optimizers, **kwargs)

        def on_dataloader(self, loader):
            calls.append("setup_dataloader")

    class Probes:
        @hookimpl
        def accelkit_register_backends(self, registry):
            registry.add("probe_order", OrderProbe)
            registry.add(
                "probe_gpu_only",
                SingleDeviceBackend,
                devices=("cuda",),
                devices_reason="its kernels are CUDA only",
            )
            registry.add(
                "probe_transformers_only", SingleDeviceBackend, models="a transformers model"
            )

    monkeypatch.setattr(backend_specs, "device_available", lambda device: device == "cpu")
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    registry.reset()
    registry.register_plugin(Probes(), "demo-probes")
    yield calls
    registry.reset()


@pytest.mark.parametrize(
    "backend, reason",
    [
        ("probe_gpu_only", "cannot run here: it needs a CUDA GPU (its kernels are CUDA only)"),
        ("probe_transformers_only", "trains a transformers model; the demo's model is a plain"),
    ],
)
def test_demo_refuses_up_front_once(demo_probes, capsys, backend, reason):
    """Refused in the parent, before any process is launched: one message, no traceback."""
    from accelkit.cli import main

    assert main(["demo", "--backend", backend, "--nproc", "2", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("accelkit demo:") == 1 and reason in err, err


def test_demo_sets_up_the_loader_before_the_model(demo_probes):
    """The order that needs no micro-batch advice from DeepSpeed: the loader first."""
    import argparse

    from accelkit.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_parser(parser)
    args = parser.parse_args(["--backend", "probe_order"])
    demo.build(args, demo.make_dataset(0), 4, init_seed=0)
    assert demo_probes == ["setup_dataloader", "setup"]


def test_demo_writes_to_a_fresh_temp_dir_per_run(monkeypatch, tmp_path, capsys):
    """Without --out each run gets its own new directory (a fixed path in /tmp would be shared
    by every user of the machine), and says where."""
    import tempfile

    from accelkit.cli import main

    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    outs = []
    for _ in range(2):
        assert main(["demo", "--steps", "2", "--resume-steps", "0", "--no-progress"]) == 0
        printed = capsys.readouterr().out
        out = printed.split("accelkit demo: writing to ", 1)[1].split("\n", 1)[0]
        assert Path(out, "summary.json").is_file() and f"summary     {out}" in printed
        outs.append(Path(out))
    assert outs[0] != outs[1] and all(o.parent == tmp_path for o in outs), outs


@pytest.mark.gpu
def test_demo_on_cuda_in_bf16(tmp_path):
    out = accelkit(
        "demo",
        "--backend",
        "cuda",
        "--precision",
        "bf16-mixed",
        "--steps",
        "30",
        "--resume-steps",
        "10",
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    _check_demo(out, tmp_path / "summary.json", 1, "cuda")


@pytest.mark.skipif(not checkpoint_available(), reason="accelkit.checkpoint not built yet")
def test_demo_resume_check_matches_after_load_and_differs_without(tmp_path):
    """The demo's resume comparison, in process: it says "matches" only when the load happened."""
    import argparse

    from accelkit.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_parser(parser)
    args = parser.parse_args(["--steps", "8", "--resume-steps", "4", "--out", str(tmp_path)])
    total = args.steps + args.resume_steps
    dataset = demo.make_dataset(args.seed)
    first = demo.build(args, dataset, total, init_seed=args.seed)
    ckpt = tmp_path / "ckpt"

    def save_at(step):
        if step == args.steps:
            first.accel.save(ckpt, first.state())

    demo.train(first, total, None, on_step=save_at)
    assert demo._resume(args, dataset, total, ckpt, first, show=False)[0] == "matches"
    verdict, diff = demo._resume(args, dataset, total, ckpt, first, show=False, load=False)
    assert verdict == "differs" and diff > 1e-3, diff


def test_env_names_the_failed_plugin_for_its_known_backends(monkeypatch):
    """An installed plugin distribution that fails to import: its backends say why."""
    from importlib import metadata
    from types import SimpleNamespace

    from accelkit import registry
    from accelkit._known_plugins import KNOWN_PLUGIN_BACKENDS
    from accelkit.cli import env

    dist_name, _ = next(iter(KNOWN_PLUGIN_BACKENDS.values()))
    names = [n for n, (d, _) in KNOWN_PLUGIN_BACKENDS.items() if d == dist_name]
    entry_point = metadata.EntryPoint(
        name="broken", value="accelkit_test_no_such_plugin_module", group="accelkit"
    )
    vars(entry_point).update(dist=SimpleNamespace(name=dist_name, version="9.9"))
    monkeypatch.setattr(registry, "_entry_points", lambda: [entry_point])
    registry.reset()
    try:
        report = env.collect()
    finally:
        registry.reset()
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["broken"]["status"] == "failed"
    assert plugins["broken"]["distribution"] == dist_name
    assert "accelkit_test_no_such_plugin_module" in plugins["broken"]["error"]
    backends = {b["name"]: b for b in report["backends"]}
    for name in names:
        assert backends[name]["status"] == "failed to load", backends[name]
        assert "accelkit_test_no_such_plugin_module" in backends[name]["reason"]
    assert backends["cpu"]["status"] == "ready"  # the native backends still load


# ---- the README's quick start and CI ----------------------------------------------------------
def _quick_start_commands() -> list[str]:
    import re

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.+?)\n```", section)


def test_readme_quick_start_is_what_ci_runs():
    """Two commands for a newcomer (set up + demo, tests) and the full tier; .ci/run reads and runs
    exactly these, and the setup script installs torch 2.13, every plugin, colossalai and the s3 extra."""
    root = Path(__file__).parents[1]
    commands = _quick_start_commands()
    assert len(commands) == 3, commands
    setup, default_tier, full_tier = commands
    assert setup == "bash scripts/setup.sh && .venv/bin/accelkit demo"
    assert default_tier == ".venv/bin/python -m pytest -q"
    assert full_tier.startswith(".venv/bin/python -m pytest -q -m ") and "slow" in full_tier
    script = (root / "scripts" / "setup.sh").read_text(encoding="utf-8")
    for needed in ("torch==2.13.0", "plugins/*/", "install_colossalai.sh", ".[test,s3]"):
        assert needed in script, needed
    printed = subprocess.run(
        ["bash", str(root / ".ci" / "run"), "--print"], capture_output=True, text=True, check=True
    ).stdout
    assert printed.splitlines() == commands
    assert os.access(root / ".ci" / "run", os.X_OK)


# ---- bench and plan ------------------------------------------------------------------------------
def test_bench_refuses_unknown_backend_names_before_running(monkeypatch, capsys):
    """A typo in --backends is reported at once, with the nearest name, before any run."""
    from accelkit.benchmark import runner
    from accelkit.cli import main

    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before the names were checked")

    monkeypatch.setattr(runner, "run", must_not_run)
    assert main(["bench", "--model", "mlp", "--backends", "cpu,fdsp,raw", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown backend 'fdsp' (did you mean 'fsdp'?)" in err, err


def test_plan_prints_each_install_line_once_under_the_table():
    from types import SimpleNamespace

    from accelkit.cli import plan

    install = "python -m pip install -e plugins/deepspeed"
    estimate = {k: 2**30 for k in ("params", "grads", "optimizer", "master", "activations")}
    candidates = [
        SimpleNamespace(
            label=f"deepspeed_stage_{i}",
            estimate={**estimate, "peak": 2**31},
            fits=True,
            why_not="",
            note=f"needs deepspeed: {install}",
        )
        for i in (1, 2, 3)
    ]
    text = plan.render(
        {
            "request": {
                "batch": 8,
                "precision": "bf16-mixed",
                "optimizer": "adamw",
                "activation_checkpointing": False,
                "gpus": 8,
                "gpu_memory": 80 * 2**30,
                "headroom": 0.1,
            },
            "model": {"name": "toy", "params": 1e6, "trainable_params": 1e6},
            "budget_per_gpu": 72 * 2**30,
            "candidates": candidates,
            "reason": "toy",
            "no_estimate": [],
            "failed_estimates": [],
        }
    )
    assert text.count(install) == 1, text
    assert text.count("yes (needs deepspeed: install [1])") == 3, text
    assert f"[1] needs deepspeed: {install}" in text
