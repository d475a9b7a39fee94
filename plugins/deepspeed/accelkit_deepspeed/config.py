"""What the user passes for ``accelkit.get("deepspeed", ...)`` and the DeepSpeed config built from it.

Two inputs are accepted:

* a native DeepSpeed config (a dict, or a JSON/YAML path), recognised by its top-level keys
  (``zero_optimization``, ``bf16``, ``train_micro_batch_size_per_gpu``, ...) and passed on as it is;
* short options (:class:`DeepSpeedOptions`): ``zero_stage``, ``offload_optimizer``, bucket sizes, ...

Keyword options given to ``get()`` apply on top of a native config; one that contradicts a value
the native config already holds is an error, as is a precision, ``accumulation_steps`` or
``max_grad_norm`` that disagrees with it. Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from accelkit.sdk import (
    ConfigError,
    DistributedOptions,
    DtypeRow,
    build_options,
    closest,
    load_config_source,
)

#: Top-level keys of a DeepSpeed config: any of them marks a config as native.
NATIVE_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "managed_gradient_accumulation",
        "gradient_clipping",
        "zero_optimization",
        "bf16",
        "bfloat16",
        "fp16",
        "torch_autocast",
        "amp",
        "optimizer",
        "scheduler",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "activation_checkpointing",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "aio",
        "compile",
        "data_types",
        "checkpoint",
        "elasticity",
        "autotuning",
        "pipeline",
        "memory_breakdown",
        "dataloader_drop_last",
        "data_efficiency",
        "compression_training",
        "hybrid_engine",
        "tensor_parallel",
    }
)

#: short option -> key inside the ``zero_optimization`` section
_ZERO_KEYS = {
    "zero_stage": "stage",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "reduce_scatter": "reduce_scatter",
    "allgather_partitions": "allgather_partitions",
    "round_robin_gradients": "round_robin_gradients",
    "sub_group_size": "sub_group_size",
    "stage3_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold": "stage3_param_persistence_threshold",
    "stage3_max_live_parameters": "stage3_max_live_parameters",
    "stage3_max_reuse_distance": "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}

#: short option -> key inside the ``fp16`` section (``precision="16-true"`` only)
_FP16_KEYS = {
    "loss_scale": "loss_scale",
    "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_loss_scale",
}

#: DeepSpeed's ``gradient_clipping`` when a native config leaves it out (GRADIENT_CLIPPING_DEFAULT)
DEEPSPEED_DEFAULT_CLIPPING = 1.0

#: ZeRO stage of ``deepspeed`` without a config (a native config without one means DeepSpeed's 0)
DEFAULT_STAGE = 2

#: The default micro-batch size DeepSpeed is told when no dataloader was set up before ``setup``.
DEFAULT_MICRO_BATCH = 1

Offload = Literal["cpu", "nvme"] | None


@dataclass
class DeepSpeedOptions(DistributedOptions):
    """Short options of the ``deepspeed`` backends (``None`` leaves DeepSpeed's own default)."""

    #: ZeRO stage: 0 (data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters);
    #: default 2, or the native config's
    zero_stage: int | None = None
    #: where optimizer state and the step live: "cpu" or "nvme" (ZeRO-1/2/3)
    offload_optimizer: Offload = None
    #: where parameters live between uses: "cpu" or "nvme" (ZeRO-3 only)
    offload_param: Offload = None
    #: folder for ``"nvme"`` offload
    nvme_path: str | None = None
    #: pinned host memory for offloaded tensors
    pin_memory: bool | None = None
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    reduce_scatter: bool | None = None
    allgather_partitions: bool | None = None
    round_robin_gradients: bool | None = None
    sub_group_size: int | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int | None = None
    stage3_max_live_parameters: int | None = None
    stage3_max_reuse_distance: int | None = None
    stage3_gather_16bit_weights_on_model_save: bool | None = None
    #: fp16 loss scaling (``precision="16-true"``): 0 is dynamic
    loss_scale: float | None = None
    initial_scale_power: int | None = None
    loss_scale_window: int | None = None
    hysteresis: int | None = None
    min_loss_scale: float | None = None
    #: dtype of gradient all-reduce / reduce-scatter: "fp32", "bf16" or "fp16"
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = None
    #: samples per process per micro-batch; default: the loader's batch size, else 1
    train_micro_batch_size_per_gpu: int | None = None
    #: level of DeepSpeed's own logger (it logs a lot at INFO)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    #: build DeepSpeed's shared-memory all-reduce op on the CPU. Only DeepSpeed's inference
    #: all-reduce uses it; its first build takes ~100 s of g++, so it is off by default.
    cpu_shm_comm: bool = False
    #: a native DeepSpeed config (dict or JSON/YAML path) the options above apply to
    ds_config: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"option 'zero_stage' must be 0, 1, 2 or 3, got {self.zero_stage}")
        if (
            self.train_micro_batch_size_per_gpu is not None
            and self.train_micro_batch_size_per_gpu < 1
        ):
            raise ValueError("option 'train_micro_batch_size_per_gpu' must be >= 1")
        if isinstance(self.ds_config, str):
            self.ds_config = load_config_source(self.ds_config)


