"""Checkpoint save/load throughput and memory: accelkit's portable format against torch.save /
torch.load and torch.distributed.checkpoint (DCP), on the same state, in one run.

Two workloads (``--workload``):

- ``square``: a stack of bias-free square Linear layers (2048 x 2048) plus Adam's ``exp_avg``
  and ``exp_avg_sq``: a few hundred equal, large tensors;
- ``gpt``: a GPT-2-small-shaped decoder (width 768, 12 heads, vocabulary 50304, tied
  embeddings; as many blocks as ``--gb`` needs) with fused AdamW, so the state holds many
  tensors of mixed sizes (the tied 154 MB embedding, 7 MB projections, 3 KB LayerNorm
  vectors, the step counters), as a real model's does.

Both are filled by one real optimizer step; ``--gb`` GB in total (params + optimizer state).
Every repeat runs in a fresh subprocess that builds the state once, warms every method up on a
tiny state (imports, planners, thread pools, pinned slots: first-call costs stay out), then,
for each method in turn (the order rotates every repeat), times

- **save** of model + optimizer state to ``--dir`` (each method's own layout; accelkit and DCP
  fsync their files by default, so the torch.save row fsyncs its file too, for the same
  durability; a ``torch.save (no fsync)`` figure is reported alongside);
- **load** of that checkpoint back into the same live objects, in place (what a resume does),
  checked for correctness against values recorded before the state was scrambled.

accelkit's saves print where their time went (:mod:`accelkit.checkpoint.profile`): prepare,
plan, stage, write (copies, checksums and writes overlapped), fsync, gather, commit, and the
writer threads' summed work. ``accelkit-async`` (asynchronous save) measures the training
stall of the first save in the process (its staging is not pinned yet) apart from the steady
state (saves 2-4, with training steps between them), the step time with no write in flight
and while a write is in flight, and checks that a checkpoint written while training went on
holds the state of the moment it was taken.

Reported: GB/s as the median over
repeats with the min-max spread; peak extra memory during the operation as (a) the process's
peak RSS above its RSS before the call (``VmHWM`` after resetting it through
``/proc/self/clear_refs``; counts file pages a method maps), and (b) the peak of anonymous
memory (``RssAnon``) sampled every 2 ms. Loads read from a warm page cache (dropping it needs
root); every method gets the same. ``bench/io_limits.py`` gives the machine's own limits
(sequential write with fsync, page-cache read) to read these against.

    python bench/checkpoint_io.py                        # 1 GB, 3 repeats, state on CUDA if any
    python bench/checkpoint_io.py --workload gpt --gb 2 --methods accelkit,accelkit-async,dcp,torch
    python bench/checkpoint_io.py --gb 2 --repeats 5 --dir /local/nvme --out ckpt.json
    python bench/checkpoint_io.py --nproc 8 --gb 8     # FSDP2-sharded over 8 ranks: accelkit vs DCP

With ``--dir s3://bucket/prefix`` the checkpoints go to S3-compatible object storage (the
endpoint and keys from the AWS_* variables; with no ``AWS_ENDPOINT_URL`` set, a local SeaweedFS
server is started for the run, :mod:`accelkit.testing.s3_server`). The methods there:
``accelkit`` and ``accelkit-async`` to the ``s3://`` path; ``dcp`` through DCP's fsspec writer
and reader (s3fs); ``s3connector``, the S3 connector for PyTorch's DCP writer and reader (its
client swapped for one that talks to the custom endpoint); ``torch``, torch.save streamed into
an object (an s3fs file) and torch.load from one; ``raw``, the same number of bytes PUT by
parallel multipart upload and read back by parallel ranged GETs through boto3 into a buffer
allocated on the clock (as any load's memory is): the server's own limit.

    python bench/checkpoint_io.py --dir s3://bench/ckpt --workload gpt --gb 0.5 \
        --methods accelkit,accelkit-async,dcp,s3connector,torch,raw

With ``--nproc N`` every layer (every block of the GPT) is FSDP2-sharded over N ranks
(torchrun), each rank saves and loads its shard, times cover the slowest rank, and memory is
rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

#: also: accelkit-noverify (load without checksums), accelkit-sha256 (SHA-256 fragment checksums),
#: accelkit-async (asynchronous save: the training stall, the step time while it writes)
METHODS = ("accelkit", "torch", "dcp")
WIDTH = 2048
#: the methods of an s3:// --dir
S3_METHODS = ("accelkit", "accelkit-async", "dcp", "s3connector", "torch", "raw")


def _remote(path: Any) -> bool:
    return str(path).startswith("s3://")


def _join(base: Any, name: str) -> Any:
    """``base/name`` for a directory or an s3:// prefix (a Path would fold the ``//``)."""
    return f"{str(base).rstrip('/')}/{name}" if _remote(base) else Path(base) / name


