"""FairScale OSS (ZeRO-1 style optimizer-state sharding) under torch DDP, and FairScale
ShardedDataParallel (OSS plus gradients reduced only to the rank that owns them).

Both keep whole parameters on every rank: OSS gives each parameter to one rank (greedily, by
size), that rank alone keeps its optimizer state and updates it, then broadcasts the new
values. FairScale is imported when a backend is built, not before.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from accelkit.sdk import (
    NATIVE_DTYPES,
    Capabilities,
    ConfigError,
    DDPBackend,
    DDPOptions,
    DistributedOptions,
    DtypeRow,
    OwnedState,
    SetupResult,
    UnsupportedError,
    optimizer_recipe,
)
from accelkit_fairscale.common import (
    ShardedMixedPrecision,
    refuse_compile,
)

log = logging.getLogger("accelkit")

_BUFFER_SIZE_IGNORED = (
    "option 'broadcast_buffer_size' is ignored by FairScale 0.4.13 (deprecated there: OSS "
    "packs each rank's parameters into one flat buffer and broadcasts it whole), so accelkit "
    "does not accept it; remove it"
)

#: OSS and ShardedDataParallel keep torch's dtypes (autocast + loss scaling); the optimizer
#: state of each parameter lives on its owner rank only.
OSS_DTYPES: dict[str, DtypeRow] = {
    key: DtypeRow(row.param, row.compute, row.master, row.reduce)
    for key, row in NATIVE_DTYPES.items()
}
SDP_DTYPES: dict[str, DtypeRow] = {
    **OSS_DTYPES,
    "16-mixed": DtypeRow(
        "fp32",
        "fp16 (autocast) + dynamic loss scaling (ShardedGradScaler: overflow all-reduced)",
        "none (params are fp32)",
        "fp32 (fp16 with reduce_fp16=True)",
    ),
}


def _build_oss(
    backend: str, optimizer: torch.optim.Optimizer, options: Any
) -> torch.optim.Optimizer:
    """FairScale's OSS around the same optimizer class, groups and hyperparameters."""
    from fairscale.optim import OSS

    recipe = optimizer_recipe(backend, optimizer)
    return OSS(
        recipe.groups,
        optim=recipe.cls,
        broadcast_fp16=options.broadcast_fp16,
        force_broadcast_object=options.force_broadcast_object,
        **recipe.defaults,
    )


def _oss_norm(optimizer: Any, max_norm: float | None, device: torch.device) -> torch.Tensor:
    """OSS's own clip: the norm over the shards each rank owns, all-reduced (the global norm)."""
    from fairscale.optim import OSS

    if not isinstance(optimizer, OSS):  # pragma: no cover - setup always builds OSS
        raise UnsupportedError("expected a FairScale OSS optimizer")
    limit = float("inf") if max_norm is None else max_norm
    return optimizer.clip_grad_norm(limit).to(device)


# ---- fairscale_oss ---------------------------------------------------------------------------
@dataclass
class OSSOptions(DDPOptions):
    #: broadcast the updated shards in fp16 (halves the traffic; rounds fp32 weights)
    broadcast_fp16: bool = False
    #: use FairScale's own object broadcast when consolidating state (some GPUs need it)
    force_broadcast_object: bool = False
    #: refused: FairScale 0.4.13 ignores it
    broadcast_buffer_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.broadcast_buffer_size is not None:
            raise ValueError(_BUFFER_SIZE_IGNORED)


