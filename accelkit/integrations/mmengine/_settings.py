"""From MMEngine config pieces to the arguments of :func:`accelkit.get`.

MMEngine users configure accumulation and clipping in ``optim_wrapper`` and mixed precision with
``type='AmpOptimWrapper'``; accelkit takes them as ``accumulation_steps``, ``max_grad_norm`` and
``precision``. This module does that translation in one place for the Runner and the Strategy,
and refuses what accelkit cannot honour instead of silently ignoring it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.errors import ConfigError

log = logging.getLogger("accelkit")

#: keys of ``accelkit=dict(...)`` / ``AccelkitStrategy(...)`` that are not backend options
ADAPTER_KEYS = ("backend", "config", "precision", "trust_pickle", "init_module", "setup_kwargs")
#: training semantics that come from MMEngine's ``optim_wrapper``, never from the accelkit section
FROM_OPTIM_WRAPPER = {
    "accumulation_steps": "optim_wrapper=dict(accumulative_counts=N)",
    "max_grad_norm": "optim_wrapper=dict(clip_grad=dict(max_norm=X))",
    "max_grad_value": "optim_wrapper=dict(clip_grad=dict(type='value', clip_value=X))",
}
_WRAPPER_TYPES = ("OptimWrapper", "AmpOptimWrapper", "AccelkitOptimWrapper")
#: MMEngine's wrappers around a library that accelkit runs as a backend: what to set instead
BACKEND_WRAPPERS = {
    "ApexOptimWrapper": "accelkit=dict(backend='apex', precision=...) (accelkit-apex)",
    "DeepSpeedOptimWrapper": "accelkit=dict(backend='deepspeed', config=<its DeepSpeed config>)",
    "ColossalAIOptimWrapper": "accelkit=dict(backend='colossalai_zero' or 'colossalai_ddp', ...)",
}
#: ``AmpOptimWrapper(dtype=...)`` values accelkit runs (None: MMEngine's default, float16)
_AMP_DTYPES = (None, "float16", "bfloat16", torch.float16, torch.bfloat16)
#: the arguments of ``torch.amp.GradScaler`` that a ``loss_scale`` dict may set
_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
#: what MMEngine's own DDP wrapping passes when the config names no wrapper
#: (``Runner.wrap_model`` and ``DDPStrategy``: ``broadcast_buffers=False``)
MMENGINE_DDP_DEFAULTS = {"broadcast_buffers": False}
#: the DDP wrappers whose ``model_wrapper_cfg`` options carry over onto a backend's options
_DDP_WRAPPER_TYPES = (
    "MMDistributedDataParallel",
    "DistributedDataParallel",
    "MMSeparateDistributedDataParallel",
)
#: MMEngine's wrapper that wraps each submodule in its own DDP, whose default is
#: ``broadcast_buffers=False`` (torch's is True)
_SEPARATE_DDP = "MMSeparateDistributedDataParallel"
#: model_wrapper_cfg keys with no backend option: accelkit places the model on its device
_PLACEMENT_KEYS = ("device_ids", "output_device")


class _ConfigKeyError(ConfigError, KeyError):
    """An unknown registry name: a :class:`ConfigError` that is also MMEngine's ``KeyError``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class _ConfigTypeError(ConfigError, TypeError):
    """A config value of the wrong type: a :class:`ConfigError` that is also the ``TypeError``
    MMEngine raises for it, so ``except TypeError`` written for MMEngine keeps working."""


