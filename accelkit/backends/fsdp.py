"""torch FSDP2 (``fully_shard``): every parameter is a DTensor sharded by rows across ranks.

What this backend adds to ``fully_shard``:

- a wrap policy (the blocks of the model's stacks, or classes the user names, then the root);
- meta-device init: ``init_module()`` builds the parameters on ``meta`` (buffers and the 1-D
  parameters of modules without ``reset_parameters`` stay real); ``setup`` materialises one wrap
  unit at a time (``reset_parameters``, and a Transformers model's ``_init_weights``) and shards
  it before the next, so peak memory is the sharded model plus one unit, and re-ties tied weights;
- the user's optimizer keeps its identity: its parameters are swapped in place for the sharded
  ones, matched by name;
- precision strings mapped onto ``MixedPrecisionPolicy`` (see :data:`FSDP_DTYPES`), and
  ``ShardedGradScaler`` for ``16-mixed``;
- a clipping norm computed over the sharded gradients (one all-reduce).

Over 800 lines: the model surgery (meta-device materialisation, re-tying) is still changing
for Transformers models; it moves to a module of its own once that settles.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from accelkit.backend import Capabilities, SetupResult
from accelkit.backends.distributed import DistributedBackend, DistributedOptions
from accelkit.backends.mesh import (
    apply_style,
    build_mesh,
    check_plan,
    fsdp_mesh,
    resolve_plan,
    resolve_shape,
)
from accelkit.backends.pipelining import (
    PassThrough,
    PipelinedModule,
    PipelineParallel,
    optimizer_slots,
)
from accelkit.errors import ConfigError
from accelkit.float8 import Float8Options
from accelkit.modules import (
    apply_activation_checkpointing,
    check_wrap_policy,
    compile_in_place,
    wrap_blocks,
)
from accelkit.pipeline import ZERO_BUBBLE
from accelkit.precision import (
    NATIVE_PRECISIONS,
    DtypeRow,
    MixedPrecision,
    cast_floats,
    low_dtype,
)

log = logging.getLogger("accelkit")

#: What each precision string means on FSDP2 (published in docs/backends/fsdp.md).
FSDP_DTYPES: dict[str, DtypeRow] = {
    "32-true": DtypeRow("fp32 (sharded)", "fp32", "none (params are fp32)", "fp32"),
    "bf16-mixed": DtypeRow(
        "fp32 sharded; all-gathered as bf16 for compute",
        "bf16 (MixedPrecisionPolicy param_dtype)",
        "fp32 (the sharded params themselves)",
        "fp32 (reduce_dtype)",
    ),
    "16-mixed": DtypeRow(
        "fp32 sharded; all-gathered as fp16 for compute",
        "fp16 (MixedPrecisionPolicy param_dtype) + dynamic loss scaling (ShardedGradScaler)",
        "fp32 (the sharded params themselves)",
        "fp32 (reduce_dtype)",
    ),
    "bf16-true": DtypeRow("bf16 (sharded)", "bf16", "none", "bf16"),
    "16-true": DtypeRow("fp16 (sharded)", "fp16", "none", "fp16"),
    "fp8-mixed": DtypeRow(
        "fp32 sharded; all-gathered as fp8 for the converted Linear weights (tensorwise "
        "recipe), as bf16 otherwise",
        "fp8 for the eligible nn.Linear layers (torchao Float8Linear); bf16 elsewhere",
        "fp32 (the sharded params themselves)",
        "fp32 (reduce_dtype)",
    ),
}


# ---- options --------------------------------------------------------------------------------
@dataclass
class FSDPOptions(DistributedOptions, Float8Options):
    """Options of ``fsdp`` (and of backends built on :class:`FSDPBackend`)."""

    #: which submodules become their own FSDP unit before the root: True = the children of the
    #: outermost ModuleList/Sequential stacks; classes, class names or a predicate; False = root only
    wrap_policy: Any = True
    #: free the gathered parameters after forward (None: FSDP2's default, True except the root;
    #: an int reshards to that smaller group size)
    reshard_after_forward: bool | int | None = None
    #: keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy)
    cpu_offload: bool = False
    #: skip the gradient reduce-scatter inside an accumulation window; saves communication but
    #: keeps unsharded gradients (the full model's size in fp32) in memory until the window closes
    skip_sync_in_accumulation: bool = False
    #: N-D parallelism (accelkit.backends.mesh): replicas of the sharded model (HSDP when > 1)
    dp_replicate: int | None = None
    #: ranks each replica's parameters are sharded over (None: what the world size leaves)
    dp_shard: int | None = None
    #: tensor-parallel degree; > 1 needs tp_plan
    tp: int | None = None
    #: {module name pattern: ParallelStyle}, or "auto" for the common transformer block shapes
    tp_plan: Any = None
    #: fp8-mixed: all-gather the converted Linear weights in float8 (torchao's
    #: enable_fsdp_float8_all_gather); None: on for the tensorwise recipe, the only one it supports
    fp8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_fp8_options()
        if self.fp8_all_gather and self.fp8_recipe != "tensorwise":
            raise ValueError(
                "option 'fp8_all_gather' needs fp8_recipe='tensorwise' (torchao all-gathers "
                f"float8 weights with one scale per tensor only), got {self.fp8_recipe!r}"
            )
        check_wrap_policy(self.wrap_policy)
        if (
            isinstance(self.reshard_after_forward, int)
            and not isinstance(self.reshard_after_forward, bool)
            and self.reshard_after_forward < 1
        ):
            raise ValueError(
                "option 'reshard_after_forward' as an int is a group size >= 1, "
                f"got {self.reshard_after_forward}"
            )


# ---- precision ------------------------------------------------------------------------------
class FSDPPrecision(MixedPrecision):
    """Precision on FSDP2. ``-mixed``: fp32 sharded params (they are the master), gathered in
    low precision for compute, gradients reduced in fp32. ``-true``: the model is cast to the
    low dtype before sharding. No autocast: FSDP2 casts parameters and inputs itself."""

    def __init__(self, precision: str, device_type: str, float8: Any = None) -> None:
        self.name = precision
        self.device_type = device_type
        #: fp8-mixed: the accelkit.float8.Float8Config, and the models converted with it
        self.float8 = float8
        self._float8_models: list[weakref.ref] = []
        self._unscaled: set[int] = set()
        self.dtype = None if precision == "32-true" else low_dtype(precision)
        self.mixed = precision.endswith("-mixed")
        self.input_dtype = self.dtype if not self.mixed else None
        self.scaler = None
        if precision == "16-mixed":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device_type)

    def mp_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed:
            return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``-true``: cast to the low dtype; ``fp8-mixed``: swap the eligible Linear layers
        (before ``fully_shard``, so FSDP2 shards and all-gathers the float8-aware weights)."""
        if self.float8 is not None:
            from accelkit.float8 import convert_to_float8

            module = convert_to_float8(module, self.float8)
            if self.float8.all_gather:
                self._float8_models.append(weakref.ref(module))
            return module
        return module.to(self.dtype) if self.dtype is not None and not self.mixed else module

    def refresh_float8_scales(self) -> None:
        """With float8 all-gather: compute the scales of the converted weights for the next
        all-gather in one all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp), after
        the weights changed. Without it, each weight would reduce its own amax at every gather."""
        if not self._float8_models:
            return
        from accelkit.float8 import refresh_fsdp_scales

        self._float8_models = [ref for ref in self._float8_models if ref() is not None]
        for ref in self._float8_models:
            model = ref()
            if model is not None:
                refresh_fsdp_scales(model)

    def convert_output(self, data: Any) -> Any:
        return data if self.dtype is None else cast_floats(data, torch.float32)

    @contextlib.contextmanager
    def init_context(self) -> Iterator[None]:
        """``-true``: build the model directly in the low dtype."""
        if self.dtype is None or self.mixed:
            yield
            return
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


