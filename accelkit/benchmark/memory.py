"""Per-device memory estimates: what ``accelkit plan`` prints and the backends' hooks compute.

Two halves:

1. :func:`model_stats` builds the model on the ``meta`` device (no memory is allocated), counts
   its parameters, and traces one forward and backward there with a tracker that adds up the bytes
   of every tensor while it lives (by storage, so views count once; a tensor saved for backward
   lives until backward frees it). The result is the step's peak of activations and gradients,
   not a rule of thumb. Two things the meta device cannot do are emulated: ``torch.autocast``
   (matmul-like ops run in bf16/fp16 and keep a low-precision copy of their weight; norms,
   softmax and losses run in fp32) and fused attention (``scaled_dot_product_attention`` keeps
   its output and a log-sum-exp per row, as flash/memory-efficient attention do, instead of the
   attention matrix the meta fallback would materialise).

2. The estimate of each backend is a formula over those numbers (bytes per device, ``P``
   parameters, ``T`` trainable parameters, ``N`` data-parallel ranks, ``k`` optimizer states per
   parameter: 2 for AdamW, 1 for SGD with momentum). Backends answer the
   ``accelkit_estimate_memory`` hook; the torch-native ones delegate to :func:`estimate_native`.

``model_stats`` (what the hook receives) holds:

- ``params``, ``trainable_params``, ``buffer_bytes``, ``param_numels`` (every parameter's numel);
- ``largest_block`` / ``root_params``: parameters of the largest repeated block (the children of
  the model's ModuleList/Sequential stacks, FSDP's default units) and of everything outside the
  blocks; ``blocks``: how many blocks; ``matmul_params``: parameters of Linear/Conv modules
  (those autocast computes with in low precision);
- ``tp_params`` / ``tp_block_params``: parameters ``tp_plan="auto"`` would shard, in the model
  and in its largest block; ``tp_divisor``: every tensor-parallel degree that divides it shards
  the plan's layers and heads evenly (0: the plan finds no layer);
- ``batch_size``, ``precision``, ``activation_checkpointing``;
- ``activation_bytes``: the traced peak of activations alone for ``precision``;
- ``step_peak(kind, grad_fraction=1.0, weight_copy_fraction=1.0, after_first_grad=0, tp=1)``:
  the traced peak over forward and backward of activations (those tensor parallelism shards
  divided by ``tp``) + ``grad_fraction`` x the gradients +
  ``weight_copy_fraction`` x autocast's weight copies (+ ``after_first_grad`` bytes from the
  moment the first gradient exists: a buffer a backend allocates in its first gradient hook), where ``kind`` is ``"fp32"`` (fp32 weights and compute), ``"autocast"``
  (fp32 weights, autocast compute; gradients fp32) or ``"low"`` (bf16/fp16 weights and compute;
  gradients bf16/fp16). Traces are made on first use and cached.

``options`` (what the hook receives) holds ``world_size`` (GPUs), ``precision``, ``optimizer``
(:data:`OPTIMIZERS`), ``device_type``, ``backend_options`` (the backend name's presets plus the
variant's options) and ``mesh`` (``accelkit plan --mesh``: propose the N-D mesh variants).

The hook returns a dict of bytes per device: ``params``, ``grads``, ``optimizer``, ``master``,
``activations`` (the traced step peak plus any gathered-parameter working set), ``peak`` (the
estimate of ``torch.cuda.max_memory_allocated``), ``host`` (bytes per process in CPU memory, for
offload), ``world_size`` (devices the backend uses), ``formula``, ``relative_step_time`` (a
stated guess for ranking: 1.0 is plain data parallelism), ``speed_note``, and optionally
``variants``: other configurations of the same backend the plan should also show, as
``[{"label": ..., "options": {...}}]``.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from accelkit.modules import apply_activation_checkpointing, default_blocks

GiB = 2**30

#: optimizer name -> (states per trainable parameter, "fused" | "foreach" temporaries)
OPTIMIZERS: dict[str, tuple[int, str]] = {
    "adamw": (2, "foreach"),
    "adamw-fused": (2, "fused"),
    "sgd-momentum": (1, "foreach"),
    "sgd": (0, "foreach"),
}

LOW_PRECISIONS = {"bf16-true", "16-true"}
#: fp8-mixed is traced as bf16-mixed: torchao's Float8Linear keeps the same high-precision
#: input and weight for backward, and its float8 copies are a byte per element on top
MIXED_PRECISIONS = {"bf16-mixed", "16-mixed", "fp8-mixed"}


def low_dtype(precision: str) -> torch.dtype:
    return torch.float16 if precision.startswith("16") else torch.bfloat16


# ---- the tracker ------------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Adds up the bytes of every storage created by an op while it lives.

    Each storage is counted once (views share it) in a category: ``act`` (activations and
    temporaries), ``wcopy`` (autocast's weight copies), ``grad`` (a parameter's ``.grad``) or
    ``tp`` (activations that tensor parallelism would shard: made in a block between a
    column-wise Linear's output and the next row-wise Linear, see :func:`mark_tp_region`).
    After every allocation the totals go on ``timeline``; peaks happen right after allocations.
    """

    CATEGORIES = ("act", "wcopy", "grad", "tp")

    def __init__(self, device_type: str = "meta") -> None:
        super().__init__()
        #: only tensors on this device type count (a real run also makes meta tensors)
        self.device_type = device_type
        self.live: dict[int, list[Any]] = {}
        self.totals = dict.fromkeys(self.CATEGORIES, 0)
        self.timeline: list[tuple[int, int, int, int]] = []
        #: inside a tensor-parallel region: new storages count as ``tp``
        self.in_tp_region = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        added = False
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                added |= self._add(leaf)
        if added:
            self.snapshot()
        return out

    def snapshot(self) -> None:
        self.timeline.append(tuple(self.totals[c] for c in self.CATEGORIES))  # type: ignore[arg-type]

    def _add(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != self.device_type:
            return False
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live:
            return False
        nbytes = storage.nbytes()
        category = "tp" if self.in_tp_region else "act"
        self.live[key] = [nbytes, category]
        self.totals[category] += nbytes
        weakref.finalize(storage, self._free, key)
        return True

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.totals[entry[1]] -= entry[0]

    def recategorize(self, tensor: torch.Tensor, category: str) -> None:
        entry = self.live.get(id(tensor.untyped_storage()))
        if entry is not None and entry[1] != category:
            self.totals[entry[1]] -= entry[0]
            self.totals[category] += entry[0]
            entry[1] = category


class FlashLikeAttention(torch.autograd.Function):
    """What flash / memory-efficient attention keep for backward: q, k, v, the output and one
    fp32 log-sum-exp per query row (no attention matrix)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _out, _lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _functions(*names: str) -> set[Any]:
    found = set()
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = {"F": F, "torch": torch, "Tensor": torch.Tensor}[owner_name]
        fn = getattr(owner, attr, None)
        if fn is not None:
            found.add(fn)
    return found


#: ops torch.autocast runs in the low dtype (CUDA's list, the ones models use)
AUTOCAST_LOW = _functions(
    "F.linear", "F.bilinear", "F.conv1d", "F.conv2d", "F.conv3d", "F.conv_transpose1d",
    "F.conv_transpose2d", "F.conv_transpose3d", "torch.matmul", "torch.mm", "torch.bmm",
    "torch.addmm", "torch.baddbmm", "torch.addbmm", "torch.mv", "torch.einsum",
    "Tensor.matmul", "Tensor.__matmul__", "Tensor.mm", "Tensor.bmm",
)  # fmt: skip
#: ops torch.autocast runs in fp32
AUTOCAST_FP32 = _functions(
    "F.layer_norm", "F.group_norm", "F.rms_norm", "F.softmax", "F.log_softmax", "F.softmin",
    "F.cross_entropy", "F.nll_loss", "F.mse_loss", "F.l1_loss", "F.smooth_l1_loss",
    "F.binary_cross_entropy_with_logits", "F.kl_div", "F.normalize", "torch.softmax",
    "torch.log_softmax", "Tensor.softmax", "Tensor.log_softmax", "torch.exp", "Tensor.exp",
    "torch.norm", "Tensor.norm",
)  # fmt: skip


class MetaTraceMode(TorchFunctionMode):
    """Emulates autocast (when ``low`` is a dtype) and fused attention on the meta device."""

    def __init__(self, tracker: LiveBytes, low: torch.dtype | None) -> None:
        super().__init__()
        self.tracker = tracker
        self.low = low
        self.weight_cache: dict[int, torch.Tensor] = {}

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        if value.dtype == dtype:
            return value
        if isinstance(value, torch.nn.Parameter):  # autocast caches one copy per weight
            cached = self.weight_cache.get(id(value))
            if cached is None:
                cached = value.to(dtype)
                self.tracker.recategorize(cached, "wcopy")
                self.weight_cache[id(value)] = cached
            return cached
        return value.to(dtype)

    def _cast_all(self, args: Any, kwargs: dict[str, Any], dtype: torch.dtype) -> tuple:
        args = tuple(
            [self._cast(v, dtype) for v in a]
            if isinstance(a, (list, tuple))
            else self._cast(a, dtype)
            for a in args
        )
        return args, {k: self._cast(v, dtype) for k, v in kwargs.items()}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            if self.low is not None:
                q, k, v = (self._cast(t, self.low) for t in (q, k, v))
            return FlashLikeAttention.apply(q, k, v)
        if self.low is not None:
            if func in AUTOCAST_LOW:
                args, kwargs = self._cast_all(args, kwargs, self.low)
            elif func in AUTOCAST_FP32:
                args, kwargs = self._cast_all(args, kwargs, torch.float32)
        return func(*args, **kwargs)


#: modules whose parameters autocast computes with in low precision (DeepSpeed's
#: ``lower_precision_safe_modules`` default is Linear and Conv too)
MATMUL_MODULES = (
    torch.nn.Linear,
    torch.nn.Bilinear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose1d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
)


# ---- model statistics -----------------------------------------------------------------------------
def outermost_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (FSDP's default units), outermost only among nested ones."""
    blocks = default_blocks(model)
    inner: set[int] = set()
    for block in blocks:
        inner.update(id(m) for m in block.modules() if m is not block)
    return [b for b in blocks if id(b) not in inner]


def build_on_meta(workload: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return workload.build()


def mark_tp_region(model: torch.nn.Module, tracker: LiveBytes) -> list[Any]:
    """Hooks that tag what ``tp_plan="auto"`` would shard: a column-wise Linear's output and
    everything made after it until a row-wise Linear starts (attention heads, the MLP's hidden
    activations). Returns the hook handles."""
    from accelkit.backends.mesh import auto_plan_kinds

    def enter(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            tracker.recategorize(output, "tp")
        tracker.in_tp_region = True

    def leave(module: torch.nn.Module, args: Any) -> None:
        tracker.in_tp_region = False

    modules = dict(model.named_modules())
    return [
        modules[name].register_forward_hook(enter)
        if kind == "colwise"
        else modules[name].register_forward_pre_hook(leave)
        for name, kind in auto_plan_kinds(model).items()
    ]


def trace_step(
    workload: Any, batch_size: int, kind: str, low: torch.dtype, activation_checkpointing: bool
) -> list[tuple[int, int, int, int]]:
    """One forward and backward on the meta device; the tracker's timeline."""
    from accelkit.benchmark.workloads import call_model, move_batch

    model = build_on_meta(workload)
    if kind == "low":
        model = model.to(low)
    if activation_checkpointing:
        apply_activation_checkpointing(model, True)
    batch = move_batch(workload.make_batch(batch_size, torch.Generator().manual_seed(0)), "meta")
    if kind == "low":
        batch = _cast_floats(batch, low)
    tracker = LiveBytes()
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: tracker.recategorize(p.grad, "grad"))
        for p in model.parameters()
        if p.requires_grad
    ]
    hooks += mark_tp_region(model, tracker)
    emulate = MetaTraceMode(tracker, low if kind == "autocast" else None)
    with tracker:
        with emulate:
            loss = call_model(model, batch)
        emulate.weight_cache.clear()  # autocast drops its cache when the region ends
        loss.backward()
        tracker.snapshot()
    for hook in hooks:
        hook.remove()
    return tracker.timeline


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast_floats(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_floats(v, dtype) for v in batch)
    return batch


def trace_kind(precision: str) -> str:
    """Which trace a native backend uses for ``precision``."""
    if precision in LOW_PRECISIONS:
        return "low"
    if precision in MIXED_PRECISIONS:
        return "autocast"
    return "fp32"


def model_stats(
    workload: Any,
    batch_size: int,
    precision: str = "32-true",
    activation_checkpointing: bool = False,
) -> dict[str, Any]:
    """Counts and traced activation peaks of ``workload`` at ``batch_size`` (see the module doc)."""
    model = build_on_meta(workload)
    params = list(model.parameters())
    blocks = outermost_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    low = low_dtype(precision) if precision != "32-true" else torch.bfloat16

    @functools.cache
    def timeline(kind: str) -> tuple[tuple[int, int, int, int], ...]:
        return tuple(trace_step(workload, batch_size, kind, low, activation_checkpointing))

    def step_peak(
        kind: str,
        grad_fraction: float = 1.0,
        weight_copy_fraction: float = 1.0,
        after_first_grad: int = 0,
        tp: int = 1,
    ) -> int:
        points = timeline(kind)
        return int(
            max(
                (
                    a
                    + t / tp
                    + weight_copy_fraction * w
                    + grad_fraction * g
                    + (after_first_grad if g else 0)
                    for a, w, g, t in points
                ),
                default=0,
            )
        )

    tp_sharded = tp_sharded_params(model)
    largest = max(blocks, key=lambda b: sum(p.numel() for p in b.parameters()), default=None)
    stats: dict[str, Any] = {
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "param_numels": [p.numel() for p in params],
        "largest_block": max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        "root_params": sum(p.numel() for p in params if id(p) not in in_blocks),
        "matmul_params": sum(
            p.numel()
            for m in model.modules()
            if isinstance(m, MATMUL_MODULES)
            for p in m.parameters(recurse=False)
        ),
        "blocks": len(blocks),
        "tp_params": sum(tp_sharded.values()),
        "tp_block_params": sum(tp_sharded_params(largest).values()) if largest else 0,
        "tp_divisor": tp_divisor(model),
        "batch_size": batch_size,
        "precision": precision,
        "activation_checkpointing": activation_checkpointing,
        "step_peak": step_peak,
    }
    stats["activation_bytes"] = step_peak(trace_kind(precision), 0.0, 0.0)
    return stats


def tp_sharded_params(model: torch.nn.Module) -> dict[str, int]:
    """``{parameter name: elements}`` that ``tp_plan="auto"`` shards: a column-wise Linear's
    weight and bias, a row-wise Linear's weight (its bias stays whole on every rank)."""
    from accelkit.backends.mesh import auto_plan_kinds

    modules = dict(model.named_modules())
    out = {}
    for name, kind in auto_plan_kinds(model).items():
        for pname, p in modules[name].named_parameters(recurse=False):
            if kind == "colwise" or pname == "weight":
                out[f"{name}.{pname}"] = p.numel()
    return out


def tp_divisor(model: torch.nn.Module) -> int:
    """The largest tensor-parallel degree whose divisors all shard the auto plan: the gcd of the
    sharded feature counts and the attention head counts (0: nothing to shard)."""
    from accelkit.backends.mesh import HEAD_ATTRIBUTES, auto_plan_kinds, fused_qkv_layers

    if fused_qkv_layers(model):
        return 0  # tp_plan="auto" refuses a fused q|k|v projection
    modules = dict(model.named_modules())
    sizes = [
        modules[n].out_features if kind == "colwise" else modules[n].in_features
        for n, kind in auto_plan_kinds(model).items()
    ]
    if not sizes:
        return 0
    heads = [
        getattr(m, a)
        for m in model.modules()
        for a in HEAD_ATTRIBUTES
        if isinstance(getattr(m, a, None), int) and not isinstance(getattr(m, a), bool)
    ]
    return math.gcd(*sizes, *heads)


# ---- the torch-native backends ------------------------------------------------------------------
#: relative step time (1.0 = plain data parallelism on the same GPUs), a stated guess for ranking
NATIVE_SPEED = {
    "single": (1.0, "no communication; one GPU"),
    "ddp": (1.0, "one gradient all-reduce per step, overlapped with backward"),
    "fsdp": (1.25, "parameters all-gathered twice and gradients reduce-scattered per step"),
    "fsdp_offload": (3.0, "FSDP plus parameter, gradient and optimizer traffic over PCIe"),
}


def optimizer_terms(options: dict[str, Any]) -> tuple[int, str]:
    """(states per trainable parameter, "fused" or "foreach" temporaries) of
    ``options["optimizer"]`` (default ``adamw``), from :data:`OPTIMIZERS`; unknown names raise."""
    name = options.get("optimizer", "adamw")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def _dtype_bytes(precision: str) -> int:
    return 2 if precision in LOW_PRECISIONS else 4


def estimate_single_or_ddp(
    stats: dict[str, Any], options: dict[str, Any], distributed: bool
) -> dict[str, Any]:
    """Model, gradients and optimizer state whole on every device."""
    precision = options["precision"]
    states, temporaries = optimizer_terms(options)
    s = _dtype_bytes(precision)
    P, T = stats["params"], stats["trainable_params"]
    params = P * s + stats["buffer_bytes"]
    grads = T * s
    optimizer = states * T * s
    temp = T * s if temporaries == "foreach" and states else 0
    kind = trace_kind(precision)
    if distributed:
        # gradient_as_bucket_view: the gradients are views into DDP's buckets, allocated once
        persistent = params + grads + optimizer
        dynamic = stats["step_peak"](kind, 0.0, 1.0)
        step = temp
        formula = "P*s + T*s (buckets) + k*T*s + max(traced step without grads, foreach temp T*s)"
    else:
        persistent = params + optimizer
        dynamic = stats["step_peak"](kind, 1.0, 1.0)
        step = grads + temp
        formula = "P*s + k*T*s + max(traced step incl. grads, grads T*s + foreach temp T*s)"
    speed, note = NATIVE_SPEED["ddp" if distributed else "single"]
    world = options["world_size"] if distributed else 1
    if not distributed and options["world_size"] > 1:
        speed = float(options["world_size"])  # one GPU of the N does all the work
        note = f"uses 1 of the {options['world_size']} GPUs"
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "master": 0,
        "activations": dynamic,
        "peak": persistent + max(dynamic, step),
        "host": 0,
        "world_size": world,
        "formula": formula + f"  (s={s} bytes, k={states})",
        "relative_step_time": speed,
        "speed_note": note,
    }


