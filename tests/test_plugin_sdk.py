"""What a third-party plugin author relies on beyond the protocol (issue 40): an unknown
precision lists the backend's own precisions, the conformance suite's failures name the first
index that differs and its attributes are checked, its markers work in a test suite outside this
repository, and ``sdk.installed_versions`` reads versions without importing."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import accelkit
from accelkit import sdk
from accelkit.testing import conformance, contract_runs


class Fp32OnlyBackend(sdk.SingleDeviceBackend):
    capabilities = sdk.Capabilities(precisions=("32-true",))


class Fp32OnlyPlugin:
    @accelkit.hookimpl
    def accelkit_register_backends(self, registry: Any) -> None:
        registry.add("fp32_only", Fp32OnlyBackend)


def test_an_unknown_precision_lists_the_backends_precisions_only():
    accelkit.register_plugin(Fp32OnlyPlugin(), "fp32_only")
    with pytest.raises(accelkit.ConfigError) as caught:
        accelkit.get("fp32_only", precision="fp33")
    message = str(caught.value)
    assert "unknown precision 'fp33'. Valid precisions: 32-true (aliases: 32, fp32)" in message
    assert "bf16" not in message


def test_a_failure_names_the_first_index_that_differs():
    reference = [1.0] * 10
    mine = [1.0] * 7 + [1.5, 1.0, 3.0]  # equal in the first 6: the old message showed no change
    with pytest.raises(AssertionError) as caught:
        conformance._close(mine, reference, (1e-5, 1e-6), "losses")
    message = str(caught.value)
    assert "at 2 of 10 indices; first at index 7: 1.5 vs 1.0; worst at index 9: 3.0" in message
    conformance._close(reference, reference, (0.0, 0.0), "losses")  # equal lists pass exactly


@pytest.mark.parametrize(
    "attributes, needle",
    [
        ({"lossy": True}, "declares its tolerance"),
        ({"save_at": 4}, "save_at must lie between 0 and steps (4)"),
        ({"steps": 6, "save_at": 0}, "save_at must lie between"),
    ],
)
def test_a_contract_with_attributes_that_cannot_work_is_refused(attributes, needle):
    contract = conformance.backend_contract("cpu", **attributes)
    with pytest.raises(TypeError, match=r"CpuContract") as caught:
        contract.check_attributes()
    assert needle in str(caught.value)


def test_lossy_resumes_are_exact_unless_told_otherwise():
    lossy = conformance.backend_contract("cpu", lossy=True, tolerance=(1e-2, 1e-3))()
    assert lossy.tolerances() == (1e-2, 1e-3)
    assert lossy.resume_tolerances() == (0.0, 0.0)
    plain = conformance.backend_contract("cpu")()
    assert plain.resume_tolerances() == plain.tolerances() == conformance.TOLERANCES["32-true"]


def test_the_markers_work_in_a_test_suite_outside_the_repository(tmp_path):
    (tmp_path / "test_outside.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from accelkit.testing.conformance import backend_contract

            TestCpuContract = backend_contract("cpu", world_sizes=(1,), resume_world_sizes=(1,))

            @pytest.mark.slow
            def test_own_slow_case():
                pass
            """
        )
    )
    run = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    run += ["-W", "error::pytest.PytestUnknownMarkWarning", "test_outside.py"]
    pick = ["-k", "resumes_at_another or own_slow"]
    out = subprocess.run([*run, *pick], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 1 skipped" in out.stdout, out.stdout  # the contract's slow case is skipped
    assert "run with -m slow" in out.stdout
    slow = [*run, "-m", "slow", "-k", "own_slow"]
    out = subprocess.run(slow, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr


def test_installed_versions_reads_metadata_without_importing():
    versions = sdk.installed_versions("torch", "no-such-distribution-kq")
    assert versions["torch"].split("+")[0] == __import__("torch").__version__.split("+")[0]
    assert versions["no-such-distribution-kq"] is None
    code = "import sys; from accelkit import sdk; sdk.installed_versions('numpy'); print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the worked example of docs/plugins.md, "Building on a native backend" -----------------
FORGETFUL = '''
import accelkit
from ef16_example import EF16Backend


class ForgetfulBackend(EF16Backend):
    """ddp_ef16, except that it does not save its residuals: its resume cannot be exact."""

    def rank_state_dict(self):
        return {}


class ForgetfulPlugin:
    @accelkit.hookimpl
    def accelkit_register_backends(self, registry):
        registry.add("ddp_ef16_forgetful", ForgetfulBackend)
'''


def _docs_block(containing: str) -> str:
    """The ```python block of docs/plugins.md that holds ``containing``."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
    (block,) = [b for b in blocks if containing in b]
    return block


@pytest.mark.slow
def test_the_lossy_contract_holds_the_example_and_fails_what_breaks_it(tmp_path):
    (tmp_path / "ef16_example.py").write_text(_docs_block("class EF16Backend"))
    (tmp_path / "ef16_forgetful.py").write_text(FORGETFUL)
    common = {"path": (str(tmp_path),), "steps": 5, "save_at": 3}
    lossy = {**common, "world_sizes": (2,), "lossy": True, "tolerance": (1e-3, 1e-4)}
    sys.path.insert(0, str(tmp_path))
    try:
        example = conformance.backend_contract(
            "ddp_ef16", plugin="ef16_example:EF16Plugin", **lossy
        )()
        example.test_accumulation_and_clipping_match_a_raw_loop(2)
        example.test_checkpoint_resumes_where_it_was_saved(1)  # bit for bit
        # the declared mode is needed: at 32-true's tolerance the raw loop is out of reach
        strict = conformance.backend_contract(
            "ddp_ef16", plugin="ef16_example:EF16Plugin", world_sizes=(1,), **common
        )()
        with pytest.raises(AssertionError, match="first at index"):
            strict.test_accumulation_and_clipping_match_a_raw_loop(1)
        forgetful = conformance.backend_contract(
            "ddp_ef16_forgetful", plugin="ef16_forgetful:ForgetfulPlugin", **lossy
        )()
        with pytest.raises(AssertionError, match="resumed: losses differ"):
            forgetful.test_checkpoint_resumes_where_it_was_saved(1)
    finally:
        sys.path.remove(str(tmp_path))


# ---- the ZeRO-1 worked example of docs/plugins.md, "Writing a sharded backend" ---------------
HERE = Path(__file__).resolve().parent


def test_the_zero1_example_is_at_most_60_lines_and_the_docs_say_how_many():
    plugin = _docs_block("class Zero1Backend").split('if __name__ == "__main__":')[0]
    lines = [line for line in plugin.splitlines() if line.strip()]
    assert len(lines) <= 60, f"the ZeRO-1 example has {len(lines)} non-blank lines"
    docs = (HERE.parent / "docs" / "plugins.md").read_text()
    assert f"The plugin is the {len(lines)} non-blank lines above the `__main__` check" in docs


@pytest.fixture
def zero1_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "zero1_example.py").write_text(_docs_block("class Zero1Backend"))
    monkeypatch.syspath_prepend(str(tmp_path))  # the suite finds the plugin's module from here
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(
    "twin, case, needle",
    [
        (
            "zero1_drops_numbers",
            "test_every_owners_optimizer_state_loads_on_another_backend",
            r"does not load on cpu: .*lacks lr_total, taken",
        ),
        (
            "zero1_empty_check",
            "test_another_optimizers_checkpoint_is_refused_and_changes_nothing",
            r"was accepted|KeyError: 'exp_avg'",
        ),
        (
            "ddp_fp8_without_options",
            "test_every_advertised_precision_and_option_is_accepted",
            r"advertises precision 'fp8-mixed', but its options class DDPOptions lacks",
        ),
    ],
)
def test_each_broken_twin_of_the_zero1_example_fails_the_suite(zero1_folder, twin, case, needle):
    """The example holds the case (the docs test runs its whole contract); the twin with one bug
    fails it, saying what was lost."""
    path = (str(zero1_folder), str(HERE))
    common = {"path": path, "world_sizes": (2,)}
    broken = conformance.backend_contract(twin, plugin="broken_zero1:BrokenPlugin", **common)()
    with pytest.raises(AssertionError, match=needle):
        getattr(broken, case)(1)
    if twin.startswith("zero1"):
        example = conformance.backend_contract(
            "zero1", plugin="zero1_example:Zero1Plugin", **common
        )()
        getattr(example, case)(1)


def test_a_ddp_subclass_on_the_wrap_options_has_no_comm_hook_option():
    import rank_state_workers  # CountingDDP: options_class = sdk.DDPWrapOptions

    rank_state_workers.register()
    with pytest.raises(accelkit.ConfigError, match="comm_hook"):
        accelkit.get("counting", comm_hook="powersgd")


@pytest.mark.slow
def test_fsdp_calls_on_wrapped_with_the_sharded_root():
    from accelkit.testing import run_ranks

    here = Path(__file__).parent
    (seen,) = run_ranks("plugin_sdk_workers:wrapped", nproc=1, timeout=300, path=[here])
    assert seen == {"root_is_fsdp": True, "params_sharded": True, "optimizer_holds_them": True}


# ---- capabilities a subclass can configure; the optimizer rebuild (issue 47) ------------------
class OnDDPOptions(sdk.DDPBackend):
    options_class = sdk.DDPOptions  # DDP's options without fp8_*: fp8-mixed must not follow


class OnDDPOptionsPlugin:
    @accelkit.hookimpl
    def accelkit_register_backends(self, registry: Any) -> None:
        registry.add("ddp_without_fp8_options", OnDDPOptions)


def test_a_subclass_inherits_only_the_precisions_its_options_configure():
    assert "fp8-mixed" in sdk.DDPBackend.capabilities.precisions  # ddp has the fp8_* options
    assert OnDDPOptions.capabilities.precisions == sdk.PRECISIONS
    accelkit.register_plugin(OnDDPOptionsPlugin(), "ddp_without_fp8_options")
    with pytest.raises(accelkit.ConfigError, match="does not support precision 'fp8-mixed'"):
        accelkit.get("ddp_without_fp8_options", precision="fp8-mixed")
    # and the suite's check of what it advertises passes it
    assert contract_runs.precision_problems("ddp_without_fp8_options", {}) == []


def test_optimizer_recipe_rebuilds_adamw_and_refuses_one_with_state():
    import torch

    net = torch.nn.Linear(3, 2)
    adamw = torch.optim.AdamW(
        [{"params": [net.weight], "lr": 0.1}, {"params": [net.bias], "weight_decay": 0.0}],
        lr=0.01,
        betas=(0.8, 0.9),
    )
    assert "decoupled_weight_decay" in adamw.defaults  # what AdamW's constructor refuses
    recipe = sdk.optimizer_recipe("mine", adamw)
    assert "decoupled_weight_decay" not in recipe.defaults
    rebuilt = recipe.cls(recipe.groups, **recipe.defaults)
    assert type(rebuilt) is torch.optim.AdamW and rebuilt.defaults == adamw.defaults
    assert [g["lr"] for g in rebuilt.param_groups] == [0.1, 0.01]
    recipe.groups[0]["lr"] = 1.0  # fresh dicts: the user's optimizer is left alone
    assert adamw.param_groups[0]["lr"] == 0.1
    net(torch.randn(4, 3)).sum().backward()
    adamw.step()
    with pytest.raises(accelkit.ConfigError, match="mine: the optimizer already has state"):
        sdk.optimizer_recipe("mine", adamw)


def test_a_contract_made_after_another_was_freed_launches_its_own_runs(monkeypatch):
    """Contract classes made one after another (as the broken twins are) never share cached runs
    or a checkpoint folder, although a freed class's ``id`` is reused. ``run_ranks`` is replaced
    by a recorder: the launches themselves are not what this checks."""
    launched: list[str] = []

    def record(target: str, job: dict, **_: object) -> list[str]:
        launched.append(job["backend"])
        return [job["backend"]]

    monkeypatch.setattr(conformance, "run_ranks", record)
    folders = set()
    for backend in ("cpu", "ddp", "cpu", "ddp"):
        contract = conformance.backend_contract(backend, world_sizes=(1,))()
        assert contract.trained(1) == [backend]
        folders.add(contract._checkpoint())
        del contract
        gc.collect()
    assert launched == ["cpu", "ddp", "cpu", "ddp"]
    assert len(folders) == 4
