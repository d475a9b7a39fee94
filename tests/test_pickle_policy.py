"""One unpickling policy for every importer (issue 35).

* Nothing in accelkit or its plugins unpickles except through the restricted unpickler
  (accelkit/checkpoint/formats/unpickle.py): no ``torch.load``, ``pickle.load(s)``, ``Unpickler`` or
  ``weights_only=False`` anywhere else. The DeepSpeed and ColossalAI importers' old
  ``torch.load(weights_only=False)`` fails this test.
* A list may let tensors carry named Python attributes (DeepSpeed's ``ds_id``): torch writes
  them through ``_rebuild_from_type_v2``, which calls the function the file hands it; each call
  is checked before anything runs, and one that hands it anything but a tensor reconstructor,
  a tensor type and the named attributes is refused.
* :class:`StandIn` reads another library's objects as their fields, running none of its code.
* Legacy (non-zip) ``torch.save`` files go through the same checks.
"""

from __future__ import annotations

import _codecs
import ast
import collections
import dataclasses
from pathlib import Path

import pytest
import torch

from accelkit.sdk import (
    PickleRefused,
    StandIn,
    conversion_allowlist,
    pickle_globals,
    restricted_torch_load,
)
from accelkit.testing.pickle_gadgets import Call, gadgets

ROOT = Path(__file__).resolve().parents[1]
#: the one module that unpickles
UNPICKLER = ROOT / "accelkit" / "checkpoint" / "formats" / "unpickle.py"
REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"
#: calls that unpickle: (the name called on, the attribute)
UNPICKLING_CALLS = {
    ("torch", "load"),
    ("pickle", "load"),
    ("pickle", "loads"),
    ("pickle", "Unpickler"),
    ("pickle", "_Unpickler"),
    ("_pickle", "Unpickler"),
    ("np", "load"),
    ("numpy", "load"),
    ("marshal", "loads"),
}


def _library_sources() -> list[Path]:
    plugins = [p for p in (ROOT / "plugins").glob("*/accelkit_*") if p.is_dir()]
    return sorted(path for top in (ROOT / "accelkit", *plugins) for path in top.rglob("*.py"))


def _unpickling_calls(path: Path) -> list[str]:
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and (func.value.id, func.attr) in UNPICKLING_CALLS
        ):
            found.append(f"{shown}:{node.lineno}: {func.value.id}.{func.attr}")
        for keyword in node.keywords:
            safe = keyword.arg == "weights_only"  # True is safe; allow_pickle: False is
            if keyword.arg in ("weights_only", "allow_pickle") and not (
                isinstance(keyword.value, ast.Constant) and keyword.value.value is safe
            ):
                found.append(f"{shown}:{node.lineno}: {keyword.arg}=...")
    return found


def test_nothing_else_in_accelkit_or_its_plugins_unpickles():
    sources = _library_sources()
    assert any("accelkit_deepspeed" in str(p) for p in sources)  # the plugins are scanned
    found = [hit for path in sources if path != UNPICKLER for hit in _unpickling_calls(path)]
    assert found == []


def test_the_scan_finds_what_the_importers_did_before(tmp_path):
    """The scan above can fail: the DeepSpeed importer's old reading is found."""
    old = tmp_path / "importer.py"
    old.write_text(
        "import torch\n"
        "def _load(path):\n"
        "    return torch.load(path, map_location='cpu', weights_only=False, mmap=True)\n"
    )
    assert _unpickling_calls(old) == [
        "importer.py:3: torch.load",
        "importer.py:3: weights_only=...",
    ]


# ---- tensors with attributes ------------------------------------------------------------------
def _tensor_with(**attributes: object) -> torch.Tensor:
    tensor = torch.arange(4.0)
    for name, value in attributes.items():
        setattr(tensor, name, value)
    return tensor


def test_a_tensor_with_a_listed_attribute_loads_with_it(tmp_path):
    torch.save({"flat": [_tensor_with(ds_id="0_3")]}, tmp_path / "f.pt")
    allowlist = conversion_allowlist().extended({}, tensor_attributes=("ds_id",))
    flat = restricted_torch_load(tmp_path / "f.pt", allowlist, hint="H")["flat"][0]
    assert type(flat) is torch.Tensor and torch.equal(flat, torch.arange(4.0))
    assert flat.ds_id == "0_3"


