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
import fcntl
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accelkit.checkpoint.format.manifest import EXTRA_NAME, MANIFEST_NAME
from accelkit.checkpoint.store.names import (
    LATEST_NAME,
    manifest_step,
    natural_key,
    rotation_pattern,
)
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

MARKER_NAME = ".accelkit-shared-check"
#: in a save's temporary sibling: which checkpoint it may replace (see :func:`_identity`)
REPLACES_NAME = ".accelkit-replaces"
TMP_SUFFIX = ".accelkit-tmp"
TRASH_SUFFIX = ".accelkit-trash"


#: temporaries of saves this process has started and not finished, by the thread doing each
_in_progress: dict[Path, int] = {}
_in_progress_lock = threading.Lock()


def temp_dir(path: Path, save_id: str = "") -> Path:
    """Where the save ``save_id`` of ``path`` is written before its rename: a sibling of its
    own, so two saves of one name never write into one directory."""
    middle = f".{save_id}" if save_id else ""
    return path.parent / f".{path.name}{middle}{TMP_SUFFIX}"


def _saved_name(temporary_name: str) -> str:
    """The checkpoint name of a temporary sibling's name (``.step-2.<save>.accelkit-tmp``)."""
    name = temporary_name[1 : -len(TMP_SUFFIX)]
    return re.sub(r"\.[0-9a-f]{12}$", "", name)


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


