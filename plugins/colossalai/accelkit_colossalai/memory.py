"""Per-GPU memory of the ColossalAI backends, for ``accelkit plan`` (the ``accelkit_estimate_memory``
hook). Nothing here imports ColossalAI: the terms were read from ColossalAI 0.5.0's source
(``zero/low_level/low_level_optim.py``, ``zero/gemini/``, ``booster/plugin/``) and the option names
and defaults come from :mod:`accelkit_colossalai.options`, the dataclasses ``accelkit.get`` validates.

Bytes per device. ``P`` parameters, ``T`` trainable, ``N`` ranks, ``s`` the parameter dtype's bytes
(2 for ``-true``; 4 for ``32-true`` and ``bf16-mixed``, whose plugin runs in fp32 under accelkit's
autocast), ``k`` optimizer states per parameter, ``S`` this rank's flat shard of the trainable
parameters (LowLevelZero pads every parameter to a multiple of ``N``: ``S = sum(ceil(n/N))``),
``B`` the ZeRO bucket (``reduce_bucket_size_in_m`` x 2**20 elements):

- ``colossalai_ddp``: torch DDP through TorchDDPPlugin, whose ``gradient_as_bucket_view`` defaults
  to False: DDP's buckets (``T*s``) live beside the gradients (``T*s``), unlike accelkit's ``ddp``.
- ``colossalai_zero`` (LowLevelZero): parameters whole, an fp32 master shard (``4S``; also when the
  parameters are fp32, ``master_weights=True``) and the optimizer state on it (``4kS``). Stage 1
  keeps every rank's gradient pieces after the all-reduce (``N*S*s``), stage 2 only its own
  (``S*s``); backward adds a flattened bucket (stage 1) or a bucket and its flat copy (stage 2).
  The step makes an fp32 copy of the gradient shard (``-true``) and the foreach temporary.
  ``cpu_offload`` puts the master, the optimizer state and the fp32 gradient copy in host memory.
- ``colossalai_gemini``: parameters in chunks (bf16/fp16), sharded over the ZeRO group
  (``N / (tp_size * extra_dp_size)``) with fp32 master chunks and HybridAdam's fp32 state; the
  gradients are written into the half-precision chunks (no memory of their own); two chunks are
  gathered at a time. A model smaller than ``min_chunk_size_m`` x 2**20 elements is one chunk kept
  gathered on every GPU: nothing is sharded or offloaded. ``placement_policy="static"`` moves
  ``offload_optim_frac`` of the master and optimizer chunks (and their gradients) to the CPU, and,
  only when ``shard_param_frac`` and ``offload_optim_frac`` are both 1, ``offload_param_frac`` of
  the parameter chunks (ColossalAI ignores it otherwise); ``"auto"`` keeps master and optimizer on
  the CPU and fills the GPU with parameter chunks up to ``steady_cuda_cap_ratio``: the estimate is
  the least it needs.
- ``colossalai_hybrid``: ``tp_size`` divides the parameters (``pp_size`` must be 1, as at
  ``accelkit.get``), the data-parallel size ``N / (tp * sp)`` the ZeRO shards; ``zero_stage=0`` is DDP (buckets as on colossalai_ddp)
  with an fp32 master for ``-true``; 1/2 the LowLevelZero terms. The activation term under tensor
  parallelism is approximate (Megatron's split: 24 of every 34 bytes of a transformer layer's
  activations divided by ``tp_size``, all of them with sequence parallelism).

A precision the backend does not run (Gemini has no ``-mixed`` mode, LowLevelZero no ``16-mixed``)
is estimated at its ``-true`` twin and says so (``precision`` and ``note`` in the answer);
``accelkit plan`` shows such rows but does not recommend them.
"""

from __future__ import annotations

from typing import Any

from accelkit_colossalai import options as opts

MiB_ELEMENTS = 2**20

