"""Raw ColossalAI pipeline training for test_colossalai_pipeline.py. Imports nothing from accelkit.

``HybridParallelPlugin(pp_size=2)`` on a tiny Llama (4 decoder layers) as ColossalAI's docs show
it: ``booster.execute_pipeline(iter([batch]), model, criterion, optimizer)`` then
``optimizer.step()`` / ``zero_grad()``. On the CPU ColossalAI 0.5.0 needs the workaround below
(written here independently of the plugin's own, so the reference shares no code with the code
under test): no-op streams, torch's CPU generator, and ``torch.distributed.is_hccl_available``,
which its pipeline p2p asks and torch 2.13 lacks. Returns the loss of each step (the last stage
only has it) and the final weights this rank holds, by name.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

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


def _cpu_workaround() -> None:
    if not hasattr(torch.distributed, "is_hccl_available"):
        torch.distributed.is_hccl_available = lambda: False
    from colossalai.accelerator import api
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    class Accel(CpuAccelerator):
        def synchronize(self, device=None):
            pass

        def Stream(self, *args, **kwargs):
            return None

        def current_stream(self, device=None):
            return None

        def default_stream(self, device=None):
            return None

        def stream(self, stream_):
            return contextlib.nullcontext()

        def get_rng_state(self, device=None):
            return torch.get_rng_state()

        def set_rng_state(self, new_state, device=None):
            torch.set_rng_state(new_state)

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def empty_cache(self):
            pass

    api.set_accelerator(Accel())


def train(style: str = "1f1b", microbatches: int = 4) -> dict[str, Any]:
    dist.init_process_group("gloo")
    _cpu_workaround()
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin

    model = tiny_llama()
    plugin = HybridParallelPlugin(
        tp_size=1,
        pp_size=2,
        num_microbatches=microbatches,
        precision="fp32",
        zero_stage=0,
        pp_style=style,
        num_model_chunks=2 if style == "interleaved" else 1,
        overlap_p2p=False,  # the interleaved schedule hangs on gloo with True
        overlap_communication=False,
    )
    booster = Booster(plugin=plugin)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, *_ = booster.boost(model, optimizer)
    losses = []
    for ids in batches():
        out = booster.execute_pipeline(
            iter([{"input_ids": ids, "labels": ids}]),
            model,
            lambda outputs, inputs: outputs.loss,
            optimizer,
            return_loss=True,
        )
        optimizer.step()
        optimizer.zero_grad()
        loss = out.get("loss")
        losses.append(None if loss is None else float(loss))
    held = {
        name: value.detach().reshape(-1).tolist()
        for name, value in model.unwrap().state_dict().items()
    }
    return {"losses": losses, "weights": held}
