"""Damaged and crafted checkpoints, and the check that a failed load changed nothing.

Each case copies a good checkpoint and breaks one thing: a flipped byte in each fragment and
each file, truncated, grown, missing and redirected files, a wrong shape, dtype or key per
tensor, missing and extra optimizer state, bad hyperparameter and scheduler types, NaN and inf,
bad versions and fields, unsafe names, huge shapes. A crafted manifest gets a valid checksum, as
a hostile writer would give it. The live state is snapshotted in raw torch (nothing from
accelkit) and compared bit for bit after the failed load.

Used in-process (``cpu``) and by :func:`ranks_job` (``ddp`` on 2 processes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "accelkit.json"


# ---- the training state -------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.norm = torch.nn.BatchNorm1d(8)  # an int64 buffer (num_batches_tracked) too
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def build(accel: Any, seed: int, steps: int) -> dict[str, Any]:
    """A model, AdamW, a scheduler and a loader, trained ``steps`` steps from ``seed``."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99))
    model, opt = accel.setup(model, opt)
    sched = accel.setup_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    data = torch.utils.data.TensorDataset(torch.randn(64, 6), torch.randn(64, 3))
    loader = accel.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=4))
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
    return {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader, "epoch": seed}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a load could change, copied (raw torch, random, numpy)."""
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optimizer": copy.deepcopy(state["optimizer"].state_dict()),
        "scheduler": copy.deepcopy(state["scheduler"].state_dict()),
        "loader": copy.deepcopy(state["loader"].state_dict()),
        "epoch": state["epoch"],
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b) or (a != a and b != b)  # NaN equals NaN here


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def changed(before: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """The parts of ``state`` that differ from ``before`` (bit for bit)."""
    after = snapshot(state)
    return [key for key in before if not _same(before[key], after[key])]


# ---- damage ---------------------------------------------------------------------------------------
def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def _write_manifest(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` with a valid checksum, as a crafted manifest would have."""
    body = {k: v for k, v in data.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    data["checksum"] = hashlib.sha256(canonical).hexdigest()
    (path / MANIFEST).write_text(json.dumps(data, indent=1))


def _craft(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = _manifest(path)
        edit(data)
        _write_manifest(path, data)

    return damage


def _flip(file: str, at: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        target = path / file
        raw = bytearray(target.read_bytes())
        raw[at] ^= 0x40
        target.write_bytes(bytes(raw))

    return damage


def _resize(file: str, delta: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        target = path / file
        raw = target.read_bytes()
        target.write_bytes(raw[:delta] if delta < 0 else raw + b"\0" * delta)

    return damage


def _remove(file: str) -> Callable[[Path], None]:
    return lambda path: (path / file).unlink()


def _redirect(file: str) -> Callable[[Path], None]:
    """The rank file becomes a link to a copy outside the checkpoint."""

    def damage(path: Path) -> None:
        outside = path.parent / f"outside-{path.name}-{file}"
        shutil.copy(path / file, outside)
        (path / file).unlink()
        os.symlink(outside, path / file)

    return damage


def _tensor(data: dict[str, Any], label: str) -> dict[str, Any]:
    return next(t for t in data["tensors"] if f"{t['object']}:{t['kind']}:{t['fqn']}" == label)


def _group(data: dict[str, Any], key: str, value: Any) -> None:
    data["objects"]["optimizer"]["param_groups"][0][key] = value


def _scheduler(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data["objects"]["scheduler"]["state"][key] = value

    return edit


def _fragment(data: dict[str, Any], label: str, key: str, value: Any) -> None:
    _tensor(data, label)["fragments"][0][key] = value


def _payload_offset(path: Path, file: str, key: str) -> int:
    """Where the bytes of safetensors ``key`` start in ``file``."""
    raw = (path / file).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    return 8 + header_len + header[key]["data_offsets"][0]


def cases(good: Path) -> dict[str, tuple[Callable[[Path], None], list[str]]]:
    """name -> (damage, words the error must contain: the file and the tensor or field)."""
    data = _manifest(good)
    out: dict[str, tuple[Callable[[Path], None], list[str]]] = {}
    # a flipped byte in every fragment of every rank file
    for t in data["tensors"]:
        label = f"{t['object']}:{t['kind']}:{t['fqn']}"
        for frag in t["fragments"]:
            at = _payload_offset(good, frag["file"], frag["key"])
            out[f"flip {label} in {frag['file']}"] = (
                _flip(frag["file"], at),
                [frag["file"], label],
            )
    files = sorted(data["files"])
    rank_files = [f for f in files if f.startswith("rank-")]
    first = rank_files[0]
    out["flip manifest"] = (_flip(MANIFEST, 200), [MANIFEST])
    out["flip rank header"] = (_flip(first, 20), [first])
    out["header length"] = (_flip(first, 5), [first])
    if "extra.json" in files:
        out["flip extra.json"] = (_flip("extra.json", 10), ["extra.json"])
        out["missing extra.json"] = (_remove("extra.json"), ["extra.json"])
    for f in rank_files:
        out[f"truncated {f}"] = (_resize(f, -7), [f])
        out[f"grown {f}"] = (_resize(f, 3), [f])
        out[f"missing {f}"] = (_remove(f), [f])
        out[f"redirected {f}"] = (_redirect(f), [f, "outside"])
    out["truncated manifest"] = (_resize(MANIFEST, -40), [MANIFEST])
    # crafted manifests (a valid checksum)
    module_tensors = [
        t for t in data["tensors"] if t["object"] == "model" and t["kind"] in ("param", "buffer")
    ]
    for t in module_tensors:
        label = f"{t['object']}:{t['kind']}:{t['fqn']}"
        if len(t["shape"]) == 2:
            out[f"shape {label}"] = (
                _craft(
                    lambda d, lb=label: _tensor(d, lb).__setitem__(
                        "shape", _tensor(d, lb)["shape"][::-1]
                    )
                ),
                [label, "shape"],
            )
        wrong = "int32" if t["dtype"] == "float32" else "float64"
        out[f"dtype {label}"] = (
            _craft(lambda d, lb=label, w=wrong: _tensor(d, lb).__setitem__("dtype", w)),
            [label],
        )
        out[f"key {label}"] = (
            _craft(
                lambda d, lb=label: _tensor(d, lb).__setitem__(
                    "fqn", _tensor(d, lb)["fqn"] + "_renamed"
                )
            ),
            [t["fqn"]],
        )
    moments = [
        t for t in data["tensors"] if t["object"] == "optimizer" and t["kind"] == "optim:exp_avg"
    ]
    target = f"optimizer:optim:exp_avg:{moments[0]['fqn']}"
    out["missing exp_avg"] = (
        _craft(lambda d: d["tensors"].remove(_tensor(d, target))),
        [moments[0]["fqn"], "exp_avg"],
    )
    out["extra state key"] = (
        _craft(lambda d: _tensor(d, target).__setitem__("kind", "optim:momentum_buffer")),
        [moments[0]["fqn"], "momentum_buffer"],
    )
    for key, value in [
        ("lr", "x"), ("lr", float("nan")), ("lr", float("inf")), ("lr", None), ("lr", True),
        ("betas", [0.9]), ("betas", ["a", "b"]), ("weight_decay", "x"), ("eps", [1e-8]),
        ("amsgrad", 3),
    ]:  # fmt: skip
        out[f"group {key}={value!r}"] = (_craft(lambda d, k=key, v=value: _group(d, k, v)), [key])
    out["group params"] = (
        _craft(lambda d: d["objects"]["optimizer"]["param_groups"][0]["params"].pop()),
        ["optimizer"],
    )
    out["group count"] = (
        _craft(
            lambda d: d["objects"]["optimizer"]["param_groups"].append({"params": [], "lr": 1.0})
        ),
        ["param groups"],
    )
    for key, value in [
        ("last_epoch", "x"), ("last_epoch", float("nan")), ("base_lrs", [0.1, 0.2]),
        ("_last_lr", "x"), ("gamma", [1]),
    ]:  # fmt: skip
        out[f"scheduler {key}={value!r}"] = (_craft(_scheduler(key, value)), [key])
    first_weight = next(t for t in module_tensors if t["kind"] == "param")
    label = f"model:param:{first_weight['fqn']}"
    for key, value in [
        ("flat_offset", -1), ("numel", 0), ("sha256", "zz"), ("file", "../escape"), ("key", 5),
    ]:  # fmt: skip
        out[f"fragment {key}={value!r}"] = (
            _craft(lambda d, k=key, v=value: _fragment(d, label, k, v)),
            [key if key != "file" else "escape"],
        )
    out["huge shape"] = (
        _craft(lambda d: _tensor(d, label).update(
            shape=[1 << 21, 1 << 21],
            fragments=[dict(_tensor(d, label)["fragments"][0], numel=1 << 42)],
        )),
        [label, "bytes"],
    )  # fmt: skip
    for key, value in [
        ("format_version", "abc"), ("format_version", "2.0"), ("format_version", 1),
        ("world_size", "x"), ("world_size", 0), ("step", "x"), ("files", []), ("tensors", {}),
    ]:  # fmt: skip
        out[f"field {key}={value!r}"] = (
            _craft(lambda d, k=key, v=value: d.__setitem__(k, v)),
            [key],
        )
    out["field world_size missing"] = (_craft(lambda d: d.pop("world_size")), ["world_size"])
    out["objects entry"] = (
        _craft(lambda d: d["objects"].__setitem__("scheduler", 5)),
        ["scheduler"],
    )
    out["rng record"] = (_craft(lambda d: d["rng"].__setitem__("0", "x")), ["rng"])
    out["backend state type"] = (
        _craft(lambda d: d["backend_state"].__setitem__("precision", "x")),
        ["backend state", "precision"],
    )
    out["backend state base64"] = (
        _craft(lambda d: d["backend_state"].__setitem__("precision", {"__bytes__": "!!"})),
        ["__backend__"],
    )
    out["scheduler without state"] = (
        _craft(lambda d: d["objects"]["scheduler"].pop("state")),
        ["scheduler"],
    )
    return out


# ---- running the cases ----------------------------------------------------------------------------
def run_case(accel: Any, damaged: Path, words: list[str], seed: int) -> dict[str, Any]:
    """Load ``damaged`` into a live state trained from ``seed``: what it raised, whether the
    message names ``words``, and what changed."""
    state = build(accel, seed, steps=3)
    random.random(), np.random.rand()  # some RNG use after the build
    before = snapshot(state)
    result: dict[str, Any] = {"raised": None, "message": "", "changed": []}
    try:
        accel.load(damaged, state)
    except Exception as err:  # the suite asserts on the class name and the message
        result["raised"] = type(err).__name__
        result["message"] = str(err)
    result["changed"] = changed(before, state)
    result["named"] = all(w in result["message"] for w in words)
    return result


def make_cases(good: Path, root: Path) -> dict[str, tuple[str, list[str]]]:
    """Write every damaged copy of ``good`` under ``root``: name -> (directory, words)."""
    out = {}
    for i, (name, (damage, words)) in enumerate(cases(good).items()):
        target = root / f"case-{i:03d}"
        shutil.copytree(good, target, symlinks=True)
        damage(target)
        out[name] = (str(target), words)
    return out


def ranks_job(root: str, backend: str = "ddp") -> dict[str, Any]:
    """On every rank: save a good checkpoint, rank 0 damages copies, every rank loads each."""
    import accelkit
    from accelkit import distributed

    accel = accelkit.get(backend, seed=0)
    good = Path(root) / "good"
    accel.save(good, build(accel, seed=1, steps=5))
    listed = make_cases(good, Path(root) / "cases") if accel.is_main else None
    listed = distributed.broadcast_object(listed)
    results = {
        name: run_case(accel, Path(directory), words, seed=2)
        for name, (directory, words) in listed.items()
    }
    # the control: the good checkpoint loads and changes the state
    results["good"] = run_case(accel, good, [], seed=2)
    accel.end_training()
    return results