@dataclass
class AdapterOptions:
    """What the user put in ``accelkit=dict(...)`` (Runner) or the strategy's arguments."""

    backend: str = "auto"
    config: Any = None
    precision: str | None = None
    #: allow loading pickled (foreign, e.g. MMEngine ``.pth``) checkpoints; off by default
    trust_pickle: bool = False
    #: build the model inside ``accel.init_module()`` (ZeRO-3 partitioned or meta-device init,
    #: to save memory on large models). Off by default: the model is built as MMEngine builds it,
    #: so its weights (and MMEngine's ``init_weights``/``init_cfg``) are exactly MMEngine's.
    init_module: bool = False
    #: keyword arguments for ``accel.setup`` (``compile=...``, ``activation_checkpointing=...``)
    setup_kwargs: dict[str, Any] = field(default_factory=dict)
    #: under ``pp``: the model's method, by path (``"head.loss"``), that turns the last stage's
    #: output and the batch's ``data_samples`` into MMEngine's loss dict (``pipeline=dict(
    #: loss=...)``; read here, it is not an accelkit pipeline option)
    pipeline_loss: str | None = None
    #: everything else: backend options handed to ``accelkit.get``
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Any, where: str) -> AdapterOptions:
        if raw is None:
            raw = {}
        if not hasattr(raw, "items"):
            raise ConfigError(f"{where} must be a dict, got {type(raw).__name__}")
        raw = {k: copy.deepcopy(v) for k, v in raw.items()}
        for key, hint in FROM_OPTIM_WRAPPER.items():
            if key in raw:
                raise ConfigError(
                    f"{where}: {key!r} comes from MMEngine's optimizer wrapper config; "
                    f"set {hint} instead"
                )
        if "seed" in raw:
            raise ConfigError(f"{where}: 'seed' comes from MMEngine's randomness=dict(seed=...)")
        known = {k: raw.pop(k) for k in ADAPTER_KEYS if k in raw}
        setup_kwargs = dict(known.pop("setup_kwargs", None) or {})
        pipeline_loss = None
        if isinstance(raw.get("pipeline"), dict):
            raw["pipeline"] = dict(raw["pipeline"])
            pipeline_loss = raw["pipeline"].pop("loss", None)
        pp = raw.get("pp", 1)
        if isinstance(pp, int) and pp > 1 and not isinstance(pipeline_loss, str):
            raise ConfigError(
                f"{where}: pp={pp} needs pipeline=dict(loss='head.loss'): the path of the "
                "model's method that takes the last stage's output (forward in mode='tensor') "
                "and the batch's data_samples and returns the loss dict, as a head's loss does"
            )
        return cls(**known, setup_kwargs=setup_kwargs, pipeline_loss=pipeline_loss, options=raw)


@dataclass
class TrainingSettings:
    """accelkit settings read from MMEngine's ``optim_wrapper`` config."""

    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    max_grad_value: float | None = None
    precision: str | None = None
    #: ``torch.amp.GradScaler`` arguments from ``AmpOptimWrapper(loss_scale=...)``; None for
    #: ``'dynamic'`` (GradScaler's defaults, which are accelkit's own scaler settings too)
    grad_scaler: dict[str, Any] | None = None
    #: ``loss_scale=<number>``: MMEngine resets the scale to it after every step (static)
    static_loss_scale: float | None = None
    #: the names of an ``OptimWrapperDict``'s wrappers (several optimizers); () for one
    several: tuple[str, ...] = ()


def _type_name(value: Any) -> str:
    return value if isinstance(value, str) else getattr(value, "__name__", repr(value))


def read_loss_scale(loss_scale: Any) -> tuple[dict[str, Any] | None, float | None]:
    """``AmpOptimWrapper(loss_scale=...)`` as ``(GradScaler arguments, static scale)``.

    MMEngine builds ``GradScaler()`` for ``'dynamic'``, ``GradScaler(init_scale=x)`` reset to
    ``x`` after every step for a number, and ``GradScaler(**d)`` for a dict
    (mmengine/optim/optimizer/amp_optimizer_wrapper.py).
    """
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return None, None
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if not loss_scale > 0:
            raise ConfigError(f"AmpOptimWrapper loss_scale must be positive, got {loss_scale!r}")
        return {"init_scale": float(loss_scale)}, float(loss_scale)
    if hasattr(loss_scale, "items"):
        kwargs = dict(loss_scale)
        unknown = sorted(set(kwargs) - set(_SCALER_KEYS))
        if unknown:
            raise _ConfigTypeError(
                f"AmpOptimWrapper loss_scale: {unknown} are not arguments of torch's GradScaler "
                f"({', '.join(_SCALER_KEYS)})"
            )
        if kwargs.pop("enabled", True) is not True:
            raise ConfigError(
                "AmpOptimWrapper loss_scale=dict(enabled=False) turns fp16 loss scaling off, "
                "which accelkit's 16-mixed does not do; use precision 'bf16-mixed' or '32-true' "
                "to train without a loss scaler"
            )
        try:  # GradScaler checks its arguments (growth_factor > 1, backoff_factor < 1)
            torch.amp.GradScaler("cpu", **kwargs)
        except (AssertionError, TypeError, ValueError) as err:
            raise ConfigError(f"AmpOptimWrapper loss_scale={loss_scale!r}: {err}") from err
        return kwargs, None
    raise _ConfigTypeError(
        f"AmpOptimWrapper loss_scale must be 'dynamic', a number or a dict of GradScaler "
        f"arguments, got {loss_scale!r}"
    )


