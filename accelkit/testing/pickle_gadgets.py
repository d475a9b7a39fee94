"""Pickles that run code when a plain unpickler reads them: inputs for testing that an importer
refuses them (``trust_pickle=True`` must never mean "run anything"). Stdlib only.

Each gadget, if it ever runs, creates ``marker``; a test gives the file to the importer, expects
the refusal to name the gadget's global, and checks that ``marker`` does not exist::

    from accelkit.testing.pickle_gadgets import gadgets

    for name, (payload, refused) in gadgets(tmp_path / "ran").items():
        torch.save({"weights": {...}, "meta": payload}, path)
        ...  # the importer raises naming `refused`; tmp_path / "ran" was not created
"""

from __future__ import annotations

import builtins
import os
import pickle
import types
from pathlib import Path
from typing import Any


class Call:
    """Pickles as ``fn(*args)``: the call a crafted file asks the unpickler to make."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args

    def __call__(self, *args: Any) -> Any:  # pickle saves only a callable as a call's function
        raise AssertionError("a Call stands for a call in a file; it is never called here")


def _write_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('ran')"


def gadgets(marker: str | os.PathLike) -> dict[str, tuple[Any, str]]:
    """name -> (a payload to put anywhere in a pickled object, the global a refusal names)."""
    marker = Path(marker)
    system = f"{os.system.__module__}.system"  # posix.system (nt.system on Windows)
    return {
        "os.system": (Call(os.system, f"touch {marker}"), system),
        "builtins.exec": (Call(builtins.exec, _write_code(marker)), "builtins.exec"),
        "nested in a dict": (
            {"config": {"hooks": [(1, {"run": Call(os.system, f"touch {marker}")})]}},
            system,
        ),
    }


def persistent_id_module(marker: str | os.PathLike) -> types.ModuleType:
    """A ``pickle_module`` for ``torch.save`` whose pickles put an ``os.system`` call inside each
    tensor storage's persistent id, the record torch's own loader takes apart (the refusal names
    the same global as the ``"os.system"`` gadget)."""
    gadget = Call(os.system, f"touch {Path(marker)}")

    class Pickler(pickle._Pickler):  # the Python pickler: its persistent ids pass save_pers
        def save_pers(self, pid: Any) -> None:
            super().save_pers((*pid, gadget) if isinstance(pid, tuple) else pid)

    module = types.ModuleType("pickle_with_gadget_ids")
    module.Pickler = Pickler  # type: ignore[attr-defined]
    module.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]
    module.dump = pickle.dump  # type: ignore[attr-defined]
    module.load = pickle.load  # type: ignore[attr-defined]
    return module
