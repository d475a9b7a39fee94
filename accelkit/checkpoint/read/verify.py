"""Checking every fragment's checksum before a load writes anything, the work split over the ranks.

Each rank checks the fragments that start in its ``1/world`` slice of the bytes
(:func:`share_spans`); small fragments lying back to back are read and checked in runs. The
load's agreement (:mod:`accelkit.checkpoint.write.agreement`) then tells every rank whether any
rank found a bad one, before any rank writes a live tensor.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from accelkit.errors import CheckpointError

# ---- checksums, split over the ranks ------------------------------------------------------------
#: fragments up to this size are checked in runs: back to back in their file, read at once
RUN_BYTES = 4 << 20


#: where a fragment lies and which it is: ``(file, byte offset, nbytes, entry, index)``
Span = tuple[str, int, int, Any, int]


def share_spans(reader: Any, rank: int, world: int) -> list[Span]:
    """This rank's share of all fragments, in file order: a fragment belongs to the rank whose
    ``1/world`` slice of the bytes it starts in. Every rank computes every share alike, so each
    fragment is checked by exactly one rank (an object-storage load downloads its share first
    and hashes it while it arrives, :mod:`accelkit.checkpoint.read.ranged_copy`)."""
    spans = []
    for entry in reader.manifest.tensors:
        for i in range(len(entry.fragments)):
            spans.append((*reader.fragment_span(entry, i), entry, i))
    spans.sort(key=lambda s: (s[0], s[1]))
    total = sum(s[2] for s in spans) or 1
    mine, seen = [], 0
    for span in spans:
        if min(world - 1, seen * world // total) == rank:
            mine.append(span)
        seen += span[2]
    return mine


def check_batches(spans: list[Span]) -> list[list[Span]]:
    """``spans`` grouped for checking: a large fragment alone (streamed in chunks), small ones
    lying back to back in one file in runs of up to :data:`RUN_BYTES` (one read each)."""
    batches: list[list[Span]] = []
    run: list[Span] | None = None
    run_file, run_end, run_bytes = None, -1, 0
    for span in spans:
        name, offset, nbytes = span[:3]
        if nbytes > RUN_BYTES:
            batches.append([span])
            continue
        if not (run and name == run_file and offset == run_end and run_bytes + nbytes <= RUN_BYTES):
            run, run_bytes = [], 0
            batches.append(run)
        run.append(span)
        run_file, run_end, run_bytes = name, offset + nbytes, run_bytes + nbytes
    return batches


def check_batch(reader: Any, batch: list[Span]) -> None:
    """Check the checksums of one of :func:`check_batches`' groups; raise on the first that
    failed."""
    if len(batch) == 1 and batch[0][2] > RUN_BYTES:
        reader.verify_fragment(batch[0][3], batch[0][4])
    else:
        reader.verify_run(batch)


def verify_share(reader: Any, rank: int, world: int, workers: int = 8) -> None:
    """Check the checksums of this rank's share of all fragments (:func:`share_spans`),
    several at once; raise naming the first that failed and how many did. Small fragments lying
    back to back are checked in runs of one read each. Fragments the reader's ``prechecked``
    reports (hashed while they downloaded) are not read again; those that failed there raise
    here, in file order, with the rest."""
    mine = share_spans(reader, rank, world)
    problems: list[CheckpointError] = []
    prechecked = getattr(reader, "prechecked", None)
    if prechecked is not None:
        checked, failed = prechecked()
        problems.extend(failed)
        mine = [s for s in mine if (s[0], s[3].fragments[s[4]].key) not in checked]
    batches = check_batches(mine)
    if batches:
        workers = min(workers, os.cpu_count() or 2, len(batches))
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            # the large fragments first: they take longest
            order = sorted(batches, key=lambda b: len(b) > 1 or b[0][2] <= RUN_BYTES)
            for future in [pool.submit(check_batch, reader, b) for b in order]:
                try:
                    future.result()
                except CheckpointError as err:
                    problems.append(err)
    if problems:
        more = f" ({len(problems) - 1} more fragments failed too)" if len(problems) > 1 else ""
        raise CheckpointError(f"{problems[0]}{more}; nothing was loaded")
