"""``trust_pickle=True`` never runs a pickle's code (issue 21).

Crafted ``.pth`` files (``os.system``, ``eval``, ``__import__``, ``subprocess`` through
``functools.partial``, and the ``getattr`` + ``_rebuild_from_type_v2`` chain that reached ``eval``
through the old allowlist) go through every public path that takes ``trust_pickle``: the MMEngine
adapter's ``load_from``/``resume`` (AccelkitRunner, AccelkitStrategy) and ``accelkit convert``
(``.pth`` and torch.distributed.checkpoint directories). Each is refused with an error that names
what was refused and what to do, and its payload, which would write a marker file, never runs.
The positive twin: a checkpoint MMEngine's own Runner wrote (message hub with HistoryBuffers and
numpy scalars) loads value for value.
"""

from __future__ import annotations

import builtins
import functools
import os
import pickle
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("mmengine")

import numpy as np
from mmengine.logging import HistoryBuffer
from mmengine.model import BaseModel

from accelkit.checkpoint.formats.convert import (
    PickleRefused,
    conversion_allowlist,
    tensor_allowlist,
)
from accelkit.cli import main as cli
from accelkit.errors import CheckpointError
from accelkit.integrations.mmengine import checkpoint as mm_checkpoint

#: every refusal ends with what to do about it
WHAT_TO_DO = "accelkit unpickles nothing beyond its allowlist"


class Call:
    """Pickles as ``fn(*args)``: the call a crafted file asks the unpickler to make."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args

    def __call__(self, *args: Any) -> Any:  # pickle lets only a callable be the function of a call
        raise AssertionError("a Call stands for a call in a file; it is never called here")


def _write_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('ran')"


def _rebuild_from_type_v2_chain(marker: Path) -> Call:
    """eval(code) from globals the old allowlist held: getattr walks from HistoryBuffer to the
    builtins, and torch's ``_rebuild_from_type_v2`` calls what it finds."""

    def rebuild(fn: Any, new_type: Any, args: tuple) -> Call:
        return Call(torch._tensor._rebuild_from_type_v2, fn, new_type, args, None)

    module_globals = Call(getattr, Call(getattr, HistoryBuffer, "__init__"), "__globals__")
    dict_type = Call(getattr, module_globals, "__class__")
    builtin_type = Call(getattr, getattr, "__class__")
    builtins_dict = rebuild(Call(getattr, module_globals, "get"), dict_type, ("__builtins__",))
    evaluate = rebuild(Call(getattr, builtins_dict, "get"), builtin_type, ("eval",))
    return rebuild(evaluate, dict_type, (_write_code(marker),))


#: name -> (the payload, a global the refusal names)
GADGETS: dict[str, tuple[Any, str]] = {
    "os.system": (lambda m: Call(os.system, f"touch {m}"), f"{os.system.__module__}.system"),
    "eval": (lambda m: Call(builtins.eval, _write_code(m)), "builtins.eval"),
    "exec": (lambda m: Call(builtins.exec, _write_code(m)), "builtins.exec"),
    "__import__": (
        lambda m: Call(Call(getattr, Call(builtins.__import__, "os"), "system"), f"touch {m}"),
        "builtins.__import__",
    ),
    "partial(subprocess.run)": (
        lambda m: Call(functools.partial(subprocess.run, ["touch", str(m)])),
        "functools.partial",
    ),
    # pickle protocol 2 writes Popen under its Python 2 module name, commands
    "subprocess.Popen": (lambda m: Call(subprocess.Popen, ["touch", str(m)]), ".Popen"),
    "getattr+_rebuild_from_type_v2": (
        _rebuild_from_type_v2_chain,
        "torch._tensor._rebuild_from_type_v2",
    ),
    "getattr(HistoryBuffer.__init__)": (
        lambda m: {"hook": Call(getattr, HistoryBuffer, "__init__"), "code": _write_code(m)},
        "builtins.getattr",
    ),
}


