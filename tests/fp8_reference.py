"""The raw reference of ``fp8-mixed`` (tests/test_fp8.py): a small GPT, learnable synthetic
tokens, and its training loop in raw PyTorch with torchao's ``convert_to_float8_training``.

It imports only torch and torchao: the float8 layer filter is written out here from its
documented rule (docs/loop-features.md, "fp8-mixed"), so a bug in accelkit's filter cannot hide
in a helper both sides use.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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


class TinyGPT(nn.Module):
    """A decoder whose forward returns the next-token cross-entropy (logits in fp32); the head
    is registered last, so it is the last nn.Linear in module order."""

    def __init__(
        self, vocab: int = 256, width: int = 64, layers: int = 2, heads: int = 4, seq: int = 32
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


def markov_tokens(
    n: int, seq: int, vocab: int, *, branches: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of a random Markov chain where each token has ``branches`` successors:
    learnable (the loss falls from ln(vocab) towards ln(branches)), the same for every seed."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, branches), generator=gen)
    tokens = torch.empty(n, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
    for t in range(seq):
        pick = torch.randint(0, branches, (n,), generator=gen)
        tokens[:, t + 1] = successors[tokens[:, t], pick]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def float8_layers(model: nn.Module, min_features: int, skip_head: bool = True) -> set[str]:
    """The documented rule: exactly nn.Linear, both dimensions multiples of 16 and at least
    ``min_features``, not the last nn.Linear in module order (the head)."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = linears[-1][0] if skip_head and linears else None
    return {
        name
        for name, m in linears
        if type(m) is nn.Linear
        and name != head
        and m.in_features % 16 == 0
        and m.out_features % 16 == 0
        and min(m.in_features, m.out_features) >= min_features
    }


def train_raw(
    *,
    precision: str,
    steps: int,
    batch: int,
    lr: float,
    model_kwargs: dict[str, Any],
    min_features: int = 16,
    recipe: str = "tensorwise",
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Train ``TinyGPT`` by hand: "fp8-mixed" converts the filtered layers with torchao and runs
    under bf16 autocast, "bf16-mixed" only autocasts, "32-true" neither. AdamW, clipping at 1."""
    torch.manual_seed(seed)
    model = TinyGPT(**model_kwargs).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # before conversion, like a user
    if precision == "fp8-mixed":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        chosen = float8_layers(model, min_features)
        convert_to_float8_training(
            model,
            module_filter_fn=lambda m, fqn: fqn in chosen,
            config=Float8LinearConfig.from_recipe_name(recipe),
        )
    x, y = markov_tokens(steps * batch, model_kwargs.get("seq", 32), model_kwargs.get("vocab", 256))
    losses = []
    for step in range(steps):
        xb = x[step * batch : (step + 1) * batch].to(device)
        yb = y[step * batch : (step + 1) * batch].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision != "32-true"):
            loss = model(xb, yb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "losses": losses,
        "converted": sorted(
            n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"
        ),
        "state": {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()},
    }


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (the curve's trend, without step-to-step noise)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(math.fsum(part) / len(part))
    return out
