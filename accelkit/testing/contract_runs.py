"""What the conformance suite runs: the raw reference loop and the jobs each rank of a launch
runs (train, probe, the core backend's load), apart from the test class
(:mod:`accelkit.testing.conformance`), which asserts on their results.

The reference side (:class:`MLPWorkload`, :func:`raw_reference`) imports nothing of accelkit;
the jobs import it inside, in the rank processes.
"""

from __future__ import annotations

import collections
import importlib
import sys
import warnings
from pathlib import Path
from typing import Any

#: micro-batches per optimizer step, optimizer steps per run, steps before the checkpoint
ACCUMULATION = 2
STEPS = 4
SAVE_AT = 2
#: below every pre-clip norm of the default workload (measured 0.43 to 1.77), so every step
#: clips and a backend that ignores max_grad_norm fails
CLIP = 0.3
#: samples per global micro-batch: divisible by 1, 2 and 3 data-parallel ranks
GLOBAL_BATCH = 6


class MLPWorkload:
    """A tiny regression MLP trained with Adam: the default workload of the contract.

    A workload is any class with these four methods; ``BackendContract.workload`` names it as
    ``"module:Class"`` (a backend that only trains certain models brings its own). It must not
    import accelkit: the raw reference runs it too.
    """

    seed = 1234

    def build(self) -> Any:
        import torch

        torch.manual_seed(self.seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def optimizer(self, params: Any) -> Any:
        import torch

        return torch.optim.Adam(params, lr=1e-2)

    def batch(self, index: int) -> dict[str, Any]:
        """Global micro-batch ``index`` (``GLOBAL_BATCH`` samples along the first dimension)."""
        import torch

        generator = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(GLOBAL_BATCH, 8, generator=generator)
        return {"x": x, "y": x.sum(dim=1, keepdim=True).sin()}

    def loss(self, model: Any, batch: dict[str, Any]) -> Any:
        import torch

        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def _import(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def _flat_state(state: dict[str, Any]) -> dict[str, list[float]]:
    return {k: v.detach().float().reshape(-1).cpu().tolist() for k, v in state.items()}


# ---- the reference: raw PyTorch, nothing of accelkit ---------------------------------------
def raw_reference(
    workload: str, steps: int = STEPS, optimizer: str | None = None
) -> dict[str, Any]:
    """The loop the backend must reproduce, in one process on the global batch: each micro-batch's
    loss divided by the accumulation steps, the total norm clipped to ``CLIP``, one step.
    ``optimizer``: one of :mod:`accelkit.testing.optimizers` instead of the workload's."""
    import torch

    from accelkit.testing import optimizers

    work = _import(workload)()
    model = work.build()
    params = model.parameters()
    optimizer = optimizers.build(optimizer, params) if optimizer else work.optimizer(params)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(ACCUMULATION):
            loss = work.loss(model, work.batch(step * ACCUMULATION + micro))
            (loss / ACCUMULATION).backward()
            losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "losses": losses,
        "norms": norms,
        "params": _flat_state(model.state_dict()),
        "optimizer_state": optimizers.state_by_name(model, optimizer),
    }


# ---- what each rank runs (through run_ranks) -----------------------------------------------
def _register(plugin: str | None) -> None:
    if plugin:
        import accelkit

        obj = _import(plugin) if ":" in plugin else importlib.import_module(plugin)
        accelkit.register_plugin(obj() if isinstance(obj, type) else obj, plugin)


def _shard(batch: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    size = GLOBAL_BATCH // world
    return {k: v[rank * size : (rank + 1) * size] for k, v in batch.items()}


def train_job(
    backend: str,
    options: dict[str, Any],
    precision: str | None,
    workload: str,
    plugin: str | None = None,
    save_to: str | None = None,
    load_from: str | None = None,
    tampered: str | None = None,
    probe: bool = False,
    steps: int = STEPS,
    save_at: int = SAVE_AT,
    optimizer: str | None = None,
    foreign: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps (saving after ``save_at``), or load ``load_from`` and train the rest;
    report losses (global means), norms, what ``grad_norm`` is, and the final full weights.
    ``probe``: first run :func:`probe_job` (in this process, before anything else is imported).
    ``optimizer``: one of :mod:`accelkit.testing.optimizers` instead of the workload's.
    ``foreign``: after ``save_at`` steps, try to load this checkpoint of another optimizer and
    report what it raised, then train on."""
    out: dict[str, Any] = {}
    if probe:
        out["probe"] = probe_job(backend, options, plugin, precision)  # registers the plugin
    else:
        _register(plugin)
    import torch

    import accelkit

    accel = accelkit.get(
        backend,
        options or None,
        precision=precision,
        accumulation_steps=ACCUMULATION,
        max_grad_norm=CLIP,
    )
    from accelkit.testing import optimizers

    work = _import(workload)()
    net = work.build()
    params = net.parameters()
    user_optimizer = optimizers.build(optimizer, params) if optimizer else work.optimizer(params)
    model, optimizer = accel.setup(net, user_optimizer)
    inner = getattr(optimizer, "optimizer", None)
    # what a torch LR scheduler does: write each group's lr; it must reach what the backend steps
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.5 * group["lr"]
    reaches = [g["lr"] for g in inner.param_groups] == [0.5 * lr for lr in lrs]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    out["optimizers"] = {
        "returned": isinstance(optimizer, torch.optim.Optimizer),
        "lr_reaches_backend": reaches,
        "types": [type(optimizer).__name__, type(inner).__name__],
    }
    state = {"model": model, "optimizer": optimizer}
    first = 0
    if tampered is not None:
        try:
            accel.load(tampered, state)
            out["tampered"] = None
        except Exception as err:  # the contract says which class; report what it was
            out["tampered"] = [type(err).__name__, str(err)[:300]]
    if load_from is not None:
        accel.load(load_from, state)
        first = save_at
    dp_rank = accel.backend.data_parallel_rank
    dp_world = accel.backend.data_parallel_world_size
    cuda = accel.device.type == "cuda"
    losses, norms, kinds, sync_sites = [], [], [], collections.Counter()
    for step in range(first, steps):
        for micro in range(ACCUMULATION):
            batch = accel.to_device(
                _shard(work.batch(step * ACCUMULATION + micro), dp_rank, dp_world)
            )
            with accel.accumulate(model):
                loss = work.loss(model, batch)
                accel.backward(loss)
            closes = micro == ACCUMULATION - 1
            if closes and cuda:  # the step that computes the norm: count host syncs
                torch.cuda.synchronize()
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = lambda message, *rest: _count_sync(message, sync_sites)
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        applied = accel.step()
                        norm = accel.grad_norm
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
            else:
                applied = accel.step()
                norm = accel.grad_norm
            losses.append(float(accel.all_reduce(loss.detach().float(), "mean")))
            if applied:
                kinds.append(
                    [
                        type(norm).__name__,
                        getattr(norm, "dim", lambda: -1)(),
                        str(getattr(norm, "device", "")).split(":")[0],
                    ]
                )
                norms.append(float(norm))
            optimizer.zero_grad()
        if save_to is not None and step + 1 == save_at:
            accel.save(save_to, state)
        if foreign is not None and step + 1 == save_at:
            try:
                accel.load(foreign, state)
                out["foreign"] = None
            except Exception as err:
                out["foreign"] = [type(err).__name__, str(err)[:400]]
    out.update(
        losses=losses,
        norms=norms,
        norm_kinds=kinds,
        device=accel.device.type,
        host_syncs_in_step=dict(sync_sites) if cuda else None,
        accelkit_host_syncs=_accelkit_sites(dict(sync_sites)),
        params=_flat_state(accel.full_state_dict(model)),
        dp=[dp_rank, dp_world],
    )
    accel.end_training()
    return out


def core_job(
    backend: str,
    workload: str,
    plugin: str | None,
    load_from: str,
    foreign_to: str,
) -> dict[str, Any]:
    """On a core backend, one process: load ``load_from`` (a run of :class:`TallyMomentum`) and
    report its optimizer state by parameter name (or what the load raised); then train one step
    of SGD with momentum and save it to ``foreign_to``, the checkpoint of another optimizer."""
    _register(plugin)
    import accelkit
    from accelkit.testing import optimizers

    accel = accelkit.get(backend, accumulation_steps=ACCUMULATION, max_grad_norm=CLIP)
    work = _import(workload)()
    out: dict[str, Any] = {}
    net = work.build()
    model, optimizer = accel.setup(net, optimizers.build("tally", net.parameters()))
    try:
        accel.load(load_from, {"model": model, "optimizer": optimizer})
        out["state"] = optimizers.state_by_name(accel.unwrap(model), optimizer)
    except Exception as err:
        out["state"] = None
        out["error"] = [type(err).__name__, str(err)[:600]]
    net = work.build()
    model, optimizer = accel.setup(net, optimizers.build("sgd-momentum", net.parameters()))
    for micro in range(ACCUMULATION):
        with accel.accumulate(model):
            accel.backward(work.loss(model, accel.to_device(work.batch(micro))))
        accel.step()
    optimizer.zero_grad()
    accel.save(foreign_to, {"model": model, "optimizer": optimizer})
    accel.end_training()
    return out


def _count_sync(message: Any, sites: collections.Counter) -> None:
    """Called where a sync warning is issued: count it at the innermost frame outside torch and
    this harness (the code that asked for the sync: accelkit's, or the backend library's)."""
    # torch's sync-debug warning; its other warnings (set_sync_debug_mode's own note that the
    # feature is experimental, issued once, also says "synchronizing") are not syncs
    if "called a synchronizing CUDA operation" not in str(message):
        return
    import traceback

    import torch

    torch_root = Path(torch.__file__).parent
    harness = Path(__file__).parent  # accelkit.testing: the launcher and this suite
    skip = {Path(warnings.__file__)}
    for frame in reversed(traceback.extract_stack()[:-1]):
        file = Path(frame.filename)
        if file in skip or file.is_relative_to(torch_root) or file.is_relative_to(harness):
            continue
        sites[f"{frame.filename}:{frame.lineno}"] += 1
        return
    sites["<unknown>"] += 1


def _accelkit_sites(sites: dict[str, int]) -> dict[str, int]:
    """The ``file:line`` sites that lie in accelkit's package or a loaded ``accelkit_*`` plugin."""
    roots = [
        Path(module.__file__).resolve().parent
        for name, module in list(sys.modules.items())
        if (name == "accelkit" or (name.startswith("accelkit_") and "." not in name))
        and getattr(module, "__file__", None)
    ]

    def ours(site: str) -> bool:
        file = Path(site.rpartition(":")[0]).resolve()
        return any(file.is_relative_to(root) for root in roots)

    return {site: n for site, n in sites.items() if ours(site)}


def probe_job(
    backend: str, options: dict[str, Any], plugin: str | None = None, precision: str | None = None
) -> dict[str, Any]:
    """In a fresh process: which backend modules listing the names imported, and what bad
    input raises."""
    from accelkit import registry

    _register(plugin)
    host = registry.host()
    host.ensure_loaded()
    names = host.registry.names()
    spec = host.resolve(backend)
    watched = list(spec.requires)
    if isinstance(spec.factory, str):
        watched.append(spec.factory.partition(":")[0])
    out: dict[str, Any] = {
        "listed": backend in names,
        "watched": watched,
        "imported": [m for m in watched if m in sys.modules],
    }
    import accelkit

    for key, kwargs in (
        ("unknown_option", {"no_such_option_kq": 1}),
        ("unknown_precision", {"precision": "fp33-weird"}),
    ):
        try:
            accelkit.get(backend, options or None, **kwargs)
            out[key] = None
        except Exception as err:
            out[key] = [type(err).__name__, [c.__name__ for c in type(err).__mro__], str(err)]
    out["precisions"] = precision_problems(backend, options, precision)
    return out


def precision_problems(
    backend: str, options: dict[str, Any], precision: str | None = None
) -> list[str]:
    """What is untrue in what ``backend`` advertises: a precision ``get()`` refuses (given with
    its options, ``PRECISION_EXAMPLE_OPTIONS``), a precision listed without the options class
    that configures it, a precision's options without the precision, an option refused at its
    own default (those the name presets or the contract passes aside). Configuration only:
    nothing is built or launched."""
    import dataclasses

    from accelkit import api, registry
    from accelkit.precision import (
        KNOWN_PRECISIONS,
        PRECISION_EXAMPLE_OPTIONS,
        precision_options,
    )

    config = options or None
    resolved = api.resolve(backend, config, precision=precision)
    advertised = resolved.backend_class.capabilities_for(resolved.options).precisions
    problems = []
    options_class = resolved.backend_class.options_class
    for known in KNOWN_PRECISIONS:
        needed = precision_options(known)
        if needed is None:
            continue
        has = isinstance(options_class, type) and issubclass(options_class, needed)
        fields = ", ".join(f.name for f in dataclasses.fields(needed))
        if known in advertised and not has:
            problems.append(
                f"advertises precision {known!r}, but its options class "
                f"{getattr(options_class, '__name__', options_class)} lacks the options that "
                f"configure it ({fields}: extend {needed.__name__})"
            )
        if has and known not in advertised:
            problems.append(
                f"has the options of precision {known!r} ({fields}), but does not advertise "
                "it: nobody can use them"
            )
    for each in advertised:
        extra = PRECISION_EXAMPLE_OPTIONS.get(each, {})
        try:
            api.resolve(backend, config, precision=each, **extra)
        except Exception as err:
            given = f" with {extra}" if extra else ""
            problems.append(
                f"advertises precision {each!r}, but get(){given} refuses it: "
                f"{type(err).__name__}: {str(err)[:300]}"
            )
    preset = set(registry.host().resolve(backend).defaults) | set(options or {})
    if dataclasses.is_dataclass(options_class):
        for field in dataclasses.fields(options_class):
            if field.name in preset:  # the name's presets and the contract's own options stay
                continue
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                continue
            try:
                api.resolve(backend, config, precision=precision, **{field.name: default})
            except Exception as err:
                problems.append(
                    f"option {field.name!r} at its default {default!r} is refused: "
                    f"{type(err).__name__}: {str(err)[:300]}"
                )
    return problems