def optim_wrapper_subclass(type_: Any) -> type:
    """The class that runs ``optim_wrapper=dict(type=<an OptimWrapper subclass>)`` on accelkit:
    the subclass on top of :class:`AccelkitOptimWrapper` (its overrides call ``super()`` into
    accelkit's backward, step and accumulation). Wrappers whose job a backend does are refused,
    naming the backend; so is a subclass of ``AmpOptimWrapper`` (its autocast and GradScaler
    would run beside accelkit's precision)."""
    from mmengine.optim import AmpOptimWrapper, OptimWrapper
    from mmengine.registry import OPTIM_WRAPPERS

    name = _type_name(type_)
    if name in BACKEND_WRAPPERS:
        raise ConfigError(
            f"optim_wrapper type {name!r} drives its own library; on accelkit the backend does "
            f"that: set {BACKEND_WRAPPERS[name]} and optim_wrapper type 'OptimWrapper'"
        )
    cls = OPTIM_WRAPPERS.get(type_) if isinstance(type_, str) else type_
    if cls is None:
        # MMEngine's own words (Registry.build_from_cfg)
        raise _ConfigKeyError(
            f"{type_} is not in the {OPTIM_WRAPPERS.scope}::{OPTIM_WRAPPERS.name} registry. "
            f"Please check whether the value of `{type_}` is correct or it was registered as "
            "expected. More details can be found at https://mmengine.readthedocs.io/en/latest/"
            "advanced_tutorials/config.html#import-the-custom-module"
        )
    if not (isinstance(cls, type) and issubclass(cls, OptimWrapper)):
        raise ConfigError(
            f"optim_wrapper type {name!r} is not an OptimWrapper: accelkit runs OptimWrapper, "
            "AmpOptimWrapper and subclasses of OptimWrapper"
        )
    if issubclass(cls, AmpOptimWrapper):
        raise ConfigError(
            f"optim_wrapper type {name!r} is an AmpOptimWrapper subclass: accelkit's precision "
            "does AMP (its autocast and loss scaler would run twice). Derive it from "
            "OptimWrapper and set AMP with accelkit=dict(precision='bf16-mixed' or '16-mixed')"
        )
    from accelkit.integrations.mmengine.optim_wrapper import on_accelkit

    return on_accelkit(cls)


