"""Registration and configuration of the DeepSpeed backends: no DeepSpeed import needed.

Every error here must come out of ``accelkit.get()`` before a process group or DeepSpeed is
touched, so these tests run in pytest's own process and check that deepspeed stays unimported.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from accelkit_deepspeed import config as dsconfig

import accelkit
from accelkit import registry
from accelkit.errors import ConfigError


@pytest.fixture(autouse=True)
def deepspeed_stays_unimported():
    # Decided per test, not at collection: an earlier test module of the same pytest process
    # (bench, plan, MMEngine) may import deepspeed legitimately after this file was collected.
    was_imported = "deepspeed" in sys.modules
    yield
    if not was_imported:
        assert "deepspeed" not in sys.modules, "a config test imported deepspeed"


def test_plugin_registers_names_without_importing_deepspeed():
    host = registry.host()
    host.ensure_loaded()
    names = set(host.registry.names())
    shortcuts = {
        "deepspeed",
        "deepspeed_stage_1",
        "deepspeed_stage_2",
        "deepspeed_stage_3",
        "deepspeed_stage_3_offload",
    }
    assert shortcuts <= names
    record = next(p for p in host.plugins if p.name == "deepspeed")
    assert record.status == "loaded" and record.distribution == "accelkit-deepspeed"
    assert host.registry.get("deepspeed_stage_3_offload").defaults == {
        "zero_stage": 3,
        "offload_optimizer": "cpu",
        "offload_param": "cpu",
    }
    spec = host.registry.get("deepspeed")
    assert spec.requires == ("deepspeed",)
    # runnable as printed: this interpreter's pip, the version the plugin is tested with
    assert spec.install == f"{shlex.quote(sys.executable)} -m pip install deepspeed==0.19.8"
    report = host.env_report()
    assert report["deepspeed"] and report["accelkit-deepspeed"] == "0.1.0"


def test_describe_publishes_capabilities_and_the_dtype_table():
    info = accelkit.describe("deepspeed_stage_3")
    caps = info["capabilities"]
    assert caps["controls_precision"] and caps["controls_device"]
    assert caps["scales_loss_for_accumulation"]
    assert not caps["no_sync"] and not caps["manual_clip"]
    assert caps["offload"] and caps["distributed"]
    # from the name's options, as the running backend has them (capabilities_for): ZeRO-3
    # partitions at construction, stage 0 shards nothing
    assert caps["init_context"] == "zero.Init" and caps["sharded"]
    stage0 = accelkit.describe("deepspeed", zero_stage=0)["capabilities"]
    assert stage0["init_context"] == "device" and not stage0["sharded"]
    assert set(info["dtypes"]) == {"32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"}
    assert info["dtypes"]["bf16-true"]["master"].startswith("fp32")
    assert info["dtypes"]["bf16-mixed"]["param"] == "fp32"


def test_unknown_short_option_names_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        accelkit.get("deepspeed", zero_stag=2)
    message = str(err.value)
    assert "unknown option 'zero_stag'" in message and "Did you mean 'zero_stage'?" in message
    assert "offload_optimizer" in message and "reduce_bucket_size" in message


@pytest.mark.parametrize(
    "key, hint, kind",
    [
        ("zero_optimisation", "zero_optimization", "DeepSpeed key"),
        ("train_micro_batch_size", "train_micro_batch_size_per_gpu", "option"),
        ("offload_optimiser", "offload_optimizer", "option"),
    ],
)
def test_misspelled_config_key_suggests_short_and_native_keys(tmp_path, key, hint, kind):
    """A config whose only key is a misspelled DeepSpeed key is neither native nor short options:
    the message suggests the nearest of both and says native configs are accepted."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({key: {"stage": 3} if "zero" in key else 1}))
    for config in ({key: 1}, str(path)):
        with pytest.raises(ConfigError) as err:
            accelkit.get("deepspeed", config=config)
        message = str(err.value)
        assert f"unknown option {key!r}. Did you mean the {kind} {hint!r}?" in message, message
        assert "native DeepSpeed config" in message and "zero_optimization" in message


def test_short_option_type_and_value_errors():
    with pytest.raises(ConfigError, match="offload_optimizer"):
        accelkit.get("deepspeed", offload_optimizer="gpu")
    with pytest.raises(ConfigError, match="zero_stage"):
        accelkit.get("deepspeed", zero_stage=4)


