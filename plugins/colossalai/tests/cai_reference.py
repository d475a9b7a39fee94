"""Raw references for the ColossalAI plugin tests: ColossalAI's Booster used as its own docs show
it (TorchDDPPlugin, LowLevelZeroPlugin), and plain torch DDP.

This module imports NOTHING from accelkit (nor from the accelkit-side workers); its model, data
and loop are its own. It runs under ``torchrun`` (2 gloo processes on the CPU, nccl on CUDA) and
returns, per run, the rank-averaged loss of every micro-batch, the gradient norm of every
optimizer step and the final full parameters.

The loop is the one accelkit promises (docs/architecture.md,
"Semantics that hold on every backend"): every micro-batch loss is divided by the
accumulation steps N; the optimizer steps after N micro-batches or at the loader's last batch,
whichever comes first (a short last window is still scaled by 1/N); the window's earlier
micro-batches run under ``booster.no_sync`` where the plugin supports it (TorchDDP, LowLevelZero
stage 1) and under DDP's ``no_sync`` for plain torch; clipping is the plugin's
``max_norm`` (LowLevelZero) or ``clip_grad_norm_`` (DDP, TorchDDPPlugin).

On the CPU, ColossalAI 0.5.0 needs the small workaround below (:func:`_cpu_workaround`) for
LowLevelZero: written here independently of the plugin's, so the reference shares no code with
the code under test.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IN, HIDDEN, OUT = 7, 13, 5  # odd sizes: ZeRO pads every parameter at world size 2
SAMPLES, BATCH = 28, 2  # 14 samples per rank -> 7 micro-batches per epoch
SEED, LR = 1234, 0.05


def build_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(99)
    x = torch.randn(SAMPLES, IN, generator=generator)
    y = torch.randn(SAMPLES, OUT, generator=generator) * 2
    return torch.utils.data.TensorDataset(x, y)


def _cpu_workaround() -> None:
    """ColossalAI's CpuAccelerator raises on stream/synchronize calls and LowLevelZero asserts a
    CUDA device; give the CPU accelerator no-op streams and drop only the device assertion."""
    from colossalai.accelerator import api
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    class Accel(CpuAccelerator):
        def synchronize(self, device=None):
            pass

        def Stream(self, *args, **kwargs):
            return None

        def current_stream(self, device=None):
            return None

        def stream(self, stream_):
            return contextlib.nullcontext()

    api.set_accelerator(Accel())
    LowLevelZeroOptimizer._sanity_checks = lambda self: None


def _init(device_type: str) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _loader() -> torch.utils.data.DataLoader:
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)


def _mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def _full_params(module: torch.nn.Module) -> dict[str, list[float]]:
    return {
        k: v.detach().float().cpu().reshape(-1).tolist() for k, v in module.state_dict().items()
    }


def _caught(function: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """With ``cfg["catch"]``, a run that raises is reported as ``{"error": ...}`` so the other
    runs of the same launch still run (one GPU launch holds the whole matrix)."""
    if not cfg.get("catch"):
        return function(cfg)
    try:
        return function(cfg)
    except Exception as err:  # reported to the test, which fails on it
        return {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """One run. ``cfg``: kind (torch_ddp | booster_ddp | booster_zero | booster_gemini), stage,
    precision (fp32 | bf16 | fp16), accumulation, max_norm, track_grad_norm, epochs, device."""
    kind = cfg["kind"]
    device = torch.device(cfg.get("device", "cpu"))
    model = build_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    steps = cfg.get("accumulation", 1)
    max_norm = cfg.get("max_norm")
    booster = None
    if kind == "torch_ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from colossalai.booster import Booster
        from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin

        if kind == "booster_ddp":
            plugin = TorchDDPPlugin()
        elif kind == "booster_gemini":
            from colossalai.nn.optimizer import HybridAdam

            optimizer = HybridAdam(model.parameters(), lr=LR, adamw_mode=False)
            plugin = GeminiPlugin(
                precision=cfg["precision"],
                max_norm=max_norm or 0.0,
                enable_gradient_accumulation=steps > 1,
            )
        else:
            plugin = LowLevelZeroPlugin(
                stage=cfg["stage"],
                precision=cfg.get("precision", "fp32"),
                max_norm=max_norm or 0.0,
                overlap_communication=device.type == "cuda",
            )
        booster = Booster(plugin=plugin)
        model, optimizer, *_ = booster.boost(model, optimizer)
    loader = _loader()
    losses: list[float] = []
    norms: list[float] = []
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.get("precision", "fp32"))
    for epoch in range(cfg.get("epochs", 1)):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            closes = (i + 1) % steps == 0 or i + 1 == len(loader)
            with contextlib.ExitStack() as stack:
                if not closes and booster is not None and booster.plugin.support_no_sync():
                    stack.enter_context(booster.no_sync(model, optimizer))
                elif not closes and booster is None:
                    stack.enter_context(model.no_sync())
                out = model(x.to(low) if low is not None else x)
                loss = F.mse_loss(out.float(), y)
                if booster is not None:
                    booster.backward(loss / steps, optimizer)
                else:
                    (loss / steps).backward()
            losses.append(_mean(loss))
            if not closes:
                continue
            # track_grad_norm: the norm without clipping (LowLevelZero computes it at every step)
            wants_norm = max_norm is not None or cfg.get("track_grad_norm", False)
            if kind in ("booster_zero", "booster_gemini"):
                optimizer.step()
                if wants_norm:
                    norm = optimizer.get_grad_norm()
                    # None: fp16's loss scaler skipped every step so far (no norm computed yet)
                    norms.append(math.inf if norm is None else float(norm))
            else:
                params = [p for p in model.parameters() if p.grad is not None]
                if wants_norm:
                    limit = max_norm if max_norm is not None else math.inf
                    norms.append(float(torch.nn.utils.clip_grad_norm_(params, limit)))
                optimizer.step()
            optimizer.zero_grad()
    if kind == "booster_gemini":
        params = {
            k: v.float().cpu().reshape(-1).tolist()
            for k, v in model.state_dict(only_rank_0=False).items()
        }
    else:
        params = _full_params(model.unwrap() if booster is not None else model.module)
    return {"losses": losses, "norms": norms, "params": params}


def runs(cfgs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every cfg in one process pair (ColossalAI's import is paid once)."""
    device = _init(cfgs[0].get("device", "cpu") if cfgs else "cpu")
    if device.type == "cpu" and any(c["kind"] != "torch_ddp" for c in cfgs):
        _cpu_workaround()
    out = {cfg["name"]: _caught(run, {**cfg, "device": device.type}) for cfg in cfgs}
    dist.destroy_process_group()
    return out


