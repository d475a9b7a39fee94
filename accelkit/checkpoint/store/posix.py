"""Directory operations that make a save atomic: temporary sibling, fsync, rename, ``latest``.

A checkpoint directory is either complete or absent: it appears under its name only by a
rename of a fully written and fsynced temporary sibling. The ``latest`` pointer is a small file
in the parent replaced atomically after that. Old checkpoints are deleted by first renaming
them away, so a half-deleted checkpoint never carries a checkpoint's name.

Checkpoints are ordered by the step their manifest records, never by a clock: a save made while
the clock was a day ahead must not outlive newer ones. Whatever a checkpoint points at (the
``latest`` pointer, rank files) must lie inside the checkpoint's own directory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import re
import shutil
import threading
import uuid
from pathlib import Path

from accelkit.checkpoint.format.manifest import MANIFEST_NAME
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

LATEST_NAME = "latest"
MARKER_NAME = ".accelkit-shared-check"
TMP_SUFFIX = ".accelkit-tmp"
TRASH_SUFFIX = ".accelkit-trash"


#: temporaries of saves this process has started and not finished, by the thread doing each
_in_progress: dict[Path, int] = {}
_in_progress_lock = threading.Lock()


def temp_dir(path: Path) -> Path:
    return path.parent / f".{path.name}{TMP_SUFFIX}"


def _claim(temporary: Path) -> None:
    """Mark ``temporary`` as in use by this thread, so a sweep in this process leaves it alone.

    A thread runs one save at a time, so its older claims belong to saves that ended (a failed
    save never reaches :func:`commit`) and are dropped here."""
    thread = threading.get_ident()
    with _in_progress_lock:
        for stale in [p for p, owner in _in_progress.items() if owner == thread]:
            del _in_progress[stale]
        _in_progress[temporary.absolute()] = thread


def _release(temporary: Path) -> None:
    with _in_progress_lock:
        _in_progress.pop(temporary.absolute(), None)


def _claimed(temporary: Path) -> bool:
    with _in_progress_lock:
        return temporary.absolute() in _in_progress


def sweep(path: Path) -> list[Path]:
    """Remove what killed saves left next to ``path``; return what was removed.

    That is ``.latest.accelkit-tmp-*`` files (a ``latest`` update cut short), the temporary
    directories ``.<name>.accelkit-tmp`` of ``path``'s series, and ``.accelkit-trash`` directories.
    Temporaries of saves still running in this process (another thread) are left alone."""
    parent = path.parent
    if not parent.is_dir():
        return []
    pattern = rotation_pattern(path.name)
    removed = []
    for stale in parent.glob(f".*{TRASH_SUFFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    for stale in parent.glob(f".{LATEST_NAME}{TMP_SUFFIX}-*"):
        if stale.is_file() and not _claimed(stale):
            stale.unlink(missing_ok=True)
            removed.append(stale)
    for stale in parent.glob(f".*{TMP_SUFFIX}"):
        name = stale.name[1 : -len(TMP_SUFFIX)]
        if rotation_pattern(name) == pattern and stale.is_dir() and not _claimed(stale):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    for stale in removed:
        log.info("removed %s, left by a save that was killed", stale)
    return removed


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
    tmp = temp_dir(path)
    _claim(tmp)
    sweep(path)
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
    try:
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
    finally:
        _release(tmp)


def write_latest(path: Path) -> None:
    """Point ``<parent>/latest`` at ``path`` (atomic replace of a one-line file)."""
    parent = path.parent
    tmp = parent / f".{LATEST_NAME}{TMP_SUFFIX}-{uuid.uuid4().hex[:8]}"
    with _in_progress_lock:  # not _claim: this thread's save is still in progress
        _in_progress[tmp.absolute()] = threading.get_ident()
    try:
        with open(tmp, "w") as f:
            f.write(path.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, parent / LATEST_NAME)
        fsync_dir(parent)
    finally:
        _release(tmp)


def _outside(root: str | os.PathLike, path: str | os.PathLike) -> tuple[Path, Path] | None:
    """(``path`` joined to ``root``, where it really leads) if that is outside ``root``; else
    None."""
    candidate = Path(root) / path
    resolved = candidate.resolve()
    root_resolved = Path(root).resolve()
    if resolved == root_resolved or resolved.is_relative_to(root_resolved):
        return None
    return candidate, resolved


def inside(root: str | os.PathLike, path: str | os.PathLike) -> Path:
    """``path`` (absolute, or relative to ``root``) with links resolved, if it lies in ``root``.

    Raises CheckpointError when it leads outside (``..``, an absolute path elsewhere, a symlink
    to another place): a checkpoint is read only from its own directory. Call it before opening
    any file a checkpoint names."""
    escape = _outside(root, path)
    if escape is not None:
        candidate, resolved = escape
        raise CheckpointError(
            f"{candidate} leads outside the checkpoint directory {Path(root).resolve()} (to "
            f"{resolved}); accelkit reads a checkpoint only from inside its own directory. Put "
            "the file itself there in place of the link or path."
        )
    return (Path(root) / path).resolve()


def _pointer_target(directory: Path, pointer: Path) -> Path:
    """The directory ``latest`` names, refused unless it is one name inside ``directory``."""
    named = pointer.read_text().strip()
    what_to_do = (
        f"Write the name of a checkpoint directory of {directory} into it (such as "
        f"'step-1200'), or delete it to use the checkpoint with the highest step."
    )
    if not named or named in (".", "..") or Path(named).name != named:
        raise CheckpointError(
            f"{pointer} holds {named!r}, which is not the name of a checkpoint directory next to "
            f"it: '{LATEST_NAME}' holds one name, with no '/', '..' or absolute path. {what_to_do}"
        )
    for link in (pointer, directory / named):
        escape = _outside(directory, link)
        if escape is not None:
            raise CheckpointError(
                f"{pointer} is refused: {link} is a link that leads outside {directory} (to "
                f"{escape[1]}); accelkit follows '{LATEST_NAME}' only inside its directory. "
                f"{what_to_do}"
            )
    return directory / named


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: itself, or where its ``latest`` points (a
    checkpoint directory inside ``path``; a pointer that leads elsewhere is refused)."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    pointer = path / LATEST_NAME
    if pointer.is_file():
        target = _pointer_target(path, pointer)
        if is_checkpoint(target):
            return target
        raise CheckpointError(
            f"{pointer} points at {target.name}, which is not a checkpoint. Write the name of a "
            f"checkpoint directory of {path} into it, or delete it."
        )
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    raise CheckpointError(
        f"{path}: neither a checkpoint (no {MANIFEST_NAME}) nor a directory with a "
        f"'{LATEST_NAME}' pointer"
    )


def rotation_pattern(name: str) -> str:
    """``step-1200`` and ``step-900`` share the pattern ``step-#``: they rotate together."""
    return re.sub(r"\d+", "#", name)


