"""The physical limits a checkpoint's speed is measured against, on this machine.

Sequential write of a file with fsync (plain, and streamed: each block handed to writeback at
once), sequential read of it after evicting it from the page
cache (``posix_fadvise(DONTNEED)``), the same read from the page cache, and pinned host-to-device
and device-to-host copy bandwidth (when CUDA is present). Prints GB/s per figure, median of
``--repeats`` with its range.

    python bench/io_limits.py --gb 2 --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

BLOCK = 64 << 20


def _write(path: Path, nbytes: int, block: bytes) -> float:
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, block[: min(len(block), nbytes - done)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return nbytes / (time.perf_counter() - started) / 1e9


def _write_streamed(path: Path, nbytes: int, block: bytes) -> float:
    """The same write, each block handed to the kernel's writeback as soon as it is written
    (``sync_file_range``), then fsync: the disk's streaming rate, with no idle disk while the
    page cache fills."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            n = os.write(fd, block[: min(len(block), nbytes - done)])
            libc.sync_file_range(fd, ctypes.c_int64(done), ctypes.c_int64(n), 2)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return nbytes / (time.perf_counter() - started) / 1e9


def _read(path: Path, nbytes: int, evict: bool) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        if evict:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = bytearray(BLOCK)
        view = memoryview(buffer)
        started = time.perf_counter()
        done = 0
        while done < nbytes:
            n = os.readv(fd, [view])
            if n <= 0:
                break
            done += n
        return done / (time.perf_counter() - started) / 1e9
    finally:
        os.close(fd)


def _copies(nbytes: int) -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d_pinned": (device, host), "d2h_pinned": (host, device)}.items():
        dst.copy_(src)
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = nbytes / (time.perf_counter() - started) / 1e9
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    nbytes = int(args.gb * 1e9)
    block = os.urandom(BLOCK)
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "limits.bin"
        for _ in range(args.repeats):
            runs.setdefault("write_fsync", []).append(_write(path, nbytes, block))
            runs.setdefault("write_streamed_fsync", []).append(_write_streamed(path, nbytes, block))
            runs.setdefault("read_cold", []).append(_read(path, nbytes, evict=True))
            runs.setdefault("read_page_cache", []).append(_read(path, nbytes, evict=False))
            for key, value in _copies(min(nbytes, 1 << 30)).items():
                runs.setdefault(key, []).append(value)
    summary = {k: [statistics.median(v), min(v), max(v)] for k, v in runs.items()}
    for key, (mid, lo, hi) in summary.items():
        print(f"{key:21s} {mid:7.2f} GB/s [{lo:.2f}-{hi:.2f}]")
    if args.out:
        Path(args.out).write_text(json.dumps({"gb": args.gb, "runs": runs, "summary": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
