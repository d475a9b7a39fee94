"""A Transformers Llama of about 1B parameters built, loaded and stepped on one GPU: accelkit's
``init_module()`` + ``load_pretrained`` on ``fsdp`` and ``deepspeed_stage_3``, against the
Transformers + accelerate path (issue 31's GPU figure).

    python bench/hf_gpu.py --out result.json
    python bench/hf_gpu.py --device cpu --small --out smoke.json   # a smoke run

The parent writes a Llama config (``LLAMA_1B``: 16 layers, 2048 wide, 32000 tokens, an untied
head: 1.10B parameters; ``--small``: 2 layers, 64 wide) and builds that model once from it on the
device, saves it with ``save_pretrained`` in bf16 (shards of at most 1GB) and computes the
reference logits of those files read back by ``from_pretrained`` in fp32 (Transformers only).

Then each side runs in a fresh process, one after the other:

- ``fsdp``, ``deepspeed_stage_3``: ``AutoModelForCausalLM.from_config`` inside
  ``accel.init_module()`` (fsdp: parameters on meta; ZeRO-3: partitioned as built), ``setup``
  with AdamW, ``load_pretrained`` (bf16 files into the fp32 weights), one training step;
- ``hf``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32, device_map=<device>)``
  (Transformers builds on meta through accelerate and loads onto the device), AdamW, accelerate's
  ``Accelerator().prepare``, one training step.

Reported per side: seconds of build (+ setup), load and step; peak host RSS above the RSS after
the imports (sampled every 5 ms, over build, load and step); peak device memory
(``torch.cuda.max_memory_allocated``) over build + load, and over the whole side with the step;
and whether the logits after the load equal the reference's bit for bit. Each side prints its
row as soon as it finishes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from pretrained_memory import Peak, _rss  # the host RSS sampler of the CPU memory bench

#: Llama-shaped, about 1B parameters (Llama-3.2-1B's body with Llama-2's vocabulary, untied head)
LLAMA_1B = dict(
    num_hidden_layers=16,
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SMALL = dict(LLAMA_1B, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
SIDES = ("fsdp", "hf", "deepspeed_stage_3")  # ZeRO-3 last: its engine takes longest to set up


def device_of(name: str) -> torch.device:
    use_cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    return torch.device("cuda", 0) if use_cuda else torch.device("cpu")


def make_config(dims: dict) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**dims, attn_implementation="sdpa")  # the same kernels on every side


def tokens(dims: dict, seq: int) -> torch.Tensor:
    return torch.randint(
        0, dims["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(3)
    )


def dtype_kwarg(dtype: torch.dtype) -> dict[str, Any]:
    """``dtype=`` on Transformers 5, ``torch_dtype=`` before."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


# ---- the source (Transformers only) -------------------------------------------------------------------
def write_source(root: Path, dims: dict, device: torch.device, seq: int, shard: str) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(make_config(dims))
    params = sum(p.numel() for p in model.parameters())
    model = model.to(torch.bfloat16)
    start = time.perf_counter()
    model.save_pretrained(root / "model", max_shard_size=shard)
    saved = time.perf_counter() - start
    del model
    # the saved files read back by Transformers in fp32 (a cast of the model in memory would
    # round its rotary frequencies to bf16 too; they are a buffer, not in the files)
    model = AutoModelForCausalLM.from_pretrained(
        root / "model", device_map=str(device), attn_implementation="sdpa",
        **dtype_kwarg(torch.float32),
    ).eval()  # fmt: skip
    with torch.no_grad():
        logits = model(tokens(dims, seq).to(device)).logits
    torch.save(logits.cpu(), root / "reference.pt")
    (root / "dims.json").write_text(json.dumps(dims))
    del model, logits
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    files = list((root / "model").glob("*.safetensors"))
    return {
        "parameters": params,
        "source_bytes": sum(f.stat().st_size for f in files),
        "shards": len(files),
        "save_seconds": saved,
    }


