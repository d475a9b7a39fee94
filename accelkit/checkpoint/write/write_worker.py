"""The asynchronous save's writer process: it writes and checksums a rank file's tensors from the
staging memory it shares with the training process.

Run as a script (``python write_worker.py BUFFER_FD NBYTES CHANNEL_FD PARENT_PID``). It uses the
standard library and ``xxhash`` alone, so it starts in milliseconds and shares nothing with
training but that memory; the two file calls the in-process writers use too (``pwrite_all``,
``load_sync_file_range``) come from :mod:`accelkit.checkpoint.format.fileio`, a standard-library
module it imports by its folder. A writer thread in the training process would take the GIL back after every write and
checksum call, and a step whose Python thread launches many small kernels pays for each
hand-off; this process never contends for it.

It lives no longer than the training process that started it, and never writes where a later
run could look (a writer stopped while its trainer died, then woken, must not touch the
restarted run's files):

- the kernel kills it when its parent dies (``PR_SET_PDEATHSIG``), and it checks before every
  write that its parent is still the process that started it;
- it writes only into a file the training process opened and handed over as a descriptor with
  the request, never a path it looks up itself: an old file stays the old file, even after a
  new run made another of the same name.

Protocol, over a Unix socket (``CHANNEL_FD``): frames of a 4-byte big-endian length and JSON
(:func:`send_frame`, :func:`recv_frame`). The worker first sends ``{"ready": pid}``. A request,
``{"name", "items": [[file_offset, buffer_offset, nbytes, key], ...], "algorithm"}``, carries
the open file as its one descriptor; the worker writes each item's bytes from the shared buffer
at its offset, in pieces, each piece handed to the kernel's writeback at once and checksummed
while it is still in cache; then fsyncs. While it writes it sends ``{"progress": bytes}`` (at
most every :data:`PROGRESS_EVERY_S`), so the training process can tell a slow disk from a
stalled one; then ``{"digests": {key: hex}, "pwrite": s, "checksum": s, "fsync": s}``, or
``{"error": message}``. It exits quietly when the socket closes or its parent is gone.
"""

import os
import sys

if __name__ == "__main__":
    if sys.path and sys.path[0] == os.path.dirname(__file__):
        sys.path.pop(0)  # the script's folder holds modules named like the standard library's
    # the two file calls it shares with the in-process writers, from a standard-library module
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "format"))
    from fileio import SYNC_FILE_RANGE_WRITE, load_sync_file_range, pwrite_all

    sys.path.pop(0)
else:
    from accelkit.checkpoint.format.fileio import (
        SYNC_FILE_RANGE_WRITE,
        load_sync_file_range,
        pwrite_all,
    )

import ctypes
import ctypes.util
import hashlib
import json
import mmap
import queue
import signal
import socket
import struct
import threading
import time

#: bytes per write call: each piece goes to writeback and is hashed while still in cache
PIECE = 8 << 20
#: pieces written but not yet checksummed, at most (the hash runs a piece behind the writes)
HASH_QUEUE = 4
#: the least time between two progress reports of one request
PROGRESS_EVERY_S = 0.5
#: the largest frame either side accepts (a request lists every tensor of a rank file)
MAX_FRAME = 256 << 20
_PR_SET_PDEATHSIG = 1


class ParentGone(Exception):
    """The training process that started this writer has exited."""


def send_frame(sock, message, fds=()):
    """Send ``message`` (JSON) as one frame, with ``fds`` riding on its first byte."""
    data = json.dumps(message).encode()
    frame = struct.pack(">I", len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], list(fds))
        frame = frame[sent:]
    sock.sendall(frame)


def recv_frame(sock, max_fds=0):
    """One frame's message and the descriptors that came with it; EOFError at end of stream."""
    data, fds = b"", []
    need = 4
    while len(data) < need:
        if max_fds:
            chunk, got, _, _ = socket.recv_fds(sock, need - len(data), max_fds)
            fds.extend(got)
        else:
            chunk = sock.recv(need - len(data))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise EOFError("the other side closed the channel")
        data += chunk
        if need == 4 and len(data) >= 4:
            size = struct.unpack(">I", data[:4])[0]
            if size > MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes is larger than {MAX_FRAME}")
            need = 4 + size
    return json.loads(data[4:]), fds