def read_optim_wrapper_cfg(cfg: Any) -> tuple[dict[str, Any] | None, TrainingSettings]:
    """Split MMEngine's ``optim_wrapper`` config into one accelkit can build, and settings.

    Returns the config with ``type`` set to ``AccelkitOptimWrapper`` (AMP keys removed), or None
    when there is no optimizer (val/test only). A value of the wrong type raises an error that
    is both a :class:`ConfigError` and the ``TypeError`` MMEngine raises for it.
    """
    from mmengine.optim import BaseOptimWrapper, OptimWrapper, OptimWrapperDict

    if cfg is None:
        return None, TrainingSettings()
    if isinstance(cfg, OptimWrapperDict) or (
        hasattr(cfg, "items") and "optimizer" not in cfg and not isinstance(cfg, BaseOptimWrapper)
    ):
        return read_several_optim_wrappers(cfg)
    if isinstance(cfg, BaseOptimWrapper):
        if type(cfg) not in (OptimWrapper,) and type(cfg).__name__ != "AccelkitOptimWrapper":
            raise ConfigError(
                f"a built {type(cfg).__name__} cannot be moved onto accelkit; pass the "
                "optim_wrapper as a config dict instead"
            )
        clip = dict(cfg.clip_grad_kwargs or {})
        if clip:
            clip["type"] = "norm" if cfg.clip_func is torch.nn.utils.clip_grad_norm_ else "value"
        cfg = dict(
            optimizer=cfg.optimizer,
            accumulative_counts=cfg._accumulative_counts,
            clip_grad=clip or None,
        )
    if not hasattr(cfg, "items"):
        # MMEngine's own words (Runner.build_optim_wrapper), which users match on
        raise _ConfigTypeError(
            f"optimizer wrapper should be an OptimWrapper object or dict, but got {cfg}"
        )
    cfg = dict(cfg)
    wrapper_type = _type_name(cfg.get("type", "OptimWrapper"))
    subclass = None
    if wrapper_type not in _WRAPPER_TYPES:
        subclass = optim_wrapper_subclass(cfg.get("type"))
        wrapper_type = "OptimWrapper"
    settings = TrainingSettings()
    if wrapper_type == "AmpOptimWrapper":
        dtype = cfg.pop("dtype", None)
        cfg.pop("use_fsdp", None)
        if dtype not in _AMP_DTYPES:
            raise ConfigError(
                f"AmpOptimWrapper dtype={dtype!r}: accelkit runs AMP in 'float16' (16-mixed, the "
                "default) or 'bfloat16' (bf16-mixed). MMEngine's autocast to float32 or float64 "
                "computes in that dtype, so train with optim_wrapper type 'OptimWrapper' instead"
            )
        is_bf16 = dtype in ("bfloat16", torch.bfloat16)
        settings.precision = "bf16-mixed" if is_bf16 else "16-mixed"
        scaler, static = read_loss_scale(cfg.pop("loss_scale", "dynamic"))
        if scaler is not None and is_bf16:
            raise ConfigError(
                "AmpOptimWrapper loss_scale applies to float16: accelkit's bf16-mixed scales no "
                "loss (bf16 has fp32's range); remove loss_scale, or use dtype='float16'"
            )
        settings.grad_scaler, settings.static_loss_scale = scaler, static
    cfg["type"] = "AccelkitOptimWrapper" if subclass is None else subclass
    settings.accumulation_steps = int(cfg.get("accumulative_counts", 1))
    clip = cfg.get("clip_grad")
    if clip is not None:
        if not hasattr(clip, "items"):
            raise ConfigError(f"clip_grad must be a dict, got {type(clip).__name__}")
        clip = dict(clip)
        clip_type = clip.pop("type", "norm")
        if clip_type == "value":  # MMEngine's clip_grad_value_: accelkit's max_grad_value
            unknown = sorted(set(clip) - {"clip_value"})
            if unknown or "clip_value" not in clip:
                raise _ConfigTypeError(
                    "clip_grad=dict(type='value', clip_value=X) takes clip_value only"
                    + (f"; unknown keys {unknown}" if unknown else "")
                )
            settings.max_grad_value = float(clip["clip_value"])
            return cfg, settings
        norm_type = float(clip.pop("norm_type", 2.0))
        if clip_type != "norm" or norm_type != 2.0:
            raise ConfigError(
                "accelkit clips by the total L2 norm (clip_grad=dict(max_norm=X)) or by value "
                "(clip_grad=dict(type='value', clip_value=X)); "
                f"got type={clip_type!r}, norm_type={norm_type}"
            )
        if clip.pop("error_if_nonfinite", False):
            raise ConfigError(
                "clip_grad error_if_nonfinite=True is not supported by accelkit; a non-finite "
                "norm skips the step under fp16 and is reported by accel.step_was_skipped"
            )
        clip.pop("foreach", None)
        if set(clip) != {"max_norm"}:
            unknown = sorted(set(clip) - {"max_norm"})
            if unknown:  # torch's clip_grad_norm_ takes no such argument
                raise _ConfigTypeError(f"clip_grad: unknown keys {unknown}")
            raise _ConfigTypeError("clip_grad=dict(max_norm=X) needs max_norm")
        settings.max_grad_norm = float(clip["max_norm"])
    return cfg, settings


#: what an ``OptimWrapperDict``'s wrappers must share: accelkit applies them per Accelerator
_SHARED_SETTINGS = {
    "max_grad_norm": "clip_grad max_norm",
    "max_grad_value": "clip_grad clip_value",
    "precision": "AMP (AmpOptimWrapper and its dtype)",
    "grad_scaler": "AmpOptimWrapper loss_scale",
    "static_loss_scale": "AmpOptimWrapper loss_scale",
}


