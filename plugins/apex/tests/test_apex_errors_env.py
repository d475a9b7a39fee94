"""What the Apex backends refuse, and what ``accelkit env`` says about Apex (fake apex, CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from apex_testlib import FAKE_ROOT, drop_apex_at, purge_apex_modules, use_apex_at

import accelkit
from accelkit.errors import ConfigError, PluginMissingError


def real_apex_installed() -> bool:
    import importlib.util

    purge_apex_modules()
    return importlib.util.find_spec("apex") is not None


@pytest.fixture
def apex_variant(tmp_path):
    """A copy of the fake apex with pieces removed or broken: ``variant(remove=[...], edit=...)``."""
    roots = []

    def make(remove=(), edit=None):
        root = tmp_path / f"variant{len(roots)}"
        shutil.copytree(FAKE_ROOT, root)
        for rel in remove:
            target = root / rel
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        if edit:
            for rel, (old, new) in edit.items():
                path = root / rel
                path.write_text(path.read_text().replace(old, new))
        roots.append(root)
        use_apex_at(root)
        return root

    yield make
    for root in roots:
        drop_apex_at(root)


@pytest.fixture
def pretend_cuda(monkeypatch):
    """Past the CUDA check to the Apex import checks (no CUDA work happens before they fail)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)


# ---- no apex, wrong apex, apex without its compiled modules --------------------------------------
@pytest.mark.skipif(real_apex_installed(), reason="an apex package is installed here")
def test_without_apex_the_error_says_how_to_get_it():
    with pytest.raises(
        PluginMissingError, match=r"needs apex.*not on the package registry.*source"
    ):
        accelkit.get("apex")
    with pytest.raises(PluginMissingError, match="unrelated web toolkit"):
        accelkit.get("apex_distributed_adam")


def test_an_apex_that_is_not_nvidias_is_named(tmp_path, pretend_cuda):
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("# some other 'apex' distribution\n")
    use_apex_at(tmp_path)
    try:
        with pytest.raises(PluginMissingError, match=r"is not NVIDIA Apex.*apex.optimizers"):
            accelkit.get("apex")
    finally:
        drop_apex_at(tmp_path)