def _save_gadget(path: Path, name: str, marker: Path) -> str:
    """A ``.pth`` as ``torch.save`` writes one, holding the gadget among ordinary weights."""
    payload, refused = GADGETS[name]
    torch.save({"state_dict": {"fc.weight": torch.ones(2, 4)}, "meta": payload(marker)}, path)
    return refused


class TinyNet(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, inputs: Any, labels: Any = None, mode: str = "tensor") -> Any:
        out = self.fc(torch.stack(inputs) if isinstance(inputs, list) else inputs)
        return {"loss": out.pow(2).mean()} if mode == "loss" else out


def _runner_cfg(work_dir: Path) -> dict:
    torch.manual_seed(0)
    data = [dict(inputs=torch.randn(4)) for _ in range(8)]
    return dict(
        model=TinyNet(),
        work_dir=str(work_dir),
        train_dataloader=dict(
            dataset=data,
            sampler=dict(type="DefaultSampler", shuffle=False),
            batch_size=2,
            collate_fn=dict(type="default_collate"),
        ),
        train_cfg=dict(by_epoch=True, max_epochs=1),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
        param_scheduler=dict(type="MultiStepLR", milestones=[1]),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)),
        randomness=dict(seed=0),
        log_level="WARNING",
    )


@pytest.fixture(scope="module")
def mmengine_pth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``epoch_1.pth`` as MMEngine's own Runner writes it, nothing from accelkit."""
    from mmengine.runner import Runner

    work = tmp_path_factory.mktemp("mmengine")
    Runner(**_runner_cfg(work)).train()
    return work / "epoch_1.pth"


def _accelkit_runner(work_dir: Path) -> Any:
    from accelkit.integrations.mmengine import AccelkitRunner

    cfg = _runner_cfg(work_dir)
    cfg["default_hooks"] = dict(checkpoint=None)
    return AccelkitRunner(**cfg, accelkit=dict(backend="cpu", trust_pickle=True))


@pytest.fixture(scope="module")
def load_runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _accelkit_runner(tmp_path_factory.mktemp("load"))


@pytest.fixture(scope="module")
def resume_runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _accelkit_runner(tmp_path_factory.mktemp("resume"))


@pytest.fixture(scope="module")
def strategy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from accelkit.integrations.mmengine import AccelkitStrategy

    # MMEngine's default work_dir is ./work_dirs: a test writes nothing outside its tmp folder
    work_dir = tmp_path_factory.mktemp("strategy")
    strategy = AccelkitStrategy(backend="cpu", trust_pickle=True, work_dir=str(work_dir))
    strategy.prepare(TinyNet())
    return strategy


def _through(path_kind: str, request: pytest.FixtureRequest, pth: Path, tmp_path: Path) -> str:
    """Load ``pth`` with trust through one public path; return the error message it gave."""
    if path_kind == "accelkit convert --trust-pickle":
        capfd = request.getfixturevalue("capfd")
        capfd.readouterr()
        assert cli(["convert", str(pth), str(tmp_path / "out"), "--trust-pickle"]) == 1
        assert not (tmp_path / "out").exists()
        return capfd.readouterr().err
    with pytest.raises(CheckpointError) as caught:
        if path_kind == "read_pickled":
            mm_checkpoint.read_pickled(pth, trust_pickle=True)
        elif path_kind == "AccelkitRunner.load_checkpoint":
            request.getfixturevalue("load_runner").load_checkpoint(str(pth))
        elif path_kind == "AccelkitRunner.resume":
            request.getfixturevalue("resume_runner").resume(str(pth))
        elif path_kind == "AccelkitStrategy.load_checkpoint":
            request.getfixturevalue("strategy").load_checkpoint(str(pth))
        else:
            raise AssertionError(path_kind)
    return str(caught.value)


PATHS = [
    "read_pickled",
    "AccelkitRunner.load_checkpoint",
    "AccelkitRunner.resume",
    "AccelkitStrategy.load_checkpoint",
    "accelkit convert --trust-pickle",
]