# ---- one side (a process of its own) ----------------------------------------------------------------
def side_main(args: argparse.Namespace) -> None:
    import torch._dynamo  # imports outside the measured window, on every side
    import transformers
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    root = Path(args.dir)
    dims = json.loads((root / "dims.json").read_text())
    device = device_of(args.device)
    batch = tokens(dims, args.seq).to(device)
    accel = None
    if args.side != "hf":
        import accelkit

        options = {"device": device.type} if args.side == "fsdp" else {}
        accel = accelkit.get(args.side, seed=0, **options)
    else:
        import accelerate
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = {}
    with Peak() as host:
        start = time.perf_counter()
        if accel is not None:
            with accel.init_module():
                model = AutoModelForCausalLM.from_config(make_config(dims))
            model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
            _sync(device)
            times["build"] = time.perf_counter() - start
            start = time.perf_counter()
            accel.load_pretrained(model, root / "model")
        else:
            model = AutoModelForCausalLM.from_pretrained(
                root / "model",
                device_map=str(device),
                attn_implementation="sdpa",
                **dtype_kwarg(torch.float32),
            )
            times["build"] = 0.0
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            hf_accel = accelerate.Accelerator(cpu=device.type == "cpu")
            model, opt = hf_accel.prepare(model, opt)
        _sync(device)
        times["load"] = time.perf_counter() - start
        host_after_load = host.peak - host.base
        device_after_load = _peak(device)
        with torch.no_grad():
            model.eval()
            logits = model(batch).logits
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            model.train()
        start = time.perf_counter()
        loss = model(batch, labels=batch).loss
        if accel is not None:
            accel.backward(loss)
        else:
            hf_accel.backward(loss)
        opt.step()
        opt.zero_grad()
        _sync(device)
        times["step"] = time.perf_counter() - start
    want = torch.load(root / "reference.pt").to(logits.device)
    row = {
        "side": args.side,
        "transformers": transformers.__version__,
        "seconds": times,
        "host_peak_load": host_after_load,
        "host_peak": host.extra,
        "device_peak_load": device_after_load,
        "device_peak": _peak(device),
        "device_after_step": _allocated(device),
        "loss": loss.item(),
        "logits_equal": bool(torch.equal(logits.float(), want)),
        "logits_max_abs_diff": float((logits.float() - want).abs().max()),
        "rss_after": _rss(),
    }
    print(json.dumps(row), flush=True)
    if accel is not None:
        accel.end_training()


# ---- the parent ---------------------------------------------------------------------------------------
def run_side(args: argparse.Namespace, side: str, device: torch.device) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.setdefault("DS_ACCELERATOR", device.type)
    cmd = [sys.executable, __file__, "--role", "side", "--side", side, "--dir", args.dir,
           "--device", device.type, "--seq", str(args.seq)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        return {"side": side, "error": f"timeout after {args.timeout:.0f} s: {err.stderr!s:.3000}"}
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        return {"side": side, "error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    return rows[-1]


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['side']:18s} FAILED {r['error']}", flush=True)
        return
    gb = 1e9
    s = r["seconds"]
    print(
        f"{r['side']:18s} build {s['build']:6.1f} s  load {s['load']:6.1f} s  step "
        f"{s['step']:5.2f} s | host RSS peak {r['host_peak_load'] / gb:6.2f} GB (load) "
        f"{r['host_peak'] / gb:6.2f} GB (all) | device peak {r['device_peak_load'] / gb:6.2f} GB "
        f"(load) {r['device_peak'] / gb:6.2f} GB (step) | loss {r['loss']:.4f} | logits "
        + ("equal" if r["logits_equal"] else f"differ by {r['logits_max_abs_diff']:.3g}"),
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--small", action="store_true", help="a 2-layer, 64-wide Llama (smoke run)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (2 sequences)")
    p.add_argument("--max-shard-size", default=None, help="default 1GB (--small: 100KB)")
    p.add_argument(
        "--dir", default=None, help="where the source goes (default: a temporary folder)"
    )
    p.add_argument("--timeout", type=float, default=150, help="seconds per side")
    p.add_argument("--out", default="-")
    p.add_argument("--role", default="parent", help=argparse.SUPPRESS)
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.seq = args.seq or (16 if args.small else 512)
    if args.role == "side":
        side_main(args)
        return 0
    device = device_of(args.device)
    dims = SMALL if args.small else LLAMA_1B
    shard = args.max_shard_size or ("100KB" if args.small else "1GB")
    rows = []
    with tempfile.TemporaryDirectory(prefix="accelkit-hf-gpu-") as tmp:
        args.dir = args.dir or tmp
        start = time.perf_counter()
        source = write_source(Path(args.dir), dims, device, args.seq, shard)
        print(
            f"source: Llama, {source['parameters']:,} parameters, "
            f"{source['source_bytes'] / 1e9:.2f} GB bf16 in {source['shards']} shards "
            f"(written in {time.perf_counter() - start:.1f} s)",
            flush=True,
        )
        for side in args.sides.split(","):
            row = run_side(args, side, device)
            print_row(row)
            rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; batch 2 x {args.seq} tokens; fp32 weights, AdamW", flush=True)
    result = {"device": name, "small": args.small, "dims": dims, "source": source, "sides": rows}
    text = json.dumps(result, indent=1)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
    ok = all("error" not in r and r["logits_equal"] for r in rows if r["side"] != "hf")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
