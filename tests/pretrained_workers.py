"""Workers of tests/test_pretrained.py: a small Transformers GPT-2 (built locally from a config,
no network) loaded with ``accel.load_pretrained`` on a given backend; returns its logits."""

from __future__ import annotations

from typing import Any

import torch

CONFIG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)


def make_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(**CONFIG)


def tokens() -> torch.Tensor:
    return torch.randint(
        0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3)
    )


def pretrained(directory: str, seed: int = 0, dtype: torch.dtype | None = None) -> list:
    """Write a GPT-2 with save_pretrained (several shards); return its fp32 logits."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(make_config()).eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory, max_shard_size="100KB")
    with torch.no_grad():
        return model.float()(tokens()).logits.tolist()


def load_job(directory: str, backend: str = "cpu", options: dict | None = None) -> dict[str, Any]:
    from transformers import GPT2LMHeadModel

    import accelkit

    accel = accelkit.get(backend, **(options or {}))
    torch.manual_seed(1)  # other weights: the load must replace every one
    model = GPT2LMHeadModel(make_config()).eval()
    model = accel.setup(model)
    accel.load_pretrained(model, directory)
    with torch.no_grad():
        logits = model(tokens()).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    out = {"logits": logits.tolist()}
    accel.end_training()
    return out


def train_and_save(path: str, backend: str = "cpu", steps: int = 3) -> dict[str, Any]:
    """Train a GPT-2 a few steps on ``backend`` and save a portable checkpoint; return the
    trained weights (full, for the reference)."""
    from transformers import GPT2LMHeadModel

    import accelkit

    accel = accelkit.get(backend, seed=0)
    torch.manual_seed(0)
    net = GPT2LMHeadModel(make_config())
    model, opt = accel.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    batch = tokens()
    for _ in range(steps):
        accel.backward(model(batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
    accel.save(path, {"model": model, "optimizer": opt})
    full = {k: v.detach().cpu().tolist() for k, v in accel.full_state_dict(model).items()}
    accel.end_training()
    return full


def load_with_optimizer_job(
    directory: str,
    backend: str,
    options: dict | None = None,
    shim_path: str | None = None,
) -> dict[str, Any]:
    """``load_job`` for the backends that set up a model together with its optimizer (the
    ZeRO-style ones partition the optimizer state by the parameters they own). ``shim_path``:
    where FairScale's TEST-ONLY CPU shim lives (its FSDP drives CUDA streams otherwise)."""
    import sys

    from transformers import GPT2LMHeadModel

    import accelkit

    if shim_path:
        sys.path.insert(0, shim_path)
        import fairscale_cpu_shim

        fairscale_cpu_shim.apply()
    accel = accelkit.get(backend, **(options or {}))
    torch.manual_seed(1)  # other weights: the load must replace every one
    model = GPT2LMHeadModel(make_config()).eval()
    model, _ = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accel.load_pretrained(model, directory)
    with torch.no_grad():
        logits = model(tokens()).logits
    out = {"logits": logits.float().tolist()}
    accel.end_training()
    return out
