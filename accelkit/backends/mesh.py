"""N-D parallelism on the torch-native path: the device mesh and tensor-parallel plans.

``accelkit.get("fsdp", dp_replicate=R, dp_shard=S, tp=T)`` lays the ranks out on a
``DeviceMesh`` of shape ``(R, S, T)`` (dimension names ``dp_replicate``, ``dp_shard``, ``tp``):

- ``R > 1`` and ``S > 1``: HSDP (FSDP2 shards over ``dp_shard`` and replicates over
  ``dp_replicate``); ``S = 1``: plain replication (DDP semantics through FSDP2);
- ``T > 1``: tensor parallelism over ``tp`` (``parallelize_module`` with a plan) before FSDP2
  shards the rest over the data-parallel dimensions.

A dimension left out is inferred from the world size (``dp_shard`` takes what is left; then
``dp_replicate`` is 1); a product that does not match is a :class:`~accelkit.errors.ConfigError`
at ``get()``. The data-parallel ranks (``R * S`` of them) are what the dataloader shards over and
what ``gather_for_metrics`` / ``all_reduce`` reduce over: the ``T`` ranks of a tensor-parallel
group see the same batch.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch

from accelkit.errors import ConfigError

#: name suffixes of the Linear layers of the common transformer blocks, by the sharding they take
COLWISE = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
           "up_proj", "gate_proj", "w1", "w3", "fc1", "c_fc")  # fmt: skip
#: fused q|k|v projections: a column-wise split of their output would hand one rank all of q and
#: part of k, so ``tp_plan="auto"`` refuses a model that has one
FUSED_QKV = ("qkv", "c_attn", "query_key_value", "Wqkv", "qkv_proj", "in_proj")
ROWWISE = ("o_proj", "out_proj", "wo", "w2", "fc2", "down_proj", "c_proj", "proj")
#: attributes that hold an attention module's head count
HEAD_ATTRIBUTES = (
    "num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads", "heads",
)  # fmt: skip


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int
    dp_shard: int
    tp: int
    #: pipeline stages (``pp``), the outermost dimension
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def is_flat(self) -> bool:
        """One dimension of sharding only: accelkit's plain ``fsdp``."""
        return self.dp_replicate == 1 and self.tp == 1 and self.pp == 1


def resolve_shape(
    world: int,
    dp_replicate: int | None,
    dp_shard: int | None,
    tp: int | None,
    pp: int = 1,
) -> MeshShape:
    """The mesh shape for ``world`` ranks, inferring what was left out (``pp`` stages each
    take ``world / pp`` ranks)."""
    if world % pp:
        raise ConfigError(
            f"{world} ranks cannot be split into pp={pp} pipeline stages (the world size is not a "
            f"multiple of {pp}); launch a multiple of {pp} processes or change pp"
        )
    if pp > 1:
        inner = resolve_shape(world // pp, dp_replicate, dp_shard, tp)
        return MeshShape(inner.dp_replicate, inner.dp_shard, inner.tp, pp)
    given = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
    for name, value in given.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ConfigError(f"fsdp: option {name!r} must be an int >= 1, got {value!r}")
    tp = tp or 1
    replicate = dp_replicate or 1
    if dp_shard is None:
        if world % (replicate * tp):
            raise ConfigError(
                f"fsdp: {world} ranks cannot be laid out as dp_replicate={replicate} x tp={tp} "
                f"x dp_shard (world size {world} is not a multiple of {replicate * tp}); choose "
                "dimensions whose product divides the world size"
            )
        dp_shard = world // (replicate * tp)
    if replicate * dp_shard * tp != world:
        raise ConfigError(
            f"fsdp: the mesh dp_replicate={replicate} x dp_shard={dp_shard} x tp={tp} has "
            f"{replicate * dp_shard * tp} ranks, the world has {world}; make the product equal "
            "the world size, or leave dp_shard out to infer it"
        )
    return MeshShape(replicate, dp_shard, tp)


def build_mesh(device_type: str, shape: MeshShape) -> Any:
    """The ``(dp_replicate, dp_shard, tp)`` mesh with a flattened ``dp`` dimension, with
    ``pp`` outermost under pipeline parallelism (stages across nodes, tensor parallelism
    inside one)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = (shape.dp_replicate, shape.dp_shard, shape.tp)
    names: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp")
    if shape.pp > 1:
        dims, names = (shape.pp, *dims), ("pp", *names)
    mesh = init_device_mesh(device_type, dims, mesh_dim_names=names)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def fsdp_mesh(mesh: Any, shape: MeshShape) -> Any:
    """What FSDP2 shards over: ``(dp_replicate, dp_shard)`` (HSDP) or ``dp_shard``."""
    if shape.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def factorizations(world: int) -> list[MeshShape]:
    """Every ``(dp_replicate, dp_shard, tp)`` whose product is ``world``."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [
        MeshShape(r, world // (r * t), t)
        for r in divisors
        for t in divisors
        if world % (r * t) == 0
    ]


# ---- tensor-parallel plans -----------------------------------------------------------------------
def auto_plan_kinds(model: torch.nn.Module) -> dict[str, str]:
    """``{Linear name: "colwise" | "rowwise"}``: what ``tp_plan="auto"`` shards (``accelkit
    plan`` estimates tensor parallelism with the same choice)."""
    kinds: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLWISE:
            kinds[name] = "colwise"
        elif leaf in ROWWISE:
            kinds[name] = "rowwise"
    return kinds


def fused_qkv_layers(model: torch.nn.Module) -> list[str]:
    """Names of the Linear layers that project q, k and v at once (see ``FUSED_QKV``)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in FUSED_QKV
    ]


def transformer_plan(model: torch.nn.Module) -> dict[str, Any]:
    """A plan for the common transformer block shapes, by the Linear layers' names: attention
    q/k/v and MLP up/gate column-wise, attention output and MLP down row-wise. Embeddings and
    the output head stay replicated (FSDP2 still shards them over the data-parallel ranks)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    fused = fused_qkv_layers(model)
    if fused:
        raise ConfigError(
            f"fsdp: tp_plan='auto' cannot shard the fused q/k/v projection {fused[0]}: a "
            "column-wise split of q|k|v would give one rank all of q and part of k. Split it "
            "into q_proj/k_proj/v_proj Linears, or pass tp_plan as a dict that leaves it out "
            "(or shards it with a style of your own)"
        )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in auto_plan_kinds(model).items()}
    if not plan:
        raise ConfigError(
            "fsdp: tp_plan='auto' found no Linear layer named like a transformer block's "
            f"({', '.join(COLWISE[:6])}, ... / {', '.join(ROWWISE[:4])}, ...); pass tp_plan as "
            "{module name pattern: ColwiseParallel() / RowwiseParallel() / ...}"
        )
    return plan