def test_native_config_is_recognised_and_kept(tmp_path):
    native = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1000},
        "wall_clock_breakdown": False,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(native))
    for source in (native, str(path)):
        options = dsconfig.parse("deepspeed", source, {})
        assert options.ds_config == native
        built = dsconfig.build_ds_config(
            options,
            precision="32-true",
            accumulation_steps=1,
            max_grad_norm=None,
            micro_batch=2,
            client_optimizer=True,
        )
        assert built["zero_optimization"] == {"stage": 3, "stage3_max_live_parameters": 1000}
        assert built["train_micro_batch_size_per_gpu"] == 4  # the config's, not the loader's
        assert built["wall_clock_breakdown"] is False


def test_native_config_mixed_with_short_options_is_refused():
    with pytest.raises(ConfigError, match="mixes DeepSpeed's own keys"):
        accelkit.get("deepspeed", {"zero_optimization": {"stage": 2}, "offload_optimizer": "cpu"})


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({}, "32-true"),
        ({"bf16": {"enabled": True}}, "bf16-true"),
        ({"fp16": {"enabled": True}}, "16-true"),
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "bf16-mixed"),
        ({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}, "16-mixed"),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": "auto"}}, "32-true"),
    ],
)
def test_precision_none_takes_the_native_configs(sections, expected):
    native = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0, **sections}
    options = dsconfig.parse("deepspeed", native, {})
    precision, _, _ = dsconfig.reconcile("deepspeed", options, None, 1, None)
    assert precision == expected


def test_native_16_mixed_zero2_without_clipping_key_is_refused_too():
    """DeepSpeed's default gradient_clipping is 1.0: the same broken combination."""
    native = {
        "zero_optimization": {"stage": 2},
        "torch_autocast": {"enabled": True, "dtype": "fp16"},
    }
    with pytest.raises(ConfigError, match=r"default 1\.0"):
        accelkit.get("deepspeed", native)


def test_explicit_precision_that_disagrees_with_the_native_config_is_an_error():
    native = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    with pytest.raises(ConfigError, match="precision='bf16-mixed' disagrees"):
        accelkit.get("deepspeed", native, precision="bf16-mixed")
    options = dsconfig.parse("deepspeed", native, {})
    assert dsconfig.reconcile("deepspeed", options, "bf16-true", 1, None)[0] == "bf16-true"
    with pytest.raises(ConfigError, match="several precisions"):
        dsconfig.native_precision({"bf16": {"enabled": True}, "fp16": {"enabled": True}})


def test_accumulation_and_clipping_reconcile_with_the_native_config():
    native = {"gradient_accumulation_steps": 4, "gradient_clipping": 1.0}
    options = dsconfig.parse("deepspeed", native, {})
    assert dsconfig.reconcile("deepspeed", options, None, 1, None) == ("32-true", 4, 1.0)
    assert dsconfig.reconcile("deepspeed", options, None, 4, 1.0) == ("32-true", 4, 1.0)
    with pytest.raises(ConfigError, match="accumulation_steps=2 disagrees"):
        accelkit.get("deepspeed", native, accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"max_grad_norm=0\.5 disagrees"):
        accelkit.get("deepspeed", native, max_grad_norm=0.5)
    auto = dsconfig.parse(
        "deepspeed", {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}, {}
    )
    assert dsconfig.reconcile("deepspeed", auto, None, 3, 2.0) == ("32-true", 3, 2.0)
    # a native config without the key keeps DeepSpeed's default, 1.0
    silent = dsconfig.parse("deepspeed", {"zero_optimization": {"stage": 1}}, {})
    assert dsconfig.reconcile("deepspeed", silent, None, 1, None)[2] == 1.0
    assert dsconfig.reconcile("deepspeed", silent, None, 1, 0.25)[2] == 0.25
    short = dsconfig.parse("deepspeed", None, {"zero_stage": 1})  # short options: accelkit's None
    assert dsconfig.reconcile("deepspeed", short, None, 1, None)[2] is None
    off = dsconfig.parse("deepspeed", {"gradient_clipping": 0.0}, {})
    assert dsconfig.reconcile("deepspeed", off, None, 1, None)[2] is None
    with pytest.raises(ConfigError, match="disagrees"):  # the config says: no clipping
        dsconfig.reconcile("deepspeed", off, None, 1, 2.0)