def read_several_optim_wrappers(cfg: Any) -> tuple[Any, TrainingSettings]:
    """MMEngine's several-optimizer ``optim_wrapper`` on accelkit: a config with a
    ``constructor`` whose entries are optimizer wrapper configs (mmagic's GANs), a dict of built
    ``OptimWrapper`` objects, or an ``OptimWrapperDict``.

    Each entry that is a wrapper config (it has an ``optimizer``) or a built ``OptimWrapper``
    is read as a single ``optim_wrapper`` is and becomes an :class:`AccelkitOptimWrapper`
    (config) or one built on the same optimizer. They keep their own ``accumulative_counts``
    (the Accelerator accumulates over the largest); clipping and AMP must agree, since accelkit
    applies them to the whole Accelerator.
    """
    from mmengine.optim import BaseOptimWrapper, OptimWrapperDict
    from mmengine.registry import OPTIM_WRAPPERS

    if isinstance(cfg, OptimWrapperDict):
        entries: dict[str, Any] = dict(cfg.items())
        constructor = None
    else:
        entries = dict(cfg)
        constructor = entries.pop("constructor", None)
    out: dict[str, Any] = {} if constructor is None else {"constructor": constructor}
    read: dict[str, TrainingSettings] = {}
    for name, value in entries.items():
        if isinstance(value, BaseOptimWrapper):
            one, settings = read_optim_wrapper_cfg(value)
            out[name] = OPTIM_WRAPPERS.build(one)
            read[name] = settings
        elif constructor is not None and hasattr(value, "items") and "optimizer" in value:
            out[name], read[name] = read_optim_wrapper_cfg(value)
        else:  # a constructor's own argument (paramwise_cfg), or what MMEngine refuses itself
            out[name] = value
    return out, combine_settings(read)


def combine_settings(read: dict[str, TrainingSettings]) -> TrainingSettings:
    """One Accelerator's settings for several optimizer wrappers: accumulation over the largest
    ``accumulative_counts`` (each wrapper closes its own window, see AccelkitOptimWrapper),
    clipping and AMP as they all say, or a :class:`ConfigError` naming the ones that differ."""
    if not read:
        return TrainingSettings(several=("",))
    names = list(read)
    first = read[names[0]]
    for key, what in _SHARED_SETTINGS.items():
        values = {name: getattr(s, key) for name, s in read.items()}
        if len({repr(v) for v in values.values()}) > 1:
            raise ConfigError(
                f"the optimizer wrappers of this OptimWrapperDict differ in {what} "
                f"({', '.join(f'{n}: {v!r}' for n, v in values.items())}); accelkit applies "
                "clipping and mixed precision to the whole Accelerator, so give every wrapper "
                "the same (accumulative_counts may differ)"
            )
    return dataclasses.replace(
        first,
        accumulation_steps=max(s.accumulation_steps for s in read.values()),
        several=tuple(names),
    )


def backend_class(backend: str) -> tuple[type, dict[str, Any]]:
    """The class of the backend ``backend`` resolves to (``auto`` picks one), and the defaults
    its registered name sets (an alias's). Imports the backend's module, never builds it."""
    from accelkit import registry

    host = registry.host()
    spec = host.resolve(backend)
    cls = spec.load_class()
    defaults = dict(spec.defaults)
    seen = {backend}
    while (other := cls.select_backend()) is not None and other not in seen:
        seen.add(other)
        spec = host.resolve(other)
        cls = spec.load_class()
        defaults = dict(spec.defaults)
    return cls, defaults


def backend_option_names(backend: str) -> tuple[frozenset[str], dict[str, Any]]:
    """The option names of the backend ``backend`` resolves to (``auto`` picks one), and the
    defaults its registered name sets (an alias's)."""
    cls, defaults = backend_class(backend)
    options_class = getattr(cls, "options_class", None)
    if options_class is None or not dataclasses.is_dataclass(options_class):
        return frozenset(), defaults
    return frozenset(f.name for f in dataclasses.fields(options_class)), defaults