@pytest.mark.parametrize("path_kind", PATHS)
@pytest.mark.parametrize("gadget", list(GADGETS))
def test_gadget_is_refused_and_never_runs(
    gadget: str, path_kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    marker = tmp_path / "payload-ran"
    refused = _save_gadget(tmp_path / "crafted.pth", gadget, marker)
    message = _through(path_kind, request, tmp_path / "crafted.pth", tmp_path)
    assert refused in message and "refused to unpickle" in message, message
    assert WHAT_TO_DO in message, message
    assert not marker.exists()


@pytest.mark.parametrize("gadget", ["eval", "getattr+_rebuild_from_type_v2"])
def test_without_trust_a_gadget_is_refused_not_asked_to_be_trusted(
    gadget: str, tmp_path: Path
) -> None:
    """trust_pickle would not make it load, so the error does not suggest it."""
    marker = tmp_path / "payload-ran"
    refused = _save_gadget(tmp_path / "crafted.pth", gadget, marker)
    with pytest.raises(PickleRefused) as caught:
        mm_checkpoint.read_pickled(tmp_path / "crafted.pth", trust_pickle=False)
    assert refused in str(caught.value) and WHAT_TO_DO in str(caught.value)
    assert not marker.exists()


def test_the_rebuild_chain_runs_under_the_old_allowlist(tmp_path: Path) -> None:
    """The gadget is live: torch's weights_only load with ``getattr`` allowed (the old list) runs
    it, so the refusals above are accelkit's doing."""
    marker = tmp_path / "payload-ran"
    _save_gadget(tmp_path / "crafted.pth", "getattr+_rebuild_from_type_v2", marker)
    with (
        torch.serialization.safe_globals([HistoryBuffer, getattr]),
        pytest.raises(Exception),  # noqa: B017 (after the payload: eval's result is no tensor)
    ):
        torch.load(tmp_path / "crafted.pth", weights_only=True)
    assert marker.read_text() == "ran"


def _raw_torch_file(path: Path, pickle_bytes: bytes) -> None:
    """A torch.save zip archive whose ``data.pkl`` is written opcode by opcode."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/byteorder", "little")


def _opcode_eval(code: str) -> bytes:
    text = code.encode()
    # PROTO 2; GLOBAL __builtin__ eval; BINUNICODE code; TUPLE1; REDUCE; STOP
    return b"\x80\x02c__builtin__\neval\nX" + len(text).to_bytes(4, "little") + text + b"\x85R."


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_hand_written_pickle_is_refused(layout: str, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    pth = tmp_path / "crafted.pth"
    raw = _opcode_eval(_write_code(marker))
    if layout == "zip":
        _raw_torch_file(pth, raw)
    else:  # the pre-1.6 format: a sequence of pickles, the first one read before any check
        pth.write_bytes(raw)
    assert pickle.loads(raw) is not None and marker.exists()  # live: plain pickle runs it
    marker.unlink()
    with pytest.raises(PickleRefused, match=r"builtins\.eval") as caught:
        mm_checkpoint.read_pickled(pth, trust_pickle=True)
    assert caught.value.refused == ("builtins.eval",)
    assert not marker.exists()


def test_history_buffer_cannot_rewrite_its_class_wide_statistics(tmp_path: Path) -> None:
    """HistoryBuffer.__setstate__ merges a file's statistics methods into a dict its class
    shares: a file that replaces one is refused, and the class keeps its own."""
    state = {
        "max_length": 5,
        "_log_history": np.array([1.0]),
        "_count_history": np.array([1]),
        "statistics_methods": {"mean": np.ndarray},
    }
    torch.save({"log": _Stateful(HistoryBuffer, state)}, tmp_path / "crafted.pth")
    with pytest.raises(PickleRefused, match="statistics methods mean"):
        mm_checkpoint.read_pickled(tmp_path / "crafted.pth", trust_pickle=True)
    assert HistoryBuffer._statistics_methods["mean"] is HistoryBuffer.mean
    buffer = HistoryBuffer()
    buffer.update(2.0)
    assert buffer.statistics("mean") == 2.0


class _Stateful:
    """Pickles as ``cls()`` then ``__setstate__(state)``."""

    def __init__(self, cls: type, state: dict) -> None:
        self.cls, self.state = cls, state

    def __reduce__(self) -> tuple:
        return self.cls, (), self.state


def test_a_dcp_metadata_gadget_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "dcp"))
    marker = tmp_path / "payload-ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(
        pickle.dumps(Call(builtins.eval, _write_code(marker)), protocol=4)
    )
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "out"), "--trust-pickle"]) == 1
    err = capfd.readouterr().err
    assert "builtins.eval" in err and ".metadata" in err and WHAT_TO_DO in err, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_dcp_value_gadget_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """DCP stores a non-tensor value as a torch.save'd blob, which DCP itself would load with
    ``weights_only=False``."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "payload-ran"
    state = {"model": {"w": torch.ones(2)}, "extra": Call(os.system, f"touch {marker}")}
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "out"), "--trust-pickle"]) == 1
    err = capfd.readouterr().err
    assert f"{os.system.__module__}.system" in err and WHAT_TO_DO in err, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_user_registered_getattr_does_not_widen_the_load(tmp_path: Path) -> None:
    """A process that allowlisted the real getattr for its own torch.load still gets the
    stand-in during accelkit's loads, and its own registration back afterwards."""
    marker = tmp_path / "payload-ran"
    _save_gadget(tmp_path / "crafted.pth", "getattr(HistoryBuffer.__init__)", marker)
    with torch.serialization.safe_globals([getattr]):
        with pytest.raises(PickleRefused, match=r"getattr\(mmengine"):
            mm_checkpoint.read_pickled(tmp_path / "crafted.pth", trust_pickle=True)
        assert getattr in torch.serialization.get_safe_globals()


