"""Every rank reads the same checkpoint: what a path means must not differ between nodes.

A directory on each node's own disk (``/scratch``, ``/tmp``, a container's overlay) holds a
different checkpoint under the same name on every node, or none. ``auto_resume`` picks a path on
rank 0 and every rank opens it in its own view of the filesystem: without a check, DDP then
trains replicas that started from different weights, with no error until the next save fails.

- :func:`check_same_checkpoint`: at load, one all-gather of the manifest's digest (its SHA-256,
  which covers every fragment's checksum); ranks that read another checkpoint are refused.
- :func:`check_same_files`: the same for a library's own checkpoint (no manifest): the names,
  sizes and modification times of its files, all-gathered.
- :func:`check_shared_directory`: before training starts, ``auto_resume`` checks that every rank
  sees a marker rank 0 writes in its directory, so a node-private directory fails at once,
  not at the first save hours later, and a node that joins an elastic job and cannot read the
  checkpoint is told why.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from accelkit import distributed
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

#: a rank's entry in the digest all-gather (a rank that failed to open sends its error text
#: instead, through :func:`accelkit.checkpoint.commit.agree`, which pairs with this gather)
_TAG = "accelkit-manifest"
#: how long a rank looks for rank 0's marker (an NFS client may see a new name late)
_MARKER_WAIT_S = 2.0

_FIX = (
    "Every rank must read checkpoints from storage all nodes share (NFS, Lustre, a parallel "
    "filesystem, or object storage: s3://bucket/prefix), not a directory on each node's own disk"
)


def manifest_digest(manifest: Any) -> str | None:
    """The manifest's stored SHA-256 (None for a manifest built in memory: pretrained files)."""
    digest = manifest.data.get("checksum")
    return digest if isinstance(digest, str) else None


def check_same_checkpoint(
    manifest: Any, where: Any, versions: dict[str, str] | None = None
) -> None:
    """Refuse, on every rank alike, a load where the ranks read different checkpoints at
    ``where`` (node-local disks), or, in object storage, other versions of its files (an
    object replaced between two ranks' listings: each rank verified its share of another).
    One all-gather of a short string; collective."""
    digest = manifest_digest(manifest)
    if digest is None or not distributed._multi():
        return
    import hashlib

    listed = hashlib.sha256(repr(sorted((versions or {}).items())).encode()).hexdigest()
    seen = distributed.all_gather_object((_TAG, digest, listed))
    reference = seen[0]
    for rank, entry in enumerate(seen):
        if entry == reference:
            continue
        if isinstance(entry, tuple) and entry[:2] == reference[:2]:
            problem = (
                f"rank {rank} read other versions of its rank files than rank 0: an object "
                "was replaced during the load; nothing was loaded. Load again"
            )
            distributed.raise_agreed(CheckpointError(f"loading {where}: {problem}."))
        if isinstance(entry, tuple) and entry[:1] == (_TAG,):
            problem = (
                f"rank {rank} reads a different checkpoint at this path than rank 0 (manifest "
                f"digest {str(entry[1])[:12]}, rank 0's {str(reference[1])[:12]}): node-local disks?"
            )
        else:  # that rank could not open it and reports its error through agree()
            problem = (
                f"rank {rank} cannot read the checkpoint rank 0 reads at this path ({entry}): "
                "node-local disks?"
            )
        distributed.raise_agreed(CheckpointError(f"loading {where}: {problem} {_FIX}."))


def check_same_files(folder: str | os.PathLike, where: Any) -> None:
    """Refuse, on every rank alike, a load of a library's own checkpoint (``format="native"``:
    no manifest, no digest) where the ranks see different files in ``folder``: the names,
    sizes and modification times of every file under it, which a shared filesystem shows alike
    to every rank and node-local disks do not (a stale checkpoint of the same name on one node).
    One all-gather of a short string; collective."""
    if not distributed._multi():
        return
    import hashlib

    root = Path(folder)
    listing = []
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            if path.is_file():
                stat = path.stat()
                listing.append((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    digest = hashlib.sha256(repr(listing).encode()).hexdigest()
    seen = distributed.all_gather_object((_TAG, digest, len(listing)))
    differ = [rank for rank, entry in enumerate(seen) if entry != seen[0]]
    if differ:
        problem = (
            f"rank(s) {differ} see other files in {root} than rank 0 (rank 0: {seen[0][2]} "
            f"files; rank {differ[0]}: {seen[differ[0]][2]}, or the same names with other sizes "
            "or times): node-local disks? Nothing was loaded"
        )
        distributed.raise_agreed(CheckpointError(f"loading {where}: {problem}. {_FIX}."))


def peers_opened(messages: list[Any]) -> list[int]:
    """The ranks whose entry in an agreement is a digest: they opened the checkpoint."""
    return [r for r, m in enumerate(messages) if isinstance(m, tuple) and m[:1] == (_TAG,)]


def cannot_read(error: BaseException, opened: list[int], what: str) -> CheckpointError:
    """This rank's error when others opened the checkpoint it could not (node-local disks)."""
    return CheckpointError(
        f"{what}: this rank cannot read the checkpoint that rank(s) {opened} read at this path "
        f"({type(error).__name__}: {error}): node-local disks? {_FIX}."
    )


def check_shared_directory(directory: str | os.PathLike, what: str = "auto_resume") -> None:
    """Check, before the first step, that every rank sees ``directory`` as rank 0 does: rank 0
    writes a marker with a fresh token there and every rank reads it back. Object storage
    (``s3://``) is shared by nature; one process has nothing to check. Collective."""
    from accelkit.checkpoint.store import store_for

    if not distributed._multi() or store_for(directory).local_directory(str(directory)) is None:
        return  # object storage: every rank reaches the same objects
    import torch.distributed as dist

    rank = dist.get_rank()
    folder = Path(directory)  # as each rank names it: a relative path is each rank's own
    name, token, error = f".accelkit-shared-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex, None
    if rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(token)
        except OSError as err:
            error = f"rank 0 cannot write in {folder.absolute()}: {err}"
    name, token, error = distributed.broadcast_object((name, token, error))
    if error is not None:
        distributed.raise_agreed(CheckpointError(f"{what}: {error}"))
    sees = rank == 0 or _sees(folder / name, token)
    views = distributed.all_gather_object((sees, str(folder.absolute())))
    if rank == 0:
        (folder / name).unlink(missing_ok=True)
    blind = [r for r, (ok, _) in enumerate(views) if not ok]
    if not blind:
        return
    paths = sorted({p for _, p in views})
    also = "" if len(paths) == 1 else f" (the ranks resolve it to {', '.join(paths[:3])})"
    distributed.raise_agreed(
        CheckpointError(
            f"{what}: rank(s) {blind} cannot see the marker rank 0 wrote in "
            f"{folder.absolute()}{also}, so they would not read the checkpoints rank 0 picks "
            f"there: node-local disks? {_FIX}. Nothing was loaded and nothing trained."
        )
    )


def _sees(marker: Path, token: str) -> bool:
    deadline = time.monotonic() + _MARKER_WAIT_S
    while True:
        try:
            if marker.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