def _options_set_by_user(adapter: AdapterOptions, alias_defaults: dict[str, Any]) -> set[str]:
    """Backend options the user (or the backend name) chose: the section, its config, an
    alias's defaults. A config that is an options object sets every option."""
    from accelkit.config import load_config_source

    chosen = set(adapter.options) | set(alias_defaults)
    try:
        chosen |= set(load_config_source(adapter.config))
    except ConfigError:
        pass  # accelkit.get reports a bad config
    return chosen


def mmengine_wrapper_options(
    adapter: AdapterOptions,
    model_wrapper_cfg: Any = None,
    *,
    find_unused_parameters: Any = None,
    distributed: bool = True,
) -> dict[str, Any]:
    """Backend options that make the backend's DDP wrap the model as MMEngine would.

    Without ``model_wrapper_cfg`` MMEngine wraps in ``MMDistributedDataParallel`` with
    ``broadcast_buffers=False`` (and the config's top-level ``find_unused_parameters``), unlike
    torch's DDP default; with it, the options it names (torch's defaults for the others).
    Applied to backends whose options have these names (``ddp``, ``fairscale_oss``/``sdp``,
    ``colossalai_ddp``/``zero``); what the ``accelkit`` section or the backend config sets wins.
    """
    names, alias_defaults = backend_option_names(adapter.backend)
    chosen = _options_set_by_user(adapter, alias_defaults)
    if model_wrapper_cfg is None:
        wanted = dict(MMENGINE_DDP_DEFAULTS)
        if find_unused_parameters is not None:
            wanted["find_unused_parameters"] = bool(find_unused_parameters)
        return {k: v for k, v in wanted.items() if k in names and k not in chosen}
    if not hasattr(model_wrapper_cfg, "items"):
        raise _ConfigTypeError(
            f"model_wrapper_cfg must be a dict, got {type(model_wrapper_cfg).__name__}"
        )
    wrapper = dict(model_wrapper_cfg)
    wrapper_type = _type_name(wrapper.pop("type", "MMDistributedDataParallel"))
    if wrapper_type == _SEPARATE_DDP and "broadcast_buffers" in names:
        wrapper.setdefault("broadcast_buffers", False)  # its default (torch's is True)
    for key in _PLACEMENT_KEYS:
        wrapper.pop(key, None)
    carried = wrapper_type in _DDP_WRAPPER_TYPES and set(wrapper) <= names
    if not carried:
        if not distributed:  # MMEngine ignores model_wrapper_cfg without a process group
            log.info("model_wrapper_cfg ignored: not distributed (as MMEngine's Runner does)")
            return {}
        usable = sorted(names & {"broadcast_buffers", "find_unused_parameters", "bucket_cap_mb"})
        raise ConfigError(
            f"model_wrapper_cfg {dict(model_wrapper_cfg)!r} cannot be used with AccelkitRunner "
            f"on backend {adapter.backend!r}: the backend wraps the model. "
            + (
                f"Options of MMDistributedDataParallel that it takes ({', '.join(usable)}, ...) "
                "carry over; set the others in the accelkit section"
                if usable
                else "Set the backend's own options in the accelkit section instead"
            )
        )
    for key, value in wrapper.items():
        if key in adapter.options and adapter.options[key] != value:
            raise ConfigError(
                f"{key}={adapter.options[key]!r} in the accelkit section disagrees with "
                f"model_wrapper_cfg ({key}={value!r}); keep one of them"
            )
    return wrapper


def accelerator_kwargs(
    adapter: AdapterOptions,
    settings: TrainingSettings,
    wrapper_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of :func:`accelkit.get` (the backend name excluded)."""
    precision = adapter.precision
    if settings.precision is not None:
        if precision is not None and precision != settings.precision:
            raise ConfigError(
                f"precision {precision!r} in the accelkit section disagrees with the "
                f"AmpOptimWrapper in optim_wrapper (which means {settings.precision!r}); "
                "keep one of them"
            )
        precision = settings.precision
    return dict(
        config=adapter.config,
        precision=precision,
        accumulation_steps=settings.accumulation_steps,
        max_grad_norm=settings.max_grad_norm,
        max_grad_value=settings.max_grad_value,
        **{**(wrapper_options or {}), **adapter.options},
    )
