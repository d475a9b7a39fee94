"""``fp8-mixed``: eligible ``nn.Linear`` layers compute in float8 through torchao's float8
training (``convert_to_float8_training``); the rest of the model runs as under ``bf16-mixed``.

The weights stay fp32 (they are the master weights). Each converted layer casts its input, its
weight and the output's gradient to float8 with scales computed from the tensors of that step
(dynamic scaling; torchao >= 0.10 has no delayed scaling) and multiplies with ``_scaled_mm``.

Which layers convert (:func:`float8_filter`): exactly ``torch.nn.Linear`` (a subclass keeps its
own ``forward``, which the swap would drop), both dimensions multiples of 16 (the float8 matmul
requires it) and at least ``fp8_min_features``, its weight not shared with another module (a
weight tied to an embedding is also looked up, which float8 cannot serve), not the output head
(the last ``nn.Linear`` in module order, with ``fp8_skip_head``), and no ``fp8_skip`` pattern
matching its name. torchao is imported only when ``fp8-mixed`` is asked for.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.errors import ConfigError, PluginMissingError

log = logging.getLogger("accelkit")

FP8_MIXED = "fp8-mixed"
#: torchao's float8 training recipes (``Float8LinearRecipeName``, torchao 0.10 to 0.18)
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: float8 matmuls (``torch._scaled_mm``) need compute capability 8.9 (Ada, Hopper) or newer
MIN_CUDA_CAPABILITY = (8, 9)
#: both dimensions of a converted layer are multiples of this (``_scaled_mm``'s requirement)
FP8_DIM_MULTIPLE = 16
INSTALL_HINT = "pip install torchao (or pip install 'accelkit[fp8]')"


@dataclass(kw_only=True)  # keyword-only: a subclass's own fields keep their positions
class Float8Options:
    """The options of ``precision="fp8-mixed"``, shared by the backends that offer it (``cpu``,
    ``cuda``, ``ddp``, ``fsdp``); giving one with another precision is an error at ``get()``."""

    #: torchao recipe: "tensorwise" (fastest), "rowwise", "rowwise_with_gw_hp" (most accurate)
    fp8_recipe: str = "tensorwise"
    #: a Linear layer with fewer input or output features stays in bf16 (the float8 casts cost
    #: more than the faster matmul saves on small layers)
    fp8_min_features: int = 1024
    #: fnmatch patterns of module names (``"head"``, ``"blocks.0.*"``) kept in bf16
    fp8_skip: tuple[str, ...] | list[str] = field(default_factory=tuple)
    #: keep the output head, the last nn.Linear in module order, in bf16
    fp8_skip_head: bool = True

    def check_fp8_options(self) -> None:
        """Refuse a value no recipe or filter can use (called by each options ``__post_init__``)."""
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(
                f"option 'fp8_recipe' must be one of {', '.join(FP8_RECIPES)}, got "
                f"{self.fp8_recipe!r} (torchao has no delayed scaling since 0.10)"
            )
        if self.fp8_min_features < FP8_DIM_MULTIPLE:
            raise ValueError(
                f"option 'fp8_min_features' must be >= {FP8_DIM_MULTIPLE} (the float8 matmul's "
                f"smallest dimension), got {self.fp8_min_features}"
            )
        if isinstance(self.fp8_skip, str) or not all(isinstance(p, str) for p in self.fp8_skip):
            raise ValueError(
                f"option 'fp8_skip' must be a list of module-name patterns, got {self.fp8_skip!r}"
            )

    def __post_init__(self) -> None:
        self.check_fp8_options()


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Float8Options) if f.name != "fp8_skip"}


@dataclass(frozen=True)
class Float8Config:
    """What ``fp8-mixed`` converts and how, read from a backend's options."""

    recipe: str = "tensorwise"
    min_features: int = 1024
    skip: tuple[str, ...] = ()
    skip_head: bool = True
    #: FSDP2: all-gather the converted weights in float8 (torchao's tensorwise recipe only)
    all_gather: bool = False


