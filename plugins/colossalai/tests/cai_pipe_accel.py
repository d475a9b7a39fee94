"""The accelkit side of test_colossalai_pipeline.py: ``accelkit.get("colossalai_hybrid",
pp=2, ...)``, ``accel.forward_backward`` then ``accel.step()``, on its own tiny Llama and data
(the same configuration as cai_pipe_raw.py, written out again)."""

from __future__ import annotations

from typing import Any

import torch

import accelkit

STEPS, BATCH, SEQ, VOCAB = 2, 8, 16, 64


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def train(
    schedule: str = "1F1B", microbatches: int = 4, save_to: str | None = None
) -> dict[str, Any]:
    accel = accelkit.get(
        "colossalai_hybrid",
        pp=2,
        pipeline=dict(schedule=schedule, microbatches=microbatches),
        track_grad_norm=True,
    )
    net = tiny_llama()
    model, optimizer = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    result: dict[str, Any] = {"losses": [], "norms": []}
    ids = batches()[0]
    try:
        model(input_ids=ids, labels=ids)
    except Exception as err:  # the test asserts on the message
        result["call_error"] = f"{type(err).__name__}: {err}"
    for ids in batches():
        loss = accel.forward_backward(model, input_ids=ids, labels=ids)
        accel.step()
        result["losses"].append(float(loss))
        result["norms"].append(float(accel.grad_norm))
    result["weights"] = {
        name: value.detach().reshape(-1).tolist()
        for name, value in accel.unwrap(model).state_dict().items()
    }
    result["dp"] = [accel.backend.data_parallel_rank, accel.backend.data_parallel_world_size]
    if save_to:
        accel.save(save_to, {"model": model, "optimizer": optimizer})
        result["saved"] = colossalai_view(accel.backend)
    return result


def colossalai_view(backend: Any) -> dict[str, list[float]]:
    """This stage's weights and momentum buffers as ColossalAI holds them: its Shardformer
    module's ``state_dict`` and its optimizer wrapper's torch state, by parameter name."""
    module = backend.model.unwrap()
    inner = backend.optimizer
    while not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optim
    out = {f"model/{k}": v.reshape(-1).tolist() for k, v in module.state_dict().items()}
    for name, param in module.named_parameters():
        out[f"optimizer/momentum_buffer/{name}"] = (
            inner.state[param]["momentum_buffer"].reshape(-1).tolist()
        )
    return out


def load_fsdp(path: str) -> dict[str, Any]:
    """The checkpoint into ``fsdp`` on 2 ranks (no pipeline), gathered back whole through
    torch's own ``get_model_state_dict`` / ``get_optimizer_state_dict``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    accel = accelkit.get("fsdp", device="cpu")
    net = tiny_llama()
    torch.manual_seed(1)
    for param in net.parameters():  # other values: everything must come from the checkpoint
        param.data.normal_()
    model, optimizer = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    accel.load(path, {"model": model, "optimizer": optimizer})
    inner = accel.unwrap(model)
    torch_opt = optimizer
    while not isinstance(torch_opt, torch.optim.Optimizer):
        torch_opt = torch_opt.optimizer
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(inner, options=options)
    # full and offloaded: rank 0 holds everything, the others get empty dicts
    state = get_optimizer_state_dict(inner, torch_opt, options=options).get("state", {})
    out = {f"model/{k}": v.reshape(-1).tolist() for k, v in weights.items()}
    for name, per in state.items():
        out[f"optimizer/momentum_buffer/{name}"] = per["momentum_buffer"].reshape(-1).tolist()
    return out
