"""Directory operations that make a save atomic: temporary sibling, fsync, rename, ``latest``.

A checkpoint directory is either complete or absent: it appears under its name only by a
rename of a fully written and fsynced temporary sibling. The ``latest`` pointer is a small file
in the parent replaced atomically after that. Old checkpoints are deleted by first renaming
them away, so a half-deleted checkpoint never carries a checkpoint's name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from accelkit.checkpoint.manifest import MANIFEST_NAME
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

LATEST_NAME = "latest"
MARKER_NAME = ".accelkit-shared-check"
TMP_SUFFIX = ".accelkit-tmp"
TRASH_SUFFIX = ".accelkit-trash"


def temp_dir(path: Path) -> Path:
    return path.parent / f".{path.name}{TMP_SUFFIX}"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


def prepare(path: Path) -> str:
    """Create the empty temporary sibling of ``path`` with a marker; return the marker's token."""
    occupied = path.exists() and (not path.is_dir() or any(path.iterdir()))
    if occupied and not is_checkpoint(path):
        raise CheckpointError(
            f"{path} exists and is not an accelkit checkpoint; refusing to replace it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".*{TRASH_SUFFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = temp_dir(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    token = uuid.uuid4().hex
    (tmp / MARKER_NAME).write_text(token)
    return token


def sees_marker(path: Path, token: str) -> bool:
    try:
        return (temp_dir(path) / MARKER_NAME).read_text() == token
    except OSError:
        return False


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


def commit(path: Path) -> None:
    """Move the finished temporary sibling to ``path`` (replacing an older checkpoint there)."""
    tmp = temp_dir(path)
    (tmp / MARKER_NAME).unlink(missing_ok=True)
    fsync_dir(tmp)
    if path.exists():
        if _rename_exchange(tmp, path):
            fsync_dir(path.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        trash = path.parent / f".{path.name}{TRASH_SUFFIX}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        os.rename(tmp, path)
        fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)
        return
    os.rename(tmp, path)
    fsync_dir(path.parent)


def write_latest(path: Path) -> None:
    """Point ``<parent>/latest`` at ``path`` (atomic replace of a one-line file)."""
    parent = path.parent
    tmp = parent / f".{LATEST_NAME}{TMP_SUFFIX}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(path.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, parent / LATEST_NAME)
    fsync_dir(parent)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: itself, or where its ``latest`` points."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    pointer = path / LATEST_NAME
    if pointer.is_file():
        target = path / pointer.read_text().strip()
        if is_checkpoint(target):
            return target
        raise CheckpointError(f"{pointer} points at {target.name}, which is not a checkpoint")
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    raise CheckpointError(
        f"{path}: neither a checkpoint (no {MANIFEST_NAME}) nor a directory with a "
        f"'{LATEST_NAME}' pointer"
    )


def rotation_pattern(name: str) -> str:
    """``step-1200`` and ``step-900`` share the pattern ``step-#``: they rotate together."""
    return re.sub(r"\d+", "#", name)


def _created(path: Path) -> int:
    try:
        return int(json.loads((path / MANIFEST_NAME).read_text()).get("created_unix_ns", 0))
    except (OSError, ValueError, AttributeError):
        return 0


def rotate(path: Path, keep_last: int) -> list[Path]:
    """Delete the oldest siblings of ``path`` of the same name pattern beyond ``keep_last``."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    pattern = rotation_pattern(path.name)
    siblings = [
        p
        for p in path.parent.iterdir()
        if not p.name.startswith(".")
        and p.is_dir()
        and rotation_pattern(p.name) == pattern
        and is_checkpoint(p)
    ]
    siblings.sort(key=lambda p: (_created(p), p.name), reverse=True)
    keep = {p.name for p in siblings[:keep_last]} | {path.name}
    deleted = []
    for old in siblings:
        if old.name in keep:
            continue
        trash = old.parent / f".{old.name}{TRASH_SUFFIX}-{uuid.uuid4().hex[:8]}"
        os.rename(old, trash)
        fsync_dir(old.parent)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(old)
        log.info("removed old checkpoint %s (keep_last=%d)", old, keep_last)
    for stale in path.parent.glob(f".*{TMP_SUFFIX}"):
        if rotation_pattern(stale.name[1 : -len(TMP_SUFFIX)]) == pattern and stale != temp_dir(
            path
        ):
            shutil.rmtree(stale, ignore_errors=True)  # left by a save that was killed
    return deleted
