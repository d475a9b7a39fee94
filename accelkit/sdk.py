"""The stable door for backend authors: every core name a backend plugin may build on.

A plugin (``plugins/*/accelkit_*``) imports from here and from ``accelkit`` only, never from
``accelkit.<module>``: core modules may move and rename their insides, and this module keeps its
names (a test, tests/test_sdk.py, fails on any other import). :data:`SDK_VERSION` changes its
major number when a name here is removed or changes meaning, its minor one when names are added.

The groups:

- the backend protocol: :class:`Backend` (its hooks are documented where they are declared),
  :class:`OwnedState` (what ``Backend.owned_optimizer_state`` returns for a ZeRO-1 optimizer),
  :class:`Capabilities`, :class:`Settings`, :class:`SetupResult`, :class:`StepResult`, and the
  torch-native backends to build on (:class:`SingleDeviceBackend`, :class:`DDPBackend` with
  :class:`DDPWrapOptions` / :class:`CommHookOptions`, :class:`FSDPBackend`; docs/plugins.md,
  "Building on a native backend");
- pipeline parallelism: :class:`PipelineSettings` (``backend.settings.pipeline``),
  :data:`PIPELINE_SCHEDULES`, :func:`split_microbatches`; a backend lists its schedules in
  ``Capabilities.pipeline_schedules`` and implements ``Backend.pipeline_forward_backward``;
- launch: :class:`DistributedBackend` (device pick, process group, ``timeout``) with its
  :class:`DistributedOptions` / :class:`ProcessGroupOptions`, :func:`init_process_group`,
  :func:`local_rank`, :func:`is_initialized`, :data:`DEFAULT_TIMEOUT_S`;
- options: :func:`build_options`, :func:`options_as_dict`, :func:`load_config_source`,
  :func:`closest`, :func:`pip_install`, :func:`installed_versions`;
- precision policies and dtype tables: :class:`Precision`, :class:`MixedPrecision`,
  :class:`BoundaryCastPrecision`, :class:`DtypeRow`, :func:`cast_floats`, ...;
- module transforms: :func:`apply_activation_checkpointing`, :func:`compile_in_place`,
  :func:`select_blocks`, and the ``wrap_policy`` option of FSDP-like backends
  (:func:`check_wrap_policy`, :func:`wrap_blocks`);
- rebuilding the user's optimizer as a library's own (ZeRO-1): :func:`optimizer_recipe`;
- the checkpoint kit (docs/plugins.md, "Checkpoints of a sharded backend"): fragments, slots,
  layouts and the loaders of :mod:`accelkit.checkpoint.shards.sharded`, the codec, names, and the
  foreign-format import helpers of ``accelkit convert``;
- checkpoint stores (docs/plugins.md, "Checkpoint stores"): the :class:`Store` protocol, and
  :class:`BucketStore` over a :class:`Bucket` for a store of objects, registered by URL scheme
  through the ``accelkit_checkpoint_stores`` hook; :func:`store_for` picks one for a path;
- restricted unpickling (docs/plugins.md, "Reading pickled checkpoints"): the one way a plugin
  reads a pickle, :func:`restricted_torch_load` with its library's :class:`PickleAllowlist`;
- memory estimates (``accelkit plan``): :func:`optimizer_terms`, :func:`trace_kind`, ...;
- errors and :data:`hookimpl`.

Importing this module is cheap: names load from their modules on first access, and none of them
imports a backend library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit.lazy import lazy_getattr

#: major.minor: the major number changes when a name is removed or changes meaning
SDK_VERSION = "1.9"

#: name -> the core module that defines it (loaded on first access)
_SOURCES: dict[str, str] = {
    # the backend protocol
    "Backend": "accelkit.backend",
    "Capabilities": "accelkit.backend",
    "Settings": "accelkit.backend",
    "SetupResult": "accelkit.backend",
    "StepResult": "accelkit.backend",
    "NoOptions": "accelkit.backend",
    "OwnedState": "accelkit.backend",
    "SingleDeviceBackend": "accelkit.backends.single",
    "device_available": "accelkit.backend_specs",
    "DDPBackend": "accelkit.backends.ddp",
    "DDPOptions": "accelkit.backends.ddp",
    "DDPWrapOptions": "accelkit.backends.ddp",
    "CommHookOptions": "accelkit.backends.ddp",
    "FSDPBackend": "accelkit.backends.fsdp",
    "FSDPOptions": "accelkit.backends.fsdp",
    "DistributedBackend": "accelkit.backends.distributed",
    "DistributedOptions": "accelkit.backends.distributed",
    "ProcessGroupOptions": "accelkit.backends.distributed",
    "hookimpl": "accelkit.hookspecs",
    # pipeline parallelism (docs/pipeline.md, "Writing a backend's pipeline")
    "PipelineSettings": "accelkit.pipeline",
    "PIPELINE_SCHEDULES": "accelkit.pipeline",
    "ZERO_BUBBLE_SCHEDULES": "accelkit.pipeline",
    "split_microbatches": "accelkit.pipeline",
    # launch
    "DEFAULT_TIMEOUT_S": "accelkit.distributed",
    "init_process_group": "accelkit.distributed",
    "is_initialized": "accelkit.distributed",
    "local_rank": "accelkit.distributed",
    # options
    "build_options": "accelkit.config",
    "closest": "accelkit.config",
    "load_config_source": "accelkit.config",
    "options_as_dict": "accelkit.config",
    "pip_install": "accelkit.registry",
    "installed_versions": "accelkit._known_plugins",
    # precision
    "BoundaryCastPrecision": "accelkit.precision",
    "DtypeRow": "accelkit.precision",
    "MixedPrecision": "accelkit.precision",
    "NATIVE_DTYPES": "accelkit.precision",
    "PRECISIONS": "accelkit.precision",
    "Precision": "accelkit.precision",
    "cast_floats": "accelkit.precision",
    "check_device_supports": "accelkit.precision",
    "low_dtype": "accelkit.precision",
    "native_precision": "accelkit.precision",
    # module transforms
    "apply_activation_checkpointing": "accelkit.modules",
    "check_wrap_policy": "accelkit.modules",
    "compile_in_place": "accelkit.modules",
    "select_blocks": "accelkit.modules",
    "wrap_blocks": "accelkit.modules",
    # rebuilding a user's optimizer
    "OptimizerRecipe": "accelkit.optim",
    "optimizer_recipe": "accelkit.optim",
    # the checkpoint kit
    "BUFFER": "accelkit.checkpoint.shards.sharded",
    "Fragment": "accelkit.checkpoint.shards.sharded",
    "Layout": "accelkit.checkpoint.shards.sharded",
    "MASTER": "accelkit.checkpoint.shards.sharded",
    "OPTIM_PREFIX": "accelkit.checkpoint.shards.sharded",
    "ObjectInfo": "accelkit.checkpoint.shards.sharded",
    "PARAM": "accelkit.checkpoint.shards.sharded",
    "ReplicaPlanner": "accelkit.checkpoint.shards.sharded",
    "Slot": "accelkit.checkpoint.shards.sharded",
    "check_shape": "accelkit.checkpoint.shards.sharded",
    "check_dense_load": "accelkit.checkpoint.shards.validate",
    "check_module_targets": "accelkit.checkpoint.shards.validate",
    "check_optimizer": "accelkit.checkpoint.shards.validate",
    "check_state_keys": "accelkit.checkpoint.shards.validate",
    "classify_state": "accelkit.checkpoint.shards.sharded",
    "fill_tensor": "accelkit.checkpoint.shards.sharded",
    "check_group_scalars": "accelkit.checkpoint.shards.sharded",
    "check_same_files": "accelkit.checkpoint.read.same_source",
    "group_scalar": "accelkit.checkpoint.shards.sharded",
    "held_objects": "accelkit.checkpoint.shards.sharded",
    "load_param_states": "accelkit.checkpoint.shards.sharded",
    "load_slot_states": "accelkit.checkpoint.shards.sharded",
    "match_module_entries": "accelkit.checkpoint.shards.sharded",
    "module_info": "accelkit.checkpoint.shards.sharded",
    "new_state": "accelkit.checkpoint.shards.sharded",
    "optimizer_info": "accelkit.checkpoint.shards.sharded",
    "optimizer_load": "accelkit.checkpoint.shards.sharded",
    "optimizer_slot_fragments": "accelkit.checkpoint.shards.sharded",
    "param_group_names": "accelkit.checkpoint.shards.sharded",
    "param_owners": "accelkit.checkpoint.shards.sharded",
    "param_state_fragments": "accelkit.checkpoint.shards.sharded",
    "put_scalar": "accelkit.checkpoint.shards.sharded",
    "ranged_fragments": "accelkit.checkpoint.shards.sharded",
    "read_slot": "accelkit.checkpoint.shards.sharded",
    "scalar_tensor": "accelkit.checkpoint.shards.sharded",
    "sharded_fragments": "accelkit.checkpoint.shards.sharded",
    "slot_state_fragments": "accelkit.checkpoint.shards.sharded",
    "state_like": "accelkit.checkpoint.shards.sharded",
    "tensor_fragments": "accelkit.checkpoint.shards.sharded",
    "weights_entry": "accelkit.checkpoint.shards.sharded",
    "ModuleEntry": "accelkit.checkpoint.shards.sharded",
    "OptimizerLoad": "accelkit.checkpoint.shards.sharded",
    "Unsharded": "accelkit.checkpoint.shards.sharded",
    "load_param_groups": "accelkit.checkpoint.shards.sharded",
    "module_fragments": "accelkit.checkpoint.shards.sharded",
    "qualname": "accelkit.checkpoint.shards.sharded",
    "slot_fragments": "accelkit.checkpoint.shards.sharded",
    "dense_fragments": "accelkit.checkpoint.shards.fragments",
    "load_dense_fragments": "accelkit.checkpoint.shards.fragments",
    "param_group_hyperparams": "accelkit.checkpoint.shards.fragments",
    "decode": "accelkit.checkpoint.format.codec",
    "drop_callables": "accelkit.checkpoint.format.codec",
    "encode": "accelkit.checkpoint.format.codec",
    "canonical_fqn": "accelkit.checkpoint.format.fqn",
    "module_tensors": "accelkit.checkpoint.format.fqn",
    "user_module": "accelkit.checkpoint.format.fqn",
    "agree": "accelkit.checkpoint.write.writer",
    "DTYPES_BY_NAME": "accelkit.checkpoint.format.safetensors_io",
    "LazyTensor": "accelkit.checkpoint.format.safetensors_io",
    # checkpoint stores (docs/plugins.md, "Checkpoint stores")
    "Store": "accelkit.checkpoint.store.base",
    "Bucket": "accelkit.checkpoint.store.base",
    "StoredObject": "accelkit.checkpoint.store.base",
    "RankFileTarget": "accelkit.checkpoint.store.base",
    "RangedFile": "accelkit.checkpoint.store.base",
    "ObjectMissing": "accelkit.checkpoint.store.base",
    "BucketMissing": "accelkit.checkpoint.store.base",
    "ObjectExists": "accelkit.checkpoint.store.base",
    "VersionChanged": "accelkit.checkpoint.store.base",
    "read_timeout_option": "accelkit.checkpoint.store.base",
    "BucketStore": "accelkit.checkpoint.store.bucket",
    "ObjectLocation": "accelkit.checkpoint.store.bucket",
    "store_for": "accelkit.checkpoint.store",
    "register_store": "accelkit.checkpoint.store",
    # foreign checkpoint formats (accelkit convert)
    "Imported": "accelkit.checkpoint.formats.importing",
    "optimizer_import": "accelkit.checkpoint.formats.importing",
    "positional_names": "accelkit.checkpoint.formats.importing",
    "write_portable": "accelkit.checkpoint.formats.importing",
    # restricted unpickling (trust_pickle)
    "PickleAllowlist": "accelkit.checkpoint.formats.unpickle",
    "PickleRefused": "accelkit.checkpoint.formats.unpickle",
    "StandIn": "accelkit.checkpoint.formats.unpickle",
    "conversion_allowlist": "accelkit.checkpoint.formats.unpickle",
    "pickle_globals": "accelkit.checkpoint.formats.unpickle",
    "restricted_torch_load": "accelkit.checkpoint.formats.unpickle",
    "tensor_allowlist": "accelkit.checkpoint.formats.unpickle",
    # memory estimates (accelkit plan)
    "LOW_PRECISIONS": "accelkit.benchmark.memory",
    "OPTIMIZERS": "accelkit.benchmark.memory",
    "estimate_fsdp": "accelkit.benchmark.memory",
    "estimate_single_or_ddp": "accelkit.benchmark.memory",
    "optimizer_terms": "accelkit.benchmark.memory",
    "trace_kind": "accelkit.benchmark.memory",
    # errors
    "AccelkitError": "accelkit.errors",
    "BackendNotFoundError": "accelkit.errors",
    "CheckpointError": "accelkit.errors",
    "PartialLoadError": "accelkit.errors",
    "ConfigError": "accelkit.errors",
    "DistributedError": "accelkit.errors",
    "PluginMissingError": "accelkit.errors",
    "UnsupportedError": "accelkit.errors",
}

__all__ = [
    "SDK_VERSION",
    "Backend",
    "Capabilities",
    "Settings",
    "SetupResult",
    "StepResult",
    "NoOptions",
    "OwnedState",
    "SingleDeviceBackend",
    "device_available",
    "DDPBackend",
    "DDPOptions",
    "DDPWrapOptions",
    "CommHookOptions",
    "FSDPBackend",
    "FSDPOptions",
    "DistributedBackend",
    "PipelineSettings",
    "PIPELINE_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "split_microbatches",
    "DistributedOptions",
    "ProcessGroupOptions",
    "hookimpl",
    "DEFAULT_TIMEOUT_S",
    "init_process_group",
    "is_initialized",
    "local_rank",
    "build_options",
    "closest",
    "load_config_source",
    "options_as_dict",
    "pip_install",
    "installed_versions",
    "BoundaryCastPrecision",
    "DtypeRow",
    "MixedPrecision",
    "NATIVE_DTYPES",
    "PRECISIONS",
    "Precision",
    "cast_floats",
    "check_device_supports",
    "low_dtype",
    "native_precision",
    "apply_activation_checkpointing",
    "check_wrap_policy",
    "compile_in_place",
    "select_blocks",
    "wrap_blocks",
    "OptimizerRecipe",
    "optimizer_recipe",
    "BUFFER",
    "Fragment",
    "Layout",
    "MASTER",
    "OPTIM_PREFIX",
    "ObjectInfo",
    "PARAM",
    "ReplicaPlanner",
    "Slot",
    "check_shape",
    "check_dense_load",
    "check_module_targets",
    "check_optimizer",
    "check_state_keys",
    "classify_state",
    "fill_tensor",
    "check_group_scalars",
    "check_same_files",
    "group_scalar",
    "held_objects",
    "load_param_states",
    "load_slot_states",
    "match_module_entries",
    "module_info",
    "new_state",
    "optimizer_info",
    "optimizer_load",
    "optimizer_slot_fragments",
    "param_group_names",
    "param_owners",
    "param_state_fragments",
    "put_scalar",
    "ranged_fragments",
    "read_slot",
    "scalar_tensor",
    "sharded_fragments",
    "slot_state_fragments",
    "state_like",
    "tensor_fragments",
    "weights_entry",
    "ModuleEntry",
    "OptimizerLoad",
    "Unsharded",
    "load_param_groups",
    "module_fragments",
    "qualname",
    "slot_fragments",
    "dense_fragments",
    "load_dense_fragments",
    "param_group_hyperparams",
    "decode",
    "drop_callables",
    "encode",
    "canonical_fqn",
    "module_tensors",
    "user_module",
    "agree",
    "DTYPES_BY_NAME",
    "LazyTensor",
    "Store",
    "Bucket",
    "StoredObject",
    "RankFileTarget",
    "RangedFile",
    "ObjectMissing",
    "BucketMissing",
    "ObjectExists",
    "VersionChanged",
    "read_timeout_option",
    "BucketStore",
    "ObjectLocation",
    "store_for",
    "register_store",
    "Imported",
    "optimizer_import",
    "positional_names",
    "write_portable",
    "PickleAllowlist",
    "PickleRefused",
    "StandIn",
    "conversion_allowlist",
    "pickle_globals",
    "restricted_torch_load",
    "tensor_allowlist",
    "LOW_PRECISIONS",
    "OPTIMIZERS",
    "estimate_fsdp",
    "estimate_single_or_ddp",
    "optimizer_terms",
    "trace_kind",
    "AccelkitError",
    "BackendNotFoundError",
    "CheckpointError",
    "PartialLoadError",
    "ConfigError",
    "DistributedError",
    "PluginMissingError",
    "UnsupportedError",
]

if TYPE_CHECKING:
    from accelkit._known_plugins import installed_versions
    from accelkit.backend import (
        Backend,
        Capabilities,
        NoOptions,
        OwnedState,
        Settings,
        SetupResult,
        StepResult,
    )
    from accelkit.backend_specs import device_available
    from accelkit.backends.ddp import CommHookOptions, DDPBackend, DDPOptions, DDPWrapOptions
    from accelkit.backends.distributed import (
        DistributedBackend,
        DistributedOptions,
        ProcessGroupOptions,
    )
    from accelkit.backends.fsdp import FSDPBackend, FSDPOptions
    from accelkit.backends.single import SingleDeviceBackend
    from accelkit.benchmark.memory import (
        LOW_PRECISIONS,
        OPTIMIZERS,
        estimate_fsdp,
        estimate_single_or_ddp,
        optimizer_terms,
        trace_kind,
    )
    from accelkit.checkpoint.format.codec import decode, drop_callables, encode
    from accelkit.checkpoint.format.fqn import canonical_fqn, module_tensors, user_module
    from accelkit.checkpoint.format.safetensors_io import DTYPES_BY_NAME, LazyTensor
    from accelkit.checkpoint.formats.importing import (
        Imported,
        optimizer_import,
        positional_names,
        write_portable,
    )
    from accelkit.checkpoint.formats.unpickle import (
        PickleAllowlist,
        PickleRefused,
        StandIn,
        conversion_allowlist,
        pickle_globals,
        restricted_torch_load,
        tensor_allowlist,
    )
    from accelkit.checkpoint.read.same_source import check_same_files
    from accelkit.checkpoint.shards.fragments import (
        dense_fragments,
        load_dense_fragments,
        param_group_hyperparams,
    )
    from accelkit.checkpoint.shards.sharded import (
        BUFFER,
        MASTER,
        OPTIM_PREFIX,
        PARAM,
        Fragment,
        Layout,
        ModuleEntry,
        ObjectInfo,
        OptimizerLoad,
        ReplicaPlanner,
        Slot,
        Unsharded,
        check_group_scalars,
        check_shape,
        classify_state,
        fill_tensor,
        group_scalar,
        held_objects,
        load_param_groups,
        load_param_states,
        load_slot_states,
        match_module_entries,
        module_fragments,
        module_info,
        new_state,
        optimizer_info,
        optimizer_load,
        optimizer_slot_fragments,
        param_group_names,
        param_owners,
        param_state_fragments,
        put_scalar,
        qualname,
        ranged_fragments,
        read_slot,
        scalar_tensor,
        sharded_fragments,
        slot_fragments,
        slot_state_fragments,
        state_like,
        tensor_fragments,
        weights_entry,
    )
    from accelkit.checkpoint.shards.validate import (
        check_dense_load,
        check_module_targets,
        check_optimizer,
        check_state_keys,
    )
    from accelkit.checkpoint.store import register_store, store_for
    from accelkit.checkpoint.store.base import (
        Bucket,
        BucketMissing,
        ObjectExists,
        ObjectMissing,
        RangedFile,
        RankFileTarget,
        Store,
        StoredObject,
        VersionChanged,
        read_timeout_option,
    )
    from accelkit.checkpoint.store.bucket import BucketStore, ObjectLocation
    from accelkit.checkpoint.write.writer import agree
    from accelkit.config import build_options, closest, load_config_source, options_as_dict
    from accelkit.distributed import (
        DEFAULT_TIMEOUT_S,
        init_process_group,
        is_initialized,
        local_rank,
    )
    from accelkit.errors import (
        AccelkitError,
        BackendNotFoundError,
        CheckpointError,
        ConfigError,
        DistributedError,
        PartialLoadError,
        PluginMissingError,
        UnsupportedError,
    )
    from accelkit.hookspecs import hookimpl
    from accelkit.modules import (
        apply_activation_checkpointing,
        check_wrap_policy,
        compile_in_place,
        select_blocks,
        wrap_blocks,
    )
    from accelkit.optim import OptimizerRecipe, optimizer_recipe
    from accelkit.pipeline import (
        PIPELINE_SCHEDULES,
        ZERO_BUBBLE_SCHEDULES,
        PipelineSettings,
        split_microbatches,
    )
    from accelkit.precision import (
        NATIVE_DTYPES,
        PRECISIONS,
        BoundaryCastPrecision,
        DtypeRow,
        MixedPrecision,
        Precision,
        cast_floats,
        check_device_supports,
        low_dtype,
        native_precision,
    )
    from accelkit.registry import pip_install


#: load a name from its core module on first access (keeps ``import accelkit.sdk`` cheap)
__getattr__ = lazy_getattr(__name__, _SOURCES, globals())


def __dir__() -> list[str]:
    return sorted(__all__)