def _s3_client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=32))


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://") :].partition("/")
    return bucket, key


def _remove(path: Any) -> None:
    """Delete a checkpoint: a file or directory, or every object under an s3:// prefix."""
    if not _remote(path):
        path = Path(path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
        return
    client = _s3_client()
    bucket, key = _split(str(path))
    for prefix in (key, key + "/"):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
        keys = [k for k in keys if k == key or k.startswith(key + "/")]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


_S3_PART = 8 << 20
_S3_THREADS = 8


def _raw_put_get(url: str, nbytes: int) -> tuple[float, float, float, bool]:
    """The server's limit: ``nbytes`` from memory by a parallel multipart upload, then back into
    memory by parallel ranged GETs (boto3); (put seconds, get seconds, get seconds into a buffer
    allocated before the clock starts, bytes equal).

    The GET's clock includes allocating the memory the bytes land in (a fresh buffer's pages
    are faulted in as they are written: a quarter of the time on a 2-vCPU VM), as every loader's
    does; the second GET, into that same buffer once its pages are in, is printed beside it."""
    from concurrent.futures import ThreadPoolExecutor

    client = _s3_client()
    bucket, key = _split(url)
    payload = memoryview(os.urandom(min(nbytes, 64 << 20)) * max(1, nbytes // (64 << 20)))
    size = payload.nbytes
    started = time.perf_counter()
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def put(number: int) -> dict[str, Any]:
        start = (number - 1) * _S3_PART
        body = bytes(payload[start : start + _S3_PART])
        reply = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body
        )
        return {"PartNumber": number, "ETag": reply["ETag"]}

    with ThreadPoolExecutor(_S3_THREADS) as pool:
        parts = list(pool.map(put, range(1, (size + _S3_PART - 1) // _S3_PART + 1)))
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
    )
    put_s = time.perf_counter() - started

    def get_all(view: memoryview) -> None:
        def get(start: int) -> None:
            end = min(size, start + _S3_PART)
            body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
            done = start
            while done < end:
                n = body["Body"].readinto(view[done:end])
                if not n:
                    raise OSError("short read")
                done += n

        with ThreadPoolExecutor(_S3_THREADS) as pool:
            list(pool.map(get, range(0, size, _S3_PART)))

    started = time.perf_counter()
    out = bytearray(size)
    get_all(memoryview(out))
    get_s = time.perf_counter() - started
    started = time.perf_counter()
    get_all(memoryview(out))
    prefaulted_s = time.perf_counter() - started
    return put_s, get_s, prefaulted_s, out == payload


def _s3connector_client() -> Any:
    """An S3 connector client for AWS_ENDPOINT_URL (its DCP classes take none themselves)."""
    from s3torchconnector._s3client import S3Client, S3ClientConfig

    return S3Client(
        os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        endpoint=os.environ.get("AWS_ENDPOINT_URL"),
        s3client_config=S3ClientConfig(part_size=_S3_PART, force_path_style=True),
    )


# ---- the worker (one measurement, in its own process) -----------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Peak RSS (VmHWM, reset first) and sampled peak RssAnon above the level at start."""

    def __enter__(self) -> _Peak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.rss0 = _status("VmRSS")
        self.anon0 = _status("RssAnon")
        self.anon_peak = self.anon0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.anon_peak = max(self.anon_peak, _status("RssAnon"))
            time.sleep(0.002)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _status("RssAnon"))
        self.rss_extra = _status("VmHWM") - self.rss0 if self.hwm_reset else None
        self.anon_extra = self.anon_peak - self.anon0


def _build(gb: float, device: str, world: int = 1, workload: str = "square"):
    """The model, its optimizer state after one step, and a training step; with ``world`` > 1
    every layer (block) is FSDP2-sharded."""
    import torch

    torch.manual_seed(0)
    if workload == "gpt":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from reference_gpt import GPT, GPT2_SMALL

        vocab, width, _, heads, seq = GPT2_SMALL
        fixed = vocab * width + seq * width + 2 * width  # tied embedding, positions, final norm
        per_block = 12 * width * width + 13 * width
        layers = max(1, round((gb * 1e9 / 12 - fixed) / per_block))
        with torch.device("meta"):
            model = GPT(vocab, width, layers, heads, seq, tie_embeddings=True)
        units = list(model.blocks)
        batch = (8, seq) if device.startswith("cuda") else (1, 64)  # a CPU step stays short
    else:
        per_layer = WIDTH * WIDTH
        layers = max(1, round(gb * 1e9 / 12 / per_layer))  # 4 bytes x (param, 2 moments)
        with torch.device("meta"):
            model = torch.nn.Sequential(
                *(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))
            )
        units = list(model)
        batch = (8, WIDTH)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(torch.device(device).type, (world,))
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    if workload == "gpt" and world == 1:
        model.head.weight = model.tok.weight  # to_empty leaves the tie; restate it plainly
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if workload == "gpt":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        gen = torch.Generator(device="cpu").manual_seed(1)
        idx = torch.randint(0, GPT2_SMALL[0], batch, generator=gen).to(device)

        inputs, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

        def step() -> None:
            model(inputs, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        x = torch.randn(*batch, device=device)

        def step() -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()
    nbytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())  # global sizes
    return model, opt, nbytes, step


def _fingerprint(model, opt) -> list[float]:
    """A few values of every parameter and optimizer-state tensor this rank holds."""
    out = []
    for p in model.parameters():
        state = opt.state[p]
        local = p.to_local() if hasattr(p, "to_local") else p
        avg = state["exp_avg"]
        avg = avg.to_local() if hasattr(avg, "to_local") else avg
        flat, avg = local.reshape(-1), avg.reshape(-1)
        out += [float(flat[7 % max(1, flat.numel())]) if flat.numel() else 0.0]
        out += [float(avg[-3 % max(1, avg.numel())]) if avg.numel() else 0.0]
        out += [float(state["step"])]
    return out


def _scramble(model, opt) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            for value in opt.state[p].values():
                value.zero_()


def _sync(device: str) -> None:
    """Wait for the device and for every rank: a timing covers the slowest rank."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _accel() -> Any:
    """None (one process), or a distributed accelkit backend on the existing process group
    (the model is sharded by hand: the checkpoint code handles any DTensor)."""
    import torch

    if not torch.distributed.is_initialized():
        return None
    if not _ACCEL:
        import accelkit

        _ACCEL.append(accelkit.get("ddp", device="cuda" if torch.cuda.is_available() else "cpu"))
    return _ACCEL[0]


_ACCEL: list[Any] = []


def _save(method: str, model, opt, path: Path, *, fsync: bool = True) -> None:
    import torch

    if method.startswith("accelkit"):
        from accelkit.checkpoint import save

        checksum = "sha256" if method == "accelkit-sha256" else "xxh3_128"
        save(
            _accel(),
            path,
            {"model": model, "optimizer": opt},
            rng=False,
            latest=False,
            checksum=checksum,
            asynchronous=method == "accelkit-async",
        )
    elif method == "torch" and _remote(path):  # streamed into one object (an s3fs file)
        import s3fs

        fs = s3fs.S3FileSystem(default_block_size=_S3_PART)
        with fs.open(str(path), "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
    elif method == "torch":
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        writer = None
        if _remote(path):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer = FsspecWriter(str(path), thread_count=_S3_THREADS)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path), storage_writer=writer)
    elif method == "s3connector":
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        writer = S3StorageWriter("us-east-1", str(path), thread_count=_S3_THREADS)
        writer.fs._client = _s3connector_client()
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path), storage_writer=writer)
    else:
        raise ValueError(method)


def _load(method: str, model, opt, path: Path, device: str) -> None:
    import torch

    if method.startswith("accelkit"):
        from accelkit.checkpoint import load

        verify = method != "accelkit-noverify"
        load(_accel(), path, {"model": model, "optimizer": opt}, rng=False, verify=verify)
    elif method == "torch" and _remote(path):
        import s3fs

        with s3fs.S3FileSystem(default_block_size=_S3_PART).open(str(path), "rb") as f:
            state = torch.load(f, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    elif method == "torch":
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        reader = None
        if _remote(path):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader = FsspecReader(str(path))
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader)
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    elif method == "s3connector":
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        reader = S3StorageReader("us-east-1", str(path))
        reader.fs._client = _s3connector_client()
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader)
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    else:
        raise ValueError(method)


def _timed_step(step, device: str) -> float:
    started = time.perf_counter()
    step()
    _sync(device)
    return (time.perf_counter() - started) * 1e3


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _breakdown(what: str = "save") -> dict[str, Any] | None:
    from accelkit.checkpoint.profile import last_load, last_save

    profile = last_save() if what == "save" else last_load()
    return profile.as_dict() if profile is not None else None


def measure_async(model, opt, step, nbytes: int, args) -> dict[str, Any]:
    """The asynchronous save as training sees it: the first save's stall (staging not yet
    pinned), then three saves in the steady state with training steps between them; the step
    time with no write in flight and while one is; then the last checkpoint, written while
    training changed the state, must load back to the state of the moment it was taken."""
    from accelkit.checkpoint.write import background

    result: dict[str, Any] = {"method": "accelkit-async", "bytes": nbytes}
    idle = [_timed_step(step, args.device) for _ in range(5)]
    stalls, wholes, during, first_during, breakdowns = [], [], [], [], []
    for i in range(4):
        path = _join(args.dir, f"async-{i}")
        if i:
            idle += [_timed_step(step, args.device) for _ in range(3)]
        expected = _fingerprint(model, opt)
        _sync(args.device)
        started = time.perf_counter()
        _save("accelkit-async", model, opt, path)
        _sync(args.device)
        stalls.append(time.perf_counter() - started)
        steps = []
        while background.pending() is not None and len(steps) < 200 and sum(steps) < 30e3:
            steps.append(_timed_step(step, args.device))
        background.wait()
        wholes.append(time.perf_counter() - started)
        (during if i else first_during).extend(steps)
        breakdowns.append(_breakdown())
    result["stall_first_s"] = stalls[0]
    result["stall_s"] = _median(stalls[1:])
    result["stalls"] = stalls
    result["save_s"] = _median(wholes[1:])
    result["save_first_s"] = wholes[0]
    result["step_ms_idle"] = _median(idle)
    result["step_ms_during_write"] = _median(during)
    result["steps_during_write"] = len(during)
    result["step_ms_during_first_write"] = _median(first_during)
    result["breakdown"] = breakdowns[-1]
    _scramble(model, opt)
    _sync(args.device)
    started = time.perf_counter()
    _load("accelkit", model, opt, path, args.device)
    _sync(args.device)
    result["load_s"] = time.perf_counter() - started
    result["correct"] = _fingerprint(model, opt) == expected
    result.update(save_rss_extra=None, save_anon_extra=None)
    result.update(load_rss_extra=None, load_anon_extra=None)
    _sync(args.device)
    if int(os.environ.get("RANK", "0")) == 0:
        for i in range(4):
            _remove(_join(args.dir, f"async-{i}"))
    _sync(args.device)
    return result


def measure(method: str, model, opt, step, nbytes: int, args) -> dict[str, Any]:
    """Save, scramble, load back: one method on the live state."""
    if method == "accelkit-async":
        return measure_async(model, opt, step, nbytes, args)
    expected = _fingerprint(model, opt)
    path = _join(args.dir, f"{method}-ckpt")
    result: dict[str, Any] = {"method": method, "bytes": nbytes}
    if method == "raw":
        save_s, load_s, prefaulted_s, correct = _raw_put_get(path, nbytes)
        result.update(save_s=save_s, load_s=load_s, load_prefaulted_s=prefaulted_s)
        result["correct"] = correct
        result.update(save_rss_extra=None, save_anon_extra=None)
        result.update(load_rss_extra=None, load_anon_extra=None)
        _remove(path)
        return result
    if method == "torch" and not _remote(path):  # the same write without durability, for reference
        started = time.perf_counter()
        _save("torch", model, opt, path, fsync=False)
        result["save_nofsync_s"] = time.perf_counter() - started
        os.remove(path)
    _sync(args.device)
    with _Peak() as peak:
        started = time.perf_counter()
        _save(method, model, opt, path)
        _sync(args.device)
        result["save_s"] = time.perf_counter() - started
    if method.startswith("accelkit"):
        result["breakdown"] = _breakdown()
    result.update(save_rss_extra=peak.rss_extra, save_anon_extra=peak.anon_extra)
    _scramble(model, opt)
    _sync(args.device)
    with _Peak() as peak:
        started = time.perf_counter()
        _load(method, model, opt, path, args.device)
        _sync(args.device)
        result["load_s"] = time.perf_counter() - started
    result.update(load_rss_extra=peak.rss_extra, load_anon_extra=peak.anon_extra)
    if method.startswith("accelkit"):
        result["load_breakdown"] = _breakdown("load")
    result["correct"] = _fingerprint(model, opt) == expected
    _sync(args.device)
    if int(os.environ.get("RANK", "0")) == 0:
        _remove(path)
    _sync(args.device)
    return result


def _warm_up(methods: list[str], args) -> None:
    """Each method saves and loads a tiny state once: imports, planners, thread pools and
    pinned slots are made outside the timings (the async staging is not: its first save is
    measured as such)."""
    import torch

    model = torch.nn.Linear(64, 64).to(args.device)
    if torch.distributed.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = torch.distributed.get_world_size()
        fully_shard(model, mesh=init_device_mesh(torch.device(args.device).type, (world,)))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64, device=args.device)).sum().backward()
    opt.step()
    warm = dict.fromkeys("accelkit" if m.startswith("accelkit") else m for m in methods)
    for method in (m for m in warm if m != "raw"):
        path = _join(args.dir, f"warmup-{method}")
        _save(method, model, opt, path)
        _load(method, model, opt, path, args.device)
        _sync(args.device)
        if int(os.environ.get("RANK", "0")) == 0:
            _remove(path)
        _sync(args.device)


def worker(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One repeat: build the state once, then measure each method in the given order."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        rank = int(os.environ["LOCAL_RANK"])
        if args.device.startswith("cuda"):
            torch.cuda.set_device(rank)
            args.device = f"cuda:{rank}"
        torch.distributed.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    model, opt, nbytes, step = _build(args.gb, args.device, world, args.workload)
    # imports and process-group plumbing happen once, outside the timings
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict

    import accelkit.checkpoint  # noqa: F401

    _accel()
    methods = args.worker.split(",")
    _warm_up(methods, args)
    results = [measure(m, model, opt, step, nbytes, args) for m in methods]
    if world > 1:
        flags = [None] * world
        torch.distributed.all_gather_object(flags, [r["correct"] for r in results])
        for i, r in enumerate(results):
            r["correct"] = all(f[i] for f in flags)
        torch.distributed.destroy_process_group()
    return results


# ---- the driver -----------------------------------------------------------------------------------------
def _summary(runs: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    rates = [r["bytes"] / 1e9 / r[key] for r in runs]
    return statistics.median(rates), min(rates), max(rates)


def _mb(values: list[Any]) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values) / 2**20:8.0f}" if values else "     n/a"


def _print_async(rs: list[dict[str, Any]], sync: list[dict[str, Any]] | None, out: dict) -> None:
    """The asynchronous save against the synchronous one of the same repeat: first and
    steady-state stalls, and the step time while a write is in flight."""

    def mid(values: list[float]) -> tuple[float, float, float]:
        values = sorted(v for v in values if v is not None)
        return (statistics.median(values), values[0], values[-1]) if values else (0, 0, 0)

    for key, label in (("stall_first_s", "first save"), ("stall_s", "steady state")):
        stall = mid([r[key] for r in rs])
        out[key] = stall
        line = f"  stall, {label:13s} {stall[0]:7.3f} s [{stall[1]:.3f}-{stall[2]:.3f}]"
        if sync:
            share = mid([r[key] / s["save_s"] for r, s in zip(rs, sync)])
            out[key.replace("_s", "_share")] = share
            line += (
                f" = {100 * share[0]:.1f}% of a synchronous save "
                f"[{100 * share[1]:.1f}-{100 * share[2]:.1f}]"
            )
        print(line)
    idle = mid([r["step_ms_idle"] for r in rs])
    during = mid([r["step_ms_during_write"] for r in rs])
    ratio = mid(
        [r["step_ms_during_write"] / r["step_ms_idle"] for r in rs if r["step_ms_during_write"]]
    )
    out.update(step_ms_idle=idle, step_ms_during_write=during, step_ratio=ratio)
    print(
        f"  training step {idle[0]:.1f} ms with no write in flight, {during[0]:.1f} ms during "
        f"a steady-state write: {ratio[0]:.3f}x [{ratio[1]:.3f}-{ratio[2]:.3f}] "
        f"({sum(r['steps_during_write'] for r in rs)} steps); whole save "
        f"{mid([r['save_s'] for r in rs])[0]:.2f} s (first {mid([r['save_first_s'] for r in rs])[0]:.2f} s)"
    )


def _print_breakdown(label: str, rs: list[dict[str, Any]]) -> None:
    """Median seconds per phase of accelkit's save and load (for the save, the writer threads'
    summed work after the bar)."""
    for key, what in (("breakdown", "save"), ("load_breakdown", "load")):
        if not all(r.get(key) for r in rs):
            continue
        phases: dict[str, list[float]] = {}
        work: dict[str, list[float]] = {}
        for r in rs:
            for k, v in r[key]["phases"].items():
                phases.setdefault(k, []).append(v)
            for k, v in r[key]["thread_work"].items():
                work.setdefault(k, []).append(v)
        text = " ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items())
        if work:
            text += f" | {rs[0][key].get('writer', 'threads')}: " + " ".join(
                f"{k} {statistics.median(v):.3f}" for k, v in work.items()
            )
        extra = f", {rs[0][key]['tensors']} tensors" if what == "save" else ""
        print(f"  {label} {what} breakdown (s{extra}): {text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state size: params + Adam state")
    parser.add_argument(
        "--workload",
        choices=("square", "gpt"),
        default="square",
        help="square Linear layers, or a GPT-2-small-shaped decoder with tied embeddings",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--methods", default=None, help=f"default: {','.join(METHODS)}")
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks (torchrun); > 1 shards the state with FSDP2 and compares accelkit with DCP",
    )
    parser.add_argument("--out", default=None, help="write all runs and the summary as JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        results = worker(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(results))
        return 0

    default = METHODS if args.nproc == 1 else ("accelkit", "dcp")
    server = None
    if args.dir and _remote(args.dir):
        default = S3_METHODS if args.nproc == 1 else ("accelkit", "dcp", "s3connector")
        if not os.environ.get("AWS_ENDPOINT_URL"):
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from accelkit.testing.s3_server import LocalS3Server

            bucket = _split(args.dir)[0]
            server = LocalS3Server(tempfile.mkdtemp(prefix="s3bench-"), bucket=bucket).start()
            os.environ.update(server.env())
            print(f"started a local S3 server (SeaweedFS weed mini) at {server.endpoint}")
    methods = [m for m in (args.methods or ",".join(default)).split(",") if m]
    if args.nproc > 1 and "torch" in methods:
        raise SystemExit("torch.save has no sharded form to compare; drop it with --nproc > 1")
    base: Any = args.dir if args.dir and _remote(args.dir) else None
    if base is None:
        base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="accelkit-ckpt-bench-"))
        base.mkdir(parents=True, exist_ok=True)
    try:
        return _drive(args, methods, base)
    finally:
        if server is not None:  # and its data: a run stores several GB
            server.stop()
            shutil.rmtree(server.directory, ignore_errors=True)


def _drive(args: argparse.Namespace, methods: list[str], base: Any) -> int:
    """The repeats, each in a fresh process, and the summary."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    started = time.time()
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
        workdir = _join(base, f"r{repeat}")
        if not _remote(workdir):
            workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__]
        if args.nproc > 1:
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
            cmd += ["--master-addr=127.0.0.1", f"--master-port={port}", __file__]
        cmd += ["--worker", ",".join(order), "--gb", str(args.gb), "--workload", args.workload]
        cmd += ["--dir", str(workdir), "--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            raise SystemExit(f"repeat {repeat} failed")
        _remove(workdir)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")][-1]
        for result in json.loads(line):
            method = result["method"]
            if not result["correct"]:
                raise SystemExit(f"{method}: the loaded state differs from the saved one")
            runs[method].append(result)
            line = (
                f"repeat {repeat} {method:9s} save {result['save_s']:6.2f} s  "
                f"load {result['load_s']:6.2f} s"
            )
            if method == "accelkit-async":
                line += f"  stall first {result['stall_first_s']:.3f} s, then " + ", ".join(
                    f"{x:.3f}" for x in result["stalls"][1:]
                )
            print(line, flush=True)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)

    import platform

    import torch

    size = runs[methods[0]][0]["bytes"] / 1e9
    print()
    print(
        f"workload {args.workload}: state {size:.2f} GB (params + Adam exp_avg, exp_avg_sq; "
        f"fp32) on {args.device}; "
        f"{args.nproc} rank(s){' (FSDP2-sharded)' if args.nproc > 1 else ''}; "
        f"dir {base}; {args.repeats} interleaved repeats; torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs; {platform.node()}"
    )
    print("GB/s: median [min-max] over repeats. Extra memory (MB, median): peak RSS above the")
    print("start (incl. mapped file pages) / peak anonymous memory above the start.")
    header = (
        f"{'method':26s} {'save GB/s':>22s} {'load GB/s':>22s}  save MB rss/anon  load MB rss/anon"
    )
    print(header)
    summary: dict[str, Any] = {}
    for method in methods:
        rs = runs[method]
        save = _summary(rs, "save_s")
        load = _summary(rs, "load_s")
        summary[method] = {"save_gbps": save, "load_gbps": load}
        label = {
            "accelkit": "accelkit",
            "accelkit-noverify": "accelkit (load unverified)",
            "accelkit-sha256": "accelkit (SHA-256)",
            "accelkit-async": "accelkit (asynchronous)",
            "torch": "torch.save/load +fsync" if not _remote(base) else "torch.save to an object",
            "dcp": "DCP" if not _remote(base) else "DCP fsspec writer",
            "s3connector": "S3 connector DCP writer",
            "raw": "raw PUT/GET (boto3)",
        }[method]
        print(
            f"{label:26s} {save[0]:8.2f} [{save[1]:5.2f}-{save[2]:5.2f}] "
            f"{load[0]:8.2f} [{load[1]:5.2f}-{load[2]:5.2f}]  "
            f"{_mb([r['save_rss_extra'] for r in rs])} {_mb([r['save_anon_extra'] for r in rs])}"
            f"  {_mb([r['load_rss_extra'] for r in rs])} {_mb([r['load_anon_extra'] for r in rs])}"
        )
        if method == "accelkit-async":
            _print_async(rs, runs.get("accelkit"), summary[method])
        if method == "raw" and rs and "load_prefaulted_s" in rs[0]:
            warm = _summary(rs, "load_prefaulted_s")
            summary["raw"]["load_prefaulted_gbps"] = warm
            print(
                f"{'  raw GET, buffer paged in':26s} {'':21s} {warm[0]:8.2f} "
                f"[{warm[1]:5.2f}-{warm[2]:5.2f}]  (its pages faulted in before the clock)"
            )
        if method.startswith("accelkit") and rs and rs[0].get("breakdown"):
            _print_breakdown(label, rs)
        if method == "torch" and not _remote(base):
            nofsync = _summary(rs, "save_nofsync_s")
            summary["torch"]["save_nofsync_gbps"] = nofsync
            print(
                f"{'torch.save (no fsync)':26s} {nofsync[0]:8.2f} [{nofsync[1]:5.2f}-{nofsync[2]:5.2f}]"
            )
    # the same state in the same repeat: accelkit's speed-up over each other method, per repeat
    if "accelkit" in runs:
        for other in (m for m in methods if m != "accelkit"):
            for key in ("save_s", "load_s"):
                ratios = sorted(
                    o[key] / a[key] for a, o in zip(runs["accelkit"], runs[other]) if a[key] > 0
                )
                if ratios:
                    mid = ratios[len(ratios) // 2]
                    summary.setdefault("speedup", {})[f"{other}:{key}"] = [
                        mid,
                        ratios[0],
                        ratios[-1],
                    ]
                    print(
                        f"accelkit {key[:4]} is {mid:.2f}x {other} [{ratios[0]:.2f}-{ratios[-1]:.2f}]"
                        " (wall time of the same state, per repeat)"
                    )
    print(f"total {time.time() - started:.0f} s")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
