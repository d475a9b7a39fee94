"""The contract every accelkit backend passes, as pytest tests a backend's own suite runs.

In a backend's test module, one line per configuration::

    from accelkit.testing.conformance import backend_contract

    TestStage2Contract = backend_contract("deepspeed_stage_2", world_sizes=(1, 2))

or subclass :class:`BackendContract` and set its attributes (``backend``, ``options``,
``world_sizes``, ...). pytest collects the class (its name starts with ``Test``) and runs:

- ``setup`` returns torch optimizers whose param groups are the ones the backend steps (a torch
  LR scheduler's lr reaches it);
- a few steps (``steps``) with accumulation 2 and clipping match a raw PyTorch loop written
  below (same data, same initial weights, no accelkit), or the ``reference`` a class names: every
  loss, every pre-clip gradient norm, the final weights, within ``tolerance``;
- ``accel.grad_norm`` is a 0-d tensor on the backend's device, and on CUDA the step that computes
  it makes no host sync (``torch.cuda.set_sync_debug_mode``);
- a checkpoint saved at the largest world size loads at each of ``resume_world_sizes`` and the
  run continues on the same trajectory; a core backend (``resume_with``) continues it too; at
  the saved world size it continues within ``resume_tolerance`` (exact for a lossy backend);
- a checkpoint with a flipped byte raises ``CheckpointError``;
- listing the backend names imports neither the backend's library nor its module;
- an unknown option and an unknown precision are ``ConfigError``s naming the value; every
  precision the backend advertises is accepted with its options (``fp8-mixed`` with ``fp8_*``),
  a precision's options exist only where the precision is advertised, and every option is
  accepted at its default;
- optimizer state survives a load on another backend: a run with a custom optimizer that keeps
  non-tensor per-parameter state (:class:`~accelkit.testing.optimizers.TallyMomentum`) is saved
  at the largest world size and loaded on ``resume_with``'s core backend, which must hold every
  parameter's state, tensors and numbers, as the raw loop has it (a backend that keeps only one
  rank's numbers fails);
- a checkpoint of another optimizer (SGD with momentum, saved by the core backend) loaded into
  the trained run is refused with ``CheckpointError``, and the run then goes on exactly as if it
  had never been tried (the load changed nothing).

Every rank-side part runs in fresh processes (:func:`accelkit.testing.run_ranks`), each launch
once per class and world size; the tests assert on the cached results. One launch per class is
in the default test run: the training run at the smallest multi-rank world size (one process
where the backend has no other), which also probes imports and bad input first; every other
case is marked ``slow``.
"""

from __future__ import annotations

import atexit
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import pytest

from accelkit.testing import _module_folders, run_ranks
from accelkit.testing.contract_runs import (  # the constants stay importable from here
    ACCUMULATION,
    CLIP,
    GLOBAL_BATCH,  # noqa: F401  (plugins import it from here)
    SAVE_AT,
    STEPS,
    MLPWorkload,
    _import,
    raw_reference,
)

__all__ = ["BackendContract", "MLPWorkload", "backend_contract", "check_backend", "raw_reference"]

#: the module whose functions the ranks run
RUNS = "accelkit.testing.contract_runs"

#: (rtol, atol) of accelkit against the raw loop and of a resume against the unbroken run, per
#: precision. 32-true, measured on torch 2.13 CPU (ddp and fsdp at 2 and 3 ranks against the raw
#: loop; the all-reduce adds the ranks' gradients in another order than one process does):
#: losses 1.24e-7 relative, pre-clip norms 8.2e-8 relative, weights 3.0e-8 absolute (cpu at one
#: process: 0); rtol 1e-5 and atol 1e-6 leave 30x and more. The others scale with the
#: precision's epsilon (bf16 3.9e-3, fp16 4.9e-4) and are not measured yet: no contract here
#: runs them (the GPU classes run 32-true).
TOLERANCES: dict[str, tuple[float, float]] = {
    "32-true": (1e-5, 1e-6),
    "bf16-mixed": (3e-2, 3e-3),
    "16-mixed": (5e-3, 5e-4),
    "bf16-true": (5e-2, 5e-3),
    "16-true": (1e-2, 1e-3),
}