# ---- what the lists hold --------------------------------------------------------------------------
#: callables that look up attributes, import, evaluate or call what they are handed
FORBIDDEN = {
    builtins.getattr,
    builtins.setattr,
    builtins.eval,
    builtins.exec,
    builtins.compile,
    builtins.__import__,
    builtins.globals,
    builtins.vars,
    builtins.type,
    builtins.object,
    functools.partial,
    os.system,
    subprocess.Popen,
    pickle.loads,
    torch.load,
    torch._tensor._rebuild_from_type_v2,
    torch._utils._rebuild_parameter_with_state,
    torch._utils._rebuild_wrapper_subclass,
    torch._utils._rebuild_device_tensor_from_cpu_tensor,
}


@pytest.mark.parametrize(
    "allowlist",
    [tensor_allowlist, conversion_allowlist, mm_checkpoint.mmengine_allowlist],
    ids=["tensors", "convert", "mmengine"],
)
def test_no_allowed_global_reaches_attribute_lookup_or_evaluation(allowlist: Any) -> None:
    import operator

    from torch._weights_only_unpickler import _get_allowed_globals

    chosen = allowlist()
    bound = dict(chosen.bindings)
    torch_defaults = _get_allowed_globals()
    forbidden = FORBIDDEN | {operator.attrgetter, operator.methodcaller}
    for name in chosen.names:
        assert name in bound or name in torch_defaults, name  # torch must resolve it
        resolved = bound.get(name, torch_defaults.get(name))
        assert not any(resolved is f for f in forbidden), name
    assert "torch._tensor._rebuild_from_type_v2" not in chosen.names
    if "builtins.getattr" in chosen.names:  # MMEngine's: a stand-in that resolves 4 methods
        stand_in = bound["builtins.getattr"]
        assert stand_in(HistoryBuffer, "mean") is HistoryBuffer.mean
        for owner, attr in [(os, "system"), (HistoryBuffer, "__init__"), (builtins, "eval")]:
            with pytest.raises(PickleRefused):
                stand_in(owner, attr)