def is_native(config: dict[str, Any]) -> bool:
    """Whether ``config`` is a DeepSpeed config (it has one of DeepSpeed's top-level keys)."""
    return any(key in NATIVE_KEYS for key in config)


def parse(name: str, config: Any, overrides: dict[str, Any]) -> DeepSpeedOptions:
    """Options from a native config or short options, plus keyword overrides."""
    owner = f"backend {name!r}"
    data = load_config_source(config)
    if data and is_native(data):
        short = {k for k in data if k in _short_keys() and k not in NATIVE_KEYS}
        if short:
            raise ConfigError(
                f"{owner}: the config mixes DeepSpeed's own keys with accelkit's short options "
                f"({', '.join(sorted(short))}). Write them in DeepSpeed's form inside the native "
                "config (zero_optimization.stage, ...), or pass the short options as keywords."
            )
        if "ds_config" in overrides:
            raise ConfigError(f"{owner}: a native config was given twice (config and ds_config=)")
        return build_options(DeepSpeedOptions, owner, {"ds_config": data}, overrides)
    _check_config_keys(owner, data)
    return build_options(DeepSpeedOptions, owner, data, overrides)


def _check_config_keys(owner: str, data: dict[str, Any]) -> None:
    """A config key that is neither a short option nor one of DeepSpeed's top-level keys (so the
    config was not taken as native): suggest the nearest of both, and say both are accepted."""
    short = _short_keys()
    for key in data:
        if key in short:
            continue
        hint = closest(key, short | NATIVE_KEYS)
        kind = "option" if hint in short else "DeepSpeed key"
        raise ConfigError(
            f"{owner}: unknown option {key!r}."
            + (f" Did you mean the {kind} {hint!r}?" if hint else "")
            + " A config holds accelkit's short options ("
            + ", ".join(sorted(short))
            + ") or is a native DeepSpeed config, recognised by DeepSpeed's own top-level keys ("
            + ", ".join(sorted(NATIVE_KEYS & _COMMON_NATIVE_KEYS))
            + ", ...)."
        )


#: the native keys an unknown-key message lists as examples
_COMMON_NATIVE_KEYS = frozenset(
    {
        "zero_optimization",
        "bf16",
        "fp16",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "optimizer",
        "scheduler",
    }
)


def _short_keys() -> set[str]:
    return {f.name for f in dataclasses.fields(DeepSpeedOptions)}


# ---- reading a native config -----------------------------------------------------------------
def _is_set(value: Any) -> bool:
    """HF-style ``"auto"`` means "fill it in", as if the key were absent."""
    return value is not None and value != "auto"


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") is True


def native_precision(native: dict[str, Any]) -> str | None:
    """The precision string a native config asks for, or None when it sets none."""
    found = []
    autocast = native.get("torch_autocast")
    if _enabled(autocast):
        dtype = str(autocast.get("dtype", "bfloat16")).replace("torch.", "")
        found.append("16-mixed" if dtype in ("float16", "fp16", "half") else "bf16-mixed")
    if _enabled(native.get("bf16")) or _enabled(native.get("bfloat16")):
        found.append("bf16-true")
    if _enabled(native.get("fp16")):
        found.append("16-true")
    if _enabled(native.get("amp")):
        raise ConfigError(
            "the DeepSpeed config enables 'amp' (NVIDIA Apex AMP), which DeepSpeed removed; use "
            "'torch_autocast' or precision='bf16-mixed' / '16-mixed'"
        )
    if len(found) > 1:
        raise ConfigError(
            f"the DeepSpeed config enables several precisions at once ({', '.join(found)}); "
            "keep one of the sections torch_autocast, bf16, fp16"
        )
    return found[0] if found else None