# ---- the test class ---------------------------------------------------------------------------
_TMP = Path(tempfile.mkdtemp(prefix="accelkit-contract-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
_CACHE: dict[tuple, Any] = {}
_SERIALS: dict[type, int] = {}


def _serial(cls: type) -> int:
    """A number no other contract class of this process gets, for its cached runs and its
    folder: ``id`` is reused once a class made by :func:`backend_contract` is freed."""
    return _SERIALS.setdefault(cls, len(_SERIALS))


def _tamper(source: Path, target: Path) -> Path:
    """A copy of a checkpoint with one byte flipped inside the first model or optimizer tensor
    of each tensor file (a tensor every load reads, unlike another rank's RNG state)."""
    if target.exists():
        return target
    shutil.copytree(source, target)
    for shard in sorted(target.rglob("*.safetensors")):
        raw = bytearray(shard.read_bytes())
        header_size = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + header_size])
        spans = [v["data_offsets"] for k, v in header.items() if not k.startswith("__")]
        spans = [(lo, hi) for lo, hi in spans if hi > lo]
        if spans:
            lo, hi = min(spans)
            raw[8 + header_size + (lo + hi) // 2] ^= 0x01
            shard.write_bytes(bytes(raw))
    return target


def _close(mine: list[float], reference: list[float], tolerance: tuple[float, float], what: str):
    """``mine`` within ``tolerance`` of ``reference``; a failure names the first index that
    differs beyond it, the values there, how many differ, and the worst."""
    rtol, atol = tolerance
    assert len(mine) == len(reference), f"{what}: {len(mine)} values, reference {len(reference)}"
    excess = [abs(a - b) - rtol * abs(b) for a, b in zip(mine, reference, strict=True)]
    bad = [i for i, (e, a) in enumerate(zip(excess, mine)) if e > atol or not math.isfinite(a)]
    if not bad:
        return
    first, worst = (
        bad[0],
        max(bad, key=lambda i: excess[i] if math.isfinite(excess[i]) else math.inf),
    )
    raise AssertionError(
        f"{what} differ beyond rtol={rtol}, atol={atol} at {len(bad)} of {len(mine)} indices; "
        f"first at index {first}: {mine[first]!r} vs {reference[first]!r}; worst at index "
        f"{worst}: {mine[worst]!r} vs {reference[worst]!r}"
    )


def _close_params(mine: dict, reference: dict, tolerance: tuple[float, float], what: str) -> None:
    assert sorted(mine) == sorted(reference), f"{what}: names {sorted(mine)} vs {sorted(reference)}"
    for name in reference:
        _close(mine[name], reference[name], tolerance, f"{what} {name}")


class BackendContract:
    """Subclass (with a name starting ``Test``) and set ``backend``; see the module docstring.

    Attributes are class-level: ``backend`` (the registered name), ``options`` (passed to
    ``accelkit.get``), ``precision``, ``world_sizes`` (the training runs), ``resume_world_sizes``
    (where the checkpoint saved at ``max(world_sizes)`` must load), ``resume_with`` (a core
    backend and its world size that must continue the run), ``workload`` (``"module:Class"``),
    ``plugin`` (``"module:attribute"`` of a plugin object every rank registers, for a backend
    registered in-process), ``env`` (added to the ranks' environment), ``gpu`` / ``slow`` (mark
    every case), ``timeout`` (seconds per launch), ``path`` (more folders the ranks import from),
    ``steps`` / ``save_at`` (optimizer steps per run, and the step after which the largest run
    saves), ``tolerance`` ((rtol, atol); None: by precision, :data:`TOLERANCES`), ``reference``
    (``"module:function"`` of the run to match, :func:`raw_reference` by default), ``lossy`` and
    ``resume_tolerance`` (a backend that computes something else on purpose, below).

    A *lossy* backend (gradient compression) declares ``lossy = True`` and its ``tolerance``
    against the reference; set ``save_at`` after its compression starts, so that the checkpoint
    holds live state. Its resumes are compared with its own uninterrupted run, and where the
    checkpoint was saved (same world size) with ``resume_tolerance``, exact by default: a
    backend that holds all of its state resumes bit for bit.
    """

    backend: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    precision: ClassVar[str] = "32-true"
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2)
    resume_world_sizes: ClassVar[tuple[int, ...]] = (1, 3)
    resume_with: ClassVar[tuple[str, int] | None] = ("cpu", 1)
    workload: ClassVar[str] = "accelkit.testing.conformance:MLPWorkload"
    plugin: ClassVar[str | None] = None
    env: ClassVar[dict[str, str]] = {}
    gpu: ClassVar[bool] = False
    #: mark every case ``slow`` (a second configuration of a backend already represented)
    slow: ClassVar[bool] = False
    timeout: ClassVar[float] = 300
    #: where the host syncs of a step are known and not yet removed: why (the count is still
    #: measured and reported, and the case is an expected failure rather than a pass)
    known_host_syncs: ClassVar[str | None] = None
    #: extra folders the ranks import ``plugin`` / ``workload`` from
    path: ClassVar[tuple[str, ...]] = ()
    #: optimizer steps per run, and the step after which the largest run saves its checkpoint
    steps: ClassVar[int] = STEPS
    save_at: ClassVar[int] = SAVE_AT
    #: (rtol, atol) against the reference and across resumes; None: by precision (TOLERANCES)
    tolerance: ClassVar[tuple[float, float] | None] = None
    #: "module:function(workload, steps)" of the run to match; None: the raw loop, raw_reference
    reference: ClassVar[str | None] = None
    #: the backend computes something else than the reference on purpose (compression): it
    #: must declare ``tolerance``; ``resume_tolerance`` then defaults to exact
    lossy: ClassVar[bool] = False
    #: (rtol, atol) of a resume at the saved world size against the uninterrupted run; None:
    #: exact where ``lossy``, else ``tolerance``
    resume_tolerance: ClassVar[tuple[float, float] | None] = None

    # ---- parametrisation and marks -----------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Each contract once per world size it concerns; multi-rank resumes are ``slow``."""
        cls = type(self)
        cls.check_attributes()
        base = ([pytest.mark.gpu] if cls.gpu else []) + ([pytest.mark.slow] if cls.slow else [])
        slow = [*base, pytest.mark.slow]
        representative = self.representative_size()
        if "world_size" in metafunc.fixturenames:
            params = [
                pytest.param(w, id=f"{w}rank", marks=base if w == representative else slow)
                for w in cls.world_sizes
            ]
            metafunc.parametrize("world_size", params)
        elif "resume_size" in metafunc.fixturenames:
            saved_at = max(cls.world_sizes)
            params = [
                pytest.param(w, id=f"{saved_at}to{w}rank", marks=slow)
                for w in cls.resume_world_sizes
            ]
            metafunc.parametrize("resume_size", params)
        else:  # the probe rides on the representative run; a resume is a launch of its own
            resumes = metafunc.function.__name__ in (
                "test_cross_backend_resume",
                "test_checkpoint_resumes_where_it_was_saved",
                "test_every_owners_optimizer_state_loads_on_another_backend",
                "test_another_optimizers_checkpoint_is_refused_and_changes_nothing",
            )
            marks = slow if resumes else base
            metafunc.parametrize("one", [pytest.param(1, id=cls.backend, marks=marks)])

    @classmethod
    def check_attributes(cls) -> None:
        """Refuse a class whose attributes cannot make a contract, saying which."""
        if not cls.backend:
            raise TypeError(f"{cls.__name__}: set the class attribute 'backend'")
        if not 0 < cls.save_at < cls.steps:
            raise TypeError(
                f"{cls.__name__}: save_at must lie between 0 and steps ({cls.steps}), "
                f"got {cls.save_at}"
            )
        if cls.lossy and cls.tolerance is None:
            raise TypeError(
                f"{cls.__name__}: a lossy backend declares its tolerance (rtol, atol) against "
                "the reference"
            )

    @classmethod
    def representative_size(cls) -> int:
        """The world size of the one launch in the default test run: the smallest multi-rank
        one (a single process where the backend has no other)."""
        return min((w for w in cls.world_sizes if w > 1), default=min(cls.world_sizes))

    # ---- launches, once per class and key ----------------------------------------------------
    def _launch(self, key: tuple, target: str, kwargs: dict[str, Any], nproc: int) -> list[Any]:
        cls = type(self)
        if cls.gpu:
            import torch

            gpus = torch.cuda.device_count()
            if nproc > gpus:
                pytest.skip(f"{nproc} ranks need {nproc} GPUs; this machine has {gpus}")
        cache_key = (_serial(cls), *key)
        if cache_key not in _CACHE:
            try:
                _CACHE[cache_key] = run_ranks(
                    target,
                    kwargs,
                    nproc=nproc,
                    timeout=cls.timeout,
                    env=dict(cls.env),
                    path=self._folders(),
                )
            except Exception as err:
                _CACHE[cache_key] = err
        result = _CACHE[cache_key]
        if isinstance(result, Exception):
            raise result
        return result

    def _folders(self) -> list[str]:
        """Where the ranks import the plugin and the workload from: ``path`` and the folders
        this process finds their modules in."""
        cls = type(self)
        folders = list(cls.path)
        for target in (cls.plugin, cls.workload):
            if target:
                module = target.partition(":")[0]
                folders += _module_folders(f"{module}:_", ())
        return list(dict.fromkeys(folders))

    def _job(self, **kwargs: Any) -> dict[str, Any]:
        cls = type(self)
        return dict(
            backend=cls.backend,
            options=dict(cls.options),
            precision=cls.precision,
            workload=cls.workload,
            plugin=cls.plugin,
            steps=cls.steps,
            save_at=cls.save_at,
            **kwargs,
        )

    def _checkpoint(self) -> Path:
        cls = type(self)
        return _TMP / f"{cls.__qualname__}-{_serial(cls)}" / "ckpt"

    def trained(self, world_size: int) -> list[dict[str, Any]]:
        """The run at ``world_size``; the largest one also saves the checkpoint."""
        save = world_size == max(type(self).world_sizes)
        probe = world_size == self.representative_size()
        job = self._job(save_to=str(self._checkpoint()) if save else None, probe=probe)
        return self._launch(("train", world_size), f"{RUNS}:train_job", job, world_size)

    def resumed(self, world_size: int, backend: str | None = None) -> list[dict[str, Any]]:
        saved = self._checkpoint()
        self.trained(max(type(self).world_sizes))  # writes it
        job = self._job(load_from=str(saved))
        if backend is not None:  # a core backend continues the run
            job.update(backend=backend, options={}, plugin=type(self).plugin)
        else:
            job["tampered"] = str(_tamper(saved, saved.parent / f"tampered-{world_size}"))
        key = ("resume", backend or type(self).backend, world_size)
        return self._launch(key, f"{RUNS}:train_job", job, world_size)

    def core_backend(self) -> str:
        """The core backend that loads this backend's checkpoints in the optimizer-state cases."""
        return (type(self).resume_with or ("cpu", 1))[0]

    def tallied(self) -> Path:
        """A checkpoint of a TallyMomentum run of ``save_at`` steps at the largest world size."""
        cls = type(self)
        saved = self._checkpoint().parent / "tally"
        world = max(cls.world_sizes)
        job = self._job(save_to=str(saved), optimizer="tally")
        job.update(steps=cls.save_at)
        self._launch(("tally", world), f"{RUNS}:train_job", job, world)
        return saved

    def core_view(self) -> dict[str, Any]:
        """What the core backend loaded of :meth:`tallied`; it also saves the foreign checkpoint
        (SGD with momentum) of :meth:`foreign_run`."""
        cls = type(self)
        job = dict(
            backend=self.core_backend(),
            workload=cls.workload,
            plugin=cls.plugin,
            load_from=str(self.tallied()),
            foreign_to=str(self._checkpoint().parent / "foreign"),
        )
        return self._launch(("core",), f"{RUNS}:core_job", job, 1)[0]

    def foreign_run(self) -> list[dict[str, Any]]:
        """The training run at the largest world size that tries the foreign checkpoint after
        ``save_at`` steps."""
        self.core_view()  # writes it
        world = max(type(self).world_sizes)
        job = self._job(foreign=str(self._checkpoint().parent / "foreign"))
        return self._launch(("foreign", world), f"{RUNS}:train_job", job, world)

    def probe(self) -> dict[str, Any]:
        """What rank 0 of the representative run found before it trained (one launch less)."""
        return self.trained(self.representative_size())[0]["probe"]

    def reference_run(self) -> dict[str, Any]:
        """What the backend's run must match: ``reference`` (the raw loop by default)."""
        cls = type(self)
        key = ("reference", cls.reference, cls.workload, cls.steps)
        if key not in _CACHE:
            run = _import(cls.reference) if cls.reference else raw_reference
            _CACHE[key] = run(cls.workload, cls.steps)
        return _CACHE[key]

    def tolerances(self) -> tuple[float, float]:
        """(rtol, atol) against the reference and across resumes."""
        cls = type(self)
        return cls.tolerance or TOLERANCES[cls.precision or "32-true"]

    def resume_tolerances(self) -> tuple[float, float]:
        """(rtol, atol) of a resume at the saved world size."""
        cls = type(self)
        if cls.resume_tolerance is not None:
            return cls.resume_tolerance
        return (0.0, 0.0) if cls.lossy else self.tolerances()

    def _resumed_from(
        self, saved: dict[str, Any], resumed: list[Any], what: str, tolerance: tuple[float, float]
    ) -> None:
        """Every rank of a resumed run continues ``saved`` (the uninterrupted run)."""
        tail = saved["losses"][type(self).save_at * ACCUMULATION :]
        for rank, result in enumerate(resumed):
            where = f"{what} rank {rank} of {len(resumed)}, resumed"
            _close(result["losses"], tail, tolerance, f"{where}: losses")
            _close_params(result["params"], saved["params"], tolerance, f"{where}: weights")

    # ---- the contracts -----------------------------------------------------------------------
    def test_setup_returns_torch_optimizers(self, world_size: int) -> None:
        for rank, result in enumerate(self.trained(world_size)):
            assert result["optimizers"]["returned"], f"rank {rank}: {result['optimizers']}"
            assert result["optimizers"]["lr_reaches_backend"], (
                f"rank {rank}: a torch LR scheduler on the returned optimizer does not set the lr "
                f"of the backend's {result['optimizers']['types'][1]}"
            )

    def test_accumulation_and_clipping_match_a_raw_loop(self, world_size: int) -> None:
        raw = self.reference_run()
        assert min(raw["norms"]) > CLIP, "the reference never clipped: the check would be blind"
        tolerance = self.tolerances()
        for rank, result in enumerate(self.trained(world_size)):
            what = f"rank {rank} of {world_size}"
            _close(result["losses"], raw["losses"], tolerance, f"{what}: losses")
            _close(result["norms"], raw["norms"], tolerance, f"{what}: pre-clip norms")
            _close_params(result["params"], raw["params"], tolerance, f"{what}: weights")

    def test_grad_norm_is_a_device_tensor_without_host_sync(self, world_size: int) -> None:
        for rank, result in enumerate(self.trained(world_size)):
            assert len(result["norm_kinds"]) == type(self).steps
            for kind, dim, device in result["norm_kinds"]:
                assert (kind, dim) == ("Tensor", 0), f"rank {rank}: grad_norm is {kind} ({dim}-d)"
                assert device == result["device"], f"rank {rank}: grad_norm on {device}"
            sites = result["host_syncs_in_step"]
            if sites is None:  # not on CUDA: nothing to count
                continue
            # a sync in accelkit's own code is always a failure; one inside the backend library
            # (which the raw library makes too) may be declared as known
            ours = result["accelkit_host_syncs"]
            assert not ours, f"rank {rank}: accelkit's code synced the host in the step: {ours}"
            if sites and type(self).known_host_syncs:
                pytest.xfail(f"rank {rank}: host syncs {sites}; {type(self).known_host_syncs}")
            assert not sites, (
                f"rank {rank}: host syncs in the steps that computed grad_norm: {sites}"
            )

    def test_checkpoint_resumes_where_it_was_saved(self, one: int) -> None:
        """Saved after ``save_at`` steps (past a lossy backend's compression start, so with its
        live per-rank state) and resumed at the same world size: the run goes on as if never
        stopped, exactly for a lossy backend."""
        saved_at = max(type(self).world_sizes)
        unbroken = self.trained(saved_at)[0]
        self._resumed_from(unbroken, self.resumed(saved_at), "", self.resume_tolerances())

    def test_checkpoint_resumes_at_another_world_size(self, resume_size: int) -> None:
        unbroken = self.trained(max(type(self).world_sizes))[0]
        self._resumed_from(unbroken, self.resumed(resume_size), "", self.tolerances())

    def test_tampered_checkpoint_raises_checkpoint_error(self, resume_size: int) -> None:
        for rank, result in enumerate(self.resumed(resume_size)):
            assert result["tampered"] is not None, f"rank {rank}: a tampered checkpoint loaded"
            assert result["tampered"][0] == "CheckpointError", f"rank {rank}: {result['tampered']}"

    def test_cross_backend_resume(self, one: int) -> None:
        if type(self).resume_with is None:
            pytest.skip("no core backend continues this backend's run")
        core, world = type(self).resume_with
        unbroken = self.trained(max(type(self).world_sizes))[0]
        resumed = self.resumed(world, backend=core)
        self._resumed_from(
            unbroken, resumed, f"{core} from {type(self).backend}: ", self.tolerances()
        )

    def test_every_advertised_precision_and_option_is_accepted(self, one: int) -> None:
        problems = self.probe()["precisions"]
        assert not problems, f"{type(self).backend}: " + "; ".join(problems)

    def test_every_owners_optimizer_state_loads_on_another_backend(self, one: int) -> None:
        """Saved at the largest world size with an optimizer that keeps numbers per parameter,
        loaded on the core backend: every parameter's state is the raw loop's."""
        cls = type(self)
        core = self.core_view()
        assert core["state"] is not None, (
            f"{cls.backend}'s checkpoint of a TallyMomentum run does not load on "
            f"{self.core_backend()}: {core.get('error')}"
        )
        expected = raw_reference(cls.workload, cls.save_at, "tally")["optimizer_state"]
        what = f"{self.core_backend()} from {cls.backend} at {max(cls.world_sizes)} ranks"
        _compare_state(core["state"], expected, self.tolerances(), what)

    def test_another_optimizers_checkpoint_is_refused_and_changes_nothing(self, one: int) -> None:
        cls = type(self)
        raw = self.reference_run()
        for rank, result in enumerate(self.foreign_run()):
            what = f"rank {rank}: a checkpoint of SGD with momentum loaded into the trained run"
            assert result["foreign"] is not None, f"{what} was accepted"
            assert result["foreign"][0] == "CheckpointError", f"{what}: {result['foreign']}"
            where = f"{what}, refused: the run then"
            _close(result["losses"], raw["losses"], self.tolerances(), f"{where} has losses that")
            _close_params(result["params"], raw["params"], self.tolerances(), f"{where}: weights")
        assert cls.steps > cls.save_at  # the run trained on after the refusal

    def test_listing_backends_imports_no_backend_library(self, one: int) -> None:
        probe = self.probe()
        assert probe["listed"], f"{type(self).backend} is not among the registered names"
        assert probe["imported"] == [], f"listing the backends imported {probe['imported']}"

    def test_bad_input_is_a_clear_config_error(self, one: int) -> None:
        probe = self.probe()
        for key, needle in (("unknown_option", "no_such_option_kq"), ("unknown_precision", "fp33")):
            assert probe[key] is not None, f"{key} was accepted"
            name, bases, message = probe[key]
            assert "ConfigError" in bases, f"{key}: {name}: {message}"
            assert needle in message, f"{key}: the message does not name it: {message}"


