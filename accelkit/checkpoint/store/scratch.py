"""Local scratch folders of object-storage transfers: a load's partial copy, an asynchronous
save's rank file before its upload, the tools' downloads.

Each folder is locked while in use and removed after; the folders of the same kind that killed
processes left (their lock died with them) are swept by the next transfer of that kind.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOAD_PREFIX = "accelkit-s3-load-"
SAVE_PREFIX = "accelkit-s3-save-"
OUT_PREFIX = "accelkit-s3-out-"

#: where rank files are staged before their upload and after their download (default: TMPDIR)
STAGING_ENV = "ACCELKIT_S3_STAGING"

#: a folder younger than this is never taken for abandoned (it may not be locked yet)
_ABANDONED_AFTER_S = 60


@contextmanager
def staging(prefix: str, root: str | os.PathLike | None = None) -> Iterator[Path]:
    """A new local folder for a transfer (in ``root``, else :data:`STAGING_ENV`, else the temp
    dir), locked while it is in use and removed after. Folders of the same kind that killed
    processes left there (their lock died with them) are removed first."""
    base = Path(root or os.environ.get(STAGING_ENV) or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(f"{prefix}*"):
        _remove_if_abandoned(stale)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    lock = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)
        except OSError:  # a filesystem without locks: nothing will take the folder for abandoned
            pass
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)


def _remove_if_abandoned(folder: Path) -> None:
    """Remove a transfer's folder whose process is gone: no lock on it, and not just made."""
    try:
        if time.time() - folder.stat().st_mtime < _ABANDONED_AFTER_S:
            return
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # in use
    else:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)
