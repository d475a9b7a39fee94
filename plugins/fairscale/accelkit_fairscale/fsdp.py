"""FairScale FullyShardedDataParallel (0.4.13): each wrapped unit flattens its parameters into
one flat parameter and keeps ``1/world_size`` of it per rank (``torch.chunk`` order, the last
rank's chunk zero-padded).

What this backend adds to FairScale's FSDP:

- a nested wrap policy through :mod:`accelkit.modules` block selection (the blocks of the
  model's stacks by default, then the root);
- the user's optimizer keeps its identity and hyperparameters: its param groups are pointed at
  the flat parameters of the units that held their parameters;
- precision strings mapped onto FairScale's own ``mixed_precision`` (fp32 master shards,
  compute in fp16/bf16) or onto fp32 FSDP plus ``torch.autocast`` (see :data:`FAIRSCALE_FSDP_DTYPES`),
  with a loss scaler whose overflow flag is all-reduced for ``16-mixed``;
- FSDP's own ``clip_grad_norm_`` for clipping and the reported norm.

FairScale 0.4.13's FSDP needs CUDA: it drives CUDA streams unconditionally. On a machine
without CUDA ``accelkit.get`` refuses with a clear error (checked by building a one-parameter
FSDP unit); accelkit ships no patch for that.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from accelkit.sdk import (
    Capabilities,
    ConfigError,
    DistributedBackend,
    DistributedOptions,
    DtypeRow,
    Precision,
    SetupResult,
    StepResult,
    UnsupportedError,
    check_device_supports,
    check_wrap_policy,
    low_dtype,
    optimizer_recipe,
    wrap_blocks,
)
from accelkit_fairscale.common import ShardedMixedPrecision

log = logging.getLogger("accelkit")

#: What each precision string means on fairscale_fsdp (published in docs/backends/fairscale.md).
FAIRSCALE_FSDP_DTYPES: dict[str, DtypeRow] = {
    "32-true": DtypeRow("fp32 flat shards", "fp32", "none (params are fp32)", "fp32"),
    "16-mixed": DtypeRow(
        "fp32 flat shards (the master); gathered as fp16 for compute",
        "fp16 (FairScale mixed_precision=True) + dynamic loss scaling (ShardedGradScaler)",
        "fp32 (the flat shards themselves)",
        "fp16 (fp32 with fp32_reduce_scatter=True)",
    ),
    "bf16-mixed": DtypeRow(
        "fp32 flat shards",
        "bf16 (torch.autocast; mixed_precision='fairscale' gathers bf16 params instead)",
        "none with autocast (params are fp32); fp32 shards with 'fairscale'",
        "fp32 with autocast; bf16 with 'fairscale' (fp32 with fp32_reduce_scatter=True)",
    ),
}


@dataclass
class FairScaleFSDPOptions(DistributedOptions):
    """``device`` ("cpu" only where FairScale can run without CUDA streams) and ``timeout``
    from the base, plus FairScale FSDP's own arguments."""

    #: which submodules become their own (nested) FSDP unit before the root: True = the
    #: children of the outermost ModuleList/Sequential stacks; classes, class names or a
    #: predicate; False = the root only
    wrap_policy: Any = True
    #: one flat parameter per unit (FairScale's default; needed for its optimizer-state gather)
    flatten_parameters: bool = True
    #: free the gathered parameters of inner units after their forward (the root keeps them)
    reshard_after_forward: bool = True
    #: keep the fp32 shards in pinned CPU memory (CUDA only)
    move_params_to_cpu: bool = False
    #: how a "-mixed" precision runs: "fairscale" = FSDP's own mixed_precision (fp32 master
    #: shards, parameters gathered in the low dtype), "autocast" = fp32 FSDP + torch.autocast.
    #: None: "fairscale" for 16-mixed, "autocast" for bf16-mixed
    mixed_precision: Literal["fairscale", "autocast"] | None = None
    #: reduce-scatter gradients in fp32 under mixed_precision="fairscale"
    fp32_reduce_scatter: bool = False
    #: reduce-scatter bucket size; None = FairScale's 25 on NCCL, 0 (unbucketed) on gloo, whose
    #: reduce_scatter rejects the 2-D bucket FairScale builds
    bucket_cap_mb: int | None = None
    #: skip the reduce-scatter inside an accumulation window; saves communication but keeps
    #: unsharded gradients (the full model's size) in memory until the window closes
    skip_sync_in_accumulation: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_wrap_policy(self.wrap_policy)
        if self.bucket_cap_mb is not None and self.bucket_cap_mb < 0:
            raise ValueError(f"option 'bucket_cap_mb' must be >= 0, got {self.bucket_cap_mb}")


