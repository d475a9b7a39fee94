"""The models ``accelkit bench`` and ``accelkit plan`` run: built-in shapes and the user's own.

A :class:`Workload` is a model factory plus a synthetic batch factory. The model's forward takes
the batch (positional arguments, or keyword arguments for a dict) and returns the loss; a model
that returns something else gets a stand-in loss (see :func:`loss_of`).

Built-in workloads (``bench/peers.py`` trains the same shapes under the peer frameworks):

- ``mlp``: 4 x (Linear 256 -> 256, ReLU), MSE loss. So little compute per step that the
  framework's own per-step cost shows.
- ``tiny-gpt``: a 2-layer, 64-wide GPT decoder on 64 tokens (vocab 512), for the CPU.
- ``gpt2-small``: a GPT-2-small-shaped decoder, 12 layers, width 768, 12 heads, sequence 1024,
  vocabulary 50304 (163,109,376 parameters with an untied head; 123,689,472 without the token
  and position embeddings, the count MFU uses).
- ``gpt-2048``: 12 layers, width 2048, 16 heads, sequence 2048, vocabulary 50304 (about 815M
  parameters, 707M without the token and position embeddings): wide enough that float8 pays
  (``--precision bf16-mixed,fp8-mixed``); AdamW at batch 8 takes about 34 GiB (accelkit plan).
- ``package.module:factory``: the user's model. ``factory()`` returns a :class:`Workload`, a
  ``(model, make_batch)`` pair, or a model alone, in which case ``make_batch`` is looked up in
  the same module (or given with ``--batch-factory package.module:function``).
  ``make_batch(batch_size, generator)`` returns one batch of CPU tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: make_batch(batch_size, generator) -> one batch (a tensor, a tuple/list, or a dict), on the CPU
BatchFactory = Callable[[int, torch.Generator], Any]


@dataclass
class Workload:
    """A model to train and how to feed it."""

    name: str
    #: builds the model (fp32) on the current default device; called inside ``init_module()``
    build: Callable[[], nn.Module]
    make_batch: BatchFactory
    #: tokens per sample for language models (tokens/s are reported), else None (samples/s)
    seq_len: int | None = None
    #: training FLOPs per sample (forward + backward) from the non-embedding parameter count
    #: (see :func:`count_params`); None: 6 x that count per sample, one multiply-add per
    #: parameter in the forward and two in the backward (exact for an MLP, not for convs)
    flops_per_sample: Callable[[int], float] | None = None
    default_batch: int = 8
    description: str = ""
    #: how ``flops_per_sample`` counts, in words, ``{n}`` standing for the non-embedding
    #: parameter count (stated in the result JSON and under the table)
    flops_formula: str = ""

    def training_flops_per_sample(self, non_embedding_params: int) -> float:
        """Training FLOPs of one sample, from the parameters that do matmul work."""
        if self.flops_per_sample is not None:
            return float(self.flops_per_sample(non_embedding_params))
        return 6.0 * non_embedding_params

    def describe_flops(self, non_embedding_params: int) -> str:
        """The accounting in words, with the count filled in."""
        if self.flops_formula:
            return self.flops_formula.format(n=f"{non_embedding_params:,}")
        if self.flops_per_sample is None:
            return f"per sample = 6 x {non_embedding_params:,} non-embedding parameters"
        return "per sample: the workload's own flops_per_sample"


@dataclass(frozen=True)
class ParamCount:
    """A model's parameters split by whether they do matmul work, for MFU.

    An embedding lookup reads one row per token and multiplies nothing, so the weights of
    ``nn.Embedding``/``nn.EmbeddingBag`` modules are left out of the ``6 N`` count (the usual
    accounting: Kaplan et al. 2020, PaLM appendix B). A weight that is both an embedding and
    another module's parameter (an output head tied to the token embedding) does matmul work in
    the head: it is counted once, as matmul work (``tied``). A tie made without a module (a
    functional ``F.linear(x, embedding.weight)``) cannot be seen and is counted as an embedding.
    """

    total: int
    #: weights of embedding modules that no other module uses: lookups only
    embedding: int
    #: embedding weights that another module also uses (tied head), counted as matmul work
    tied: int = 0

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_params(model: nn.Module) -> ParamCount:
    """Count ``model``'s parameters (shared ones once) and its lookup-only embedding weights."""
    unique = {id(p): p for p in model.parameters()}
    lookup_kinds = (nn.Embedding, nn.EmbeddingBag)
    embedding_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, lookup_kinds)
        for p in m.parameters(recurse=False)
    }
    used_elsewhere = {
        id(p)
        for m in model.modules()
        if not isinstance(m, lookup_kinds)
        for p in m.parameters(recurse=False)
    }
    lookup_only = embedding_ids - used_elsewhere
    return ParamCount(
        total=sum(p.numel() for p in unique.values()),
        embedding=sum(unique[i].numel() for i in lookup_only if i in unique),
        tied=sum(unique[i].numel() for i in embedding_ids & used_elsewhere if i in unique),
    )