#: backend name -> (options dataclass, precisions it runs)
BACKENDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "colossalai_ddp": (
        opts.DDPOptions,
        ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"),
    ),
    "colossalai_zero": (opts.ZeroOptions, tuple(opts.ZERO_DTYPES)),
    "colossalai_gemini": (opts.GeminiOptions, tuple(opts.GEMINI_DTYPES)),
    "colossalai_hybrid": (opts.HybridOptions, tuple(opts.HYBRID_DTYPES)),
}
#: the backends that run on the CPU too (Gemini needs CUDA)
CPU_BACKENDS = ("colossalai_ddp", "colossalai_zero", "colossalai_hybrid")
#: a precision the backend lacks -> the one it is estimated at instead
TWIN = {"bf16-mixed": "bf16-true", "16-mixed": "16-true"}
#: Megatron's per-layer activation split (bytes per token and hidden unit): 10 replicated, 24
#: divided by the tensor-parallel size (Korthikanti et al. 2022, without the attention matrix)
TP_REPLICATED, TP_SHARDED = 10, 24

OFFLOAD_SPEED = 3.0


def option_values(backend: str, given: dict[str, Any]) -> dict[str, Any]:
    """The backend's options as ``accelkit.get`` validates them (defaults, types; an unknown
    name is a ConfigError naming the closest valid one: a typo must not pass as a default)."""
    from accelkit.sdk import build_options, options_as_dict

    return options_as_dict(build_options(BACKENDS[backend][0], f"backend {backend!r}", None, given))


def estimate(backend: str, stats: dict[str, Any], options: dict[str, Any]) -> Any:
    """The estimate for a ``colossalai_*`` name, or None (another backend, or nothing to say)."""
    if backend not in BACKENDS:
        return None
    device_type = options.get("device_type", "cuda")
    if device_type != "cuda" and not (device_type == "cpu" and backend in CPU_BACKENDS):
        return None
    o = option_values(backend, options.get("backend_options") or {})
    requested = options["precision"]
    supported = BACKENDS[backend][1]
    if backend == "colossalai_hybrid" and o["zero_stage"] > 0:
        supported = ("bf16-true", "16-true")  # hybrid ZeRO has no fp32 mode
    precision = requested if requested in supported else TWIN.get(requested)
    if precision not in supported:
        return None
    build = {
        "colossalai_ddp": _ddp,
        "colossalai_zero": _zero,
        "colossalai_gemini": _gemini,
        "colossalai_hybrid": _hybrid,
    }[backend]
    result = build(stats, {**options, "precision": precision}, o)
    if result is not None and precision != requested:
        result["precision"] = precision
        notes = [f"estimated at {precision}: {backend} does not run {requested}"]
        result["note"] = "; ".join(notes + ([result["note"]] if result.get("note") else []))
    return result


# ---- shared terms -----------------------------------------------------------------------------
def _common(stats: dict[str, Any], options: dict[str, Any]) -> tuple[int, int, int, int, str]:
    from accelkit.sdk import LOW_PRECISIONS, optimizer_terms

    states, temporaries = optimizer_terms(options)
    s = 2 if options["precision"] in LOW_PRECISIONS else 4
    N = max(1, int(options["world_size"]))
    return N, s, states, (1 if temporaries == "foreach" and states else 0), options["precision"]


