"""The ColossalAI backends pass accelkit's conformance suite; under tensor parallelism
``gather_for_metrics`` returns each sample once and ``all_reduce`` counts each replica once.

``colossalai_gemini`` needs CUDA (GPU-marked). ``colossalai_hybrid`` trains Shardformer models
only, so its contract runs on a tiny Llama (tp_size=1: the portable checkpoint refuses
tensor-parallel layouts, so tp_size=2 is checked here for what it promises, the data-parallel
group).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("colossalai")

from accelkit.testing import run_ranks
from accelkit.testing.conformance import GLOBAL_BATCH, backend_contract


class TinyLlamaWorkload:
    """A 2-layer Llama from a config (what Shardformer shards), next-token loss, Adam."""

    def build(self) -> Any:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(1234)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
        return LlamaForCausalLM(config)

    def optimizer(self, params: Any) -> Any:
        import torch

        return torch.optim.Adam(params, lr=1e-2)

    def batch(self, index: int) -> dict[str, Any]:
        import torch

        generator = torch.Generator().manual_seed(1000 + index)
        return {"input_ids": torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=generator)}

    def loss(self, model: Any, batch: dict[str, Any]) -> Any:
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids).loss.float()


TestColossalDdpContract = backend_contract(
    "colossalai_ddp",
    world_sizes=(1, 2),
    slow=True,  # a second configuration of the Booster: colossalai_zero is its default-tier case
)
TestColossalZeroContract = backend_contract(
    "colossalai_zero", options={"stage": 2}, world_sizes=(1, 2)
)
TestColossalGeminiContract = backend_contract(
    "colossalai_gemini",
    precision="bf16-true",  # Gemini keeps bf16/fp16 weights only; its contract runs in bf16
    world_sizes=(1, 2),
    resume_world_sizes=(1,),
    gpu=True,
)
TestColossalHybridContract = backend_contract(
    "colossalai_hybrid",
    options={"tp_size": 1},
    world_sizes=(2,),
    resume_world_sizes=(1,),
    workload="test_colossalai_conformance:TinyLlamaWorkload",
    slow=True,  # the tp_size=2 gather test below is the hybrid backend's default-tier case
)


# ---- gather_for_metrics on the data-parallel group -------------------------------------------
def gather_worker(tp_size: int) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import accelkit

    accel = accelkit.get("colossalai_hybrid", {"tp_size": tp_size})
    loader = accel.setup_dataloader(
        DataLoader(TensorDataset(torch.arange(10)), batch_size=4), shuffle=False
    )
    tensors, objects = [], []
    for (index,) in loader:
        tensors.extend(accel.gather_for_metrics(index).tolist())
        objects.extend(accel.gather_for_metrics([f"s{i}" for i in index.tolist()]))
    backend = accel.backend
    out = {
        "tensors": tensors,
        "objects": objects,
        # one count per data-parallel replica: the tp ranks of a replica must not add up twice
        "sum_of_ones": accel.all_reduce(torch.ones(()), "sum").item(),
        "dp": [backend.data_parallel_rank, backend.data_parallel_world_size],
    }
    accel.end_training()
    return out


@pytest.mark.slow  # 2 ranks under Shardformer: 15-35 s
@pytest.mark.parametrize("tp_size", [2, 1])
def test_gather_for_metrics_returns_each_sample_once_under_tensor_parallelism(tp_size):
    # tp_size=2 on 2 ranks: one data-parallel replica, both ranks read all 10 samples; tp_size=1:
    # two replicas of 5 samples each. Either way the gathered epoch is the dataset once.
    ranks = run_ranks("test_colossalai_conformance:gather_worker", {"tp_size": tp_size})
    for rank, result in enumerate(ranks):
        assert result["dp"] == ([0, 1] if tp_size == 2 else [rank, 2])
        assert sorted(result["tensors"]) == list(range(10)), result["tensors"]
        assert sorted(result["objects"]) == sorted(f"s{i}" for i in range(10))
        assert result["sum_of_ones"] == (1 if tp_size == 2 else 2)
