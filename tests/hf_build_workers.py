"""Workers of tests/test_hf_build.py: a Transformers GPT-2 or Llama-shaped model built from a
config with ``accel.init_module()``, filled with ``accel.load_pretrained`` from its own
``save_pretrained`` output, trained a few steps and saved. Nothing is downloaded.

The plain-PyTorch side (:func:`reference_run`) imports nothing from accelkit."""

from __future__ import annotations

from typing import Any

import torch

#: small configs of the two shapes: Conv1D, tied embeddings and a causal-mask buffer (GPT-2);
#: rotary buffers, RMSNorm, grouped KV heads and an untied head (Llama)
CONFIGS: dict[str, dict[str, Any]] = {
    # no dropout: the plain run on one process draws other masks than two ranks do
    "gpt2": dict(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "llama": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ),
}
STEPS = 3
LR = 1e-3


def make_config(kind: str) -> Any:
    from transformers import GPT2Config, LlamaConfig

    return (GPT2Config if kind == "gpt2" else LlamaConfig)(**CONFIGS[kind])


def batch(kind: str) -> torch.Tensor:
    """The global batch: 4 sequences of 16 tokens (each of 2 ranks takes 2 of them)."""
    vocab = CONFIGS[kind]["vocab_size"]
    return torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(3))


def write_pretrained(kind: str, directory: str, seed: int = 0) -> None:
    """What a user downloads: ``save_pretrained`` in several shards, with its config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind))
    model.save_pretrained(directory, max_shard_size="100KB")


def reference_run(kind: str, directory: str, lr: float = LR) -> dict[str, Any]:
    """Plain PyTorch + Transformers on one process, the whole batch: the losses of the same
    fine-tuning run, and the logits of the pretrained model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    tokens = batch(kind)
    with torch.no_grad():
        logits = model.eval()(tokens).logits
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(STEPS):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "logits": logits.tolist()}


def _local(tensor: Any) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _no_full_copy(model: torch.nn.Module) -> list[str]:
    """The parameters this rank holds whole after the build (1-D ones are small and allowed):
    none on a meta (fsdp) or partitioned (ZeRO-3) build."""
    held = []
    for name, param in model.named_parameters():
        if param.dim() <= 1 or param.is_meta:
            continue
        if getattr(param, "ds_numel", None) is not None and param.numel() < param.ds_numel:
            continue
        held.append(name)
    return held


def fine_tune_job(
    kind: str,
    directory: str,
    backend: str,
    options: dict | None = None,
    save: str | None = None,
    shim_path: str | None = None,
) -> dict[str, Any]:
    """Build inside ``init_module()``, check the initialisation, load, train, save."""
    import sys

    from transformers import AutoModelForCausalLM

    import accelkit

    if shim_path:
        sys.path.insert(0, shim_path)
        import fairscale_cpu_shim

        fairscale_cpu_shim.apply()
    accel = accelkit.get(backend, seed=0, **(options or {}))
    with accel.init_module():
        model = AutoModelForCausalLM.from_config(make_config(kind))
    out: dict[str, Any] = {"held_whole_after_build": _no_full_copy(model)}
    model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    inner = accel.unwrap(model)
    out["tied"] = inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
    out["buffers"] = {
        n.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", ""): b.cpu().tolist()
        for n, b in inner.named_buffers()
    }
    initial = accel.full_state_dict(model)
    out["initial"] = {
        name: {"mean": t.float().mean().item(), "std": t.float().std().item()}
        for name, t in initial.items()
    }
    del initial
    accel.load_pretrained(model, directory)
    loaded = accel.full_state_dict(model)
    out["loaded"] = {name: t.detach().cpu().tolist() for name, t in loaded.items()}
    del loaded
    tokens = batch(kind)
    with torch.no_grad():
        model.eval()
        out["logits"] = _local(model(tokens).logits).float().cpu().tolist()
        model.train()
    mine = tokens.chunk(accel.world_size)[accel.rank]
    losses = []
    for _ in range(STEPS):
        loss = model(mine, labels=mine).loss
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(_local(loss).item())
    out["losses"] = losses
    with torch.no_grad():
        model.eval()
        out["trained_logits"] = _local(model(tokens).logits).float().cpu().tolist()
    if save:
        accel.save(save, {"model": model, "optimizer": opt})
    accel.end_training()
    return out


def build_failure_job(backend: str, case: str) -> str:
    """A build that must fail at ``setup`` with a message naming what to do."""
    from transformers import AutoModelForCausalLM

    import accelkit

    accel = accelkit.get(backend, seed=0, **({"device": "cpu"} if backend == "fsdp" else {}))
    with accel.init_module():
        model = AutoModelForCausalLM.from_config(make_config("gpt2"))
        if case == "uninitialised":
            # a 2-D weight that neither a reset_parameters() nor GPT-2's _init_weights writes
            model.transformer.extra = _Gate()
    try:
        accel.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    except Exception as err:  # the message is what the test checks
        return f"{type(err).__name__}: {err}"
    finally:
        accel.end_training()
    return "no error"


class _Gate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.ones(4, 4))
