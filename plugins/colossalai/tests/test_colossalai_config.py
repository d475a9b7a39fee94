"""Registration, options and refusals of the ColossalAI backends, in this process (no torchrun).

Most refusals happen before ColossalAI's Booster is imported; the last test builds
``colossalai_zero`` on a process group of one (the Booster import takes ~10 s here).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("colossalai")

import accelkit
from accelkit.errors import ConfigError, UnsupportedError

NAMES = ("colossalai_ddp", "colossalai_zero", "colossalai_gemini", "colossalai_hybrid")


def test_backends_are_registered_by_the_entry_point():
    from accelkit import registry

    host = registry.host()
    for name in NAMES:
        spec = host.resolve(name)
        assert spec.plugin == "accelkit-colossalai" or "colossalai" in spec.plugin
        assert spec.requires == ("colossalai",)


def test_importing_the_plugin_imports_no_colossalai():
    code = (
        "import sys, accelkit_colossalai.plugin, accelkit_colossalai.options;"
        "from accelkit import registry; registry.host().resolve('colossalai_zero');"
        "assert 'colossalai' not in sys.modules, 'colossalai imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_env_report_names_colossalai():
    from accelkit_colossalai import plugin

    report = plugin.accelkit_env_report()
    assert report["colossalai"] == "0.5.0"
    assert report["accelkit-colossalai"] is not None


@pytest.mark.parametrize(
    "name,kwargs,message",
    [
        ("colossalai_zero", {"stage": 3}, "stage"),
        ("colossalai_zero", {"bogus": 1}, "bogus"),
        ("colossalai_zero", {"plugin_kwargs": {"precision": "fp16"}}, "plugin_kwargs may not set"),
        ("colossalai_zero", {"plugin_kwargs": {"max_norm": 1.0}}, "max_grad_norm"),
        ("colossalai_hybrid", {"pp_size": 2}, "execute_pipeline"),
        ("colossalai_gemini", {"placement_policy": "nowhere"}, "placement_policy"),
    ],
)
def test_bad_options_fail_at_get(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        accelkit.get(name, precision="bf16-true", **kwargs)


def test_gemini_has_no_fp32_mode():
    with pytest.raises(ConfigError, match="no fp32 mode"):
        accelkit.get("colossalai_gemini")
    with pytest.raises(ConfigError, match="does not support precision '32-true'"):
        accelkit.get("colossalai_gemini", precision="32-true")


def test_hybrid_zero_needs_half_precision():
    with pytest.raises(ConfigError, match="zero_stage=1 needs precision"):
        accelkit.get("colossalai_hybrid", zero_stage=1)


def test_zero_refuses_16_mixed():
    with pytest.raises(ConfigError, match="16-mixed"):
        accelkit.get("colossalai_zero", precision="16-mixed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU refusals")
def test_cpu_refusals_name_the_reason():
    with pytest.raises(ConfigError, match="HybridAdam"):
        accelkit.get("colossalai_gemini", precision="bf16-true")
    with pytest.raises(ConfigError, match=r"16-true.*needs CUDA"):
        accelkit.get("colossalai_zero", precision="16-true")
    with pytest.raises(ConfigError, match="CUDA streams"):
        accelkit.get("colossalai_zero", overlap_communication=True)


def test_capabilities_follow_the_plugin():
    zero = accelkit.describe("colossalai_zero")["capabilities"]
    assert zero["manual_clip"] is False and zero["sharded"] is True
    assert zero["controls_precision"] is True
    ddp = accelkit.describe("colossalai_ddp")["capabilities"]
    assert ddp["no_sync"] is True and ddp["manual_clip"] is True
    assert ddp["controls_precision"] is False
    gemini = accelkit.describe("colossalai_gemini")
    assert set(gemini["dtypes"]) == {"bf16-true", "16-true"}
    assert gemini["capabilities"]["init_context"] == "lazy"


def test_hybrid_capabilities_follow_tp_and_zero():
    """Built without launching: tp_size > 1 has a portable checkpoint only without ZeRO (ZeRO
    over tensor-parallel pieces is refused at save), ZeRO-2 has no no_sync."""
    from accelkit_colossalai.backend import ColossalHybridBackend
    from accelkit_colossalai.options import HybridOptions

    from accelkit.backend import Settings

    def caps(**options):
        return ColossalHybridBackend("colossalai_hybrid", HybridOptions(**options), Settings())

    tp2, tp1, zero2 = caps(tp_size=2).capabilities, caps().capabilities, caps(zero_stage=2)
    assert tp2.portable_checkpoint is True and tp2.sharded is True
    tp2_zero1 = caps(tp_size=2, zero_stage=1).capabilities
    assert tp2_zero1.portable_checkpoint is False and tp2_zero1.sharded is True
    assert tp1.portable_checkpoint is True and tp1.no_sync is True and tp1.sharded is False
    assert zero2.capabilities.no_sync is False and zero2.capabilities.portable_checkpoint is True


@pytest.mark.parametrize(
    "name,options",
    [
        ("colossalai_hybrid", {"tp_size": 2}),
        ("colossalai_hybrid", {"tp_size": 2, "zero_stage": 1}),
        ("colossalai_hybrid", {"zero_stage": 2}),
        ("colossalai_hybrid", {}),
        ("colossalai_zero", {"stage": 2}),
        ("colossalai_zero", {"stage": 1}),
    ],
)
def test_describe_and_the_running_backend_report_the_same_capabilities(name, options):
    """One classmethod (capabilities_for) answers for both, so describe() cannot disagree with
    the backend built from the same options (issue 20: it reported the class defaults)."""
    import dataclasses

    from accelkit.backend import Settings
    from accelkit.registry import host

    spec = host().resolve(name)
    cls = spec.load_class()
    parsed = cls.parse_config(name, None, {**spec.defaults, **options})
    built = cls(name, parsed, Settings(precision="bf16-true"))  # not launched: no group needed
    described = accelkit.describe(name, **options)["capabilities"]
    assert described == dataclasses.asdict(built.capabilities)
    if options == {"tp_size": 2}:
        assert described["portable_checkpoint"] is True and described["sharded"] is True
    if options == {"tp_size": 2, "zero_stage": 1}:
        assert described["portable_checkpoint"] is False
    if options.get("stage") == 2 or options.get("zero_stage") == 2:
        assert described["no_sync"] is False


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU run")
def test_zero_on_one_process_trains_and_refuses_manual_clipping():
    accel = accelkit.get("colossalai_zero", stage=1, accumulation_steps=2)
    assert accel.capabilities.no_sync is True  # stage 1
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(opt, torch.optim.Optimizer)
    sched = accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    before = [p.detach().clone() for p in accel.unwrap(model).parameters()]
    for _ in range(4):  # 2 windows of 2
        loss = model(torch.randn(4, 3)).pow(2).mean()
        accel.backward(loss)
        accel.step()
    assert accel.applied_steps == 2
    assert sched.get_last_lr() == [0.1 * 0.25]  # stepped once per applied step
    after = list(accel.unwrap(model).parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(UnsupportedError, match="partitions gradients"):
        accel.clip_grad_norm(1.0)
    second = torch.nn.Linear(3, 1)  # a second model (the first again is refused sooner)
    with pytest.raises(UnsupportedError, match="one model per Booster"):
        accel.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU run")
def test_hybrid_init_module_is_lazy_and_setup_materializes():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    accel = accelkit.get("colossalai_hybrid", tp_size=1)
    assert accel.capabilities.init_context == "lazy"
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
    with accel.init_module():
        net = LlamaForCausalLM(config)
    assert type(next(net.parameters())).__name__ == "LazyTensor"
    model, _opt = accel.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    params = list(accel.unwrap(model).parameters())
    assert all(type(p) is torch.nn.Parameter and p.numel() for p in params)
    ids = torch.randint(0, 128, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    accel.backward(loss)
    assert accel.step()
    assert torch.isfinite(loss.detach())