def float8_config(owner: str, precision: str, options: Any) -> Float8Config | None:
    """The float8 settings of a backend's ``options`` under ``precision`` (None unless
    ``fp8-mixed``). Refuses fp8 options given with another precision: they would do nothing."""
    if precision != FP8_MIXED:
        given = [
            name
            for name, default in _DEFAULTS.items()
            if hasattr(options, name) and getattr(options, name) != default
        ]
        if tuple(getattr(options, "fp8_skip", ())):
            given.append("fp8_skip")
        if getattr(options, "fp8_all_gather", None) is not None:
            given.append("fp8_all_gather")
        if given:
            raise ConfigError(
                f"{owner}: the options {', '.join(sorted(given))} apply to "
                f"precision='fp8-mixed' only, not {precision!r}"
            )
        return None
    recipe = getattr(options, "fp8_recipe", "tensorwise")
    # only a backend with the option shards with FSDP2 (elsewhere nothing is all-gathered)
    all_gather = getattr(options, "fp8_all_gather", False)
    return Float8Config(
        recipe=recipe,
        min_features=getattr(options, "fp8_min_features", 1024),
        skip=tuple(getattr(options, "fp8_skip", ())),
        skip_head=getattr(options, "fp8_skip_head", True),
        all_gather=recipe == "tensorwise" if all_gather is None else bool(all_gather),
    )


def import_torchao() -> Any:
    """``torchao.float8``, or an error that says how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise PluginMissingError(
            f"precision 'fp8-mixed' runs through torchao's float8 training, and torchao cannot "
            f"be imported here ({err}). Install it: {INSTALL_HINT}."
        ) from err
    missing = [
        name
        for name in ("convert_to_float8_training", "Float8LinearConfig")
        if not hasattr(float8, name)
    ]
    if missing:
        raise PluginMissingError(
            f"precision 'fp8-mixed' needs torchao >= 0.10; this torchao lacks {', '.join(missing)}. "
            "Upgrade it: pip install -U torchao"
        )
    return float8


def check_device_supports_float8(device: torch.device, recipe: str = "tensorwise") -> None:
    """Fail at ``get()`` where float8 matmuls cannot run: CUDA below compute capability 8.9,
    MPS, and the CPU for the one recipe torchao runs on CUDA only."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CUDA_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ConfigError(
                f"precision 'fp8-mixed' needs float8 matmuls, which need a GPU of compute "
                f"capability 8.9 or newer (Ada, Hopper, Blackwell); {name} has "
                f"{capability[0]}.{capability[1]}. Use 'bf16-mixed'."
            )
    elif device.type != "cpu":
        raise ConfigError(
            f"precision 'fp8-mixed' runs on CUDA (compute capability 8.9 or newer) and the CPU "
            f"only, not on {device.type!r}. Use 'bf16-mixed'."
        )
    elif recipe == "rowwise_with_gw_hp":
        raise ConfigError(
            "fp8_recipe='rowwise_with_gw_hp' runs on CUDA only: torchao's Float8Linear reads the "
            "CUDA autocast dtype, so on the CPU its high-precision weight-gradient matmul mixes "
            "fp32 and bf16 operands. Use 'tensorwise' or 'rowwise' on the CPU."
        )
    import_torchao()