def estimate_fsdp(stats: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """FSDP2: parameters, gradients and optimizer state sharded N ways; a working set of
    gathered units (the root stays gathered; two blocks at a time with prefetch).

    On a ``(dp_replicate, dp_shard, tp)`` mesh (``backend_options``): FSDP2 shards over
    ``dp_shard`` only (HSDP replicates over ``dp_replicate``), and tensor parallelism first
    divides the layers ``tp_plan="auto"`` shards (``stats["tp_params"]``) and the activations
    between them by ``tp``. ``options["mesh"]`` asks for a variant per mesh of the GPUs."""
    from accelkit.backends.mesh import resolve_shape

    precision = options["precision"]
    backend_options = options.get("backend_options", {})
    offload = bool(backend_options.get("cpu_offload", False))
    world = max(1, int(options["world_size"]))
    shape = resolve_shape(
        world,
        backend_options.get("dp_replicate"),
        backend_options.get("dp_shard"),
        backend_options.get("tp"),
    )
    N, tp = shape.dp_shard, shape.tp
    states, temporaries = optimizer_terms(options)
    P, T = stats["params"], stats["trainable_params"]
    # what one tensor-parallel rank holds before FSDP2 shards it (the plan's layers / tp)
    tp_cut = stats.get("tp_params", 0) - stats.get("tp_params", 0) // tp
    P_rank, T_rank = P - tp_cut, max(0, T - tp_cut)
    block_cut = stats.get("tp_block_params", 0) - stats.get("tp_block_params", 0) // tp
    s = _dtype_bytes(precision)  # sharded params, grads, optimizer state
    c = 4 if precision == "32-true" else 2  # gathered params and unsharded grads
    mixed = precision in MIXED_PRECISIONS
    shard_params = P_rank * s // N + stats["buffer_bytes"]
    shard_grads = T_rank * s // N
    optimizer = states * T_rank * s // N
    block = stats["largest_block"] - block_cut
    gathered = stats["root_params"] * c + 2 * block * c
    # the root unit reduce-scatters after the whole backward: its unsharded gradients (and
    # their fp32 reduce-scatter input) live through it; a block's only while it reduces
    unsharded_grads = (stats["root_params"] + block) * (c + (4 if mixed else 0))
    kind = "low" if mixed else trace_kind(precision)
    traced_grad_bytes = 2 if kind == "low" else 4
    grad_fraction = 0.0 if offload or not T else (s / traced_grad_bytes) * (T_rank / T) / N
    dynamic = stats["step_peak"](kind, grad_fraction, 0.0, tp=tp) + gathered + unsharded_grads
    temp = T_rank * s // N if temporaries == "foreach" and states and not offload else 0
    if offload:
        peak = dynamic
        host = shard_params + shard_grads + optimizer
    else:
        peak = shard_params + optimizer + max(dynamic, shard_grads + temp)
        host = 0
    speed, note = _fsdp_speed(shape, offload)
    p_, t_ = ("P", "T") if tp == 1 else ("P'", "T'")
    result = {
        "params": 0 if offload else shard_params,
        "grads": 0 if offload else shard_grads,
        "optimizer": 0 if offload else optimizer,
        "master": 0,
        "activations": dynamic,
        "peak": peak,
        "host": host,
        "world_size": world,
        "mesh": [shape.dp_replicate, shape.dp_shard, shape.tp],
        "formula": (
            (
                f"host: ({p_}*s + {t_}*s + k*{t_}*s)/N; device: "
                if offload
                else f"({p_}*s + k*{t_}*s)/N + "
            )
            + f"traced step (grads {t_}*s/N) + gathered root*c + 2*block*c + block*(c+4 if mixed)"
            + (
                "; P', T', block: the auto plan's layers / tp; traced tp-region activations / tp"
                if tp > 1
                else ""
            )
            + f"  (s={s}, c={c}, k={states}, N={N}"
            + (f", tp={tp}, replicas={shape.dp_replicate})" if not shape.is_flat else ")")
        ),
        "relative_step_time": speed,
        "speed_note": note,
    }
    if not offload and shape.is_flat and not _has_mesh_options(backend_options):
        result["variants"] = [{"label": "cpu_offload", "options": {"cpu_offload": True}}]
        if options.get("mesh"):
            result["variants"] += mesh_variants(stats, world)
    return result


def _has_mesh_options(backend_options: dict[str, Any]) -> bool:
    return any(backend_options.get(k) is not None for k in ("dp_replicate", "dp_shard", "tp"))


def mesh_variants(stats: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """A variant per ``(dp_replicate, dp_shard, tp)`` factorisation of ``world`` other than
    plain FSDP's ``(1, world, 1)``; a ``tp`` the auto plan cannot shard evenly is left out."""
    from accelkit.backends.mesh import factorizations

    out = []
    for shape in factorizations(world):
        if shape.is_flat:
            continue
        divisor = stats.get("tp_divisor") or 0  # 0: nothing tp_plan="auto" can shard
        if shape.tp > 1 and (not stats.get("tp_params") or not divisor or divisor % shape.tp):
            continue
        options: dict[str, Any] = {
            "dp_replicate": shape.dp_replicate,
            "dp_shard": shape.dp_shard,
            "tp": shape.tp,
        }
        if shape.tp > 1:
            options["tp_plan"] = "auto"
        label = f"mesh {shape.dp_replicate}x{shape.dp_shard}x{shape.tp}"
        out.append({"label": label, "options": options})
    return out


def _fsdp_speed(shape: Any, offload: bool) -> tuple[float, str]:
    """The stated guess for ranking: plain FSDP2's, and on a mesh 1.05 for replicas alone
    (S=1) or 1.25 with sharding, times 1 + 0.2 log2(tp) for tensor parallelism's activation
    all-reduces (two per block, forward and backward)."""
    if offload or shape.is_flat:
        return NATIVE_SPEED["fsdp_offload" if offload else "fsdp"]
    base = 1.25 if shape.dp_shard > 1 else 1.05
    speed = base * (1 + 0.2 * math.log2(shape.tp))
    parts = []
    if shape.dp_shard > 1:
        parts.append(f"sharded over {shape.dp_shard}")
    if shape.dp_replicate > 1:
        parts.append(f"{shape.dp_replicate} replicas")
    if shape.tp > 1:
        parts.append(f"tensor parallel over {shape.tp}: activation all-reduces per block")
    return round(speed, 3), "; ".join(parts)


def estimate_native(backend: str, stats: dict[str, Any], options: dict[str, Any]) -> Any:
    """The estimate for a torch-native backend name, or None for names it does not plan."""
    device_type = options.get("device_type", "cuda")
    if backend in ("cuda", "cpu", "mps"):
        if backend != device_type:
            return None
        return estimate_single_or_ddp(stats, options, distributed=False)
    if backend == "ddp":
        return estimate_single_or_ddp(stats, options, distributed=True)
    if backend == "fsdp":
        return estimate_fsdp(stats, options)
    return None


def measure_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes of parameters (local shards for DTensors), gradients and optimizer state as they are."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def nbytes(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    out = {"params": 0, "grads": 0, "optimizer": 0}
    for p in model.parameters():
        out["params"] += nbytes(p)
        if p.grad is not None:
            out["grads"] += nbytes(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    out["optimizer"] += nbytes(value)
    return out


def format_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def parse_size(text: str) -> int:
    """``80GiB``, ``80GB`` (taken as GiB, as nvidia-smi's figures are), ``512MiB``, ``1e9``."""
    units = {"t": 2**40, "g": 2**30, "m": 2**20, "k": 2**10, "": 1}
    cleaned = text.strip().lower().replace(" ", "")
    for suffix in ("ib", "b"):
        if cleaned.endswith(suffix):
            cleaned = cleaned[: -len(suffix)]
            break
    unit = cleaned[-1] if cleaned and cleaned[-1] in units else ""
    number = cleaned[:-1] if unit else cleaned
    try:
        return int(float(number) * units[unit])
    except ValueError:
        raise ValueError(f"cannot read a memory size from {text!r} (e.g. 80GiB, 512MiB)") from None


Estimator = Callable[[str, dict[str, Any], dict[str, Any]], Any]