def zero_stage(options: DeepSpeedOptions) -> int:
    """The ZeRO stage: the short option, else a native config's (DeepSpeed's default there is
    0), else :data:`DEFAULT_STAGE`."""
    if options.zero_stage is not None:
        return options.zero_stage
    if options.ds_config is None:
        return DEFAULT_STAGE
    stage = (options.ds_config.get("zero_optimization") or {}).get("stage", 0)
    return int(stage) if _is_set(stage) else 0


def offload_devices(options: DeepSpeedOptions) -> tuple[str | None, str | None]:
    """(optimizer offload device, parameter offload device), None where nothing is offloaded."""
    zero = (options.ds_config or {}).get("zero_optimization") or {}

    def device(short: str | None, key: str) -> str | None:
        if short is not None:
            return short
        section = zero.get(key) or {}
        found = section.get("device", "none") if isinstance(section, dict) else "none"
        return None if found in (None, "none") else str(found)

    return (
        device(options.offload_optimizer, "offload_optimizer"),
        device(options.offload_param, "offload_param"),
    )


# ---- reconciling the shared settings -------------------------------------------------------
def reconcile(
    name: str,
    options: DeepSpeedOptions,
    precision: str | None,
    accumulation_steps: int,
    max_grad_norm: float | None,
) -> tuple[str, int, float | None]:
    """Final (precision, accumulation steps, max grad norm); a disagreement with the native
    config is an error. ``accumulation_steps=1`` and ``max_grad_norm=None`` (the defaults of
    ``accelkit.get``) take the native config's values."""
    owner = f"backend {name!r}"
    native = options.ds_config or {}

    from_config = native_precision(native)
    if precision is not None and from_config is not None and precision != from_config:
        raise ConfigError(
            f"{owner}: precision={precision!r} disagrees with the DeepSpeed config, which asks for "
            f"{from_config!r}. Drop one of them (precision=None takes the config's)."
        )
    resolved = precision or from_config or "32-true"

    gas = native.get("gradient_accumulation_steps")
    if _is_set(gas):
        if not isinstance(gas, int) or gas < 1:
            raise ConfigError(
                f"{owner}: gradient_accumulation_steps must be an int >= 1, got {gas!r}"
            )
        if accumulation_steps not in (1, gas):
            raise ConfigError(
                f"{owner}: accumulation_steps={accumulation_steps} disagrees with the DeepSpeed "
                f"config's gradient_accumulation_steps={gas}. Set one of them."
            )
        accumulation_steps = gas

    clipping = native.get("gradient_clipping")
    if options.ds_config is not None and "gradient_clipping" not in native:
        # a native config keeps DeepSpeed's meaning, and DeepSpeed clips at 1.0 by default
        clipping = DEEPSPEED_DEFAULT_CLIPPING if max_grad_norm is None else max_grad_norm
    if _is_set(clipping):
        if isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or clipping < 0:
            raise ConfigError(f"{owner}: gradient_clipping must be a number >= 0, got {clipping!r}")
        config_norm = float(clipping) if clipping > 0 else None
        if max_grad_norm is not None and config_norm != max_grad_norm:
            raise ConfigError(
                f"{owner}: max_grad_norm={max_grad_norm} disagrees with the DeepSpeed config's "
                f"gradient_clipping={clipping}. Set one of them."
            )
        max_grad_norm = config_norm

    stage = zero_stage(options)
    optimizer_device, param_device = offload_devices(options)
    if param_device is not None and stage != 3:
        raise ConfigError(
            f"{owner}: offload_param needs ZeRO stage 3 (the config has stage {stage}); "
            "use offload_optimizer at stages 1-2"
        )
    if optimizer_device is not None and stage == 0:
        raise ConfigError(f"{owner}: offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)")
    if "nvme" in (optimizer_device, param_device) and not (
        options.nvme_path or _native_nvme_path(native)
    ):
        raise ConfigError(f"{owner}: offload to 'nvme' needs nvme_path='/a/fast/disk'")
    if resolved == "16-mixed" and stage >= 1 and max_grad_norm is not None:
        raise ConfigError(
            f"{owner}: precision='16-mixed' with ZeRO stage {stage} and gradient clipping is "
            "refused: DeepSpeed's ZeRO optimizers clip the loss-scaled fp16 autocast gradients "
            "before torch's GradScaler unscales them (checked on DeepSpeed 0.19.8: the update "
            "comes out ~65536x too small). Use bf16-mixed, 16-true (DeepSpeed's own fp16 loss "
            "scaling), ZeRO stage 0, or no max_grad_norm (a native config without "
            "'gradient_clipping' clips at DeepSpeed's default 1.0: set it to 0.0)."
        )
    if resolved == "16-true" and stage == 0:
        raise ConfigError(
            f"{owner}: precision='16-true' at ZeRO stage 0 is refused: DeepSpeed's ZeRO-0 fp16 "
            "optimizer divides the gradients by the loss scale although the engine never "
            "multiplied the loss by it (checked on DeepSpeed 0.19.8: SGD updates come out "
            "65536x too small). Use ZeRO stage 1-3 with 16-true, or 16-mixed / bf16 at stage 0."
        )
    if any(getattr(options, key) is not None for key in _FP16_KEYS) and resolved != "16-true":
        raise ConfigError(
            f"{owner}: the loss-scale options ({', '.join(_FP16_KEYS)}) apply to "
            f"precision='16-true' (DeepSpeed's fp16 section) only, not {resolved!r}"
        )
    if _is_set(native.get("scheduler")):
        raise ConfigError(
            f"{owner}: the DeepSpeed config has a 'scheduler' section. accelkit never hands a "
            "scheduler to DeepSpeed; remove it and pass a torch LR scheduler built on the "
            "optimizer that accel.setup() returns (accelkit steps it once per applied step)."
        )
    managed = native.get("managed_gradient_accumulation", True)
    if managed is not True and managed is not False:
        raise ConfigError(f"{owner}: managed_gradient_accumulation must be true or false")
    # build the config once now, so a short option that contradicts it fails at get()
    try:
        build_ds_config(
            options,
            precision=resolved,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
            micro_batch=DEFAULT_MICRO_BATCH,
            client_optimizer=True,
        )
    except ConfigError as err:
        raise ConfigError(f"{owner}: {err}") from None
    return resolved, accumulation_steps, max_grad_norm