# ---- which layers convert -------------------------------------------------------------------------
def _shared_weights(model: torch.nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1
    return {pid for pid, count in owners.items() if count > 1}


def output_head(model: torch.nn.Module) -> str | None:
    """The name of the last ``nn.Linear`` in module order: the output head of a model that
    registers it last (a GPT's ``lm_head``); None when the model has no Linear layer."""
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return names[-1] if names else None


def float8_filter(
    model: torch.nn.Module, config: Float8Config
) -> tuple[Callable[[torch.nn.Module, str], bool], dict[str, str]]:
    """The ``module_filter_fn`` for torchao, and why each Linear it refuses stays in bf16.

    A ``fp8_skip`` pattern that names no Linear layer is an error: a typo would silently keep
    nothing in bf16."""
    shared = _shared_weights(model)
    head = output_head(model) if config.skip_head else None
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    unused = [p for p in config.skip if not any(fnmatch.fnmatchcase(n, p) for n, _ in linears)]
    if unused:
        raise ConfigError(
            f"fp8_skip patterns {unused} match no nn.Linear layer of the model; its Linear "
            f"layers are: {', '.join(n for n, _ in linears[:12])}"
            + (" ..." if len(linears) > 12 else "")
        )
    kept: dict[str, str] = {}
    for name, module in linears:
        reason = _keep_reason(name, module, config, head, shared)
        if reason:
            kept[name] = reason
    return (lambda module, fqn: isinstance(module, torch.nn.Linear) and fqn not in kept), kept


def _keep_reason(
    name: str, module: torch.nn.Linear, config: Float8Config, head: str | None, shared: set[int]
) -> str:
    """Why the Linear layer ``name`` stays in bf16 ("" when it converts)."""
    if type(module) is not torch.nn.Linear:
        return f"a subclass of nn.Linear ({type(module).__name__}) keeps its own forward"
    if name == head:
        return "the output head (fp8_skip_head)"
    if any(fnmatch.fnmatchcase(name, p) for p in config.skip):
        return "matches fp8_skip"
    if id(module.weight) in shared:
        return "its weight is shared with another module (tied)"
    dims = (module.in_features, module.out_features)
    if any(d % FP8_DIM_MULTIPLE for d in dims):
        return f"{dims[0]}x{dims[1]}: not multiples of {FP8_DIM_MULTIPLE}"
    if min(dims) < config.min_features:
        return f"{dims[0]}x{dims[1]}: below fp8_min_features={config.min_features}"
    return ""


def convert_to_float8(model: torch.nn.Module, config: Float8Config) -> torch.nn.Module:
    """Swap the eligible Linear layers of ``model`` for torchao's ``Float8Linear``, in place.

    Parameter names and objects stay (``Float8Linear`` takes the layer's own weight and bias;
    with ``all_gather`` the weight is re-wrapped for FSDP2's float8 all-gather, under the same
    name), so an optimizer built before and the portable checkpoint see the plain model's names.
    """
    float8 = import_torchao()
    if isinstance(model, torch.nn.Linear):
        raise ConfigError(
            "fp8-mixed converts the Linear layers inside a model; the model itself is one "
            "nn.Linear, which cannot be swapped in place. Wrap it in a module."
        )
    if any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        raise ConfigError(
            "fp8-mixed: this model already has Float8Linear layers; pass the original"
        )
    module_filter, kept = float8_filter(model, config)
    converted = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in kept
    ]
    if not converted:
        raise ConfigError(
            "fp8-mixed: no nn.Linear layer of this model qualifies for float8 ("
            + "; ".join(f"{n}: {why}" for n, why in list(kept.items())[:6])
            + "). Lower fp8_min_features, or train it under 'bf16-mixed'."
        )
    try:
        recipe_config = float8.Float8LinearConfig.from_recipe_name(config.recipe)
    except (AssertionError, ValueError) as err:
        raise ConfigError(
            f"fp8_recipe={config.recipe!r} is not a recipe of the installed torchao: {err}"
        ) from err
    if config.all_gather:
        recipe_config = dataclasses.replace(recipe_config, enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(model, module_filter_fn=module_filter, config=recipe_config)
    shown = list(kept.items())[:8]
    log.info(
        "fp8-mixed (%s): %d Linear layers compute in float8, %d stay in bf16%s%s",
        config.recipe,
        len(converted),
        len(kept),
        "".join(f"\n  {n}: {why}" for n, why in shown),
        "\n  ..." if len(kept) > len(shown) else "",
    )
    return model


def refresh_fsdp_scales(model: torch.nn.Module) -> None:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp``: the float8 scales of every
    all-gathered weight in one all-reduce, after the weights changed (a step, a load)."""
    import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)