def recorded_step(path: Path) -> int | None:
    """The training step ``path``'s manifest records (``step``, else ``applied_steps``)."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    for field in ("step", "applied_steps"):
        value = manifest.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def natural_key(name: str) -> tuple:
    """``step-9`` before ``step-10``: digit runs compare as numbers."""
    parts = re.split(r"(\d+)", name)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def checkpoint_order(path: Path) -> tuple:
    """Sort key, oldest first: the recorded step, then the name in natural order; never a
    clock. Checkpoints without a recorded step come before any with one, by name."""
    step = recorded_step(path)
    return (step is not None, step if step is not None else 0, natural_key(path.name))


def rotate(path: Path, keep_last: int) -> list[Path]:
    """Delete the siblings of ``path`` of the same name pattern beyond the ``keep_last`` with the
    highest steps (:func:`checkpoint_order`); ``path`` itself is always kept."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    pattern = rotation_pattern(path.name)
    siblings = [
        p
        for p in path.parent.iterdir()
        if not p.name.startswith(".")
        and p.is_dir()
        and not p.is_symlink()  # never delete through a link: it is not this series' directory
        and rotation_pattern(p.name) == pattern
        and is_checkpoint(p)
    ]
    siblings.sort(key=checkpoint_order, reverse=True)
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
    return deleted