# ---- the positive twin -----------------------------------------------------------------------------
def _assert_same(ours: Any, theirs: Any, where: str = "checkpoint") -> None:
    assert type(ours) is type(theirs), where
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for key in theirs:
            _assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), where
    elif isinstance(theirs, HistoryBuffer):
        assert ours.max_length == theirs.max_length, where
        _assert_same(ours._log_history, theirs._log_history, f"{where}.log")
        _assert_same(ours._count_history, theirs._count_history, f"{where}.count")
    else:
        assert ours == theirs, where


def test_what_a_torch_save_of_tensors_holds_loads_without_trust(tmp_path: Path) -> None:
    """The tensor list is not narrower than real state dicts: dtypes, a Parameter, quantized,
    sparse and meta tensors, views, bytes, sizes, devices and layouts in plain containers."""
    import collections

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = collections.OrderedDict(
        floats=[base.to(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float64)],
        ints=(base.to(torch.int8), base.to(torch.uint8), base.to(torch.int64), base > 3),
        complex=torch.complex(base, base),
        view=base[1:, ::2],
        param=torch.nn.Parameter(base.clone()),
        quantized=torch.quantize_per_tensor(base, 0.1, 0, torch.qint8),
        sparse=base.to_sparse(),
        meta=torch.empty(2, 3, device="meta"),
        plain={"bytes": b"\x00\xff", "size": torch.Size([3, 4]), "set": {1, 2}, "c": 1j},
        torch_values=[torch.device("cpu"), torch.float32, torch.strided],
        counter=collections.Counter(a=2),
    )
    torch.save(state, tmp_path / "plain.pth")
    loaded = mm_checkpoint.read_pickled(tmp_path / "plain.pth", trust_pickle=False)
    assert list(loaded) == list(state) and loaded["plain"] == state["plain"]
    for key in ("complex", "view", "param"):
        assert torch.equal(loaded[key], state[key]), key
    assert type(loaded["param"]) is torch.nn.Parameter
    for ours, theirs in zip(
        loaded["floats"] + list(loaded["ints"]), state["floats"] + list(state["ints"])
    ):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert torch.equal(loaded["quantized"].int_repr(), state["quantized"].int_repr())
    assert torch.equal(loaded["sparse"].to_dense(), base)
    assert loaded["meta"].is_meta and loaded["meta"].shape == (2, 3)
    assert loaded["torch_values"] == state["torch_values"] and loaded["counter"] == state["counter"]


def test_mmengine_checkpoint_loads_value_for_value(mmengine_pth: Path) -> None:
    reference = torch.load(mmengine_pth, weights_only=False)  # the test trusts its own file
    hub = reference["message_hub"]
    assert isinstance(hub["log_scalars"]["train/loss"], HistoryBuffer)
    assert any(isinstance(v, np.generic) for v in hub["runtime_info"].values())
    with pytest.raises(CheckpointError) as untrusted:
        mm_checkpoint.read_pickled(mmengine_pth, trust_pickle=False)
    assert "trust_pickle=True" in str(untrusted.value) and "HistoryBuffer" in str(untrusted.value)
    _assert_same(mm_checkpoint.read_pickled(mmengine_pth, trust_pickle=True), reference)


def test_mmengine_checkpoint_resumes_through_the_runner(mmengine_pth: Path, tmp_path: Path) -> None:
    reference = torch.load(mmengine_pth, weights_only=False)
    runner = _accelkit_runner(tmp_path)
    runner.resume(str(mmengine_pth))
    weights = {k.removeprefix("module."): v for k, v in runner.model.state_dict().items()}
    _assert_same(weights, dict(reference["state_dict"]))
    loss = runner.message_hub.get_scalar("train/loss")
    _assert_same(loss, reference["message_hub"]["log_scalars"]["train/loss"])
    assert loss.mean() == reference["message_hub"]["log_scalars"]["train/loss"].mean()
