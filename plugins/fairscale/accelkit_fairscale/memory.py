"""Per-GPU memory of the FairScale backends, for ``accelkit plan`` (the ``accelkit_estimate_memory``
hook). Nothing here imports FairScale. Bytes per device, ``P`` parameters, ``T`` trainable, ``N``
ranks, ``s`` the parameter dtype's bytes, ``k`` optimizer states per parameter:

- ``fairscale_oss``: torch DDP for the gradients (whole, in DDP's buckets) and OSS for the optimizer,
  whose state each rank keeps for its own parameters only: ``P*s + T*s + k*T*s/N``.
- ``fairscale_sdp``: ShardedDataParallel sends each gradient to the rank that owns its parameter
  and frees it elsewhere: ``P*s + (T*s + k*T*s)/N`` after backward.
- ``fairscale_fsdp``: flat parameters sharded like FSDP2: the FSDP formula of
  :func:`accelkit.benchmark.memory.estimate_fsdp` (no offload variant).
"""

from __future__ import annotations

from typing import Any

SPEED = {
    "fairscale_oss": (1.05, "DDP all-reduce plus a broadcast of each rank's updated parameters"),
    "fairscale_sdp": (1.1, "gradients reduced to their owner, parameters broadcast back"),
    "fairscale_fsdp": (1.3, "parameters gathered per unit in forward and backward"),
}


def estimate(backend: str, stats: dict[str, Any], options: dict[str, Any]) -> Any:
    from accelkit.sdk import LOW_PRECISIONS, estimate_fsdp, optimizer_terms, trace_kind

    if backend not in SPEED or options.get("device_type", "cuda") != "cuda":
        return None
    if backend == "fairscale_fsdp":
        result = estimate_fsdp(stats, {**options, "backend_options": {}})
        result.pop("variants", None)
    else:
        precision = options["precision"]
        N = max(1, int(options["world_size"]))
        states, temporaries = optimizer_terms(options)
        s = 2 if precision in LOW_PRECISIONS else 4
        P, T = stats["params"], stats["trainable_params"]
        params = P * s + stats["buffer_bytes"]
        optimizer = states * T * s // N
        temp = T * s // N if temporaries == "foreach" and states else 0
        kind = trace_kind(precision)
        if backend == "fairscale_oss":
            grads = T * s  # DDP's bucket views, kept between steps
            persistent = params + grads + optimizer
            dynamic = stats["step_peak"](kind, 0.0, 1.0)
            step = temp
            formula = "P*s + T*s (DDP buckets) + k*T*s/N + max(traced step, temp T*s/N)"
        else:
            grads = T * s // N
            persistent = params + optimizer
            dynamic = stats["step_peak"](kind, 1.0 / N, 1.0)
            step = grads + temp
            formula = "P*s + k*T*s/N + max(traced step (grads T*s/N), grads + temp T*s/N)"
        result = {
            "params": params,
            "grads": grads,
            "optimizer": optimizer,
            "master": 0,
            "activations": dynamic,
            "peak": persistent + max(dynamic, step),
            "host": 0,
            "world_size": N,
            "formula": formula + f"  (s={s}, k={states}, N={N})",
        }
    speed, note = SPEED[backend]
    result.update(relative_step_time=speed, speed_note=note)
    return result