def _native_nvme_path(native: dict[str, Any]) -> str | None:
    zero = native.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if isinstance(section, dict) and section.get("nvme_path"):
            return section["nvme_path"]
    return None


# ---- building the final config ------------------------------------------------------------
def _put(config: dict[str, Any], path: tuple[str, ...], value: Any, why: str) -> None:
    """Set ``config[path] = value``; a different value already there is an error."""
    node = config
    for key in path[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"DeepSpeed config: {'.'.join(path[:-1])} must be a mapping")
        node = child
    leaf = path[-1]
    if leaf in node and _is_set(node[leaf]) and node[leaf] != value:
        raise ConfigError(
            f"DeepSpeed config: {'.'.join(path)}={node[leaf]!r} disagrees with {why} "
            f"(which needs {value!r}). Set one of them."
        )
    node[leaf] = value


PRECISION_SECTIONS = ("torch_autocast", "bf16", "bfloat16", "fp16")


def build_ds_config(
    options: DeepSpeedOptions,
    *,
    precision: str,
    accumulation_steps: int,
    max_grad_norm: float | None,
    micro_batch: int,
    client_optimizer: bool,
) -> dict[str, Any]:
    """The config handed to ``deepspeed.initialize`` and ``deepspeed.zero.Init``."""
    config = copy.deepcopy(options.ds_config or {})
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if key in config and not _is_set(config[key]):
            del config[key]  # HF-style "auto": filled in below
    if options.zero_stage is not None or "zero_optimization" not in config:
        _put(config, ("zero_optimization", "stage"), zero_stage(options), "zero_stage")
    for short, key in _ZERO_KEYS.items():
        value = getattr(options, short)
        if value is not None and short != "zero_stage":
            _put(config, ("zero_optimization", key), value, short)
    for short, key in (
        ("offload_optimizer", "offload_optimizer"),
        ("offload_param", "offload_param"),
    ):
        device = getattr(options, short)
        if device is None:
            continue
        _put(config, ("zero_optimization", key, "device"), device, short)
        if options.pin_memory is not None:
            _put(config, ("zero_optimization", key, "pin_memory"), options.pin_memory, "pin_memory")
        if device == "nvme":
            _put(config, ("zero_optimization", key, "nvme_path"), options.nvme_path, "nvme_path")

    # precision: one section, the others disabled
    section = {
        "bf16-mixed": ("torch_autocast", {"enabled": True, "dtype": "bfloat16"}),
        "16-mixed": ("torch_autocast", {"enabled": True, "dtype": "float16"}),
        "bf16-true": ("bf16", {"enabled": True}),
        "16-true": ("fp16", {"enabled": True}),
    }.get(precision)
    wanted = section[0] if section else None
    if wanted == "bf16" and "bfloat16" in config and "bf16" not in config:
        wanted = "bfloat16"  # DeepSpeed's older spelling of the same section
    for name in PRECISION_SECTIONS:
        current = config.get(name)
        if name == wanted:
            if not isinstance(current, dict):
                current = config[name] = {}
            current["enabled"] = True
        elif isinstance(current, dict):
            current["enabled"] = False
    if section is not None and wanted == "torch_autocast":
        autocast = config["torch_autocast"]
        dtype = section[1]["dtype"]
        if "dtype" in autocast:
            given = str(autocast["dtype"]).replace("torch.", "")
            same = {"bfloat16": ("bfloat16", "bf16"), "float16": ("float16", "fp16", "half")}
            if given not in same[dtype]:
                raise ConfigError(
                    f"DeepSpeed config: torch_autocast.dtype={autocast['dtype']!r} disagrees with "
                    f"precision={precision!r}"
                )
        autocast["dtype"] = dtype
    if precision == "16-true":
        for short, key in _FP16_KEYS.items():
            value = getattr(options, short)
            if value is not None:
                _put(config, ("fp16", key), value, short)

    _put(config, ("gradient_accumulation_steps",), accumulation_steps, "accumulation_steps")
    _put(config, ("gradient_clipping",), float(max_grad_norm or 0.0), "max_grad_norm")
    if options.train_micro_batch_size_per_gpu is not None:
        _put(
            config,
            ("train_micro_batch_size_per_gpu",),
            options.train_micro_batch_size_per_gpu,
            "train_micro_batch_size_per_gpu",
        )
    elif "train_micro_batch_size_per_gpu" not in config and "train_batch_size" not in config:
        config["train_micro_batch_size_per_gpu"] = micro_batch
    if options.communication_data_type is not None:
        _put(
            config,
            ("communication_data_type",),
            options.communication_data_type,
            "communication_data_type",
        )
    # accelkit's own defaults, where the native config is silent
    config.setdefault("steps_per_print", 2**62)  # DeepSpeed's periodic print: off
    if client_optimizer:
        # The user chose this optimizer; DeepSpeed's list of "tested" ones is advisory.
        config.setdefault("zero_allow_untested_optimizer", True)
        if offload_devices(options)[0] is not None:
            # DeepSpeed refuses a client optimizer with offload unless told it is intended.
            config.setdefault("zero_force_ds_cpu_optimizer", False)
    return config


# ---- the published dtype table -----------------------------------------------------------------
DTYPES: dict[str, DtypeRow] = {
    "32-true": DtypeRow("fp32", "fp32", "none (params are fp32)", "fp32"),
    "bf16-mixed": DtypeRow(
        "fp32",
        "bf16 (torch.autocast: DeepSpeed's torch_autocast section)",
        "none (params are fp32)",
        "ZeRO 1-3: bf16 for Linear/Conv parameters (DeepSpeed's lower_precision_safe_modules), "
        "fp32 for the rest; ZeRO 0: fp32",
    ),
    "16-mixed": DtypeRow(
        "fp32",
        "fp16 (torch.autocast) + torch GradScaler dynamic loss scaling",
        "none (params are fp32)",
        "ZeRO 1-3: fp16 for Linear/Conv parameters, fp32 for the rest; ZeRO 0: fp32",
    ),
    "bf16-true": DtypeRow(
        "bf16", "bf16", "fp32 (DeepSpeed's bf16 section)", "bf16 (communication_data_type)"
    ),
    "16-true": DtypeRow(
        "fp16",
        "fp16 + DeepSpeed dynamic loss scaling",
        "fp32 (DeepSpeed's fp16 section)",
        "fp16 (communication_data_type)",
    ),
}