def _padded_shard(stats: dict[str, Any], N: int, divisor: int = 1) -> int:
    """Elements of this rank's LowLevelZero shard: each trainable parameter padded to ``N``."""
    numels = stats.get("param_numels") or []
    if divisor == 1 and numels and sum(numels) == stats["trainable_params"]:
        return sum(-(-n // N) for n in numels)
    return -(-(stats["trainable_params"] // divisor) // N)


def _ddp_terms(
    stats: dict[str, Any], T_l: int, s: int, k: int, foreach: int, kind: str, bucket_view: bool
) -> dict[str, Any]:
    """torch DDP on ``T_l`` trainable elements of dtype ``s`` (buckets allocated at wrap time)."""
    buckets = T_l * s
    grads = 0 if bucket_view else T_l * s  # the .grad tensors beside the buckets
    optimizer = k * T_l * s
    temp = foreach * T_l * s
    if bucket_view:
        dynamic = stats["step_peak"](kind, 0.0, 1.0)
        step = temp
    else:
        dynamic = stats["step_peak"](kind, 1.0, 1.0)
        step = grads + temp
    return {
        "buckets": buckets,
        "grads": buckets + grads,
        "optimizer": optimizer,
        "dynamic": dynamic,
        "step": step,
    }


def _finish(result: dict[str, Any], speed: float, note: str) -> dict[str, Any]:
    result.setdefault("master", 0)
    result.setdefault("host", 0)
    result.update(relative_step_time=speed, speed_note=note)
    return result


# ---- colossalai_ddp -----------------------------------------------------------------------------
def _ddp(stats: dict[str, Any], options: dict[str, Any], o: dict[str, Any]) -> dict[str, Any]:
    from accelkit.sdk import trace_kind

    N, s, k, foreach, precision = _common(stats, options)
    P, T = stats["params"], stats["trainable_params"]
    bucket_view = bool(o["gradient_as_bucket_view"])
    d = _ddp_terms(stats, T, s, k, foreach, trace_kind(precision), bucket_view)
    params = P * s + stats["buffer_bytes"]
    persistent = params + d["buckets"] + d["optimizer"]
    result = {
        "params": params,
        "grads": d["grads"],
        "optimizer": d["optimizer"],
        "activations": d["dynamic"],
        "peak": persistent + max(d["dynamic"], d["step"]),
        "world_size": N,
        "formula": (
            "P*s + T*s (buckets) + k*T*s + max(traced step without grads, foreach temp T*s)"
            if bucket_view
            else "P*s + T*s (buckets) + k*T*s + max(traced step incl. grads, grads T*s + "
            "foreach temp T*s)  [gradient_as_bucket_view=False: grads beside the buckets]"
        )
        + f"  (s={s}, k={k}, N={N})",
    }
    if not bucket_view:
        result["variants"] = [
            {"label": "gradient_as_bucket_view", "options": {"gradient_as_bucket_view": True}}
        ]
    return _finish(result, 1.0, "torch DDP through TorchDDPPlugin: one all-reduce per step")


# ---- colossalai_zero (and hybrid's zero_stage 1/2) --------------------------------------------
def _low_level_zero(
    stats: dict[str, Any],
    *,
    P_l: int,
    T_l: int,
    shard: int,
    N: int,
    s: int,
    k: int,
    foreach: int,
    kind: str,
    stage: int,
    cpu_offload: bool,
    master_weights: bool,
    bucket: int,
    activation_factor: float = 1.0,
) -> dict[str, Any]:
    """LowLevelZeroOptimizer's memory: ``shard`` elements per rank of ``T_l`` over ``N`` ranks."""
    params = P_l * s + stats["buffer_bytes"]
    state_bytes = 4 if master_weights else s  # torch's optimizer steps the master (or the split)
    master = 4 * shard if master_weights else 0
    optimizer = k * state_bytes * shard
    grads = (N * shard if stage == 1 else shard) * s
    grad32 = 4 * shard if master_weights and s != 4 else 0  # grad.to(master dtype) in step()
    temp = foreach * state_bytes * shard
    host = 0
    if cpu_offload:
        host = master + optimizer + 4 * shard  # fp32 gradient copy on the master's device
        master = optimizer = grad32 = temp = 0
    flat = min(bucket, T_l) * s
    # stage 1: every gradient stays (traced in full) and one bucket is flattened at a time;
    # stage 2: only the own shards stay, plus a bucket's gradients and its flat copy
    grad_fraction = 1.0 if stage == 1 else 1.0 / N
    after_first_grad = flat if stage == 1 else 2 * flat
    dynamic = int(
        activation_factor * stats["step_peak"](kind, grad_fraction, 1.0, after_first_grad)
    )
    step = grads + grad32 + temp
    persistent = params + master + optimizer
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "master": master,
        "activations": dynamic,
        "peak": persistent + max(dynamic, step),
        "host": host,
    }


def _zero(stats: dict[str, Any], options: dict[str, Any], o: dict[str, Any]) -> dict[str, Any]:
    from accelkit.sdk import trace_kind

    N, s, k, foreach, precision = _common(stats, options)
    stage = int(o["stage"])
    if stage not in (1, 2):
        raise ValueError(f"colossalai_zero: stage must be 1 or 2, got {stage}")
    bucket = int(o["reduce_bucket_size_in_m"]) * MiB_ELEMENTS
    offload = bool(o["cpu_offload"])
    result = _low_level_zero(
        stats,
        P_l=stats["params"],
        T_l=stats["trainable_params"],
        shard=_padded_shard(stats, N),
        N=N,
        s=s,
        k=k,
        foreach=foreach,
        kind=trace_kind(precision),
        stage=stage,
        cpu_offload=offload,
        master_weights=bool(o["master_weights"]),
        bucket=bucket,
    )
    grads = "N*S*s (every rank's pieces)" if stage == 1 else "S*s (own shard)"
    result.update(
        world_size=N,
        formula=(
            f"P*s + 4S master + k*4*S states + max(traced step (grads {grads}) + "
            f"{'B*s flat bucket' if stage == 1 else '2*B*s bucket and flat copy'}, "
            "grads + 4S fp32 grad copy (-true) + foreach temp)"
            + ("; host: 4S + k*4*S + 4S (cpu_offload)" if offload else "")
            + f"  (s={s}, k={k}, N={N}, S={_padded_shard(stats, N)}, B={bucket})"
        ),
    )
    if offload:
        speed, note = OFFLOAD_SPEED, "optimizer step on the CPU; traffic over PCIe every step"
    elif stage == 1:
        speed, note = 1.05, "optimizer state sharded; gradients all-reduced in buckets"
    else:
        speed, note = 1.1, "optimizer state and gradients sharded; reduce-scatter in buckets"
    if stage == 1 and not offload:
        result["variants"] = [
            {"label": "stage=2", "options": {"stage": 2}},
            {"label": "stage=2 cpu_offload", "options": {"stage": 2, "cpu_offload": True}},
        ]
    return _finish(result, speed, note)


# ---- colossalai_gemini --------------------------------------------------------------------------
def _gemini(stats: dict[str, Any], options: dict[str, Any], o: dict[str, Any]) -> Any:
    from accelkit.sdk import OPTIMIZERS

    if OPTIMIZERS[options.get("optimizer", "adamw")][0] != 2:
        return None  # Gemini steps only HybridAdam / CPUAdam / FusedAdam (Adam-like: 2 states)
    N = max(1, int(options["world_size"]))
    s, k = 2, 2
    tp, edp = max(1, int(o["tp_size"])), max(1, int(o["extra_dp_size"]))
    z = max(1, N // (tp * edp))  # the ZeRO group: chunks are sharded over it
    P_l, T_l = stats["params"] // tp, stats["trainable_params"] // tp
    largest = max(stats.get("param_numels") or [0]) // tp
    min_chunk = round(float(o["min_chunk_size_m"]) * MiB_ELEMENTS)
    master_weights = bool(o["master_weights"])
    auto = o["placement_policy"] == "auto"
    if o["placement_policy"] not in ("static", "auto"):
        raise ValueError(f"colossalai_gemini: placement_policy {o['placement_policy']!r}")
    f_s, f_o, f_p = (
        float(o[x]) for x in ("shard_param_frac", "offload_optim_frac", "offload_param_frac")
    )
    notes = []
    if T_l < min_chunk:
        # ColossalAI's chunk search keeps a group smaller than one chunk gathered everywhere
        z, f_s, f_o, f_p, auto = 1, 1.0, 0.0, 0.0, False
        notes.append(
            f"the model ({T_l} elements per tensor-parallel rank) is smaller than "
            f"min_chunk_size_m={o['min_chunk_size_m']}: one chunk kept gathered on every GPU, "
            "not sharded, not offloaded"
        )
    elif auto:
        f_s, f_o, f_p = 1.0, 1.0, 1.0  # master, state, gradients on the CPU; chunks evictable
    elif f_p > 0 and (f_s != 1.0 or f_o != 1.0):
        f_p = 0.0
        notes.append(
            "offload_param_frac ignored: ColossalAI applies it only with shard_param_frac=1.0 "
            "and offload_optim_frac=1.0"
        )
    chunked = T_l >= min_chunk
    fp16 = 2 * P_l
    params = int(fp16 * ((1 - f_s) + f_s / z) * (1 - f_p)) + stats["buffer_bytes"]
    master_all = 4 * T_l // z if master_weights else 0
    optim_all = 4 * k * T_l // z
    grads_all = 0 if master_weights else 2 * T_l // z  # reuse_fp16_chunk: grads in the chunks
    master = int(master_all * (1 - f_o))
    optimizer = int(optim_all * (1 - f_o))
    grads = int(grads_all * (1 - f_o))
    host = int((master_all + optim_all + grads_all + fp16 // z) * f_o)  # + the fp16 shards
    if auto:
        host = master_all + optim_all + grads_all + fp16 // z
    chunk = max(min_chunk, largest)
    # two chunks at a time are gathered from their shards (or fetched back from the CPU)
    moves = chunked and f_s > 0 and (z > 1 or f_p > 0)
    gathered = min(P_l, chunk + min_chunk) * s if moves else 0
    dynamic = stats["step_peak"]("low", 0.0, 0.0) + gathered
    peak = params + master + optimizer + grads + dynamic
    if auto:
        speed, note = 2.0, "chunks moved between CPU and GPU as memory demands; step on the CPU"
    elif not chunked:
        speed, note = 1.05, "one chunk kept gathered: no parameter gathering, one reduction"
    elif f_o > 0 or f_p > 0:
        speed = round(1.3 + (OFFLOAD_SPEED - 1.3) * max(f_o, f_p), 3)
        note = "chunks gathered per layer; the offloaded part steps on the CPU (CPUAdam)"
    else:
        speed, note = 1.3, "chunks gathered for every layer in forward and backward"
    policy = "auto" if auto else f"static, shard {f_s:g}, offload optim {f_o:g}, param {f_p:g}"
    result = {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "master": master,
        "activations": dynamic,
        "peak": peak,
        "host": host,
        "world_size": N,
        "formula": (
            "2P*((1-shard)+shard/z)*(1-offload_param) + (4T + 8T)/z*(1-offload_optim) + traced "
            "step (bf16, grads into the chunks) + 2 chunks gathered x 2; host: "
            "(4T + 8T + 2T)/z*offload_optim"
            + (
                " (auto: the least it needs; it fills the GPU up to steady_cuda_cap_ratio)"
                if auto
                else ""
            )
            + f"  (z={z}, tp={tp}, chunk~{chunk}, {policy})"
        ),
    }
    if notes:
        result["note"] = "; ".join(notes)
    if chunked and not auto and f_o == 0 and f_p == 0:
        result["variants"] = [
            {"label": "offload_optim_frac=1.0", "options": {"offload_optim_frac": 1.0}},
            {"label": "placement_policy=auto", "options": {"placement_policy": "auto"}},
        ]
    return _finish(result, speed, note)


# ---- colossalai_hybrid --------------------------------------------------------------------------
def _hybrid(stats: dict[str, Any], options: dict[str, Any], o: dict[str, Any]) -> dict[str, Any]:
    from accelkit.sdk import trace_kind

    N, s, k, foreach, precision = _common(stats, options)
    tp = max(1, int(o["tp_size"]))  # pp_size > 1 is refused, as at accelkit.get
    sp_on = bool(o["enable_sequence_parallelism"])
    mode = o["sequence_parallelism_mode"] or ("all_to_all" if sp_on else None)
    sp = int(o["sp_size"] or 1) if sp_on and mode in ("all_to_all", "ring_attn") else 1
    if N % (tp * sp):
        raise ValueError(f"colossalai_hybrid: {N} GPUs are not divisible by tp*sp={tp * sp}")
    dp = N // (tp * sp)
    zero = int(o["zero_stage"])
    P_l, T_l = stats["params"] // tp, stats["trainable_params"] // tp
    if sp_on and mode in ("split_gather", "ring"):
        act = 1.0 / tp
    else:
        act = (TP_REPLICATED + TP_SHARDED / tp) / (TP_REPLICATED + TP_SHARDED) / sp
    kind = trace_kind(precision)
    notes = []
    if tp > 1 or sp > 1:
        notes.append(
            "activations approximate under tensor/sequence parallelism (Megatron's split); "
            "tp_size needs a model Shardformer has a policy for"
        )
    if zero in (1, 2):
        shard = _padded_shard(stats, dp, tp)
        bucket = int(o["zero_bucket_size_in_m"]) * MiB_ELEMENTS
        result = _low_level_zero(
            stats,
            P_l=P_l,
            T_l=T_l,
            shard=shard,
            N=dp,
            s=s,
            k=k,
            foreach=foreach,
            kind=kind,
            stage=zero,
            cpu_offload=bool(o["cpu_offload"]),
            master_weights=True,
            bucket=bucket,
            activation_factor=act,
        )
        if dp == 1:  # the plugin wraps in DDP here too (a group of one)
            result["grads"] += T_l * s
            result["peak"] += T_l * s
        formula = (
            f"LowLevelZero stage {zero} over dp={dp} on P/tp: P*s/tp + (4S + k*4*S) "
            "+ max(traced step x activation factor, grads + fp32 copy + temp)"
        )
        speed, note = (
            (1.05, "ZeRO-1 over the data-parallel group")
            if zero == 1
            else (1.1, "ZeRO-2 over the data-parallel group")
        )
        if o["cpu_offload"]:
            speed, note = OFFLOAD_SPEED, "optimizer step on the CPU; traffic over PCIe every step"
    else:
        params = P_l * s + stats["buffer_bytes"]
        bucket_view = bool(o["plugin_kwargs"].get("gradient_as_bucket_view", False))
        master = 4 * T_l if s != 4 else 0  # HybridParallelAMPOptimizer's fp32 master (-true)
        state_bytes = 4
        optimizer = k * state_bytes * T_l
        temp = foreach * state_bytes * T_l
        buckets = T_l * s  # the plugin always wraps in DDP without pipeline parallelism
        grads = T_l * s
        dynamic = int(act * stats["step_peak"](kind, 0.0 if bucket_view else 1.0, 1.0))
        # the step: fp32 copies of the gradients for the master (-true), then the temporary
        step = (0 if bucket_view else grads) + (4 * T_l if master else 0) + temp
        result = {
            "params": params,
            "grads": grads + (buckets if not bucket_view else 0),
            "optimizer": optimizer,
            "master": master,
            "activations": dynamic,
            "peak": params + master + optimizer + buckets + max(dynamic, step),
            "host": 0,
        }
        formula = (
            "P*s/tp + T*s DDP buckets + grads T*s + (4T master with -true) + k*4*T "
            "+ max(traced step x activation factor, grads + 4T fp32 copy + temp)"
        )
        speed, note = 1.0, "torch DDP over the data-parallel group"
    if tp > 1:
        speed, note = speed + 0.2, note + "; tensor-parallel collectives in every layer"
    result.update(
        world_size=N,
        formula=formula + f"  (s={s}, k={k}, tp={tp}, sp={sp}, dp={dp}, "
        f"activation factor {act:.3f})",
    )
    if notes:
        result["note"] = "; ".join(notes)
    return _finish(result, speed, note)
