"""Per-GPU memory of the Apex backends, for ``accelkit plan`` (the ``accelkit_estimate_memory``
hook). Nothing here imports Apex; the option names and defaults are the backends' own dataclasses
(:class:`~accelkit_apex.backend.ApexOptions`, :class:`~accelkit_apex.distributed_adam.DistributedAdamOptions`).
Bytes per device, ``P`` parameters, ``T`` trainable, ``N`` ranks, ``s`` the parameter dtype's bytes,
``k`` optimizer states per parameter:

- ``apex``: one device, as ``cuda``, with the optimizer swapped at ``setup``: FusedAdam keeps
  torch AdamW's two states, always in fp32 (``8T``, also for ``-true`` parameters, where torch's
  AdamW keeps them in the parameters' dtype), and its multi-tensor kernel needs no foreach
  temporary; FusedSGD keeps the momentum in the parameters' dtype (and refuses bf16 parameters).
  ``fused_optimizer=False`` is the ``cuda`` estimate.
- ``apex_distributed_adam`` (DistributedFusedAdam, ZeRO-2): parameters whole; an fp32 copy of the
  parameters (``store_params``) and the two fp32 moments sharded over ``N``, allocated in whole
  buckets (``bucket_cap_mb`` MiB of the gradient-sync dtype each; the last bucket is not trimmed,
  so a model smaller than a bucket still gets a whole bucket's shard); the reduced gradient shards
  in the gradient-sync dtype; in backward, two gradient buckets in flight; in the step,
  ``pipeline_size`` buckets of parameters all-gathered. The bucket terms follow Apex's source
  (``distributed_fused_adam.py``); they were not measured on a GPU here.
"""

from __future__ import annotations

from typing import Any

SPEED = {
    "apex": (1.0, "one GPU; fused Adam/SGD kernels, otherwise the cuda path"),
    "apex_distributed_adam": (
        1.05,
        "ZeRO-2: gradients reduce-scattered in buckets during backward, parameters all-gathered "
        "after the step",
    ),
}
SYNC_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Apex aligns shards to 128 bytes
ALIGN_BYTES = 128


def option_values(backend: str, given: dict[str, Any]) -> dict[str, Any]:
    """The backend's options as ``accelkit.get`` validates them (defaults, types; an unknown
    name is a ConfigError naming the closest valid one), as a dict."""
    from accelkit.sdk import build_options, options_as_dict

    if backend == "apex":
        from accelkit_apex.backend import ApexOptions as cls
    else:
        from accelkit_apex.distributed_adam import DistributedAdamOptions as cls
    return options_as_dict(build_options(cls, f"backend {backend!r}", None, given))


def estimate(backend: str, stats: dict[str, Any], options: dict[str, Any]) -> Any:
    """The estimate for ``apex`` / ``apex_distributed_adam``, or None (another backend, no CUDA,
    or an optimizer the backend refuses)."""
    if backend not in SPEED or options.get("device_type", "cuda") != "cuda":
        return None
    o = option_values(backend, options.get("backend_options") or {})
    if backend == "apex":
        return _apex(stats, options, o)
    return _distributed_adam(stats, options, o)


def _apex(stats: dict[str, Any], options: dict[str, Any], o: dict[str, Any]) -> Any:
    from accelkit.sdk import LOW_PRECISIONS, estimate_single_or_ddp, optimizer_terms, trace_kind

    if not o["fused_optimizer"]:
        result = estimate_single_or_ddp(stats, options, distributed=False)
        result["formula"] += "  [fused_optimizer=False: torch's optimizer, as on cuda]"
        return result
    precision = options["precision"]
    name = options.get("optimizer", "adamw")
    states, _ = optimizer_terms(options)
    s = 2 if precision in LOW_PRECISIONS else 4
    adam = name.startswith("adamw")
    if not adam and precision == "bf16-true":
        return None  # FusedSGD updates fp16 and fp32 parameters only: refused at setup
    state_bytes = 4 if adam else s  # FusedAdam's moments are fp32; FusedSGD's momentum is not
    P, T = stats["params"], stats["trainable_params"]
    params = P * s + stats["buffer_bytes"]
    grads = T * s
    optimizer = states * state_bytes * T
    dynamic = stats["step_peak"](trace_kind(precision), 1.0, 1.0)
    speed, note = SPEED["apex"]
    N = int(options["world_size"])
    if N > 1:
        speed, note = float(N), f"uses 1 of the {N} GPUs"
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "master": 0,
        "activations": dynamic,
        "peak": params + optimizer + max(dynamic, grads),
        "host": 0,
        "world_size": 1,
        "formula": (
            f"P*s + k*{state_bytes}*T ({'FusedAdam: fp32 moments' if adam else 'FusedSGD'}, no "
            "temporary) + max(traced step incl. grads, grads T*s)"
            f"  (s={s}, k={states})"
        ),
        "relative_step_time": speed,
        "speed_note": note,
    }


def _distributed_adam(stats: dict[str, Any], options: dict[str, Any], o: dict[str, Any]) -> Any:
    from accelkit.sdk import LOW_PRECISIONS, optimizer_terms, trace_kind

    states, _ = optimizer_terms(options)
    if states != 2 or not options.get("optimizer", "adamw").startswith("adamw"):
        return None  # DistributedFusedAdam replaces a torch Adam/AdamW only
    precision = options["precision"]
    N = max(1, int(options["world_size"]))
    s = 2 if precision in LOW_PRECISIONS else 4
    g = s if o["grad_sync_dtype"] == "auto" else SYNC_BYTES[o["grad_sync_dtype"]]
    P = stats["params"]
    # Apex: bucket = bucket_cap_mb MiB of the grad-sync dtype, shard = bucket / N rounded down
    # to 128 bytes (at least 128 bytes); every bucket holds N shards, the last one too
    align = ALIGN_BYTES // g
    shard = max(int(float(o["bucket_cap_mb"]) * 2**20 / g / N) // align * align, align)
    bucket = shard * N
    buckets = -(-P // bucket)
    local = buckets * shard  # elements of optimizer state per rank
    master = 4 * local  # store_params: the fp32 copy of the parameters
    optimizer = 2 * 4 * local
    grad_shards = g * local
    in_flight = min(2, buckets) * bucket * g  # the bucket filling and the one reducing
    params = P * s + stats["buffer_bytes"]
    if o["contiguous_param_buffer"]:
        params = buckets * bucket * s + stats["buffer_bytes"]  # parameters become its views
    persistent = params + master + optimizer
    if o["contiguous_grad_buffer"]:
        persistent += buckets * bucket * g
        in_flight = 0
    traced = 2 if precision in LOW_PRECISIONS else 4
    dynamic = stats["step_peak"](
        trace_kind(precision), (g / traced) / N, 1.0, after_first_grad=in_flight
    )
    step = grad_shards + min(int(o["pipeline_size"]), buckets) * bucket * s
    speed, note = SPEED["apex_distributed_adam"]
    return {
        "params": params,
        "grads": grad_shards + (buckets * bucket * g if o["contiguous_grad_buffer"] else 0),
        "optimizer": optimizer,
        "master": master,
        "activations": dynamic,
        "peak": persistent + max(dynamic, step),
        "host": 0,
        "world_size": N,
        "formula": (
            "P*s + (4 + 8) x L + max(traced step (grad shards) + 2 buckets x g, grad shards + "
            "pipeline_size buckets x s), L = ceil(P / bucket) x bucket / N"
            f"  (s={s}, g={g}, N={N}, bucket={bucket} elements, L={local})"
        ),
        "relative_step_time": speed,
        "speed_note": note,
    }