class OSSBackend(DDPBackend):
    """torch DDP for the gradients, FairScale OSS for the optimizer: state sharded by parameter."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        no_sync=True, sharded=True, distributed=True, compile=False
    )
    options_class = OSSOptions
    dtype_table = OSS_DTYPES

    def launch(self) -> None:
        super().launch()
        if self.settings.precision == "16-mixed":
            self.precision = ShardedMixedPrecision("16-mixed", self.device.type)

    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        compile: bool | dict[str, Any] = False,
        activation_checkpointing: Any = None,
    ) -> SetupResult:
        refuse_compile(self.name, compile)
        for optimizer in optimizers:
            optimizer_recipe(self.name, optimizer)  # refuse before wrapping anything
        # FairScale's documented order: DDP first, then OSS over the same parameters.
        result = super().setup(model, [], activation_checkpointing=activation_checkpointing)
        sharded = [_build_oss(self.name, opt, self.options) for opt in optimizers]
        return SetupResult(result.model, sharded)

    def grad_norm(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
    ) -> torch.Tensor:
        return _oss_norm(optimizer, max_norm, self.device)

    # ---- portable checkpoint: each rank writes the optimizer state it owns ---------------------
    def owned_optimizer_state(self, optimizer: Any) -> OwnedState | None:
        """OSS keeps each parameter's state on its owner rank, in the wrapped optimizer (its
        ``optim``, over this rank's partition); the SDK's default hooks save, load and check it."""
        from fairscale.optim import OSS

        if not isinstance(optimizer, OSS):
            return None
        mine = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
        return OwnedState(
            groups=optimizer.param_groups,
            state=optimizer.optim.state,
            owns=lambda param: id(param) in mine,
            optimizer=optimizer.optim,
        )


# ---- fairscale_sdp ---------------------------------------------------------------------------
@dataclass
class ShardedDDPOptions(DistributedOptions):
    #: broadcast buffers (batch-norm statistics) from rank 0 before each synced forward
    broadcast_buffers: bool = True
    #: elements per gradient bucket. 0 (accelkit's default; FairScale's is 2**23) reduces each
    #: gradient on its own. Bucketed gradients are views into the bucket, and a
    #: ``zero_grad(set_to_none=True)`` outside accelkit detaches them: the next backward then
    #: reduces stale bucket contents and the owner steps on its own local gradient (measured:
    #: losses leave DDP's from the third step). See docs/backends/fairscale.md.
    reduce_buffer_size: int = 0
    #: reduce gradients in fp16 (FairScale allows it only with reduce_buffer_size=0)
    reduce_fp16: bool = False
    #: re-check which parameters require grad at every forward
    auto_refresh_trainable: bool = True
    #: broadcast the updated shards in fp16 (halves the traffic; rounds fp32 weights)
    broadcast_fp16: bool = False
    #: use FairScale's own object broadcast when consolidating state (some GPUs need it)
    force_broadcast_object: bool = False
    #: refused: FairScale 0.4.13 ignores it
    broadcast_buffer_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.broadcast_buffer_size is not None:
            raise ValueError(_BUFFER_SIZE_IGNORED)
        if self.reduce_buffer_size < 0:
            raise ValueError(
                f"option 'reduce_buffer_size' must be >= 0 elements, got {self.reduce_buffer_size}"
            )
        if self.reduce_fp16 and self.reduce_buffer_size > 0:
            raise ValueError(
                "option 'reduce_fp16' works only with reduce_buffer_size=0 (FairScale turns it "
                "off when gradients are bucketed)"
            )


class ShardedDDPBackend(OSSBackend):
    """FairScale ShardedDataParallel: each gradient is reduced to the rank owning its parameter
    (OSS's partition) and dropped elsewhere; that rank steps and broadcasts."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        no_sync=True, sharded=True, distributed=True, compile=False
    )
    options_class = ShardedDDPOptions
    dtype_table = SDP_DTYPES

    def __init__(self, name: str, options: Any, settings: Any) -> None:
        super().__init__(name, options, settings)
        self._wrappers: list[Any] = []
        self._wrapper_of_optimizer: dict[int, Any] = {}
        #: a synced backward ran since the last zero_grad (SDP cannot accumulate across two)
        self._synced_since_step = False
        self._in_no_sync = 0

    def setup(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        compile: bool | dict[str, Any] = False,
        activation_checkpointing: Any = None,
    ) -> SetupResult:
        from fairscale.nn.data_parallel import ShardedDataParallel

        refuse_compile(self.name, compile)
        if not optimizers:
            raise ConfigError(
                f"{self.name}: ShardedDataParallel needs the optimizer at setup (the gradient "
                "partition comes from it); call setup(model, optimizer)"
            )
        for optimizer in optimizers:
            optimizer_recipe(self.name, optimizer)
        model = self.prepare_module(model, activation_checkpointing)
        sharded = [_build_oss(self.name, opt, self.options) for opt in optimizers]
        o = self.options
        wrapper = ShardedDataParallel(
            model,
            sharded,
            broadcast_buffers=o.broadcast_buffers,
            reduce_buffer_size=o.reduce_buffer_size,
            reduce_fp16=o.reduce_fp16,
            auto_refresh_trainable=o.auto_refresh_trainable,
        )
        self._wrappers.append(wrapper)
        for opt in sharded:
            self._wrapper_of_optimizer[id(opt)] = wrapper
        return SetupResult(wrapper, sharded)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside ShardedDataParallel (and DDP-style wrappers)."""
        from fairscale.nn.data_parallel import ShardedDataParallel

        while isinstance(model, ShardedDataParallel):
            model = model.module
        return super().unwrap(model)

    def _wrapper_of(self, model: torch.nn.Module | None) -> Any:
        from fairscale.nn.data_parallel import ShardedDataParallel

        if isinstance(model, ShardedDataParallel):
            return model
        return self._wrappers[0] if len(self._wrappers) == 1 else None

    @contextlib.contextmanager
    def _without_sync(self, wrapper: Any) -> Iterator[None]:
        self._in_no_sync += 1
        try:
            with wrapper.no_sync():
                yield
        finally:
            self._in_no_sync -= 1

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        wrapper = self._wrapper_of(model)
        return self._without_sync(wrapper) if wrapper is not None else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None, **kwargs: Any) -> None:
        synced = not self._in_no_sync and self.world_size > 1
        if synced and self._synced_since_step:
            raise UnsupportedError(
                f"{self.name}: a second synced backward before the optimizer step. "
                "ShardedDataParallel reduces each gradient to its owner rank and frees it on "
                "the others, so accumulating across synced backwards averages the earlier "
                "micro-batches twice (measured: wrong losses). Run each micro-batch inside "
                "`with accel.accumulate(model):`, which skips the sync until the window closes."
            )
        super().backward(loss, model, **kwargs)
        if synced:
            self._synced_since_step = True

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Through the wrapper: it frees unbucketed gradients and zeroes bucketed ones in place,
        so the bucket views that the reduction reads stay attached."""
        self._synced_since_step = False
        wrapper = self._wrapper_of_optimizer.get(id(optimizer))
        if wrapper is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            wrapper.zero_grad(set_to_none=True)
