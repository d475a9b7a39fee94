"""The raw reference GPT every bench script uses: plain PyTorch, nothing from accelkit.

A pre-norm decoder (causal SDPA attention, 4x GELU MLP) returning the next-token cross-entropy.
``tie_embeddings`` shares the token embedding with the output head, as GPT-2 does; the default
is an untied head. GPT-2 small's shape is ``GPT(50304, 768, 12, 12, 1024)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: (vocab, width, layers, heads, seq) of GPT-2 small, the vocabulary padded to a multiple of 64
GPT2_SMALL = (50304, 768, 12, 12, 1024)


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
    """Decoder-only transformer; ``forward(idx, targets)`` returns the mean cross-entropy."""

    def __init__(
        self,
        vocab: int,
        width: int,
        layers: int,
        heads: int,
        seq: int,
        *,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def non_embedding_params(model: nn.Module) -> int:
    """Parameters that do matmul work: all but the embedding tables (lookups); a head tied to
    the token embedding counts once, as the embedding."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups)


def flops_per_token(non_embedding: int, layers: int, seq: int, width: int) -> int:
    """Training FLOPs per token: 6 N (N without embeddings) + 12 L T d for attention (PaLM,
    appendix B)."""
    return 6 * non_embedding + 12 * layers * seq * width