def test_shortcut_preset_that_contradicts_the_native_config_fails_at_get():
    native = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=2 disagrees with zero_stage"):
        accelkit.get("deepspeed_stage_3", native)
    with pytest.raises(ConfigError, match="disagrees with overlap_comm"):
        accelkit.get(
            "deepspeed",
            {"zero_optimization": {"stage": 2, "overlap_comm": True}},
            overlap_comm=False,
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(zero_stage=2, offload_param="cpu"), "offload_param needs ZeRO stage 3"),
        (dict(zero_stage=0, offload_optimizer="cpu"), "offload_optimizer needs ZeRO stage 1"),
        (dict(zero_stage=3, offload_param="nvme"), "nvme_path"),
        (dict(zero_stage=2, precision="16-mixed", max_grad_norm=1.0), "clip the loss-scaled"),
        (dict(zero_stage=0, precision="16-true"), "ZeRO stage 0 is refused"),
        (dict(zero_stage=2, loss_scale=128.0), "apply to precision='16-true'"),
        (dict(config={"scheduler": {"type": "WarmupLR"}}), "never hands a scheduler"),
        (dict(config={"amp": {"enabled": True}}), "Apex AMP"),
    ],
)
def test_refused_combinations_fail_at_get_with_the_way_out(kwargs, message):
    config = kwargs.pop("config", None)
    with pytest.raises(ConfigError, match=message):
        accelkit.get("deepspeed", config, **kwargs)


def test_stage_zero_with_16_mixed_may_clip():
    options = dsconfig.parse("deepspeed", None, {"zero_stage": 0})
    assert dsconfig.reconcile("deepspeed", options, "16-mixed", 1, 1.0)[0] == "16-mixed"


def _build(precision="32-true", client_optimizer=True, **short):
    options = dsconfig.parse("deepspeed", short.pop("config", None), short)
    return dsconfig.build_ds_config(
        options,
        precision=precision,
        accumulation_steps=3,
        max_grad_norm=0.5,
        micro_batch=5,
        client_optimizer=client_optimizer,
    )


def test_built_config_maps_precisions_onto_deepspeed_sections():
    assert _build("bf16-mixed")["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert _build("16-mixed")["torch_autocast"] == {"enabled": True, "dtype": "float16"}
    true = _build("bf16-true")
    assert true["bf16"] == {"enabled": True} and "torch_autocast" not in true
    assert _build("16-true", loss_scale=0, initial_scale_power=12)["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
    }
    # a native section of another precision is switched off, not left on
    disabled = _build("bf16-mixed", config={"bf16": {"enabled": "auto"}})
    assert disabled["bf16"] == {"enabled": False}
    plain = _build("32-true")
    assert not any(k in plain for k in ("bf16", "fp16", "torch_autocast"))


def test_built_config_settings_and_defaults():
    built = _build(zero_stage=2, offload_optimizer="cpu", reduce_bucket_size=10**6)
    assert built["gradient_accumulation_steps"] == 3
    assert built["gradient_clipping"] == 0.5
    assert built["train_micro_batch_size_per_gpu"] == 5
    assert built["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 10**6,
        "offload_optimizer": {"device": "cpu"},
    }
    assert built["zero_allow_untested_optimizer"] is True
    assert built["zero_force_ds_cpu_optimizer"] is False  # the user's torch optimizer, offloaded
    assert _build(client_optimizer=False).get("zero_force_ds_cpu_optimizer") is None
    assert _build()["zero_optimization"]["stage"] == dsconfig.DEFAULT_STAGE == 2
    assert _build(config={"optimizer": {"type": "AdamW"}})["zero_optimization"]["stage"] == 0


@pytest.mark.parametrize("reference", ["dsk_reference.py", "dsk_gather.py", "dsk_rawckpt.py"])
def test_the_references_import_nothing_from_accelkit(reference):
    """Raw DeepSpeed / raw PyTorch references and the independent gathers stay independent."""
    import ast
    from pathlib import Path

    source = Path(__file__).with_name(reference).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert "torch" in imported  # the walk sees imports at all
    assert not any(name.split(".")[0] in ("accelkit", "accelkit_deepspeed") for name in imported)
    # nor a test helper that does (dsk_gather is the only sibling they may use)
    assert not imported & {"dsk_accel", "dsk_ckpt", "dsk_checks", "dsk_worker"}, imported
