"""From MMEngine config pieces to the arguments of :func:`accelkit.get`.

MMEngine users configure accumulation and clipping in ``optim_wrapper`` and mixed precision with
``type='AmpOptimWrapper'``; accelkit takes them as ``accumulation_steps``, ``max_grad_norm`` and
``precision``. This module does that translation in one place for the Runner and the Strategy,
and refuses what accelkit cannot honour instead of silently ignoring it.
"""

from __future__ import annotations

import copy
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
}
_WRAPPER_TYPES = ("OptimWrapper", "AmpOptimWrapper", "AccelkitOptimWrapper")


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
        return cls(**known, setup_kwargs=setup_kwargs, options=raw)


@dataclass
class TrainingSettings:
    """accelkit settings read from MMEngine's ``optim_wrapper`` config."""

    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    precision: str | None = None


def _type_name(value: Any) -> str:
    return value if isinstance(value, str) else getattr(value, "__name__", repr(value))


def read_optim_wrapper_cfg(cfg: Any) -> tuple[dict[str, Any] | None, TrainingSettings]:
    """Split MMEngine's ``optim_wrapper`` config into one accelkit can build, and settings.

    Returns the config with ``type`` set to ``AccelkitOptimWrapper`` (AMP keys removed), or None
    when there is no optimizer (val/test only).
    """
    from mmengine.optim import BaseOptimWrapper, OptimWrapper

    if cfg is None:
        return None, TrainingSettings()
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
        raise ConfigError(f"optim_wrapper must be a config dict, got {type(cfg).__name__}")
    cfg = dict(cfg)
    if "optimizer" not in cfg and "constructor" not in cfg:
        raise ConfigError(
            "accelkit's MMEngine adapter supports one optimizer per model; this optim_wrapper "
            "config has none (several optimizers need an OptimWrapperDict, not supported yet)"
        )
    wrapper_type = _type_name(cfg.get("type", "OptimWrapper"))
    if wrapper_type not in _WRAPPER_TYPES:
        raise ConfigError(
            f"optim_wrapper type {wrapper_type!r} cannot run on accelkit; use one of "
            f"{', '.join(_WRAPPER_TYPES)} (accelkit's backend does what the wrapper did)"
        )
    settings = TrainingSettings()
    if wrapper_type == "AmpOptimWrapper":
        dtype = cfg.pop("dtype", None)
        cfg.pop("loss_scale", None)
        cfg.pop("use_fsdp", None)
        is_bf16 = dtype in ("bfloat16", torch.bfloat16)
        settings.precision = "bf16-mixed" if is_bf16 else "16-mixed"
    cfg["type"] = "AccelkitOptimWrapper"
    settings.accumulation_steps = int(cfg.get("accumulative_counts", 1))
    clip = cfg.get("clip_grad")
    if clip is not None:
        clip = dict(clip)
        clip_type = clip.pop("type", "norm")
        norm_type = float(clip.pop("norm_type", 2.0))
        if clip_type != "norm" or norm_type != 2.0:
            raise ConfigError(
                "accelkit clips by the total L2 norm only (clip_grad=dict(max_norm=X)); "
                f"got type={clip_type!r}, norm_type={norm_type}"
            )
        if clip.pop("error_if_nonfinite", False):
            raise ConfigError(
                "clip_grad error_if_nonfinite=True is not supported by accelkit; a non-finite "
                "norm skips the step under fp16 and is reported by accel.step_was_skipped"
            )
        clip.pop("foreach", None)
        if set(clip) != {"max_norm"}:
            raise ConfigError(f"clip_grad: unknown keys {sorted(set(clip) - {'max_norm'})}")
        settings.max_grad_norm = float(clip["max_norm"])
    return cfg, settings


def accelerator_kwargs(adapter: AdapterOptions, settings: TrainingSettings) -> dict[str, Any]:
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
        **adapter.options,
    )
