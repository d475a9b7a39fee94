"""What a killed transfer leaves in a staging folder, for the tests of its sweep."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def leftovers(root: Path, prefix: str, file_name: str) -> Iterator[list[str]]:
    """Three folders of ``prefix`` in ``root``: one a killed process left (old, unlocked), one in
    use (old, locked while the context runs) and one just made. Yields the names the next
    transfer must leave in place: the locked and the new one."""
    folders = {name: root / f"{prefix}{name}" for name in ("dead", "busy", "new")}
    for name, folder in folders.items():
        (folder / "step-1").mkdir(parents=True)
        (folder / "step-1" / file_name).write_bytes(b"left over")
        if name != "new":
            os.utime(folder, (0, 0))
    busy = os.open(folders["busy"], os.O_RDONLY)
    try:
        fcntl.flock(busy, fcntl.LOCK_SH)
        yield sorted(folders[name].name for name in ("busy", "new"))
    finally:
        os.close(busy)