def resolve_plan(model: torch.nn.Module, plan: Any, missing_ok: bool = False) -> dict[str, Any]:
    """The plan as ``{module name: ParallelStyle}``: patterns expanded, each one matching
    (``missing_ok``: a pipeline stage, which holds part of the model)."""
    if plan is None:
        raise ConfigError(
            "fsdp: tp > 1 needs a tensor-parallel plan: tp_plan='auto' (the common transformer "
            "block shapes) or {module name pattern: ColwiseParallel() / RowwiseParallel() / "
            "SequenceParallel() / PrepareModuleInput(...)}"
        )
    if plan == "auto":
        if missing_ok and not auto_plan_kinds(model):
            return {}
        return transformer_plan(model)
    if not isinstance(plan, dict):
        raise ConfigError(f"fsdp: tp_plan must be 'auto' or a dict, got {type(plan).__name__}")
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched and not missing_ok:
            raise ConfigError(f"fsdp: tp_plan entry {pattern!r} matches no module of the model")
        for name in matched:
            out[name] = style
    return out


def check_plan(model: torch.nn.Module, plan: dict[str, Any], tp: int) -> None:
    """Refuse, naming the module, what the plan cannot shard ``tp`` ways."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules[name]
        if isinstance(module, torch.nn.Linear):
            dim, size = (
                ("output features", module.out_features)
                if isinstance(style, ColwiseParallel)
                else ("input features", module.in_features)
                if isinstance(style, RowwiseParallel)
                else (None, 0)
            )
            if dim and size % tp:
                raise ConfigError(
                    f"fsdp: tensor parallelism cannot shard {name} ({size} {dim}) {tp} ways; "
                    f"use a tp that divides {size}, or leave {name} out of tp_plan"
                )
    for name, module in model.named_modules():
        for attribute in HEAD_ATTRIBUTES:
            heads = getattr(module, attribute, None)
            if (
                isinstance(heads, int)
                and heads % tp
                and any(k.startswith(f"{name}.") for k in plan)
            ):
                raise ConfigError(
                    f"fsdp: {name or 'the model'} has {attribute}={heads}, which tp={tp} does "
                    "not divide: each tensor-parallel rank must hold whole heads"
                )


def apply_style(module: torch.nn.Module, tp_mesh: Any, style: Any) -> None:
    """One plan entry on its module (what ``parallelize_module`` does for each entry)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(module, tp_mesh, style)


# ---- what this torch offers (``accelkit env``) ---------------------------------------------------
MESH_OPTIONS = "dp_replicate, dp_shard, tp, tp_plan ('auto' or {module pattern: ParallelStyle})"


def support_report() -> dict[str, str]:
    """What the ``fsdp`` backend's mesh can use in this torch, in words, by feature."""
    import importlib.util

    def found(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    if not torch.distributed.is_available():
        missing = "unavailable: this torch is built without torch.distributed"
        return {"options": MESH_OPTIONS, "device mesh": missing, "HSDP": missing, "tp": missing}
    mesh = found("torch.distributed.device_mesh")
    fsdp2 = mesh and hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard")
    tp = found("torch.distributed.tensor.parallel")
    return {
        "options": MESH_OPTIONS,
        "device mesh": "available (init_device_mesh)" if mesh else "unavailable in this torch",
        "HSDP": "available (fully_shard on the dp_replicate x dp_shard mesh)"
        if fsdp2
        else "unavailable: this torch has no FSDP2 fully_shard",
        "tp": "available (parallelize_module: ColwiseParallel, RowwiseParallel, SequenceParallel)"
        if tp
        else "unavailable: this torch has no torch.distributed.tensor.parallel",
    }
