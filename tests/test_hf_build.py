"""A Transformers model built inside ``accel.init_module()`` (fsdp: meta parameters; ZeRO-3:
partitioned at construction), loaded from its own ``save_pretrained`` output, fine-tuned and
exported with ``accelkit convert --to hf``, on every backend (docs/fine-tuning.md).

Each run is checked against plain Transformers on one process (tests/hf_build_workers.py,
``reference_run``): the initial weights follow Transformers' initialisation, the loaded weights
and the logits are the saved model's bit for bit, the losses of 3 AdamW steps match within
``LOSS_RTOL``, and ``from_pretrained`` of the export gives the trained model's logits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accelkit
from accelkit.testing import run_ranks

pytest.importorskip("transformers")

from hf_build_workers import (
    fine_tune_job,
    make_config,
    reference_run,
    write_pretrained,
)

HERE = Path(__file__).parent
#: per-step relative difference of the losses against the plain run. Measured floor (2 ranks,
#: gloo, fp32, the same on ddp, fsdp, ZeRO-2/3, colossalai_zero, fairscale_oss/fsdp): 2.6e-7 on
#: GPT-2, 5.3e-8 on Llama (the mean of two half-batch losses against one whole-batch loss, and
#: the order of the gradient reduction); 0 on cpu. Ten times the larger floor.
LOSS_RTOL = 3e-6
#: the initial weights' std against Transformers' own initialisation of the same config
INIT_STD_RTOL = 0.1
SHARDED_BUILDS = {"fsdp", "deepspeed_stage_3"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    out = {}
    for kind in ("gpt2", "llama"):
        directory = tmp_path_factory.mktemp(kind)
        write_pretrained(kind, str(directory))
        assert len(list(directory.glob("model-*.safetensors"))) > 2  # really sharded
        out[kind] = (str(directory), reference_run(kind, str(directory)))
    return out


def _reference_model(kind: str, directory: str | None = None):
    from transformers import AutoModelForCausalLM

    if directory is not None:
        return AutoModelForCausalLM.from_pretrained(directory)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(kind))


def _loss_rdiff(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def _run(kind, backend, sources, tmp_path, nproc, options=None):
    directory, _ = sources[kind]
    save = str(tmp_path / "ckpt")
    kwargs = {"kind": kind, "directory": directory, "backend": backend, "save": save}
    if options:
        kwargs["options"] = options
    if backend.endswith("_shim"):
        kwargs["backend"] = backend.removesuffix("_shim")
        kwargs["shim_path"] = str(HERE.parent / "plugins" / "fairscale" / "tests")
    if nproc == 1:
        return [fine_tune_job(**kwargs)], save
    env = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    return run_ranks(
        "hf_build_workers:fine_tune_job", kwargs, nproc=nproc, timeout=420, path=[HERE], env=env
    ), save


def check_run(kind, backend, sources, ranks, save, tmp_path):
    directory, reference = sources[kind]
    base = backend.removesuffix("_shim")
    initial_ref = _reference_model(kind)
    loaded_ref = _reference_model(kind, directory).state_dict()
    for result in ranks:
        # built without a whole weight on any rank, ties and non-persistent buffers right
        if base in SHARDED_BUILDS:
            assert result["held_whole_after_build"] == []
        assert result["tied"] == (kind == "gpt2")
        for name, buffer in initial_ref.named_buffers():
            assert torch.equal(torch.tensor(result["buffers"][name]), buffer), name
        # initialised as Transformers initialises (scaled c_proj, norms at one, zero biases)
        for name, want in initial_ref.state_dict().items():
            if name not in result["initial"]:
                continue  # a buffer, or a tied name stored once
            got = result["initial"][name]
            ref_std = want.float().std().item()
            if ref_std == 0:
                assert got["std"] == 0 and got["mean"] == want.float().mean().item(), name
            else:
                assert abs(got["std"] - ref_std) < INIT_STD_RTOL * ref_std, (name, got, ref_std)
        # loaded: the saved weights bit for bit, and their logits
        for name, want in loaded_ref.items():
            assert torch.equal(torch.tensor(result["loaded"][name]), want), name
        assert result["logits"] == reference["logits"]
    # fine-tuned: the mean of the ranks' losses (equal halves of the batch) against the plain run
    losses = [sum(step) / len(ranks) for step in zip(*(r["losses"] for r in ranks))]
    print(f"{kind} {backend}: loss rdiff {_loss_rdiff(losses, reference['losses']):.3g}")
    assert _loss_rdiff(losses, reference["losses"]) < LOSS_RTOL, (losses, reference["losses"])
    # exported: from_pretrained of `accelkit convert --to hf` gives the trained model's logits
    exported = tmp_path / "hf"
    command = ["convert", save, str(exported), "--to", "hf", "--config", directory]
    subprocess.run(
        [sys.executable, "-m", "accelkit.cli", *command],
        check=True,
        capture_output=True,
    )
    again = _reference_model(kind, str(exported)).eval()
    with torch.no_grad():
        from hf_build_workers import batch

        logits = again(batch(kind)).logits
    assert logits.tolist() == ranks[0]["trained_logits"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cpu_builds_loads_fine_tunes_and_exports(kind, sources, tmp_path):
    ranks, save = _run(kind, "cpu", sources, tmp_path, nproc=1)
    check_run(kind, "cpu", sources, ranks, save, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,backend",
    [
        ("gpt2", "fsdp"),
        ("llama", "fsdp"),
        ("gpt2", "deepspeed_stage_3"),
        ("llama", "deepspeed_stage_3"),
        ("gpt2", "deepspeed_stage_2"),
        ("llama", "deepspeed_stage_2"),
        ("gpt2", "ddp"),
        ("llama", "ddp"),
        ("gpt2", "colossalai_zero"),
        ("gpt2", "fairscale_oss"),
        ("gpt2", "fairscale_fsdp_shim"),
    ],
)
def test_two_ranks_build_load_fine_tune_and_export(kind, backend, sources, tmp_path):
    pytest.importorskip(backend.split("_")[0] if "_" in backend else "torch")
    options = {"device": "cpu"} if backend == "fsdp" else None
    ranks, save = _run(kind, backend, sources, tmp_path, nproc=2, options=options)
    check_run(kind, backend, sources, ranks, save, tmp_path)


# ---- negative twins: each check above can fail -------------------------------------------------
def test_the_loss_tolerance_separates_a_different_run(sources):
    """A learning rate 1% off moves the losses far beyond LOSS_RTOL."""
    directory, reference = sources["gpt2"]
    other = reference_run("gpt2", directory, lr=1.01e-3)
    assert _loss_rdiff(other["losses"], reference["losses"]) > 100 * LOSS_RTOL


def test_the_weights_check_sees_other_weights(sources, tmp_path):
    """A model loaded from another seed's files fails the bit-for-bit check of check_run."""
    write_pretrained("gpt2", str(tmp_path / "other"), seed=1)
    directory, _ = sources["gpt2"]
    mine = _reference_model("gpt2", directory).state_dict()
    other = _reference_model("gpt2", str(tmp_path / "other")).state_dict()
    assert not torch.equal(
        mine["transformer.h.0.attn.c_attn.weight"], other["transformer.h.0.attn.c_attn.weight"]
    )