def test_without_cuda_the_error_says_so(fake_apex, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("apex", "apex_distributed_adam"):
        with pytest.raises(ConfigError, match=rf"backend {name!r} needs a CUDA GPU.*amp_C"):
            accelkit.get(name)


def test_apex_built_without_cuda_extensions(apex_variant, pretend_cuda):
    apex_variant(
        edit={"apex/multi_tensor_apply/__init__.py": ("available = True", "available = False")}
    )
    with pytest.raises(PluginMissingError, match=r"built without its CUDA extensions.*--cuda_ext"):
        accelkit.get("apex")


def test_fused_norm_needs_fused_layer_norm_cuda(apex_variant, pretend_cuda):
    apex_variant(remove=["fused_layer_norm_cuda.py"])
    with pytest.raises(PluginMissingError, match="fused_layer_norm_cuda"):
        accelkit.get("apex", fused_norm=True)


def test_distributed_adam_needs_its_build_flag(apex_variant, pretend_cuda):
    apex_variant(remove=["distributed_adam_cuda.py"])
    with pytest.raises(PluginMissingError, match=r"--distributed_adam"):
        accelkit.get("apex_distributed_adam")


# ---- Apex's removed amp ---------------------------------------------------------------------------
#: amp's opt_level -> the precision string with the same effect (either case)
AMP_LEVELS = [
    ("O0", "32-true"),
    ("O1", "16-mixed"),
    ("O2", "16-mixed"),
    ("O3", "16-true"),
    ("o1", "16-mixed"),
    ("o3", "16-true"),
]


@pytest.mark.parametrize(("level", "precision"), AMP_LEVELS)
@pytest.mark.parametrize("name", ["apex", "apex_distributed_adam"])
def test_opt_level_says_amp_was_removed_and_what_to_pass(fake_apex, name, level, precision):
    with pytest.raises(ConfigError) as err:
        accelkit.get(name, opt_level=level)
    message = str(err.value)
    assert "removed apex.amp" in message and "May 2025" in message
    assert f"is precision={precision!r}" in message
    with pytest.raises(ConfigError, match=r"removed apex\.amp"):
        accelkit.get(name, config={"opt_level": level})


@pytest.mark.parametrize(("level", "precision"), AMP_LEVELS)
@pytest.mark.parametrize("name", ["apex", "apex_distributed_adam"])
def test_an_opt_level_as_precision_gets_amps_message(fake_apex, name, level, precision):
    with pytest.raises(ConfigError) as err:
        accelkit.get(name, precision=level)
    message = str(err.value)
    assert message.startswith(f"backend {name!r}: precision={level!r}: Apex removed apex.amp")
    assert "May 2025" in message and f"is precision={precision!r}" in message
    assert "unknown precision" not in message
    # word for word what opt_level= gets, after the part that names what was passed
    with pytest.raises(ConfigError) as via_option:
        accelkit.get(name, opt_level=level)
    assert message.split(": ", 2)[2] == str(via_option.value).split(": ", 2)[2]


def test_other_precision_errors_stay_generic(fake_apex):
    """Only amp's opt levels get amp's message: an unknown string on apex, and an opt level on a
    backend that is not Apex's, get the core's unknown-precision error."""
    with pytest.raises(ConfigError, match=r"unknown precision 'O4'") as err:
        accelkit.get("apex", precision="O4")
    assert "apex.amp" not in str(err.value)
    with pytest.raises(ConfigError, match=r"unknown precision 'O1'") as err:
        accelkit.get("cpu", precision="O1")
    assert "apex.amp" not in str(err.value)
    from accelkit_apex.backend import ApexBackend

    assert ApexBackend.parse_precision("apex", "bf16") == "bf16-mixed"  # aliases still work
    assert ApexBackend.parse_precision("apex", None) is None


@pytest.mark.parametrize("option", ["loss_scale", "keep_batchnorm_fp32", "master_weights"])
def test_other_amp_options_are_refused_the_same_way(fake_apex, option):
    with pytest.raises(ConfigError, match=rf"{option}=.*removed apex.amp.*'16-mixed'"):
        accelkit.get("apex", **{option: "dynamic"})


def test_unknown_options_still_get_the_usual_message(fake_apex):
    with pytest.raises(
        ConfigError, match=r"unknown option 'fused_norms'.*Did you mean 'fused_norm'"
    ):
        accelkit.get("apex", fused_norms=True)


def test_describe_publishes_the_dtype_tables(fake_apex):
    apex = accelkit.describe("apex")
    assert apex["dtypes"]["bf16-true"]["master"].startswith("none (FusedAdam keeps")
    assert not apex["capabilities"]["controls_precision"]
    dfa = accelkit.describe("apex_distributed_adam")
    assert dfa["capabilities"]["sharded"] and dfa["capabilities"]["no_sync"]
    assert "fp32 shard" in dfa["dtypes"]["bf16-true"]["master"]


# ---- accelkit env ---------------------------------------------------------------------------------
def test_env_report_names_apex_its_import_and_compiled_modules(fake_apex):
    from accelkit_apex.plugin import accelkit_env_report

    report = accelkit_env_report()
    assert "NVIDIA Apex at" in report["apex"] and str(FAKE_ROOT / "apex") in report["apex"]
    assert report["apex imports"] == "yes"
    compiled = report["apex compiled modules"]
    assert compiled.startswith("amp_C, fused_layer_norm_cuda, distributed_adam_cuda")
    assert "missing" not in compiled
    assert report["accelkit-apex"] == "0.1.0"


def test_env_report_says_what_is_missing_or_broken(apex_variant):
    apex_variant(
        remove=["distributed_adam_cuda.py"],
        edit={
            "fused_layer_norm_cuda.py": (
                "ACCELKIT_FAKE = True",
                "raise ImportError('undefined symbol')",
            )
        },
    )
    from accelkit_apex.probe import env_report

    compiled = env_report()["apex compiled modules"]
    assert compiled.startswith("amp_C;")
    assert "fused_layer_norm_cuda: ImportError: undefined symbol" in compiled
    assert "missing: distributed_adam_cuda (for apex_distributed_adam" in compiled


def test_env_report_without_apex_or_with_another_apex(tmp_path):
    from accelkit_apex.probe import env_report

    if not real_apex_installed():
        assert env_report() == {"apex": None}
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("")
    use_apex_at(tmp_path)
    try:
        assert "not NVIDIA Apex" in env_report()["apex"]
    finally:
        drop_apex_at(tmp_path)


def test_accelkit_env_imports_no_apex_into_its_own_process():
    """With the fake on PYTHONPATH: env reports it, and apex is not in the env process's modules
    (a child interpreter imported it)."""
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from accelkit.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["env", "--json"]) == 0
        report = json.loads(out.getvalue())
        plugin = next(p for p in report["plugins"] if p["name"] == "apex")
        backends = {b["name"]: b["status"] for b in report["backends"]}
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("apex", "amp_C"))
        print("RESULT" + json.dumps([plugin["libraries"], backends["apex"], heavy]))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_ROOT), *sys.path])}
    env.pop("ACCELKIT_DISABLE_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    libraries, status, heavy = json.loads(line[len("RESULT") :])
    assert heavy == []
    # apex declares it needs CUDA: found but not runnable on a machine without it
    runnable = "ready" if torch.cuda.is_available() else "installed, not runnable here"
    assert status == runnable and libraries["apex imports"] == "yes"
    assert "amp_C" in libraries["apex compiled modules"]
    assert Path(FAKE_ROOT).name in libraries["apex"]