def _hasher(algorithm):
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def die_with_parent(parent):
    """Ask the kernel to kill this process when its parent exits; False if that parent (pid
    ``parent``) is already gone."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the check before each write still holds
    return os.getppid() == parent


def _checksum_pieces(pieces, algorithm, digests, times, cancelled):
    """Hash the pieces queued by :func:`write`, in order: ``(key, piece)`` feeds key's hasher,
    ``(key, None)`` closes it, ``None`` ends. Runs beside the writes (xxhash releases the GIL)."""
    hasher = None
    while (item := pieces.get()) is not None:
        key, piece = item
        if piece is None:
            digests[key] = (hasher or _hasher(algorithm)).hexdigest()
            hasher = None
            continue
        if not cancelled.is_set():
            hasher = hasher or _hasher(algorithm)
            started = time.perf_counter()
            hasher.update(piece)
            times["checksum"] += time.perf_counter() - started
        piece.release()


def write(buffer, request, fd, writeback, parent, report):
    """Write ``request``'s items into the open file ``fd``; ``report(bytes)`` after each piece.

    Each piece is checksummed on a second thread while the next is written, so a save takes
    the longer of writing and hashing rather than their sum (on the H200 the two in sequence
    made the process-written save 1.4x as long as the in-process threads' one).
    """
    _hasher(request["algorithm"])  # an unknown algorithm fails before anything is written
    times = {"pwrite": 0.0, "checksum": 0.0, "fsync": 0.0}
    digests = {}
    view = memoryview(buffer)
    pieces = queue.Queue(maxsize=HASH_QUEUE)
    cancelled = threading.Event()
    hashing = threading.Thread(
        target=_checksum_pieces,
        args=(pieces, request["algorithm"], digests, times, cancelled),
        name="accelkit-checksum",
        daemon=True,
    )
    hashing.start()
    done = 0
    try:
        for file_offset, buffer_offset, nbytes, key in request["items"]:
            if buffer_offset < 0 or buffer_offset + nbytes > len(view):
                raise ValueError(f"{key}: bytes [{buffer_offset}, +{nbytes}) are outside staging")
            for lo in range(0, nbytes, PIECE):
                if os.getppid() != parent:  # nothing written now could be wanted
                    raise ParentGone
                piece = view[buffer_offset + lo : buffer_offset + min(nbytes, lo + PIECE)]
                started = time.perf_counter()
                pwrite_all(fd, piece, file_offset + lo)
                if writeback is not None:
                    writeback(fd, file_offset + lo, len(piece), SYNC_FILE_RANGE_WRITE)
                times["pwrite"] += time.perf_counter() - started
                done += len(piece)
                pieces.put((key, piece))
                report(done)
            pieces.put((key, None))
        pieces.put(None)
        hashing.join()
        started = time.perf_counter()
        os.fsync(fd)
        times["fsync"] = time.perf_counter() - started
    except BaseException:
        cancelled.set()  # the hasher drops what is queued and ends
        pieces.put(None)
        hashing.join()
        raise
    finally:
        view.release()
    return {"digests": digests, **times}


def serve(channel, buffer, parent):
    """Answer requests until the channel closes."""
    writeback = load_sync_file_range()
    send_frame(channel, {"ready": os.getpid()})
    while True:
        request, fds = recv_frame(channel, max_fds=1)
        last = [time.monotonic()]

        def report(done, last=last):
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S:
                last[0] = now
                send_frame(channel, {"progress": done})

        try:
            if len(fds) != 1:
                raise ValueError(f"a request carries one open file, this one {len(fds)}")
            reply = write(buffer, request, fds[0], writeback, parent, report)
        except (ParentGone, OSError) as err:
            if os.getppid() != parent:
                raise ParentGone from err
            reply = {"error": f"{type(err).__name__}: {err}"}
        except Exception as err:  # the training process raises it, naming the checkpoint
            reply = {"error": f"{type(err).__name__}: {err}"}
        finally:
            for fd in fds:
                os.close(fd)
        send_frame(channel, reply)


def main(argv):
    import xxhash  # noqa: F401  (fail at start, where the training process falls back to threads)

    buffer_fd, nbytes, channel_fd, parent = (int(a) for a in argv[1:5])
    if not die_with_parent(parent):
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group:
    # the training process decides, and this one ends with it, saying nothing
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 10)  # below the training process
    except (AttributeError, OSError):
        pass
    buffer = mmap.mmap(buffer_fd, nbytes, prot=mmap.PROT_READ) if nbytes else b""
    os.close(buffer_fd)
    channel = socket.socket(fileno=channel_fd)
    try:
        serve(channel, buffer, parent)
    except (EOFError, ParentGone, ConnectionError):
        pass  # the training process closed the channel, or is gone: nothing to say to anyone
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