# ---- model surgery --------------------------------------------------------------------------
def _own_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (name, t)
        for name, t in (*module._parameters.items(), *module._buffers.items())
        if t is not None
    ]


def _module_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): (name or "<root>") for name, m in model.named_modules()}


def _tie_groups(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """Parameters reachable under more than one (module, name), in module order."""
    groups: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                groups.setdefault(id(param), []).append((module, name))
    return [g for g in groups.values() if len(g) > 1]


def _select_wrap_blocks(model: torch.nn.Module, policy: Any) -> list[torch.nn.Module]:
    """The submodules that become FSDP units, outermost first among nested ones."""
    blocks = wrap_blocks(model, policy, "fsdp")
    # a block that shares a parameter with the rest of the model must stay in an outer unit
    ties = _tie_groups(model)
    names = _module_names(model)
    kept = []
    for block in blocks:
        members = {id(m) for m in block.modules()}
        crossing = [g for g in ties if len({id(m) in members for m, _ in g}) > 1]
        if crossing:
            log.info(
                "fsdp: %s shares parameters with modules outside it (tied weights); it stays "
                "in its parent's FSDP unit",
                names.get(id(block), type(block).__name__),
            )
            continue
        kept.append(block)
    return kept


def _has_reset(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def _model_init_owner(module: torch.nn.Module) -> bool:
    """A Transformers-style model: ``_init_weights(submodule)`` initialises its modules, as its
    ``post_init()`` does at construction (duck-typed: Transformers is never imported here)."""
    return callable(getattr(module, "_init_weights", None)) and callable(
        getattr(module, "post_init", None)
    )


def keeps_built_value(module: torch.nn.Module, param: torch.Tensor) -> bool:
    """Whether a meta build keeps this parameter as its constructor made it (on the CPU): the
    1-D parameters (norm gains, biases) of a module without ``reset_parameters()``, which nothing
    else could recreate (``LlamaRMSNorm``'s ones, ``Conv1D``'s zero bias). They are small."""
    return param.dim() <= 1 and not _has_reset(module)


@contextlib.contextmanager
def build_context(
    meta: bool, device: torch.device, precision: Any, created: list[torch.nn.Parameter]
) -> Iterator[None]:
    """Where ``init_module()`` builds: on meta (``meta``), or on ``device``; in the precision's
    build dtype. A meta build keeps buffers and the 1-D parameters of modules without
    ``reset_parameters()`` real (:func:`keeps_built_value`). ``created`` receives every
    parameter built (the meta ones included)."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def register(module: torch.nn.Module, name: str, param: Any) -> Any:
        if param is None:
            return None
        if (
            meta
            and not param.is_meta
            and type(param) is torch.nn.Parameter
            and not keeps_built_value(module, param)
        ):
            # built on the CPU by its constructor (torch.empty: no memory is touched) and
            # moved to meta as it is registered, before the constructor initialises it
            on_meta = torch.nn.Parameter(
                param.detach().to("meta"), requires_grad=param.requires_grad
            )
            on_meta.__dict__.update(param.__dict__)
            created.append(on_meta)
            return on_meta
        created.append(param)
        return None

    handle = register_module_parameter_registration_hook(register)
    try:
        with contextlib.ExitStack() as stack:
            if not meta:
                stack.enter_context(device)
            stack.enter_context(precision.init_context())
            yield
    finally:
        handle.remove()


class _Materializer:
    """Brings a meta-built model onto the device one module at a time, in module order, so
    each unit can be sharded before the next is allocated.

    Every module that owns meta tensors has them allocated on the device (NaN-filled) and its
    tensors built for real (buffers, kept 1-D parameters) moved there. Then it is initialised:
    by its own ``reset_parameters()``; inside a Transformers model, also by the model's
    ``_init_weights(module)`` after its children, the order ``post_init()`` uses. Tied weights
    take the value of their first owner in module order."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.names = _module_names(model)
        self.ties = _tie_groups(model)
        self.tied_later = {(id(m), n) for g in self.ties for m, n in g[1:]}
        self.visited: set[int] = set()
        self.pending = list(range(len(self.ties)))
        self.owners = self._owners(model)
        #: per module: the tensors allocated for it and their version after the NaN fill
        self.handed: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
        #: tensors the initialisation did not write, and NaN flags of those it wrote
        self.unwritten: list[str] = []
        self.nan_flags: list[tuple[str, torch.Tensor]] = []

    @staticmethod
    def _owners(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
        """id(module) -> the innermost Transformers-style model holding it (itself included)."""
        owners: dict[int, torch.nn.Module] = {}

        def walk(module: torch.nn.Module, owner: torch.nn.Module | None) -> None:
            owner = module if _model_init_owner(module) else owner
            if owner is not None:
                owners[id(module)] = owner
            for child in module.children():
                walk(child, owner)

        walk(model, None)
        return owners

    def check(self, model: torch.nn.Module) -> None:
        """Fail before touching anything if a module could not be initialised."""
        mixed, missing = [], []
        for module in model.modules():
            own = _own_tensors(module)
            meta = [n for n, t in own if t.is_meta]
            if not meta:
                continue
            where = f"{self.names[id(module)]} ({type(module).__name__})"
            real_params = [
                n for n, t in module._parameters.items() if t is not None and not t.is_meta
            ]
            if real_params and _has_reset(module):
                mixed.append(where)
            elif (
                not _has_reset(module)
                and id(module) not in self.owners
                and not self._alias_only(module)
            ):
                missing.append(where)
        if mixed:
            raise ConfigError(
                "fsdp: these modules hold both meta and real parameters, so they cannot be "
                f"materialised: {', '.join(mixed)}. Build the whole model inside "
                "accel.init_module(), or none of it."
            )
        if missing:
            raise ConfigError(
                "fsdp: the model was built on the meta device (accel.init_module()), and these "
                "modules own parameters or buffers but have no reset_parameters() to initialise "
                f"them after sharding: {', '.join(missing)}. Give those classes a "
                "reset_parameters() method, or build the model with "
                "accel.init_module(empty_init=False) (full weights on every rank until setup)."
            )

    def _alias_only(self, module: torch.nn.Module) -> bool:
        own = _own_tensors(module)
        return all((id(module), n) in self.tied_later and n in module._parameters for n, t in own)

    def materialize(self, module: torch.nn.Module) -> None:
        """Before the module's children: allocate, move, and run ``reset_parameters()``."""
        self.visited.add(id(module))
        own = _own_tensors(module)
        if not own or not any(t.is_meta or t.device != self.device for _, t in own):
            return
        if self._alias_only(module) and not _has_reset(module):
            return  # re-tied to the first owner below
        handed: dict[str, tuple[torch.Tensor, int]] = {}
        with torch.no_grad():
            for store in (module._parameters, module._buffers):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    if t.is_meta:
                        new = torch.empty_like(t, device=self.device)
                        if new.is_floating_point() or new.is_complex():
                            new.fill_(math.nan)
                    elif t.device != self.device:
                        new = t.to(self.device)
                    else:
                        continue
                    if store is module._parameters:
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    store[name] = new
                    if t.is_meta:
                        handed[name] = (new, new._version)
            if not handed:
                return
            self.handed[id(module)] = handed
            if _has_reset(module):
                module.reset_parameters()

    def finish(self, module: torch.nn.Module) -> None:
        """After the module's children: the model's ``_init_weights(module)``, then check that
        every allocated tensor was written."""
        owner = self.owners.get(id(module))
        if owner is not None:
            with torch.no_grad():
                owner._init_weights(module)
        handed = self.handed.pop(id(module), None)
        if handed is None:
            return
        prefix = self.names[id(module)]
        current = dict(_own_tensors(module))
        for name, (tensor, version) in handed.items():
            t = current.get(name)
            if t is not None and (t.is_floating_point() or t.is_complex()):
                # NaN-filled: a write through .data (Transformers' init) leaves no version trace
                self.nan_flags.append((f"{prefix}.{name}", t.isnan().any()))
            elif tensor is t and t._version == version:  # neither written nor replaced
                self.unwritten.append(f"{prefix}.{name}")

    def retie(self) -> None:
        """Point every alias at its first owner once all of a group's modules are visited."""
        still = []
        for index in self.pending:
            group = self.ties[index]
            if not all(id(m) in self.visited for m, _ in group):
                still.append(index)
                continue
            owner, owner_name = group[0]
            param = owner._parameters[owner_name]
            for module, name in group[1:]:
                if module._parameters[name] is not param:
                    module._parameters[name] = param
        self.pending = still

    def verify(self) -> None:
        """``reset_parameters`` must have written every tensor it was handed (floating-point
        ones were NaN-filled, so a write that reads them shows too)."""
        bad = list(self.unwritten)
        if self.nan_flags:
            flags = torch.stack([flag for _, flag in self.nan_flags]).cpu().tolist()
            bad += [name for (name, _), flag in zip(self.nan_flags, flags) if flag]
        self.unwritten, self.nan_flags = [], []
        if bad:
            raise ConfigError(
                "fsdp: after materialising the meta-built model, reset_parameters() (or the "
                "model's _init_weights) left these tensors uninitialised (or NaN): "
                f"{', '.join(bad)}. Make reset_parameters() initialise every parameter and "
                "buffer its module owns, or build the model with "
                "accel.init_module(empty_init=False)."
            )


# ---- the backend ----------------------------------------------------------------------------
class FSDPBackend(PipelineParallel, DistributedBackend):
    """torch FSDP2: parameters, gradients and optimizer state sharded across ranks; with
    ``pp > 1``, each pipeline stage sharded over its data-parallel ranks
    (:mod:`accelkit.backends.pipelining`)."""

    capabilities = Capabilities(
        controls_precision=True,
        controls_device=True,
        no_sync=True,
        no_sync_by_default=False,
        manual_clip=True,
        sharded=True,
        distributed=True,
        offload=True,
        init_context="meta",
        precisions=NATIVE_PRECISIONS,
        pipeline_schedules=PipelineParallel.PIPELINE_SCHEDULES,
    )
    options_class = FSDPOptions
    dtype_table = FSDP_DTYPES

    def __init__(self, name: str, options: Any, settings: Any) -> None:
        super().__init__(name, options, settings)
        #: id(param) -> (weakref, version) of parameters built on meta in init_module()
        self._meta_versions: dict[int, tuple[weakref.ref, int]] = {}
        #: the N-D mesh (None: one flat dimension of sharding, accelkit's plain fsdp)
        self.mesh: Any = None
        self.mesh_shape: Any = None

    @classmethod
    def resolve_settings(cls, name: str, options: Any, settings: Any) -> Any:
        """Refuses at ``get()``, before any process joins, a zero-bubble schedule with FSDP2's
        resharding after forward."""
        pipeline = settings.pipeline
        if (
            pipeline is not None
            and pipeline.schedule in ZERO_BUBBLE
            and options.reshard_after_forward not in (None, False)
        ):
            raise ConfigError(
                f"fsdp: the {pipeline.schedule} schedule with reshard_after_forward="
                f"{options.reshard_after_forward!r} gives wrong gradients (measured 4e-2 off a "
                "one-process run with torch 2.13, bench/results/2026-12-05-pipeline-traps.txt: "
                "the split backward's weight part runs on resharded parameters); leave reshard_after_forward out (False "
                "under pp) or pick GPipe / 1F1B / Interleaved1F1B"
            )
        return super().resolve_settings(name, options, settings)

    def make_precision(self) -> FSDPPrecision:
        from accelkit.float8 import float8_config

        precision = self.settings.precision
        float8 = float8_config(f"backend {self.name!r}", precision, self.options)
        return FSDPPrecision(precision, self._device.type, float8)

    # ---- the device mesh (accelkit.backends.mesh) ----------------------------------------------
    def launch(self) -> None:
        super().launch()
        o = self.options
        pipeline = self.settings.pipeline
        self.mesh_shape = resolve_shape(
            self.world_size, o.dp_replicate, o.dp_shard, o.tp, pipeline.pp if pipeline else 1
        )
        if self.settings.precision == "fp8-mixed" and self.mesh_shape.tp > 1:
            raise ConfigError(
                "fsdp: precision 'fp8-mixed' with tensor parallelism (tp > 1) is not supported: "
                "the tensor-parallel plans shard plain Linear layers, and torchao's float8 layers "
                "need parallel styles of their own. Use tp=1 (FSDP2 or HSDP) or 'bf16-mixed'."
            )
        self.mesh = (
            None if self.mesh_shape.is_flat else build_mesh(self._device.type, self.mesh_shape)
        )

    @property
    def data_parallel_rank(self) -> int:
        return self.rank if self.mesh is None else self.mesh["dp"].get_local_rank()

    @property
    def data_parallel_world_size(self) -> int:
        return self.world_size if self.mesh is None else self.mesh_shape.dp

    def data_parallel_group(self) -> Any:
        return None if self.mesh is None else self.mesh["dp"].get_group()

    # ---- building the model -------------------------------------------------------------------
    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Build the parameters on the meta device (default), or on this rank's device with
        ``empty_init=False``.

        A meta build keeps buffers (a causal mask, rotary frequencies) and the 1-D parameters of
        modules without ``reset_parameters()`` as their constructor made them, on the CPU: they
        are small, and nothing else could recreate them. ``setup`` initialises the meta
        parameters (``reset_parameters()``, and a Transformers model's ``_init_weights``)."""
        return self._build_context(meta=empty_init is not False)

    @contextlib.contextmanager
    def _build_context(self, meta: bool) -> Iterator[None]:
        created: list[torch.nn.Parameter] = []
        with build_context(meta, self.device, self.precision, created):
            yield
        for param in created:
            if param.is_meta:
                self._meta_versions[id(param)] = (weakref.ref(param), param._version)

    def _refuse_meta_writes(self, model: torch.nn.Module) -> None:
        written = []
        for name, param in model.named_parameters():
            record = self._meta_versions.get(id(param))
            if record is not None and record[0]() is param and param._version != record[1]:
                written.append(name)
        if written:
            shown = ", ".join(written[:8]) + (" ..." if len(written) > 8 else "")
            raise ConfigError(
                "fsdp: these parameters were written after accel.init_module() built them on "
                f"the meta device: {shown}. Meta tensors hold no data, so a custom weight "
                "initialisation or load_state_dict() between init_module() and setup() is lost. "
                "Put the initialisation in the modules' reset_parameters() (setup calls it for "
                "every module after sharding), build with accel.init_module(empty_init=False) "
                "to keep your own initialisation, or load weights after setup with accel.load()."
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
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

        if isinstance(model, FSDPModule):
            raise ConfigError("fsdp: this model is already sharded; pass the original module")
        if self.settings.pipeline is not None and not self._in_stage:
            return self.setup_pipeline(
                model,
                optimizers,
                compile=compile,
                activation_checkpointing=activation_checkpointing,
            )
        slots = self._optimizer_slots(model, optimizers)
        self._refuse_meta_writes(model)
        # before the materializer indexes the modules: fp8-mixed swaps Linear layers for new ones
        model = self.precision.convert_module(model)
        has_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        materializer = _Materializer(model, self.device)
        if has_meta:
            materializer.check(model)

        tp_styles = self._tp_styles(model)
        if activation_checkpointing:
            apply_activation_checkpointing(model, activation_checkpointing)
        blocks = _select_wrap_blocks(model, self.options.wrap_policy)

        o = self.options
        offload = (
            CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
            if o.cpu_offload
            else OffloadPolicy()
        )
        mesh = (
            init_device_mesh(self.device.type, (self.world_size,))
            if self.mesh is None
            else fsdp_mesh(self.mesh, self.mesh_shape)
        )
        shard_kwargs: dict[str, Any] = dict(
            mesh=mesh,
            mp_policy=self.precision.mp_policy(),
            offload_policy=offload,
        )
        if o.reshard_after_forward is not None:  # else FSDP2's own default
            shard_kwargs["reshard_after_forward"] = o.reshard_after_forward
        elif self.settings.pipeline is not None:
            # under pp: each stage's parameters are used again by every micro-batch's backward
            # (and the zero-bubble schedules' weight part is wrong on resharded ones)
            shard_kwargs["reshard_after_forward"] = False
        unit_ids = {id(b) for b in blocks}
        seen: set[int] = set()
        # The optimizer must not keep the unsharded tensors alive while we shard.
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = []

        def visit(module: torch.nn.Module) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            if has_meta:
                materializer.materialize(module)
            for child in module.children():
                visit(child)
            if has_meta:
                materializer.finish(module)
            materializer.retie()
            style = tp_styles.get(id(module))
            if style is not None:  # its whole subtree is real now; before its unit is sharded
                apply_style(module, self.mesh["tp"], style)
            if id(module) in unit_ids:
                fully_shard(module, **shard_kwargs)

        visit(model)
        fully_shard(model, **shard_kwargs)
        self._meta_versions.clear()

        sharded = dict(model.named_parameters())
        for optimizer, groups in zip(optimizers, slots):
            for group, names in zip(optimizer.param_groups, groups):
                group["params"] = [sharded[n] for n in names]
        materializer.verify()
        self.on_wrapped(model)

        if compile:
            options = compile if isinstance(compile, dict) else None
            for unit in blocks or [model]:
                compile_in_place(unit, options)
        log.debug(
            "fsdp: sharded %d blocks + root over %d ranks (%s)",
            len(blocks),
            self.world_size,
            self.settings.precision,
        )
        return SetupResult(model, optimizers)

    #: inside setup_pipeline's wrapping of one stage (setup then shards that stage alone)
    _in_stage = False

    def _wrap_stage(
        self, module: torch.nn.Module, activation_checkpointing: Any, compile: Any
    ) -> torch.nn.Module:
        """One pipeline stage: the tensor-parallel plan, checkpointing, ``fully_shard`` over
        the stage's data-parallel ranks, as ``setup`` does for a whole model."""
        self._in_stage = True
        try:
            return self.setup(
                module, [], compile=compile, activation_checkpointing=activation_checkpointing
            ).model
        finally:
            self._in_stage = False

    def _materializer(self, model: torch.nn.Module) -> _Materializer:
        self._refuse_meta_writes(model)
        return _Materializer(model, self.device)

    def optimizer_step(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        """Under pp, a weight tied across stages gets its gradients summed first."""
        self.sum_tied_grads(model)
        return super().optimizer_step(model, optimizer, **kwargs)

    def on_wrapped(self, model: torch.nn.Module) -> None:
        """Hook: runs in ``setup`` once ``fully_shard`` sharded every unit and the root and the
        optimizers hold the sharded parameters, before ``compile``; gets the root FSDP module,
        returns nothing (set prefetching, register hooks). The default does nothing."""

    def _tp_styles(self, model: torch.nn.Module) -> dict[int, Any]:
        """``id(module) -> ParallelStyle`` of the tensor-parallel plan (empty without ``tp``).

        Each style is applied in ``setup``'s walk right after its module is materialised (a
        meta-built model) and before its FSDP unit is sharded: the plan slices a full tensor
        that the module's own ``reset_parameters()`` initialised, so the weights are those of
        the same seed built on the CPU."""
        if self.mesh is None or self.mesh_shape.tp == 1:
            return {}
        # one pipeline stage holds part of the model: entries for the others match nothing
        plan = resolve_plan(model, self.options.tp_plan, missing_ok=self._in_stage)
        modules = dict(model.named_modules())
        plan = {n: st for n, st in plan.items() if not isinstance(modules[n], PassThrough)}
        check_plan(model, plan, self.mesh_shape.tp)
        return {id(modules[name]): style for name, style in plan.items()}

    @staticmethod
    def _optimizer_slots(
        model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> list[list[list[str]]]:
        """The parameter names of every optimizer's groups; refuses what cannot be swapped."""
        return optimizer_slots(model, optimizers, "fsdp")

    # ---- the training step --------------------------------------------------------------------
    def end_step(self) -> None:
        """After every optimizer of the step: fp8-mixed's all-gather scales of the new weights
        (torchao's precompute, after each optimizer step)."""
        super().end_step()
        self.precision.refresh_float8_scales()

    def load_fragments(self, reader: Any, state: dict[str, Any]) -> None:
        """A load replaces the weights: their float8 all-gather scales are computed again."""
        super().load_fragments(reader, state)
        self.precision.refresh_float8_scales()

    @contextlib.contextmanager
    def _without_sync(self, model: torch.nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip the reduce-scatter (gradients stay unsharded and accumulate locally)."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return self._without_sync(model)
        return contextlib.nullcontext()

    def grad_norm(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
    ) -> torch.Tensor:
        """Total norm over the sharded gradients (a plain 0-d tensor, equal on every rank);
        under pp, over every stage's."""
        from torch.distributed.tensor import DTensor

        if isinstance(model, PipelinedModule):
            return self.pipeline_grad_norm(
                model,
                optimizer,
                max_norm,
                lambda opt, _: self.grad_norm(None, opt, None),
                self._clip_with,
            )
        params = [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        if not params:
            return torch.zeros((), device=self.device)
        sharded = [p.grad for p in params if isinstance(p.grad, DTensor)]
        local = [p.grad for p in params if not isinstance(p.grad, DTensor)]
        parts = []
        if sharded:
            parts.append(self._sharded_norm(sharded))
        if local:
            parts.append(torch.nn.utils.get_total_norm(local).to(self.device))
        total = parts[0] if len(parts) == 1 else torch.stack([p.float() for p in parts]).norm()
        if max_norm is not None:
            self._clip_with(params, max_norm, total)
        return total

    @staticmethod
    def _clip_with(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
        """Clip to ``max_norm`` given the total norm: one foreach per mesh (DTensor ops cannot
        mix meshes)."""
        groups: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)

    def _sharded_norm(self, grads: list[Any], via_dtensor: bool | None = None) -> torch.Tensor:
        """2-norm of DTensor gradients, as a plain tensor on this rank's device.

        Where the shards live on the mesh's device, DTensor reduces the norm itself (what a raw
        FSDP2 loop does). Offloaded shards (CPU gradients on a CUDA mesh) cannot go through the
        mesh's NCCL group, so each rank's squared norm moves to the device and is summed there.
        """
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import Shard

        mesh = grads[0].device_mesh
        if via_dtensor is None:
            via_dtensor = all(g.to_local().device.type == mesh.device_type for g in grads)
        if via_dtensor:
            # one norm per mesh (on an N-D mesh, tensor-parallel and plain parameters live on
            # different meshes, which one foreach norm cannot mix), then the 2-norm of those
            by_mesh: dict[Any, list[Any]] = {}
            for g in grads:
                by_mesh.setdefault(g.device_mesh, []).append(g)
            norms = []
            for group in by_mesh.values():
                norm = torch.nn.utils.get_total_norm(group)
                norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            return norms[0] if len(norms) == 1 else torch.stack(norms).norm()
        if mesh.ndim != 1 or not all(
            all(isinstance(pl, Shard) for pl in g.placements) for g in grads
        ):
            raise ConfigError("fsdp: offloaded gradients must be sharded on a 1-D mesh")
        local = torch.nn.utils.get_total_norm([g.to_local() for g in grads])
        squared = local.to(self.device, torch.float32).square()
        torch.distributed.all_reduce(squared, group=mesh.get_group())
        return squared.sqrt().to(local.dtype)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 shards in place: the module is the user's own (its class gains FSDPModule);
        under pp, this rank's part of it."""
        return model.module if isinstance(model, PipelinedModule) else model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer unsharded, on every rank: an all-gather per tensor (the
        whole model in memory on each rank, on its device). With one process the tensors may
        alias the live parameters; clone them to keep them while training continues."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        if isinstance(model, PipelinedModule):
            return super().full_state_dict(model)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach() for k, v in state.items()}