# ---- built-in models ----------------------------------------------------------------------------
class MLP(nn.Module):
    """``depth`` x (Linear width -> width, ReLU) with an MSE loss against a target."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (SDPA) and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer returning the next-token cross-entropy (logits in fp32)."""

    def __init__(
        self,
        vocab: int = 50304,
        width: int = 768,
        layers: int = 12,
        heads: int = 12,
        seq: int = 1024,
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def gpt_flops(layers: int, width: int, seq: int) -> Callable[[int], float]:
    """``6 N + 12 L T d`` per token (N the non-embedding parameters; the second term is
    attention's score and value matmuls, PaLM appendix B), times T tokens per sample."""
    return lambda non_embedding: (6.0 * non_embedding + 12.0 * layers * seq * width) * seq


def gpt_flops_formula(layers: int, width: int, seq: int) -> str:
    return (
        "per token = 6 x {n} non-embedding parameters + 12 x L x T x d attention "
        f"(PaLM appendix B; L={layers}, T={seq}, d={width})"
    )


def _gpt_workload(name: str, vocab: int, width: int, layers: int, heads: int, seq: int, doc: str):
    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        idx = torch.randint(0, vocab, (batch_size, seq), generator=generator)
        targets = torch.randint(0, vocab, (batch_size, seq), generator=generator)
        return idx, targets

    return Workload(
        name=name,
        build=lambda: GPT(vocab, width, layers, heads, seq),
        make_batch=make_batch,
        seq_len=seq,
        flops_per_sample=gpt_flops(layers, width, seq),
        default_batch=8,
        description=doc,
        flops_formula=gpt_flops_formula(layers, width, seq),
    )


def _mlp_workload() -> Workload:
    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (
            torch.randn(batch_size, 256, generator=generator),
            torch.randn(batch_size, 256, generator=generator),
        )

    return Workload(
        name="mlp",
        build=lambda: MLP(256, 4),
        make_batch=make_batch,
        default_batch=8,
        description="4 x (Linear 256->256, ReLU), MSE loss",
    )


BUILTIN: dict[str, Callable[..., Workload]] = {
    "mlp": lambda seq=None: _mlp_workload(),
    "tiny-gpt": lambda seq=None: _gpt_workload(
        "tiny-gpt", 512, 64, 2, 4, seq or 64, "GPT decoder, 2 layers, width 64, vocab 512"
    ),
    "gpt2-small": lambda seq=None: _gpt_workload(
        "gpt2-small",
        50304,
        768,
        12,
        12,
        seq or 1024,
        "GPT-2-small-shaped decoder, 12 layers, width 768, 12 heads, vocab 50304",
    ),
    "gpt-2048": lambda seq=None: _gpt_workload(
        "gpt-2048",
        50304,
        2048,
        12,
        16,
        seq or 2048,
        "GPT decoder, 12 layers, width 2048, 16 heads, vocab 50304",
    ),
}


# ---- the user's model -----------------------------------------------------------------------------
def _import_attr(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected 'package.module:name', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {module_name!r} for {spec!r}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


def _user_workload(spec: str, batch_factory: str | None) -> Workload:
    factory = _import_attr(spec)
    module_name = spec.partition(":")[0]
    explicit_batch = _import_attr(batch_factory) if batch_factory else None
    made = factory()  # once, to see what the factory gives; each run builds its own later
    if isinstance(made, Workload):
        if explicit_batch is not None:
            made.make_batch = explicit_batch
        return made
    make_batch = explicit_batch
    if make_batch is None and isinstance(made, tuple) and len(made) == 2:
        make_batch = made[1]
    if make_batch is None:
        make_batch = getattr(importlib.import_module(module_name), "make_batch", None)
    if make_batch is None:
        raise ValueError(
            f"{spec!r} gives a model but no batch factory: define make_batch(batch_size, "
            f"generator) in {module_name!r}, return (model, make_batch) from the factory, or pass "
            "--batch-factory package.module:function"
        )
    _model_of(made, spec)
    del made
    return Workload(
        name=spec,
        build=lambda: _model_of(factory(), spec),
        make_batch=make_batch,
        description=f"user model {spec}",
    )


def _model_of(made: Any, spec: str) -> nn.Module:
    if isinstance(made, tuple):
        made = made[0]
    if not isinstance(made, nn.Module):
        raise ValueError(f"{spec!r} returned {type(made).__name__}, not a torch.nn.Module")
    return made


def get_workload(name: str, batch_factory: str | None = None, seq: int | None = None) -> Workload:
    """A built-in workload by name, or the user's ``package.module:factory``. ``seq`` sets the
    sequence length of the built-in GPTs (default 64 for tiny-gpt, 1024 for gpt2-small, 2048 for
    gpt-2048)."""
    if name in BUILTIN:
        return BUILTIN[name](seq)
    if ":" in name:
        if seq is not None:
            raise ValueError("--seq applies to the built-in GPT models only")
        return _user_workload(name, batch_factory)
    raise ValueError(
        f"unknown model {name!r}: use one of {', '.join(BUILTIN)}, or package.module:factory"
    )


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: a 0-d tensor, ``output.loss`` / ``output["loss"]``, or the
    first element of a tuple; any other tensor gets a stand-in loss, its fp32 mean (the same
    backward work for benchmarking, not a meaningful objective)."""
    if isinstance(output, dict) and "loss" in output:
        output = output["loss"]
    elif not isinstance(output, torch.Tensor) and hasattr(output, "loss"):
        output = output.loss
    elif isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model returned {type(output).__name__}, not a loss tensor")
    return output if output.dim() == 0 else output.float().mean()


def call_model(model: nn.Module, batch: Any) -> torch.Tensor:
    """Run ``model`` on one batch (tuple: positional, dict: keywords) and return the loss."""
    if isinstance(batch, dict):
        return loss_of(model(**batch))
    if isinstance(batch, (tuple, list)):
        return loss_of(model(*batch))
    return loss_of(model(batch))


def move_batch(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_batch(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_batch(v, device) for v in batch)
    return batch