# ---- HybridParallelPlugin on a tiny Llama (Shardformer needs a model it has a policy for) ----
def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def token_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randint(0, 128, (16, 12), generator=generator))


def _hybrid_run(cfg: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(cfg["device"])
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin

    plugin = HybridParallelPlugin(
        tp_size=cfg["tp_size"],
        pp_size=1,
        zero_stage=cfg.get("zero_stage", 0),
        precision=cfg.get("precision", "fp32"),
        overlap_communication=device.type == "cuda",  # the plugin's default; CPUs have no streams
        max_norm=cfg.get("max_norm", 0.0),
    )
    booster = Booster(plugin=plugin)
    model = tiny_llama().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, *_ = booster.boost(model, optimizer)
    data = token_data()
    dp_rank = dist.get_group_rank(plugin.dp_group, dist.get_rank())
    sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=plugin.dp_group.size(), rank=dp_rank, shuffle=False
    )
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    losses, norms = [], []
    steps = 2
    for i, (ids,) in enumerate(loader):
        ids = ids.to(device)
        closes = (i + 1) % steps == 0 or i + 1 == len(loader)
        with contextlib.ExitStack() as stack:
            if not closes and cfg.get("zero_stage", 0) != 2:
                stack.enter_context(booster.no_sync(model, optimizer))
            loss = model(input_ids=ids, labels=ids).loss.float()
            booster.backward(loss / steps, optimizer)
        losses.append(_mean(loss))
        if closes:
            optimizer.step()
            if cfg.get("max_norm"):
                norm = optimizer.get_grad_norm()  # computed while clipping (plugin's max_norm)
                norms.append(math.inf if norm is None else float(norm))
            optimizer.zero_grad()
    module = model.unwrap()
    return {
        "losses": losses,
        "norms": norms,
        "params": _full_params(module),  # this rank's working weights (its tp shard)
        "masters": _fp32_masters(module, optimizer),
        "dp": [dp_rank, plugin.dp_group.size()],
    }