def test_a_tensor_with_attributes_is_refused_unless_the_list_names_them(tmp_path):
    torch.save({"flat": [_tensor_with(ds_id="0_3", hook="x")]}, tmp_path / "f.pt")
    with pytest.raises(PickleRefused, match=f"it names {REBUILD_FROM_TYPE}, .* H$"):
        restricted_torch_load(tmp_path / "f.pt", conversion_allowlist(), hint="H")
    only_ds_id = conversion_allowlist().extended({}, tensor_attributes=("ds_id",))
    with pytest.raises(PickleRefused, match=f"it calls {REBUILD_FROM_TYPE} with more than"):
        restricted_torch_load(tmp_path / "f.pt", only_ds_id, hint="H")


#: what a crafted file hands ``_rebuild_from_type_v2`` instead of a tensor reconstructor and a
#: tensor type: a listed class, a value the file made, a non-tensor type, an undeclared field
CRAFTED_REBUILDS = {
    "a listed class": (collections.Counter, torch.Tensor, ({"a": 1},), {}),
    "a made value": (Call(_codecs.encode, "x", "latin1"), torch.Tensor, (), {}),
    "another type": (torch._utils._rebuild_tensor_v2, collections.OrderedDict, (), {}),
    "a slot": (torch._utils._rebuild_tensor_v2, torch.Tensor, (), ({}, {"__class__": 1})),
}


@pytest.mark.parametrize("crafted", CRAFTED_REBUILDS)
def test_a_crafted_rebuild_is_refused_before_it_runs(crafted, tmp_path):
    func, new_type, args, state = CRAFTED_REBUILDS[crafted]
    gadget = Call(torch._tensor._rebuild_from_type_v2, func, new_type, args, state)
    torch.save({"w": torch.ones(2), "x": gadget}, tmp_path / "f.pt")
    allowlist = conversion_allowlist().extended({}, tensor_attributes=("ds_id",))
    with pytest.raises(PickleRefused, match="nothing in the file was run") as refusal:
        restricted_torch_load(tmp_path / "f.pt", allowlist, hint="H")
    assert refusal.value.refused == (REBUILD_FROM_TYPE,)


# ---- another library's classes ----------------------------------------------------------------
@dataclasses.dataclass
class Foreign:
    """Stands for a class of another library that a checkpoint holds."""

    numel: int
    start: int

    def __setstate__(self, state: dict) -> None:
        raise AssertionError("a StandIn load runs none of the class's code")


def test_a_stand_in_holds_the_fields_and_runs_nothing(tmp_path):
    torch.save({"where": [Foreign(3, 5)]}, tmp_path / "f.pt")
    name = f"{Foreign.__module__}.Foreign"
    assert name in pickle_globals(tmp_path / "f.pt")
    allowlist = conversion_allowlist().extended({name: StandIn})
    where = restricted_torch_load(tmp_path / "f.pt", allowlist, hint="H")["where"][0]
    assert type(where) is StandIn and (where.numel, where.start) == (3, 5)
    with pytest.raises(PickleRefused, match=f"it names {name},"):
        restricted_torch_load(tmp_path / "f.pt", conversion_allowlist(), hint="H")


# ---- the legacy format --------------------------------------------------------------------------
@pytest.mark.parametrize("gadget", gadgets("marker"))
def test_a_legacy_file_with_a_gadget_is_refused(gadget, tmp_path):
    marker = tmp_path / "ran"
    payload, refused = gadgets(marker)[gadget]
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2), "x": payload}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(PickleRefused, match=f"it names {refused},"):
        restricted_torch_load(path, conversion_allowlist(), hint="H", mmap=True)
    assert not marker.exists()


def test_a_clean_legacy_file_loads_when_mmap_is_asked(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": _tensor_with(ds_id="1")}, path, _use_new_zipfile_serialization=False)
    allowlist = conversion_allowlist().extended({}, tensor_attributes=("ds_id",))
    loaded = restricted_torch_load(path, allowlist, hint="H", mmap=True)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["w"].ds_id == "1"
