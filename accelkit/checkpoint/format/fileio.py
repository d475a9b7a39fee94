"""The two file calls every writer of rank files uses: the in-process writers, and the
asynchronous save's writer process (:mod:`accelkit.checkpoint.write.write_worker`), which runs
this module as a plain script's import. Standard library only, so that process starts in
milliseconds."""

import ctypes
import ctypes.util
import os

SYNC_FILE_RANGE_WRITE = 2


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
