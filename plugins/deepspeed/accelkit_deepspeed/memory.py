"""Per-GPU memory of the DeepSpeed backends, for ``accelkit plan`` (the ``accelkit_estimate_memory``
hook). Nothing here imports DeepSpeed.

The coefficients were measured on DeepSpeed 0.19.8 through accelkit (every tensor's bytes while
it lived, on a 1M-parameter model, 1 and 2 ranks), then written as formulas. Bytes per device,
``P`` parameters, ``N`` ranks, ``s`` the parameter dtype's bytes (4 for ``32-true`` and the
``-mixed`` strings, whose parameters stay fp32 under DeepSpeed's ``torch_autocast``; 2 for
``-true``), ``B`` the ZeRO ``reduce_bucket_size`` (DeepSpeed's default 5e8 elements):

- ZeRO-0: like one device; ``-true`` adds an fp32 master (``P*s + 12 P``, 8 P more in the step).
- ZeRO-1 and ZeRO-2: parameters whole plus an fp32 master partition and AdamW's two states,
  ``P*s + 12 P/N``; in the step, ``12 P/N`` more (gradient partition, its fp32 copy, the update's
  temporary). In backward, at the first gradient, DeepSpeed allocates its gradient bucket, ``B``
  elements of the parameter dtype, one per communication dtype (``-mixed``: low precision for Linear/Conv
  parameters, fp32 for the rest, so two buckets), whatever the model's size: with the default
  ``B`` that is 2 GB per fp32 bucket.
- ZeRO-3: everything partitioned, ``24 P/N`` with fp32 parameters and ``18 P/N`` with ``-true``,
  plus one bucket of ``B`` elements per communication dtype held from setup on, plus the
  gathered working set (two of the largest blocks, in the parameter dtype).
- Offload moves the master, optimizer state and gradient partition (ZeRO-1/2/3) and the
  parameters (ZeRO-3 ``offload_param``) to host memory.
"""

from __future__ import annotations

from typing import Any

DEFAULT_BUCKET = 500_000_000
MIXED = ("bf16-mixed", "16-mixed")
LOW = ("bf16-true", "16-true")

#: relative step time (1.0 = torch DDP on the same GPUs): stated guesses, for ranking only
SPEED = {
    0: (1.05, "DeepSpeed engine, plain data parallelism"),
    1: (1.05, "optimizer state partitioned; one gradient reduction per step"),
    2: (1.1, "optimizer state and gradients partitioned; reduce-scatter in buckets"),
    3: (1.4, "parameters gathered for every layer in forward and backward"),
}
OFFLOAD_SPEED = (3.0, "optimizer step on the CPU; traffic over PCIe every step")


def _states(options: dict[str, Any]) -> int:
    from accelkit.sdk import optimizer_terms

    return optimizer_terms(options)[0]


def estimate(backend: str, stats: dict[str, Any], options: dict[str, Any]) -> Any:
    """The estimate for a ``deepspeed_stage_*`` name (``deepspeed`` itself is one of them)."""
    backend_options = options.get("backend_options") or {}
    if "zero_stage" not in backend_options or options.get("device_type", "cuda") != "cuda":
        return None
    stage = int(backend_options["zero_stage"])
    precision = options["precision"]
    N = max(1, int(options["world_size"]))
    P = stats["params"]
    s = 2 if precision in LOW else 4
    k = _states(options)
    adam_like = 4 * k  # fp32 states per parameter
    bucket_elems = int(backend_options.get("reduce_bucket_size") or DEFAULT_BUCKET)
    offload_opt = backend_options.get("offload_optimizer") not in (None, "none")
    offload_param = backend_options.get("offload_param") not in (None, "none")
    step_peak = stats["step_peak"]
    matmul, other = stats.get("matmul_params", P), P - stats.get("matmul_params", P)

    if precision in MIXED:
        kind, wcopy = "autocast", 1.0
        comm_dtypes = [2] * (matmul > 0) + [4] * (other > 0)
    else:
        kind, wcopy = ("low" if precision in LOW else "fp32"), 0.0
        comm_dtypes = [s]
    traced_grad_bytes = 2 if kind == "low" else 4

    result: dict[str, Any] = {"master": 0, "host": 0, "world_size": N}
    if stage == 0:
        master = 4 * P if precision in LOW else 0
        params, grads, optimizer = P * s, P * s, adam_like * P
        persistent = params + master + optimizer
        dynamic = step_peak(kind, 1.0, wcopy)
        step = P * s + (4 * P if precision in LOW else P * s)  # grads + fp32 grads / temporary
        formula = "P*s + k*4*P (+ 4P master with -true) + max(traced step, 8P step)"
        result.update(master=master)
    elif stage in (1, 2):
        params = P * s
        master, optimizer = 4 * P // N, adam_like * P // N
        grads = P * s // N
        buckets = bucket_elems * s * len(comm_dtypes)
        # the buckets are allocated in the first gradient hook, once part of backward has run
        dynamic = step_peak(kind, (s / traced_grad_bytes) / N, wcopy, after_first_grad=buckets)
        step = 12 * P // N
        if offload_opt:
            result["host"] = master + optimizer + 4 * P // N
            master = optimizer = 0
            step = grads
        persistent = params + master + optimizer
        formula = (
            "P*s + (4P master + k*4*P states)/N + max(traced step (grads P*s/N) + B*s per "
            "communication dtype, 12P/N in the step)"
        )
        result.update(master=master)
    elif stage == 3:
        per_p = 18 if precision in LOW else 24
        persistent_all = per_p * P // N
        params = P * s // N
        grads = 4 * P // N
        optimizer = adam_like * P // N
        master = max(0, persistent_all - params - grads - optimizer)
        bucket = bucket_elems * sum(comm_dtypes)
        gathered = 2 * max(stats["largest_block"], max(stats.get("param_numels") or [0])) * s
        dynamic = step_peak(kind, 0.0, wcopy) + gathered
        step = 12 * P // N
        host = 0
        if offload_opt:
            host += master + optimizer + grads
            master = optimizer = 0
            step = grads = 0
        if offload_param:
            host += params
            params = 0
        persistent = params + grads + master + optimizer + bucket
        result.update(master=master, host=host)
        formula = (
            "(24P fp32 params | 18P -true)/N + B*bytes per communication dtype + traced step "
            "+ 2 x largest block gathered"
        )
    else:
        return None
    speed, note = OFFLOAD_SPEED if (offload_opt or offload_param) else SPEED[stage]
    result.update(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=dynamic,
        peak=persistent + max(dynamic, step),
        formula=formula + f"  (s={s}, k={k}, N={N}, B={bucket_elems:.0e})",
        relative_step_time=speed,
        speed_note=note,
    )
    if stage in (1, 2) and not offload_opt:
        result["variants"] = [
            {"label": "offload_optimizer=cpu", "options": {"offload_optimizer": "cpu"}}
        ]
    return result