def _compare_state(
    mine: dict[str, Any], expected: dict[str, Any], tolerance: tuple[float, float], what: str
) -> None:
    """Every parameter's optimizer state, key by key: tensors within ``tolerance``, other values
    equal (floats within it too)."""
    assert sorted(mine) == sorted(expected), (
        f"{what}: state for parameters {sorted(mine)}, the raw loop has {sorted(expected)}"
    )
    for name, values in expected.items():
        got = mine[name]
        assert sorted(got) == sorted(values), (
            f"{what}: {name} has state keys {sorted(got)}, the raw loop {sorted(values)}"
        )
        for key, value in values.items():
            where = f"{what}: {name} {key!r}"
            if isinstance(value, list):
                _close(got[key], value, tolerance, where)
            elif isinstance(value, float):
                _close([float(got[key])], [value], tolerance, where)
            else:
                assert got[key] == value and type(got[key]) is type(value), (
                    f"{where} is {got[key]!r}, the raw loop has {value!r}"
                )


def _plugin_target(plugin: Any) -> tuple[str, tuple[str, ...]]:
    """``"module:attribute"`` for a plugin object (a class or a module), and the folder to import
    it from where it lives in a script (``__main__``: the script is imported by its file name,
    so its ``if __name__ == "__main__":`` part does not run in the ranks)."""
    if isinstance(plugin, str):
        return plugin, ()
    is_module = isinstance(plugin, type(sys))
    module = plugin if is_module else sys.modules.get(getattr(plugin, "__module__", ""))
    if module is None or not (is_module or isinstance(plugin, type)):
        raise TypeError(f"plugin must be 'module:attribute', a class or a module, got {plugin!r}")
    folders: tuple[str, ...] = ()
    module_name = module.__name__
    if module_name == "__main__":
        script = Path(module.__file__).resolve()
        module_name, folders = script.stem, (str(script.parent),)
    return (module_name if is_module else f"{module_name}:{plugin.__qualname__}"), folders


