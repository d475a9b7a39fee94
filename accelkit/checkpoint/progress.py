"""Progress bars: of long conversions, and of ``accel.save``/``load``/``load_pretrained``.

A conversion shows its bar from :data:`PROGRESS_BYTES` up. A save or load shows one on rank 0
only, when it moves at least :data:`PROGRESS_BYTES` there and is still running after
:data:`PROGRESS_DELAY_S` (a short one stays silent); ``ACCELKIT_PROGRESS=1`` shows it whatever
the size, ``ACCELKIT_PROGRESS=0`` never. The bar counts rank 0's own bytes: the other ranks
move their parts at the same time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

#: conversions, saves and loads at least this large show a progress bar by default
PROGRESS_BYTES = 256 << 20
#: a save's or load's bar appears only once it has run this long
PROGRESS_DELAY_S = 1.0
#: "1" always shows the bar of saves and loads, "0" never
PROGRESS_ENV = "ACCELKIT_PROGRESS"


def progress_bar(total: int, enabled: bool | None, desc: str, delay: float = 0.0) -> Any:
    if enabled is False or (enabled is None and total < PROGRESS_BYTES):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, delay=delay)


def rank_zero_bar(total: int, rank: int, desc: str) -> Any:
    """The bar of a save or load on rank 0 (None elsewhere, or when it is not wanted)."""
    if rank != 0:
        return None
    setting = os.environ.get(PROGRESS_ENV)
    enabled = None if setting not in ("0", "1") else setting == "1"
    return progress_bar(total, enabled, desc, delay=0.0 if enabled else PROGRESS_DELAY_S)


def close(bar: Any) -> None:
    """Finish ``bar`` at 100% (its total was an estimate) and close it."""
    if bar is None:
        return
    if bar.total is not None and bar.n != bar.total:
        bar.total = bar.n
        bar.refresh()
    bar.close()


def read_estimate(backend: Any, reader: Any, tensor_state: dict[str, Any]) -> int:
    """The bytes this rank is likely to read into ``tensor_state``: all of its objects' tensors,
    or a 1/world share of them on a backend that shards."""
    from accelkit.checkpoint.format.safetensors_io import DTYPES_BY_NAME

    total = 0
    for name in tensor_state:
        for entry in reader.entries(name):
            dtype = DTYPES_BY_NAME.get(entry.dtype)
            total += entry.numel * (dtype.itemsize if dtype is not None else 4)
    return total // backend.world_size if backend.capabilities.sharded else total


@contextlib.contextmanager
def counting_reads(reader: Any, bar: Any) -> Iterator[None]:
    """Advance ``bar`` by the bytes of every range read through ``reader.read_flat``."""
    if bar is None:
        yield
        return
    read_flat = reader.read_flat

    def counted(entry: Any, start: int = 0, numel: int | None = None, **kwargs: Any) -> Any:
        out = read_flat(entry, start, numel, **kwargs)
        count = entry.numel - start if numel is None else numel
        bar.update(count * out.element_size())
        return out

    reader.read_flat = counted
    try:
        yield
    finally:
        del reader.read_flat  # the class's method again
        close(bar)