class FairScaleFSDPPrecision(ShardedMixedPrecision):
    """``-mixed`` on FairScale FSDP: FairScale casts (mixed_precision) or torch.autocast does."""

    def __init__(self, precision: str, device_type: str, native: bool) -> None:
        super().__init__(precision, device_type, autocast=not native)
        self.native = native


def _unit_blocks(model: torch.nn.Module, policy: Any) -> list[torch.nn.Module]:
    """The submodules that become nested FSDP units (outermost first among nested ones)."""
    blocks = wrap_blocks(model, policy, "fairscale_fsdp")
    # A block sharing a parameter with the rest of the model stays in its parent's unit:
    # FairScale would flatten the shared tensor into the inner unit only.
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), set()).add(id(module))
    kept = []
    for block in blocks:
        members = {id(m) for m in block.modules()}
        if any((mods & members) and (mods - members) for mods in owners.values() if len(mods) > 1):
            log.info(
                "fairscale_fsdp: %s shares parameters outside itself; it stays in its "
                "parent's unit",
                type(block).__name__,
            )
            continue
        kept.append(block)
    return kept


class FairScaleFSDPBackend(DistributedBackend):
    """FairScale FSDP: flat parameters, gradients and optimizer state sharded across ranks."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        controls_precision=True,
        controls_device=True,
        no_sync=True,
        no_sync_by_default=False,
        manual_clip=True,
        sharded=True,
        distributed=True,
        offload=True,
        precisions=("32-true", "bf16-mixed", "16-mixed"),
        activation_checkpointing=False,
        compile=False,
    )
    options_class = FairScaleFSDPOptions
    dtype_table = FAIRSCALE_FSDP_DTYPES

    def __init__(self, name: str, options: Any, settings: Any) -> None:
        super().__init__(name, options, settings)
        self._roots: list[Any] = []
        self._hold_sync = False  # this backward runs under no_sync (see before_backward)

    # ---- launch -------------------------------------------------------------------------------
    def launch(self) -> None:
        self._device = self.pick_device()
        use_cuda = self._device.type == "cuda"
        if not use_cuda and self.options.move_params_to_cpu:
            raise ConfigError(
                "fairscale_fsdp: move_params_to_cpu=True needs CUDA (FairScale pins the "
                "CPU shards); on the CPU the parameters are in CPU memory already"
            )
        precision = self.settings.precision
        check_device_supports(precision, self._device)
        self.join_process_group()
        if precision == "32-true":
            self.precision = Precision()
        else:
            mode = self.options.mixed_precision or (
                "fairscale" if precision == "16-mixed" else "autocast"
            )
            self.precision = FairScaleFSDPPrecision(
                precision, self._device.type, native=mode == "fairscale"
            )
        if self.options.fp32_reduce_scatter and not getattr(self.precision, "native", False):
            raise ConfigError(
                "fairscale_fsdp: fp32_reduce_scatter=True needs FairScale's own mixed precision "
                "(precision='16-mixed', or 'bf16-mixed' with mixed_precision='fairscale')"
            )
        if not use_cuda:
            self._refuse_without_streams()

    def _fsdp_kwargs(self) -> dict[str, Any]:
        import torch.distributed as dist

        o = self.options
        bucket = o.bucket_cap_mb
        if bucket is None:
            bucket = 25 if dist.get_backend() == "nccl" else 0
        native = getattr(self.precision, "native", False)
        return dict(
            compute_device=self.device,
            reshard_after_forward=o.reshard_after_forward,
            flatten_parameters=o.flatten_parameters,
            move_params_to_cpu=o.move_params_to_cpu,
            mixed_precision=native,
            compute_dtype=low_dtype(self.settings.precision) if native else None,
            fp32_reduce_scatter=o.fp32_reduce_scatter,
            bucket_cap_mb=bucket,
        )

    def _refuse_without_streams(self) -> None:
        """FairScale's FSDP creates its CUDA streams only when CUDA exists, then uses them
        unconditionally; build a one-parameter unit and look, rather than fail at the first
        forward with ``KeyError: 'all_gather'``."""
        from fairscale.nn import FullyShardedDataParallel

        probe = FullyShardedDataParallel(torch.nn.Linear(1, 1), **self._fsdp_kwargs())
        probe._lazy_init()
        if "all_gather" not in probe._streams:
            raise UnsupportedError(
                "fairscale_fsdp: FairScale 0.4.13's FullyShardedDataParallel cannot run without "
                "CUDA (it drives CUDA streams unconditionally; its first forward would fail "
                "with KeyError: 'all_gather'). Run on a CUDA device, or use backend 'fsdp' "
                "(torch FSDP2) or 'fairscale_oss'/'fairscale_sdp' on the CPU."
            )

    # ---- setup --------------------------------------------------------------------------------
    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        compile: bool | dict[str, Any] = False,
        activation_checkpointing: Any = None,
    ) -> SetupResult:
        from fairscale.nn import FullyShardedDataParallel

        if compile or activation_checkpointing:
            raise UnsupportedError(
                "fairscale_fsdp: setup(compile=..., activation_checkpointing=...) is not "
                "supported; FairScale FSDP wants fairscale.nn.checkpoint_wrapper around the "
                "blocks, applied by you before setup()"
            )
        if isinstance(model, FullyShardedDataParallel):
            raise ConfigError("fairscale_fsdp: this model is already wrapped; pass the original")
        if len(optimizers) > 1:
            raise ConfigError(
                "fairscale_fsdp: one optimizer per model (its param groups are re-pointed at "
                "FairScale's flat parameters); put several in one optimizer's param groups"
            )
        group_of: dict[int, int] = {}
        for optimizer in optimizers:
            for index, group in enumerate(optimizer_recipe(self.name, optimizer).groups):
                for param in group["params"]:
                    group_of[id(param)] = index
        names = {id(p): n for n, p in model.named_parameters()}
        unknown = [p for p in group_of if p not in names]
        if unknown:
            raise ConfigError(
                f"fairscale_fsdp: the optimizer holds {len(unknown)} parameter(s) that are not "
                "in the model passed to setup(); build it from that model's parameters()"
            )
        if not self.options.move_params_to_cpu:
            model = model.to(self.device)
        blocks = _unit_blocks(model, self.options.wrap_policy)
        kwargs = self._fsdp_kwargs()
        new_groups: dict[int, list[torch.nn.Parameter]] = {}

        def wrap(module: torch.nn.Module) -> Any:
            own = [p for p in module.parameters() if not hasattr(p, "_is_sharded")]
            groups = {group_of.get(id(p)) for p in own}
            if self.options.flatten_parameters and len(groups) > 1:
                where = names.get(id(own[0]), type(module).__name__).rsplit(".", 1)[0]
                raise ConfigError(
                    f"fairscale_fsdp: the FSDP unit around {where or '<root>'} flattens "
                    "parameters of different optimizer param groups (or parameters outside the "
                    "optimizer) into one flat parameter. Give the unit one group, choose a "
                    "wrap_policy that separates them, or set flatten_parameters=False."
                )
            if len({p.requires_grad for p in own}) > 1 and self.options.flatten_parameters:
                raise ConfigError(
                    "fairscale_fsdp: a unit mixes frozen and trainable parameters, which one "
                    "flat parameter cannot hold; adjust wrap_policy or flatten_parameters=False"
                )
            origin = {id(p): group_of.get(id(p)) for p in own}
            unit = FullyShardedDataParallel(module, **kwargs)
            for param in unit.params:
                if self.options.flatten_parameters:
                    index = next(iter(groups))
                else:
                    index = origin.get(id(param))
                if index is not None:
                    new_groups.setdefault(index, []).append(param)
            return unit

        for block in reversed(blocks):  # innermost first: a unit wraps already-wrapped ones
            parent, attr = self._parent_of(model, block)
            setattr(parent, attr, wrap(block))
        root = wrap(model)
        self._roots.append(root)
        # In root.parameters() order (the root's flat parameter first, then the nested units'),
        # as an optimizer built on the wrapped model would hold them; FairScale's optimizer-state
        # tools (gather_full_optim_state_dict) rely on that order.
        order = {id(p): i for i, p in enumerate(root.parameters())}
        for optimizer in optimizers:
            optimizer.state.clear()
            for index, group in enumerate(optimizer.param_groups):
                group["params"] = sorted(new_groups.get(index, []), key=lambda p: order[id(p)])
        log.debug(
            "fairscale_fsdp: %d nested units + root over %d ranks (%s)",
            len(blocks),
            self.world_size,
            self.settings.precision,
        )
        return SetupResult(root, optimizers)

    @staticmethod
    def _parent_of(model: torch.nn.Module, block: torch.nn.Module) -> tuple[torch.nn.Module, str]:
        for module in model.modules():
            for attr, child in module._modules.items():
                if child is block:
                    return module, attr
        raise ConfigError("fairscale_fsdp: a selected block is not a submodule of the model")

    # ---- the training step --------------------------------------------------------------------
    def _root_of(self, model: torch.nn.Module | None) -> Any:
        from fairscale.nn import FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return model
        return self._roots[0] if len(self._roots) == 1 else None

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip the reduce-scatter: full-size gradients accumulate locally until the window closes."""
        root = self._root_of(model)
        return root.no_sync() if root is not None else contextlib.nullcontext()

    def before_backward(self, model: torch.nn.Module | None, *, closes_window: bool) -> None:
        # FairScale 0.4.13 with move_params_to_cpu copies each synced backward's gradient shard
        # over the last one (p._cpu_grad): accumulating outside no_sync keeps only the window's
        # last micro-batch (measured on the H200: raw FairScale that way is 1.9x off DDP's loss,
        # under no_sync 2.6e-7). So inside a window its micro-batches always run under no_sync.
        self._hold_sync = bool(self.options.move_params_to_cpu and not closes_window)

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None, **kwargs: Any) -> None:
        hold, self._hold_sync = self._hold_sync, False
        with self.no_sync(model) if hold else contextlib.nullcontext():
            super().backward(loss, model, **kwargs)

    def grad_norm(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
    ) -> torch.Tensor:
        """FSDP's ``clip_grad_norm_``: the norm of the local shards, all-reduced (global)."""
        root = self._root_of(model)
        if root is None:
            raise UnsupportedError("fairscale_fsdp: cannot tell which model this optimizer trains")
        limit = float("inf") if max_norm is None else max_norm
        return root.clip_grad_norm_(limit)

    def _grads_in_param_dtype(self, optimizer: torch.optim.Optimizer) -> None:
        """Under FairScale's own mixed precision, give every gradient its parameter's dtype.

        At world size > 1 FairScale casts the reduce-scattered gradient shard to fp32. At world
        size 1 (no reduce-scatter) 0.4.13 casts only a ``.data`` alias in ``_post_reduction_hook``
        and leaves ``p.grad`` in fp16, so ``AdamW.step()`` fails ("expected dtype float for
        `end` but got dtype c10::Half", measured on the H200 and on the CPU shim). Cast it here,
        which is what FairScale does at world size > 1.
        """
        if not getattr(self.precision, "native", False) or self.world_size > 1:
            return  # only world size 1 leaves them in fp16; keep the step loop free elsewhere
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is not None and grad.dtype != param.dtype:
                    param.grad = grad.to(param.dtype)

    def clip_grad_norm(
        self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        self._grads_in_param_dtype(optimizer)
        return super().clip_grad_norm(model, optimizer, max_norm)

    def optimizer_step(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None,
        track_grad_norm: bool,
    ) -> StepResult:
        self._grads_in_param_dtype(optimizer)
        return super().optimizer_step(
            model, optimizer, max_grad_norm=max_grad_norm, track_grad_norm=track_grad_norm
        )

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module (its selected blocks are now nested FSDP units)."""
        inner = model
        while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
            inner = inner.module
        return inner

    # ---- state --------------------------------------------------------------------------------
    def local_fragments(self, state: dict[str, Any]) -> Iterator[Any]:
        """Each rank's ranges of the flat parameters (and their optimizer state), cut back to
        the original parameters; no gather (see accelkit_fairscale.checkpoint)."""
        from accelkit_fairscale.checkpoint import fsdp_fragments

        return fsdp_fragments(self, state)

    def load_fragments(self, reader: Any, state: dict[str, Any]) -> None:
        from accelkit_fairscale.checkpoint import load_fsdp_fragments

        load_fsdp_fragments(self, reader, state)

    def check_load(self, reader: Any, state: dict[str, Any]) -> None:
        """Keys, full shapes and optimizer state by the original parameters inside each flat
        one (no gather: the dense check would all-gather every unit through state_dict)."""
        from accelkit_fairscale.checkpoint import check_fsdp_load

        check_fsdp_load(self, reader, state)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """FairScale's full state dict: every unit's parameters all-gathered, on every rank,
        with FairScale's wrapper prefixes removed. Copies, in the parameters' dtype (fp32)."""
        root = self._root_of(model)
        state = root.state_dict()
        return {k: v.detach().clone() for k, v in state.items()}