def test_the_init_check_sees_torch_default_init(sources):
    """torch's own init (kaiming Linear/Conv1D, N(0, 1) embeddings) is outside INIT_STD_RTOL
    of Transformers' N(0, 0.02)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(make_config("llama"))
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    want = _reference_model("llama").state_dict()["model.embed_tokens.weight"].std().item()
    got = model.state_dict()["model.embed_tokens.weight"].std().item()
    assert abs(got - want) > INIT_STD_RTOL * want


def _cpu_built(kind: str, hidden: int | None = None):
    from transformers import AutoModelForCausalLM

    config = make_config(kind)
    if hidden:
        config = type(config)(**dict(config.to_dict(), n_embd=hidden))
    accel = accelkit.get("cpu", seed=0)
    with accel.init_module():
        model = AutoModelForCausalLM.from_config(config)
    model, _ = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return accel, model, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_missing_shard_fails_naming_it_and_changes_nothing(sources, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(sources["gpt2"][0], target)
    shard = sorted(target.glob("model-*.safetensors"))[-1]
    shard.unlink()
    accel, model, before = _cpu_built("gpt2")
    with pytest.raises(accelkit.CheckpointError, match=f"names {shard.name}, which"):
        accel.load_pretrained(model, target)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_wrong_shape_fails_before_anything_is_written(sources):
    accel, model, before = _cpu_built("gpt2", hidden=128)
    with pytest.raises(accelkit.CheckpointError, match=r"has shape \[.*\], the target has"):
        accel.load_pretrained(model, sources["gpt2"][0])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_flipped_byte_in_an_index_fails_clearly(sources, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(sources["gpt2"][0], target)
    index = target / "model.safetensors.index.json"
    text = index.read_text()
    index.write_text(text.replace("{", "[", 1))
    accel, model, before = _cpu_built("gpt2")
    with pytest.raises(accelkit.CheckpointError, match="not a safetensors index"):
        accel.load_pretrained(model, target)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    json.loads(text)  # the original was valid


@pytest.mark.slow
def test_fsdp_names_a_weight_no_initialisation_writes():
    ranks = run_ranks(
        "hf_build_workers:build_failure_job",
        {"backend": "fsdp", "case": "uninitialised"},
        nproc=2,
        timeout=300,
        path=[HERE],
    )
    for message in ranks:
        assert message.startswith("ConfigError:") and "transformer.extra.gate" in message
        assert "transformer.h.0" not in message