def backend_contract(backend: str, **attributes: Any) -> type[BackendContract]:
    """A :class:`BackendContract` subclass for ``backend``; assign it to a ``Test...`` name.

    ``plugin`` may be the plugin class itself (a backend registered in-process)."""
    unknown = set(attributes) - set(BackendContract.__annotations__)
    if unknown:
        raise TypeError(f"backend_contract: unknown attributes {sorted(unknown)}")
    if attributes.get("plugin") is not None:
        target, folders = _plugin_target(attributes["plugin"])
        attributes["plugin"] = target
        attributes["path"] = (*attributes.get("path", ()), *folders)
    name = "Test" + "".join(part.title() for part in backend.split("_")) + "Contract"
    return type(name, (BackendContract,), {"backend": backend, **attributes})


def check_backend(backend: str, **attributes: Any) -> list[str]:
    """Run every contract of ``backend`` outside pytest (a script, a notebook, the docs): the
    slow cases included. Returns the names of the contracts that held; raises
    ``AssertionError`` naming every one that did not."""
    contract = backend_contract(backend, **attributes)()
    cls = type(contract)
    cases: list[tuple[str, Any]] = []
    for name in sorted(n for n in dir(cls) if n.startswith("test_")):
        method = getattr(contract, name)
        parameters = method.__code__.co_varnames[1 : method.__code__.co_argcount]
        if "world_size" in parameters:
            values: tuple[int, ...] = cls.world_sizes
        elif "resume_size" in parameters:
            values = cls.resume_world_sizes
        else:
            values = (1,)
        cases += [(f"{name}[{value}]", lambda m=method, v=value: m(v)) for value in values]
    held, failed = [], []
    for case, run in cases:
        try:
            run()
            held.append(case)
        except pytest.skip.Exception:
            pass
        except AssertionError as err:
            failed.append(f"{case}: {str(err)[:2000]}")
    if failed:
        raise AssertionError(f"{backend} broke {len(failed)} contracts:\n" + "\n".join(failed))
    return held
