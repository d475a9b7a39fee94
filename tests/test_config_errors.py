"""What ``accelkit.get`` says when the name, a key or a value is wrong, and the shapes a config
may come in (issue 2, item 2). Every error must name the thing and the fix."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist

import accelkit
from accelkit.backend import Backend, Capabilities, SetupResult

DDP_KEYS = [
    "broadcast_buffers",
    "bucket_cap_mb",
    "comm_hook",
    "device",
    "find_unused_parameters",
    "fp8_min_features",
    "fp8_recipe",
    "fp8_skip",
    "fp8_skip_head",
    "gradient_as_bucket_view",
    "powersgd_rank",
    "powersgd_start_iter",
    "static_graph",
    "timeout",
]
NATIVE_NAMES = ["auto", "cpu", "cuda", "ddp", "fsdp", "mps"]


# ---- names ------------------------------------------------------------------------------------
def test_unknown_backend_lists_registered_names_and_closest_match(only_native_plugins):
    with pytest.raises(accelkit.BackendNotFoundError) as info:
        accelkit.get("dpp")
    message = str(info.value)
    assert "unknown backend 'dpp'" in message
    assert "Did you mean 'ddp'?" in message
    registered = re.search(r"Registered backends: (.*)\.", message).group(1).split(", ")
    assert set(NATIVE_NAMES) <= set(registered)
    assert isinstance(info.value, ValueError)


def test_unknown_backend_far_from_any_name_has_no_guess(only_native_plugins):
    with pytest.raises(accelkit.BackendNotFoundError) as info:
        accelkit.get("tensorflow")
    assert "Did you mean" not in str(info.value)
    assert "Registered backends:" in str(info.value)


@pytest.mark.parametrize(
    "name, distribution, folder",
    [
        ("colossalai_gemini", "accelkit-colossalai", "colossalai"),
        ("apex", "accelkit-apex", "apex"),
        ("fairscale_fsdp", "accelkit-fairscale", "fairscale"),
    ],
)
def test_known_plugin_not_installed_gives_its_pip_line(
    only_native_plugins, name, distribution, folder
):
    with pytest.raises(accelkit.PluginMissingError) as info:
        accelkit.get(name)
    message = str(info.value)
    assert repr(distribution) in message
    # the distributions are not on a package index: the line installs the repository's folder
    assert f"-m pip install -e {Path(accelkit.__file__).parents[1] / 'plugins' / folder}" in message
    assert "not installed" in message
    assert isinstance(info.value, ImportError)  # `except ImportError` keeps working


class _Plugin:
    """An in-process plugin (no entry point) that registers the backends of these tests."""

    @staticmethod
    @accelkit.hookimpl
    def accelkit_register_backends(registry):
        registry.add(
            "needs_lib",
            "accelkit.backends.single:SingleDeviceBackend",
            requires=("accelkit_surely_absent_library",),
            install="pip install accelkit-surely-absent-library",
        )
        registry.add("fp32_only", Fp32OnlyBackend)


class Fp32OnlyBackend(Backend):
    capabilities = Capabilities(precisions=("32-true",))

    def setup(self, model, optimizers, **kwargs):
        return SetupResult(model, optimizers)


def test_missing_backend_library_names_it_and_the_install_line(only_native_plugins):
    accelkit.register_plugin(_Plugin(), "config-errors-plugin")
    with pytest.raises(accelkit.PluginMissingError) as info:
        accelkit.get("needs_lib")
    message = str(info.value)
    assert "accelkit_surely_absent_library" in message
    assert "pip install accelkit-surely-absent-library" in message


def test_precision_a_backend_does_not_support_fails_at_get(only_native_plugins):
    accelkit.register_plugin(_Plugin(), "config-errors-plugin")
    assert accelkit.get("fp32_only").precision == "32-true"
    with pytest.raises(
        accelkit.ConfigError, match=r"'fp32_only'.*'bf16-mixed'.*supported: 32-true"
    ):
        accelkit.get("fp32_only", precision="bf16-mixed")


# ---- keys -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config, options, wrong, hint",
    [
        (None, {"timeot": 5.0}, "timeot", "timeout"),
        ({"find_unused_parameter": True}, {}, "find_unused_parameter", "find_unused_parameters"),
        ({"bucket_size_mb": 5}, {}, "bucket_size_mb", "bucket_cap_mb"),
    ],
)
def test_unknown_key_names_valid_keys_and_closest(config, options, wrong, hint):
    with pytest.raises(accelkit.ConfigError) as info:
        accelkit.get("ddp", config, **options)
    message = str(info.value)
    assert f"unknown option {wrong!r}" in message
    assert f"Did you mean {hint!r}?" in message
    listed = re.search(r"Valid options: (.*)\.", message).group(1).split(", ")
    assert listed == DDP_KEYS
    assert not dist.is_initialized()  # failed before joining a process group


def test_unknown_key_for_a_backend_without_that_option():
    with pytest.raises(accelkit.ConfigError, match=r"backend 'cpu'.*'timeout'.*device_index"):
        accelkit.get("cpu", timeout=5.0)


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"timeout": "fast"}, r"option 'timeout' must be float, got 'fast' \(str\)"),
        ({"find_unused_parameters": "yes"}, r"'find_unused_parameters' must be bool, got 'yes'"),
        ({"device": "tpu"}, r"'device' must be one of 'auto', 'cpu', 'cuda', got 'tpu'"),
        ({"bucket_cap_mb": "25"}, r"'bucket_cap_mb' must be .*float.*got '25'"),
        ({"timeout": -1.0}, r"'timeout' must be > 0 seconds, got -1"),
        ({"timeout": True}, r"'timeout' must be float, got True"),
    ],
)
def test_wrong_type_or_value_names_the_key_and_why(options, pattern):
    with pytest.raises(accelkit.ConfigError, match=pattern):
        accelkit.get("ddp", **options)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "settings, pattern",
    [
        ({"accumulation_steps": 0}, r"accumulation_steps must be an int >= 1, got 0"),
        ({"accumulation_steps": 2.0}, r"accumulation_steps must be an int >= 1, got 2.0"),
        ({"max_grad_norm": -1.0}, r"max_grad_norm must be a positive number or None, got -1"),
        ({"max_grad_norm": 0}, r"max_grad_norm must be a positive number or None, got 0"),
        ({"max_grad_norm": "1"}, r"max_grad_norm must be a positive number or None, got '1'"),
        ({"precision": "fp8"}, r"unknown precision 'fp8'. Valid precisions: 32-true"),
        ({"seed": "42"}, r"seed must be an int or None, got '42'"),
    ],
)
def test_wrong_training_setting_names_it(settings, pattern):
    with pytest.raises(accelkit.ConfigError, match=pattern):
        accelkit.get("cpu", **settings)


# ---- config sources ---------------------------------------------------------------------------
EXPECTED = {"timeout": 42.0, "find_unused_parameters": True, "bucket_cap_mb": 5.0}


def assert_options(accel: accelkit.Accelerator) -> None:
    options = accel.backend.options
    for key, value in EXPECTED.items():
        assert getattr(options, key) == value, key
    assert options.static_graph is False  # untouched keys keep their defaults


@dataclasses.dataclass
class MyDDPConfig:
    timeout: float = 42.0
    find_unused_parameters: bool = True
    bucket_cap_mb: float = 5.0


def test_config_from_dict():
    assert_options(accelkit.get("ddp", dict(EXPECTED)))


def test_config_from_a_dataclass():
    assert_options(accelkit.get("ddp", MyDDPConfig()))


def test_config_from_yaml_file(tmp_path):
    path = tmp_path / "ddp.yaml"
    path.write_text("timeout: 42\nfind_unused_parameters: true\nbucket_cap_mb: 5.0\n")
    assert_options(accelkit.get("ddp", path))


def test_config_from_json_file(tmp_path):
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps(EXPECTED))
    assert_options(accelkit.get("ddp", str(path)))


def test_keyword_options_override_the_config():
    accel = accelkit.get("ddp", dict(EXPECTED), timeout=7.0)
    assert accel.backend.options.timeout == 7.0
    assert accel.backend.options.bucket_cap_mb == 5.0


def test_unknown_key_in_a_yaml_file_is_named(tmp_path):
    path = tmp_path / "ddp.yml"
    path.write_text("timeout: 42\nstatic_grahp: true\n")
    with pytest.raises(accelkit.ConfigError, match=r"'static_grahp'.*Did you mean 'static_graph'"):
        accelkit.get("ddp", path)


@pytest.mark.parametrize(
    "filename, content, pattern",
    [
        ("missing.yaml", None, r"config file .*missing.yaml' does not exist"),
        ("broken.json", "{timeout: 42", r"broken.json' is not valid JSON"),
        ("list.yaml", "- timeout\n- 42\n", r"list.yaml' must hold a mapping, not list"),
    ],
)
def test_bad_config_file_says_what_is_wrong(tmp_path, filename, content, pattern):
    path = tmp_path / filename
    if content is not None:
        path.write_text(content)
    with pytest.raises(accelkit.ConfigError, match=pattern):
        accelkit.get("ddp", path)


def test_config_of_another_type_is_refused():
    with pytest.raises(accelkit.ConfigError, match="config must be a dict, a dataclass, or a path"):
        accelkit.get("cpu", 42)


def test_every_distributed_backend_refuses_a_non_positive_timeout_before_joining_a_group():
    """``timeout`` is declared and checked once (the options of ``DistributedBackend``): every
    multi-process backend installed here, plugins included, refuses 0 with the same message."""
    from accelkit import registry

    host = registry.host()
    host.ensure_loaded()
    checked = []
    for spec in host.registry.specs():
        if spec.alias_of or spec.missing_libraries():
            continue
        capabilities = getattr(spec.load_class(), "capabilities", None)
        if capabilities is None or not capabilities.distributed:
            continue
        with pytest.raises(accelkit.ConfigError, match=r"'timeout' must be > 0 seconds, got 0"):
            accelkit.describe(spec.name, timeout=0)
        checked.append(spec.name)
    assert {"ddp", "fsdp"} <= set(checked), checked
    assert not dist.is_initialized()
