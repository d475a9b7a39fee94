"""``accel.load_pretrained`` on one GPU: a GPT-2-small-shaped sharded checkpoint loaded into
``fsdp`` and ``deepspeed_stage_3``, from fp32 and from bf16 files (issue 25's GPU figures).

    python bench/pretrained_gpu.py --out result.json
    python bench/pretrained_gpu.py --device cpu --small --out smoke.json   # a smoke run

The model is GPT-2 small written in plain torch with GPT-2's parameter names and shapes (124M
parameters, the head tied to the token embedding; ``--small``: 2 layers, 64 wide). It is saved
once per dtype the way ``save_pretrained`` lays it out: shards of at most ``--max-shard-size``
(``model-0000i-of-0000n.safetensors``), ``model.safetensors.index.json``, the tied head stored
once. The same process computes the reference logits of the weights it saved, on the device
(bf16: the bf16 weights in fp32); that part imports nothing from accelkit.

Each backend runs in a fresh process of one rank. Per load, in rounds (the dtype order alternates
each round): the model is built inside ``accel.init_module()`` (``fsdp``: on the meta device;
``deepspeed_stage_3``: under ``zero.Init``), set up with AdamW, and filled by
``load_pretrained``. Reported: the load's seconds and GB/s (bytes of the source's safetensors
files, read from a warm page cache), its peak host RSS above the RSS before it (sampled every
5 ms) and over build + setup + load, its peak device memory above the memory after setup
(``torch.cuda.max_memory_allocated``), and whether the logits equal the reference's bit for bit
(fp32 compute on the same device: they must).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pretrained_memory import Peak, _rss  # the host RSS sampler of the CPU memory bench
from torch import nn

GPT2_SMALL = dict(vocab=50257, positions=1024, width=768, layers=12, heads=12)
SMALL = dict(vocab=128, positions=32, width=64, layers=2, heads=4)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INDEX_NAME = "model.safetensors.index.json"


# ---- GPT-2 in plain torch, with its parameter names ---------------------------------------------------
class Conv1D(nn.Module):
    """GPT-2's linear layer: the weight stored (in, out), as its checkpoints hold it."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], -1)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = Conv1D(width, 3 * width), Conv1D(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            part.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for part in self.c_attn(x).split(d, dim=2)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(a.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(width, 4 * width), Conv1D(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = Attention(width, heads), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, positions: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(positions, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHead(nn.Module):
    """``transformer.*`` and ``lm_head.weight`` (tied to ``transformer.wte.weight``)."""

    def __init__(self, vocab: int, positions: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.transformer = Transformer(vocab, positions, width, layers, heads)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(idx))


def shape_of(small: bool) -> dict[str, int]:
    return SMALL if small else GPT2_SMALL


def tokens(shape: dict[str, int]) -> torch.Tensor:
    seq = min(64, shape["positions"])
    return torch.randint(0, shape["vocab"], (2, seq), generator=torch.Generator().manual_seed(3))


def device_of(name: str) -> torch.device:
    use_cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    return torch.device("cuda", 0) if use_cuda else torch.device("cpu")


# ---- the source and its reference (no accelkit) -----------------------------------------------------
def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    return int(float(text[:-2]) * units[text[-2:].upper()])


