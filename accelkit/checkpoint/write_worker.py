"""The asynchronous save's writer process: it writes and checksums a rank file's tensors from the
staging memory it shares with the training process.

Run as a script (``python write_worker.py FD NBYTES``). It uses the standard library and
``xxhash`` alone, so it starts in milliseconds and shares nothing with training but that memory;
for the same reason it is the one home of the two file calls the in-process writers use too
(:func:`pwrite_all`, :func:`load_sync_file_range`): importing it costs nothing. A writer thread in the training process would take the GIL back
after every write and checksum call, and a step whose Python thread launches many small kernels
pays for each hand-off; this process never contends for it.

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout.

- ``{"path", "items": [[file_offset, buffer_offset, nbytes, key], ...], "algorithm"}``:
  write each item's bytes from the shared buffer into the existing file ``path`` at its offset,
  in pieces, each piece handed to the kernel's writeback at once and checksummed while it is
  still in cache; then fsync. Reply ``{"digests": {key: hex}, "pwrite": s, "checksum": s,
  "fsync": s}``, or ``{"error": message}``.

It exits when stdin closes (the training process ended, or replaced its staging memory).
"""

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(__file__):
    sys.path.pop(0)  # the script's folder holds modules named like the standard library's

import ctypes
import ctypes.util
import hashlib
import json
import mmap
import time

#: bytes per write call: each piece goes to writeback and is hashed while still in cache
PIECE = 8 << 20
SYNC_FILE_RANGE_WRITE = 2


def _hasher(algorithm):
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def load_sync_file_range():
    """libc's ``sync_file_range``, or None where it is missing or ``ACCELKIT_NO_EARLY_WRITEBACK``
    is set (then writes are left to the kernel until the fsync)."""
    if os.environ.get("ACCELKIT_NO_EARLY_WRITEBACK"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        func = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


def pwrite_all(fd, view, offset):
    """Write all of ``view`` at ``offset`` (``pwrite`` may write less than asked)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def write(buffer, request, writeback):
    times = {"pwrite": 0.0, "checksum": 0.0, "fsync": 0.0}
    digests = {}
    view = memoryview(buffer)
    fd = os.open(request["path"], os.O_WRONLY)
    try:
        for file_offset, buffer_offset, nbytes, key in request["items"]:
            if buffer_offset < 0 or buffer_offset + nbytes > len(view):
                raise ValueError(f"{key}: bytes [{buffer_offset}, +{nbytes}) are outside staging")
            hasher = _hasher(request["algorithm"])
            for lo in range(0, nbytes, PIECE):
                piece = view[buffer_offset + lo : buffer_offset + min(nbytes, lo + PIECE)]
                started = time.perf_counter()
                pwrite_all(fd, piece, file_offset + lo)
                if writeback is not None:
                    writeback(fd, file_offset + lo, len(piece), SYNC_FILE_RANGE_WRITE)
                written = time.perf_counter()
                hasher.update(piece)
                times["pwrite"] += written - started
                times["checksum"] += time.perf_counter() - written
                piece.release()
            digests[key] = hasher.hexdigest()
        started = time.perf_counter()
        os.fsync(fd)
        times["fsync"] = time.perf_counter() - started
    finally:
        os.close(fd)
        view.release()
    return {"digests": digests, **times}


def main(argv):
    import xxhash  # noqa: F401  (fail at start, where the training process falls back to threads)

    fd, nbytes = int(argv[1]), int(argv[2])
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 10)  # below the training process
    except (AttributeError, OSError):
        pass
    buffer = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) if nbytes else b""
    os.close(fd)
    writeback = load_sync_file_range()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        try:
            reply = write(buffer, json.loads(line), writeback)
        except Exception as err:  # the training process raises it, naming the checkpoint
            reply = {"error": f"{type(err).__name__}: {err}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
