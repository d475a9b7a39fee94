"""Does the gs:// store (plugins/gcs) stream a rank file, or hold it in memory? One file of
``--mib`` MiB goes to a local fake-gcs-server two ways, each in a fresh process:

- ``upload``: ``GCSBucket.upload`` (what a save does with a rank file), streamed from the file;
- ``whole``: the same bytes read into memory first and sent by ``GCSBucket.put``, the contrast.

Each prints the client's peak RSS before and after the transfer (``ru_maxrss``: the process's
high-water mark, imports included) and the peak of Python allocations during it (tracemalloc).

    .venv/bin/python bench/gcs_upload_memory.py --mib 1024
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def _mib(kib: float) -> str:
    return f"{kib / 1024:.0f} MiB"


def run_case(case: str, source: Path, endpoint: str) -> None:
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    from accelkit_gcs.bucket import GCSBucket

    bucket = GCSBucket("ckpts")
    bucket.head("warm-up")  # imports and a connection, before the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    started = time.perf_counter()
    if case == "upload":
        bucket.upload(f"{case}.bin", source)
    else:
        bucket.put(f"{case}.bin", source.read_bytes())
    seconds = time.perf_counter() - started
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stored = bucket.head(f"{case}.bin")
    assert stored is not None and stored.size == source.stat().st_size, stored
    print(
        f"{case:7s} peak RSS {_mib(before)} -> {_mib(after)} (+{_mib(after - before)}), "
        f"Python allocations' peak {python_peak / 2**10:.0f} KiB, {seconds:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        run_case(args.case, Path(args.source), args.endpoint)
        return
    from accelkit.testing.gcs_server import LocalGCSServer

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "rank.bin")
        with open(source, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(args.mib):
                f.write(block)
        print(f"one file of {args.mib} MiB to fake-gcs-server on loopback, each case a process")
        with LocalGCSServer(Path(tmp, "server"), bucket="ckpts") as server:
            for case in ("upload", "whole"):
                command = [sys.executable, __file__, "--case", case, "--source", str(source)]
                subprocess.run([*command, "--endpoint", server.endpoint], check=True)


if __name__ == "__main__":
    main()