def save_sharded(state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> int:
    """The tensors in order, in shards of at most ``max_shard_bytes``, with the index; return
    the bytes of the shard files."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous().clone()
        size += nbytes
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def write_sources(root: Path, args: argparse.Namespace, device: torch.device) -> dict[str, int]:
    """Save the model once per dtype; store the reference logits beside; return the bytes of
    each source's safetensors files."""
    shape = shape_of(args.small)
    torch.manual_seed(0)
    model = GPT2LMHead(**shape).eval()
    sizes = {}
    for name in args.dtypes:
        state = {
            k: v.detach().to(DTYPES[name])
            for k, v in model.state_dict().items()
            if k != "lm_head.weight"  # tied: stored once, as save_pretrained does
        }
        sizes[name] = save_sharded(state, root / name, parse_size(args.max_shard_size))
        reference = GPT2LMHead(**shape).eval()
        reference.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        reference.lm_head.weight = reference.transformer.wte.weight
        with torch.no_grad():
            logits = reference.to(device)(tokens(shape).to(device))
        torch.save(logits.cpu(), root / f"reference-{name}.pt")
        del reference, logits, state
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sizes


# ---- one backend's loads (a process of its own) -------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def load_once(accel: Any, args: argparse.Namespace, name: str, device: torch.device) -> dict:
    """Build, set up and load one source; measure; check the logits."""
    root = Path(args.dir)
    shape = shape_of(args.small)
    gc.collect()
    _reset_peak(device)
    device_base = _allocated(device)
    torch.manual_seed(1)  # other weights than the source's: the load must replace every one
    with Peak() as whole:
        with accel.init_module():  # meta (fsdp) or zero.Init (deepspeed_stage_3)
            model = GPT2LMHead(**shape).eval()
        model, opt = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
        _sync(device)
        device_model = _allocated(device) - device_base
        _reset_peak(device)
        load_base = _allocated(device)
        with Peak() as load:
            start = time.perf_counter()
            accel.load_pretrained(model, root / name)
            _sync(device)
            seconds = time.perf_counter() - start
        device_load_peak = _peak(device) - load_base
    with torch.no_grad():
        logits = model(tokens(shape).to(accel.device))
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    want = torch.load(root / f"reference-{name}.pt").to(logits.device)
    row = {
        "backend": args.backend,
        "dtype": name,
        "seconds": seconds,
        "host_load_peak": load.extra,
        "host_peak": whole.extra,
        "device_model": device_model,
        "device_load_peak": device_load_peak,
        "logits_equal": bool(torch.equal(logits.float(), want)),
        "logits_max_abs_diff": float((logits.float() - want).abs().max()),
    }
    del model, opt, logits
    accel.free_memory()
    return row


def backend_main(args: argparse.Namespace) -> None:
    import accelkit

    device = device_of(args.device)
    options = {"device": device.type} if args.backend == "fsdp" else {}
    accel = accelkit.get(args.backend, **options)
    for repeat in range(args.repeats):
        order = args.dtypes if repeat % 2 == 0 else args.dtypes[::-1]
        for name in order:
            row = load_once(accel, args, name, device)
            print(json.dumps({"repeat": repeat, **row, "rss_after": _rss()}), flush=True)
    accel.end_training()


# ---- the parent: sources, one process per backend, the table --------------------------------
def run_backend(args: argparse.Namespace, backend: str, device: torch.device) -> list[dict]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.setdefault("DS_ACCELERATOR", device.type)
    cmd = [sys.executable, __file__, "--role", "backend", "--backend", backend, "--dir", args.dir,
           "--device", device.type, "--repeats", str(args.repeats), "--dtypes", *args.dtypes]  # fmt: skip
    if args.small:
        cmd.append("--small")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        print(f"{backend} did not finish within {args.timeout:.0f} s", flush=True)
        return [{"backend": backend, "error": f"timeout: {str(err.stderr or '')[-4000:]}"}]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        print(f"{backend} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", flush=True)
        rows.append({"backend": backend, "error": proc.stderr[-4000:]})
    return rows


def summarize(rows: list[dict], sizes: dict[str, int]) -> list[dict]:
    """Medians (and ranges) over the rounds of each backend and dtype."""
    table = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        for name, nbytes in sizes.items():
            runs = [r for r in rows if r["backend"] == backend and r.get("dtype") == name]
            if not runs:
                continue
            seconds = [r["seconds"] for r in runs]
            table.append(
                {
                    "backend": backend,
                    "dtype": name,
                    "source_bytes": nbytes,
                    "rounds": len(runs),
                    "seconds": statistics.median(seconds),
                    "seconds_range": [min(seconds), max(seconds)],
                    "gb_per_s": nbytes / 1e9 / statistics.median(seconds),
                    "host_load_peak": statistics.median(r["host_load_peak"] for r in runs),
                    "host_peak": statistics.median(r["host_peak"] for r in runs),
                    "device_model": statistics.median(r["device_model"] for r in runs),
                    "device_load_peak": statistics.median(r["device_load_peak"] for r in runs),
                    "logits_equal": all(r["logits_equal"] for r in runs),
                    "logits_max_abs_diff": max(r["logits_max_abs_diff"] for r in runs),
                }
            )
    return table


def print_table(table: list[dict], device: torch.device) -> None:
    mb = 1e6
    print(
        f"{'backend':18s} {'file':4s} {'MB':>6s} {'load s (min-max)':>20s} {'GB/s':>6s} "
        f"{'host MB load/all':>17s} {'dev MB model/load':>18s}  logits"
    )
    for r in table:
        low, high = r["seconds_range"]
        print(
            f"{r['backend']:18s} {r['dtype']:4s} {r['source_bytes'] / mb:6.0f} "
            f"{r['seconds']:8.3f} ({low:.3f}-{high:.3f}) {r['gb_per_s']:6.2f} "
            f"{r['host_load_peak'] / mb:8.0f}/{r['host_peak'] / mb:<8.0f} "
            f"{r['device_model'] / mb:8.0f}/{r['device_load_peak'] / mb:<9.0f} "
            + ("equal" if r["logits_equal"] else f"DIFFER by {r['logits_max_abs_diff']:.3g}")
        )
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--backends", default="fsdp,deepspeed_stage_3")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--repeats", type=int, default=3, help="rounds of loads per backend")
    p.add_argument("--small", action="store_true", help="a 2-layer, 64-wide GPT-2 (smoke run)")
    p.add_argument("--max-shard-size", default=None, help="default 100MB (--small: 100KB)")
    p.add_argument("--dir", default=None, help="where the sources go (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per backend process")
    p.add_argument("--out", default="-")
    p.add_argument("--role", default="parent", help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "backend":
        backend_main(args)
        return 0
    device = device_of(args.device)
    args.max_shard_size = args.max_shard_size or ("100KB" if args.small else "100MB")
    with tempfile.TemporaryDirectory(prefix="accelkit-pretrained-gpu-") as tmp:
        args.dir = args.dir or tmp
        sizes = write_sources(Path(args.dir), args, device)
        shards = {n: len(list((Path(args.dir) / n).glob("*.safetensors"))) for n in sizes}
        print(f"sources: {sizes} bytes in {shards} shards", flush=True)
        rows = []
        for backend in args.backends.split(","):
            rows += run_backend(args, backend, device)
    table = summarize([r for r in rows if "error" not in r], sizes)
    print_table(table, device)
    failed = [r["backend"] for r in rows if "error" in r]
    result = {"device": str(device), "small": args.small, "max_shard_size": args.max_shard_size,
              "shards": shards, "table": table, "loads": rows, "failed": failed}  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
    ok = not failed and all(r["logits_equal"] for r in table)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
