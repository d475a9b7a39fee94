"""accelkit side of the ColossalAI plugin tests (runs under torchrun, one job after another in the
same processes so ColossalAI is imported once). Its model and data are written here again, on
purpose: the raw references (cai_reference.py) share no code with this side."""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import accelkit

IN, HIDDEN, OUT = 7, 13, 5
SAMPLES, BATCH = 28, 2
SEED, LR = 1234, 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def _data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(99)
    x = torch.randn(SAMPLES, IN, generator=generator)
    y = torch.randn(SAMPLES, OUT, generator=generator) * 2
    return torch.utils.data.TensorDataset(x, y)


def _mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()  # on its own device: NCCL reduces no CPU tensor
    if dist.is_initialized():
        dist.all_reduce(value)
        return float(value) / dist.get_world_size()
    return float(value)


def _flat(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {k: v.detach().float().cpu().reshape(-1).tolist() for k, v in tensors.items()}


def _build(job: dict[str, Any]):
    accel = accelkit.get(
        job["backend"],
        job.get("options"),
        precision=job.get("precision"),
        accumulation_steps=job.get("accumulation", 1),
        max_grad_norm=job.get("max_norm"),
        track_grad_norm=job.get("track_grad_norm", False),
    )
    model, optimizer = accel.setup(_model(), torch.optim.Adam(_model().parameters(), lr=LR))
    return accel, model, optimizer


def _fresh_optimizer_check(accel: Any, model: Any, optimizer: Any) -> None:
    """The optimizer from setup() is a torch Optimizer whose param_groups a scheduler drives."""
    assert isinstance(optimizer, torch.optim.Optimizer)


class _Count(logging.Handler):
    """Counts accelkit's warning that gradients are reduced at every micro-batch."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "reduced at every micro-batch" in record.getMessage():
            self.count += 1


def train(job: dict[str, Any]) -> dict[str, Any]:
    counter = _Count()
    logging.getLogger("accelkit").addHandler(counter)
    accel = accelkit.get(
        job["backend"],
        job.get("options"),
        precision=job.get("precision"),
        accumulation_steps=job.get("accumulation", 1),
        max_grad_norm=job.get("max_norm"),
        track_grad_norm=job.get("track_grad_norm", False),
    )
    net = _model()
    model, optimizer = accel.setup(net, torch.optim.Adam(net.parameters(), lr=LR))
    _fresh_optimizer_check(accel, model, optimizer)
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=False), shuffle=False
    )
    losses, norms, skipped_sync = [], [], []
    for _epoch in range(job.get("epochs", 1)):
        for x, y in loader:
            with accel.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accel.backward(loss)
            losses.append(_mean(loss))
            if accel.step():
                if job.get("max_norm") is not None or job.get("track_grad_norm"):
                    norms.append(float(accel.grad_norm))
                skipped_sync.append(accel.step_was_skipped)
            optimizer.zero_grad()
    logging.getLogger("accelkit").removeHandler(counter)
    return {
        "losses": losses,
        "norms": norms,
        "params": _flat(accel.full_state_dict(model)),
        "applied": accel.applied_steps,
        "no_sync": accel.capabilities.no_sync,
        "sync_warnings": counter.count,
    }


def _caught(function: Any, job: dict[str, Any]) -> dict[str, Any]:
    """With ``job["catch"]``, a job that raises is reported as ``{"error": ...}`` so the other
    jobs of the same launch still run (one GPU launch holds the whole matrix)."""
    if not job.get("catch"):
        return function(job)
    try:
        return function(job)
    except Exception as err:  # reported to the test, which fails on it
        return {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"}


def trains(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {job["name"]: _caught(train, job) for job in jobs}


# ---- checkpoints --------------------------------------------------------------------------
def _deepspeed_state(engine: Any) -> dict[str, Any]:
    """DeepSpeed's own full views: ``safe_get_full_fp32_param`` (the fp32 master) and
    ``safe_get_full_optimizer_state`` per parameter, and the base optimizer's ``step``."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    wrapper = engine.optimizer
    base = getattr(wrapper, "optimizer", wrapper)
    has_state = any(bool(s) for s in base.state.values())  # the same on every rank
    if has_state and getattr(wrapper, "_hp_optimizer_states_linked", True) is False:
        # ZeRO-1/2 link their per-parameter optimizer views at the first step; link them now
        wrapper._lazy_init_hp_params_optimizer_state()
    steps = sorted(
        {float(s["step"]) for s in base.state.values() if isinstance(s, dict) and "step" in s}
    )
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, list[float]] = {}
    for name, p in engine.module.named_parameters():
        params[name] = safe_get_full_fp32_param(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if has_state:  # a collective: every rank takes this branch or none does
                value = safe_get_full_optimizer_state(p, key)
                optim[f"{name}.{key}"] = value.detach().float().cpu().reshape(-1).tolist()
        if steps:
            optim[f"{name}.step"] = steps  # one per flat group in DeepSpeed
    return {"params": _flat(params), "optim": optim}


def _independent_state(accel: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """Weights and optimizer state gathered WITHOUT accelkit's checkpoint code, keyed by
    parameter name: torch state dicts; torch's full state dicts for fsdp (FSDP2); ColossalAI's
    own gathering ``optimizer.state_dict()`` for colossalai_zero and colossalai_gemini;
    DeepSpeed's ``safe_get_full_*`` for the deepspeed backends."""
    if accel.name.startswith("deepspeed"):
        return _deepspeed_state(model)
    if accel.name == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        params = get_model_state_dict(model, options=full)
        by_name = get_optimizer_state_dict(model, optimizer.optimizer, options=full)["state"]
    else:
        wrapper = getattr(accel.backend, "optimizer", None)
        if wrapper is not None and ("zero" in accel.name or "gemini" in accel.name):
            opt_state = wrapper.state_dict()  # ColossalAI's own gather
        else:
            opt_state = optimizer.state_dict()
        names = [n for n, p in accel.unwrap(model).named_parameters() if p.requires_grad]
        by_name = {names[int(i)]: entry for i, entry in opt_state["state"].items()}
        params = accel.full_state_dict(model)  # Gemini: its own gather; else the module's
    optim = {}
    for pname, entry in by_name.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                optim[f"{pname}.{key}"] = value.detach().float().cpu().reshape(-1).tolist()
    return {"params": _flat(params), "optim": optim}


def _master_shards(accel: Any) -> list[list[float]]:
    wrapper = getattr(accel.backend, "optimizer", None)
    groups = getattr(wrapper, "_master_param_groups_of_current_rank", None)
    if not groups:
        return []
    return [m.detach().float().cpu().tolist() for ms in groups.values() for m in ms]


def ckpt_job(job: dict[str, Any]) -> dict[str, Any]:
    accel = accelkit.get(
        job["backend"], job.get("options"), precision=job.get("precision"), max_grad_norm=1.0
    )
    net = _model()
    model, optimizer = accel.setup(net, torch.optim.Adam(net.parameters(), lr=LR))
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(_data(), batch_size=job.get("batch", BATCH), shuffle=True),
        shuffle=True,
    )
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    out: dict[str, Any] = {"losses": {}}
    if job.get("load_from"):
        try:
            accel.load(job["load_from"], state)
        except Exception as err:  # the negative twins report their error
            out["error"] = f"{type(err).__name__}: {err}"
            return out
        out["after_load"] = _independent_state(accel, model, optimizer)
        out["masters_after_load"] = _master_shards(accel)
    start = job.get("start", 0)  # where the checkpoint left off; ``step`` counts those run here
    for step, (x, y) in enumerate(loader, start=1):
        loss = F.mse_loss(model(x), y)
        accel.backward(loss)
        accel.step()
        optimizer.zero_grad()
        out["losses"][str(start + step)] = _mean(loss)
        if job.get("save_to") and start + step == job["save_at"]:
            out["at_save"] = _independent_state(accel, model, optimizer)
            out["masters_at_save"] = _master_shards(accel)
            accel.save(job["save_to"], state)
        if start + step >= job["total"]:
            break
    return out


def ckpt_jobs(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    os.environ.setdefault("ACCELKIT_LOG_LEVEL", "WARNING")
    return {job["name"]: _caught(ckpt_job, job) for job in jobs}


# ---- colossalai_hybrid on a tiny Llama ----------------------------------------------------------
def _tiny_llama() -> torch.nn.Module:
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


def _tokens() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randint(0, 128, (16, 12), generator=generator))


def hybrid_jobs(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {job["name"]: _caught(hybrid_train, job) for job in jobs}


def hybrid_train(job: dict[str, Any]) -> dict[str, Any]:
    accel = accelkit.get(
        "colossalai_hybrid",
        {"tp_size": job["tp_size"], "zero_stage": job.get("zero_stage", 0)},
        precision=job.get("precision"),
        accumulation_steps=2,
        max_grad_norm=job.get("max_norm"),
    )
    net = _tiny_llama()
    model, optimizer = accel.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(_tokens(), batch_size=2, shuffle=False), shuffle=False
    )
    losses, norms = [], []
    for (ids,) in loader:
        with accel.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss.float()
            accel.backward(loss)
        losses.append(_mean(loss))
        if accel.step() and job.get("max_norm"):
            norms.append(float(accel.grad_norm))
        optimizer.zero_grad()
    backend = accel.backend
    module = accel.unwrap(model)
    return {
        "losses": losses,
        "norms": norms,
        "params": _flat(module.state_dict()),  # this rank's working weights (its tp shard)
        "masters": _hybrid_masters(module, backend.optimizer),
        "dp": [backend.data_parallel_rank, backend.data_parallel_world_size],
        "applied": accel.applied_steps,
    }


def _hybrid_masters(module: torch.nn.Module, wrapper: Any) -> dict[str, list[float]]:
    """Each parameter's fp32 master by name, read from ColossalAI's optimizer wrapper without
    accelkit's checkpoint code: ZeRO's flat shards (``get_working_to_master_map``) all-gathered
    over the parameter's group and cut to size, or the AMP optimizer's whole masters."""
    zero_map = wrapper.get_working_to_master_map() if hasattr(wrapper, "param_to_pg") else None
    amp_map = getattr(wrapper, "working_to_master_map", None)
    masters: dict[str, list[float]] = {}
    for name, param in module.named_parameters():
        if zero_map is not None and id(param) in zero_map:
            shard = zero_map[id(param)].detach().float()
            group = wrapper.param_to_pg[param]
            gathered = [torch.zeros_like(shard) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, shard, group=group)
            value = torch.cat(gathered)[: param.numel()]
        elif amp_map is not None and param in amp_map and amp_map[param] is not param:
            value = amp_map[param].detach().float().reshape(-1)
        else:
            continue
        masters[name] = value.cpu().tolist()
    return masters


def hybrid_ckpt_jobs(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """colossalai_hybrid (tiny Llama) save after 2 steps / load, with the independent dumps."""
    out = {}
    for job in jobs:
        backend = job["backend"]
        options = {"tp_size": 1, "zero_stage": job["zero_stage"]} if "hybrid" in backend else None
        accel = accelkit.get(backend, options, precision=job.get("precision"))
        net = _tiny_llama()
        model, optimizer = accel.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
        loader = accel.setup_dataloader(
            torch.utils.data.DataLoader(_tokens(), batch_size=2, shuffle=False), shuffle=False
        )
        state = {"model": model, "optimizer": optimizer, "loader": loader}
        result: dict[str, Any] = {"losses": []}
        if job.get("load_from"):
            accel.load(job["load_from"], state)
            result["after_load"] = _hybrid_dump(accel, model, optimizer)
        for step, (ids,) in enumerate(loader, start=1):
            loss = model(input_ids=ids, labels=ids).loss.float()
            accel.backward(loss)
            accel.step()
            optimizer.zero_grad()
            result["losses"].append(_mean(loss))
            if job.get("save_to") and step == 2:
                result["at_save"] = _hybrid_dump(accel, model, optimizer)
                accel.save(job["save_to"], state)
        out[job["name"]] = result
    return out


def _hybrid_dump(accel: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    wrapper = getattr(accel.backend, "optimizer", None)
    zero = wrapper is not None and hasattr(wrapper, "_master_param_groups_of_current_rank")
    opt_state = wrapper.state_dict() if zero else optimizer.state_dict()
    optim = {
        f"{i}.{k}": v.detach().float().cpu().reshape(-1).tolist()
        for i, entry in opt_state["state"].items()
        for k, v in entry.items()
        if isinstance(v, torch.Tensor)
    }
    module = accel.unwrap(model)
    masters = _hybrid_masters(module, wrapper) if wrapper is not None else {}
    return {"optim": optim, "params": _flat(module.state_dict()), "masters": masters}


def overflow_jobs(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """16-true with an initial loss scale so large that the first steps overflow: what accelkit
    reports for skipped steps (GPU only: ColossalAI's fp16 scaler needs CUDA)."""
    out = {}
    for job in jobs:
        accel = accelkit.get(
            job["backend"],
            {**job.get("options", {}), "initial_scale": 2.0**17, "hysteresis": 1},
            precision="16-true",
            max_grad_norm=1.0,
        )
        net = _model()
        model, optimizer = accel.setup(net, torch.optim.Adam(net.parameters(), lr=LR))
        scheduler = accel.setup_scheduler(
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        )
        loader = accel.setup_dataloader(
            torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=False), shuffle=False
        )
        skipped, norms, lrs, scales = [], [], [], []
        for _epoch in range(3):  # 21 steps: the scale halves from 2**17 until fp16 holds
            for x, y in loader:
                accel.backward(F.mse_loss(model(x), y) * 1000)
                accel.step()
                optimizer.zero_grad()
                skipped.append(accel.step_was_skipped)
                norms.append(float(accel.grad_norm))
                lrs.append(scheduler.get_last_lr()[0])
                scales.append(accel.backend.state_dict()["colossalai_loss_scaler"]["scale"])
        out[job["name"]] = {"skipped": skipped, "norms": norms, "lrs": lrs, "scales": scales}
    return out


# ---- colossalai_hybrid with tensor parallelism (tp_size=2) --------------------------------------
def _tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4, n_positions=32)
    return GPT2LMHeadModel(config)


def _gathered_state(accel: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """Whole weights and Adam state by parameter name, gathered WITHOUT accelkit's checkpoint
    code: the module's state_dict (Shardformer's layers gather their pieces) and ColossalAI's own
    ``gather_from_sharded_optimizer_state`` under tensor parallelism; torch's state dicts else."""
    module = accel.unwrap(model)
    names = {id(p): n for n, p in module.named_parameters()}
    backend = accel.backend
    tp_group = getattr(getattr(backend, "plugin", None), "tp_group", None)
    if accel.name == "colossalai_hybrid":
        base = backend.torch_optimizer(backend.optimizer)
        from colossalai.checkpoint_io.hybrid_parallel_checkpoint_io import (
            HybridParallelCheckpointIO,
        )
        from colossalai.tensor.d_tensor import get_global_shape, is_distributed_tensor
    else:
        base = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    # bf16-true: the optimizer steps fp32 masters; ColossalAI maps each to its working piece
    to_working = getattr(getattr(backend, "optimizer", None), "master_to_working_map", {})
    optim = {}
    for group in base.param_groups:
        for param in group["params"]:
            state = base.state.get(param, {})
            working = to_working.get(param, param)
            if accel.name == "colossalai_hybrid":
                distributed = is_distributed_tensor(working)
                shape = get_global_shape(working) if distributed else working.shape
                state = HybridParallelCheckpointIO.gather_from_sharded_optimizer_state(
                    state, param, shape, backend.plugin.dp_group, tp_group, False, False
                )
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    optim[f"{names[id(working)]}.{key}"] = value.float().reshape(-1).tolist()
    return {"params": _flat(module.state_dict()), "optim": optim}


def hybrid_tp_ckpt_job(job: dict[str, Any]) -> dict[str, Any]:
    """Train 4 steps (saving after 2) or load and train the rest, with the gathered dumps."""
    backend = job["backend"]
    options = {"tp_size": 2, "zero_stage": 0} if backend == "colossalai_hybrid" else None
    accel = accelkit.get(backend, options, precision=job.get("precision"))
    net = _tiny_gpt2() if job.get("model") == "gpt2" else _tiny_llama()
    model, optimizer = accel.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(_tokens(), batch_size=2, shuffle=False), shuffle=False
    )
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    result: dict[str, Any] = {"losses": []}
    if job.get("model") == "gpt2":  # Shardformer's GPT-2 forward calls torch.cuda.set_device
        accel.save(job["save_to"], state)
        return result
    if job.get("load_from"):
        accel.load(job["load_from"], state)
        result["after_load"] = _gathered_state(accel, model, optimizer)
    for step, (ids,) in enumerate(loader, start=1):
        loss = model(input_ids=ids, labels=ids).loss.float()
        accel.backward(loss)
        accel.step()
        optimizer.zero_grad()
        result["losses"].append(_mean(loss))
        if job.get("save_to") and step == 2:
            result["at_save"] = _gathered_state(accel, model, optimizer)
            accel.save(job["save_to"], state)
        if step == 4:
            break
    return result


def hybrid_tp_ckpt_jobs(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    os.environ.setdefault("ACCELKIT_LOG_LEVEL", "WARNING")
    return {job["name"]: _caught(hybrid_tp_ckpt_job, job) for job in jobs}