@contextmanager
def _series_lock(parent: Path) -> Iterator[None]:
    """Hold the parent folder's lock: a commit's check of what it replaces and its rename, and
    another job's sweep of the temporary siblings, then never interleave (two jobs saving one
    name were both told they committed when one's check and rename straddled the other's).
    An advisory flock on the folder itself, so nothing is left beside the checkpoints; where
    the filesystem has no flock the commit goes on unlocked, as before."""
    try:
        fd = os.open(parent, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def sweep(path: Path) -> list[Path]:
    """Remove what killed saves left next to ``path``; return what was removed.

    That is ``.latest.accelkit-tmp-*`` files (a ``latest`` update cut short), the temporary
    directories ``.<name>.accelkit-tmp`` of ``path``'s series, and ``.accelkit-trash`` directories.
    Temporaries of saves still running in this process (another thread) are left alone."""
    parent = path.parent
    if not parent.is_dir():
        return []
    with _series_lock(parent):
        removed = _sweep_locked(parent, rotation_pattern(path.name))
    for stale in removed:
        log.info("removed %s, left by a save that was killed", stale)
    return removed


def _sweep_locked(parent: Path, pattern: Any) -> list[Path]:
    removed = []
    for stale in parent.glob(f".*{TRASH_SUFFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    for stale in parent.glob(f".{LATEST_NAME}{TMP_SUFFIX}-*"):
        if stale.is_file() and not _claimed(stale):
            stale.unlink(missing_ok=True)
            removed.append(stale)
    for stale in parent.glob(f".*{TMP_SUFFIX}"):
        name = _saved_name(stale.name)
        if rotation_pattern(name) == pattern and stale.is_dir() and not _claimed(stale):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
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


def prepare(path: Path, save_id: str = "") -> str:
    """Create the empty temporary sibling of ``path`` with a marker; return the marker's token."""
    occupied = path.exists() and (not path.is_dir() or any(path.iterdir()))
    if occupied and not is_checkpoint(path):
        raise CheckpointError(
            f"{path} exists and is not an accelkit checkpoint; refusing to replace it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(path, save_id)
    _claim(tmp)
    sweep(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    token = save_id or uuid.uuid4().hex
    try:
        (tmp / MARKER_NAME).write_text(token)
        (tmp / REPLACES_NAME).write_text(_identity(path))
    except FileNotFoundError as err:  # swept by another job's save of this name, just now
        raise CheckpointError(
            f"saving {path}: another job writes here (its save of the same name removed "
            f"{tmp} as it was made); nothing was committed. Give each job its own location."
        ) from err
    return token


def _identity(path: Path) -> str:
    """Which committed checkpoint ``path`` holds now (its manifest's inode, time and size), or
    ``none``: a save replaces only the one it saw when it began."""
    try:
        st = (path / MANIFEST_NAME).stat()
    except OSError:
        return "none"
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def sees_marker(path: Path, token: str, save_id: str = "") -> bool:
    try:
        return (temp_dir(path, save_id) / MARKER_NAME).read_text() == token
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


def commit(
    path: Path, save_id: str = "", *, manifest: bytes | None = None, extras: bytes | None = None
) -> None:
    """Write the manifest (and extras) into the finished temporary sibling and move it to
    ``path`` (replacing an older checkpoint there), under the series lock."""
    with _series_lock(path.parent):
        try:
            _commit_locked(path, save_id, manifest, extras)
        except FileNotFoundError as err:
            _release(temp_dir(path, save_id))
            raise CheckpointError(
                f"saving {path}: another job writes here (its save of the same name removed "
                f"this one's files as it committed); nothing was committed. Give each job its "
                "own location."
            ) from err


def _commit_locked(path: Path, save_id: str, manifest: bytes | None, extras: bytes | None) -> None:
    tmp = temp_dir(path, save_id)
    if not (tmp / MARKER_NAME).is_file():
        _release(tmp)
        raise CheckpointError(
            f"saving {path}: its temporary directory {tmp} is gone: another job writes here "
            "(its save of the same name removed this one's); nothing was committed. Give each "
            "job its own location."
        )
    try:
        seen = (tmp / REPLACES_NAME).read_text()
    except OSError:
        seen = _identity(path)
    if seen != _identity(path):
        _release(tmp)
        raise CheckpointError(
            f"saving {path}: another job writes here: it committed {path} while this save was "
            "writing; this save was not committed. Give each job its own location."
        )
    if extras is not None:
        (tmp / EXTRA_NAME).write_bytes(extras)
        fsync_file(tmp / EXTRA_NAME)
    if manifest is not None:
        (tmp / MANIFEST_NAME).write_bytes(manifest)
        fsync_file(tmp / MANIFEST_NAME)
    (tmp / REPLACES_NAME).unlink(missing_ok=True)
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
    checkpoint directory inside ``path``; a pointer that leads elsewhere is refused), or past it
    to a committed sibling with a higher step (:func:`_followed_past`). Every reader of a path
    resolves through here, so a load and a :class:`CheckpointReader` never pick different
    checkpoints of one folder."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    pointer = path / LATEST_NAME
    if pointer.is_file():
        target = _pointer_target(path, pointer)
        if is_checkpoint(target):
            return _followed_past(target)
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


def recorded_step(path: Path) -> int | None:
    """The training step ``path``'s manifest records (``step``, else ``applied_steps``)."""
    try:
        return manifest_step((path / MANIFEST_NAME).read_bytes())
    except OSError:
        return None


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


def _followed_past(target: Path) -> Path:
    """``target`` (what ``latest`` names), or a committed sibling of its name pattern with a
    higher recorded step: a save that committed and was killed before it moved ``latest``."""
    pattern, step = rotation_pattern(target.name), recorded_step(target)
    best, best_step = target, step
    for sibling in target.parent.iterdir():
        if (
            sibling.name.startswith(".")
            or sibling.name == target.name
            or rotation_pattern(sibling.name) != pattern
            or sibling.is_symlink()
            or not is_checkpoint(sibling)
        ):
            continue
        found = recorded_step(sibling)
        if found is not None and (best_step is None or found > best_step):
            best, best_step = sibling, found
    if best != target:
        log.warning(
            "%s names %s, but %s is committed with a higher step (a save that died before it "
            "moved '%s'): using %s",
            target.parent / LATEST_NAME,
            target.name,
            best.name,
            LATEST_NAME,
            best,
        )
    return best


class _LocalFile:
    """A rank file on a local disk, for ranged reads (:meth:`PosixStore.open_ranged`)."""

    def __init__(self, path: Path) -> None:
        self.path, self.name, self.size = path, path.name, path.stat().st_size

    def read_into(self, view: memoryview, offset: int) -> None:
        with open(self.path, "rb") as f:
            f.seek(offset)
            if f.readinto(view) != view.nbytes:
                raise CheckpointError(f"{self.path}: shorter than expected")


class _Target:
    def __init__(self, path: Path) -> None:
        self.sink, self.path = None, path


class PosixStore:
    """Checkpoints in a directory of a local or shared filesystem: the save writes into a
    temporary sibling of its own and commits by an atomic rename (the module's docstring)."""

    scheme = ""

    def child(self, where: str, name: str) -> str:
        return str(Path(where) / name)

    def display(self, where: str) -> str:
        return str(where)

    # ---- finding --------------------------------------------------------------------------------
    def resolve(self, where: str) -> str:
        return str(resolve(where))

    def newest(self, where: str) -> str | None:
        directory = Path(where)
        if not directory.exists():
            return None
        if is_checkpoint(directory):
            return str(directory)
        if (directory / LATEST_NAME).is_file():
            try:
                return self.resolve(where)
            except CheckpointError as err:
                log.warning("%s; looking for the newest complete checkpoint instead", err)
        candidates = []
        for entry in directory.iterdir():
            if entry.name.startswith(".") or not entry.is_dir() or not is_checkpoint(entry):
                continue
            try:
                inside(directory, entry.name)
            except CheckpointError as err:
                log.warning("%s; not a candidate to resume from", err)
                continue
            candidates.append(entry)
        return str(max(candidates, key=checkpoint_order)) if candidates else None

    def recorded_step(self, where: str) -> int | None:
        return recorded_step(Path(where))

    def read_manifest(self, where: str) -> bytes:
        return (Path(where) / MANIFEST_NAME).read_bytes()

    def is_checkpoint(self, where: str) -> bool:
        path = Path(where)
        return path.is_dir() and (is_checkpoint(path) or (path / LATEST_NAME).is_file())

    # ---- saving ---------------------------------------------------------------------------------
    def prepare(self, where: str, save_id: str) -> None:
        prepare(Path(where), save_id)

    def check_prepared(self, where: str, save_id: str) -> str | None:
        if sees_marker(Path(where), save_id, save_id):
            return None
        return (
            f"cannot see {temp_dir(Path(where), save_id)}, which rank 0 created. Every rank "
            "must write to the same directory on a filesystem they all share (NFS, Lustre, a "
            "single machine's disk)."
        )

    def rank_file_name(self, rank: int, save_id: str) -> str:
        return f"rank-{rank:05d}.safetensors"  # the temporary sibling is the save's own

    def extras_name(self, save_id: str) -> str:
        return EXTRA_NAME

    @contextmanager
    def open_rank_file(
        self, where: str, save_id: str, name: str, *, asynchronous: bool, profile: Any
    ) -> Iterator[_Target]:
        """The file in the save's own temporary sibling; where that is gone when the writing
        fails (another job's save of the name swept it), the error says so."""
        tmp = temp_dir(Path(where), save_id)
        try:
            yield _Target(tmp / name)
        except OSError as err:
            if (tmp / MARKER_NAME).is_file():
                raise
            raise CheckpointError(
                f"saving {where}: its temporary directory {tmp} was removed while this rank "
                "wrote its file: another job writes here (its save of the same name removed "
                "this one's); nothing was committed. Give each job its own location."
            ) from err

    def commit(
        self,
        where: str,
        save_id: str,
        manifest: bytes,
        files: dict[str, int],
        extras: bytes | None,
    ) -> None:
        path = Path(where)
        tmp = temp_dir(path, save_id)
        for name, size in files.items():
            try:
                found = (tmp / name).stat().st_size
            except OSError:
                found = None
            if found != size:
                raise CheckpointError(
                    f"{tmp / name}: expected {size} bytes, found {found}: another job writes "
                    f"here ({path}), or removed this save's files; nothing was committed."
                )
        commit(path, save_id, manifest=manifest, extras=extras)

    def point_latest(self, where: str) -> None:
        write_latest(Path(where))

    def rotate(self, where: str, keep_last: int) -> list[str]:
        return [str(p) for p in rotate(Path(where), keep_last)]

    def sweep(self, where: str) -> list[str]:
        return []  # a disk save sweeps before it writes (prepare): nothing is left to do

    # ---- loading --------------------------------------------------------------------------------
    def local_directory(self, where: str) -> Path | None:
        return Path(where)

    def open_ranged(self, where: str, name: str) -> _LocalFile:
        return _LocalFile(inside(where, name))

    def download(self, where: str, dest: Path) -> None:
        shutil.copytree(where, dest, dirs_exist_ok=True)

    def upload(self, local: Path, where: str) -> None:
        if Path(local).resolve() != Path(where).resolve():
            shutil.copytree(local, where, dirs_exist_ok=True)