def _fp32_masters(module: torch.nn.Module, optimizer: Any) -> dict[str, list[float]]:
    """The fp32 master of every parameter by name, read from ColossalAI's optimizer wrapper:
    LowLevelZero's flat shards (``working_to_master_param``, keyed by the working parameter's id)
    all-gathered over the parameter's ZeRO group and cut to its size, or the mixed-precision
    optimizer's whole masters (``working_to_master_map``). Empty where the weights are their own
    master (fp32 without ZeRO)."""
    shards = getattr(optimizer, "working_to_master_param", None)
    whole = getattr(optimizer, "working_to_master_map", None)
    out: dict[str, list[float]] = {}
    for name, param in module.named_parameters():
        if shards is not None and id(param) in shards:
            shard = shards[id(param)].detach().float()
            group = optimizer.param_to_pg[param]
            pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, shard, group=group)
            master = torch.cat(pieces)[: param.numel()]
        elif whole is not None and param in whole and whole[param] is not param:
            master = whole[param].detach().float().reshape(-1)
        else:
            continue
        out[name] = master.cpu().tolist()
    return out


def hybrid_runs(cfgs: list[dict[str, Any]]) -> dict[str, Any]:
    """HybridParallelPlugin runs: tp_size, zero_stage, precision, max_norm (the plugin clips and
    reports the norm); accumulation 2.
    On the CPU by default; ``device="cuda"`` in the first cfg runs them all on CUDA (nccl)."""
    device = _init(cfgs[0].get("device", "cpu") if cfgs else "cpu")
    if device.type == "cpu":
        _cpu_workaround()
        from colossalai.accelerator import api

        accelerator = api.get_accelerator()
        type(accelerator).get_rng_state = lambda self, device=None: torch.get_rng_state()
        type(accelerator).set_rng_state = lambda self, state, device=None: torch.set_rng_state(
            state
        )
        type(accelerator).manual_seed = lambda self, seed: torch.manual_seed(seed)
    out = {cfg["name"]: _caught(_hybrid_run, {**cfg, "device": device.type}) for cfg in cfgs}
    dist.destroy_process_group()
    return out


def booster_sharded_save(path: str) -> dict[str, Any]:
    """Train LowLevelZero stage 2 (fp32) 4 steps, then ``booster.save_model`` and
    ``booster.save_optimizer`` with ``shard=True`` under ``path``; return the gathered state
    (``state_dict()`` of the ZeRO optimizer, by parameter name) for comparison."""
    device = _init("cpu")
    _cpu_workaround()
    from colossalai.booster import Booster
    from colossalai.booster.plugin import LowLevelZeroPlugin

    model = build_model()
    names = [n for n, _ in model.named_parameters()]
    booster = Booster(
        plugin=LowLevelZeroPlugin(stage=2, precision="fp32", overlap_communication=False)
    )
    model, optimizer, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=LR))
    for i, (x, y) in enumerate(_loader()):
        booster.backward(F.mse_loss(model(x.to(device)), y.to(device)), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if i == 3:
            break
    # size_per_shard=0: every tensor in a shard of its own, so the index really matters
    booster.save_model(model, f"{path}/model", shard=True, size_per_shard=0)
    booster.save_optimizer(optimizer, f"{path}/optimizer", shard=True, size_per_shard=0)
    gathered = optimizer.state_dict()
    optim = {
        f"{names[int(i)]}.{k}": v.float().reshape(-1).tolist()
        for i, entry in gathered["state"].items()
        for k, v in entry.items()
        if isinstance(v, torch.Tensor)
    }
    dist.destroy_process_group()
    return {"params": _full_params(model.unwrap()), "optim": optim}
