"""``accelkit inspect CKPT``: the manifest in brief, and every checksum verified."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory, or one with a 'latest' pointer")
    parser.add_argument("--tensors", action="store_true", help="list every tensor")
    parser.add_argument("--no-verify", action="store_true", help="skip the checksums")
    parser.add_argument("--json", action="store_true", help="print the raw manifest")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", action="store_true", default=None, help="always show a bar")
    progress.add_argument("--no-progress", dest="progress", action="store_false")


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def summary_lines(reader: Any, cited: str | None = None) -> list[str]:
    """The summary ``inspect`` prints; ``cited``: where the checkpoint is (a URL), when the
    reader reads a downloaded copy."""
    import torch

    from accelkit.checkpoint.format.safetensors_io import DTYPES_BY_NAME

    data = reader.manifest.data
    writer = data.get("writer", {})
    created = data.get("created_unix_ns")
    when = (
        datetime.datetime.fromtimestamp(created / 1e9, tz=datetime.timezone.utc).isoformat(
            timespec="seconds"
        )
        if created
        else "?"
    )
    lines = [
        f"checkpoint  {cited or reader.directory}",
        f"format      {data.get('format')} {data.get('format_version')}",
        "written by  " + ", ".join(f"{k} {v}" for k, v in writer.items()) + f"; {when}",
        f"world size  {data.get('world_size')}   precision {data.get('precision')}   "
        f"step {data.get('step')}",
        *(
            [
                f"pipeline    pp {data['pipeline'].get('pp')}   "
                f"{data['pipeline'].get('schedule')}   "
                f"{data['pipeline'].get('microbatches')} micro-batches (any layout loads it)"
            ]
            if isinstance(data.get("pipeline"), dict)
            else []
        ),
        "files       "
        + ", ".join(
            f"{name} ({_size(info.get('bytes', 0))})" for name, info in data["files"].items()
        ),
        "objects",
    ]
    for name, info in reader.manifest.objects.items():
        entries = reader.entries(name)
        nbytes = sum(
            e.numel * torch.empty((), dtype=DTYPES_BY_NAME.get(e.dtype, torch.uint8)).element_size()
            for e in entries
        )
        kind = info.get("type", "?")
        detail = ""
        if kind == "module":
            params = sum(e.numel for e in entries if e.kind == "param")
            detail = f"{len(entries)} tensors, {params:,} parameters, {_size(nbytes)}"
        elif kind == "optimizer":
            groups = info.get("param_groups", [])
            keys = sorted({e.kind.removeprefix("optim:") for e in entries})
            detail = (
                f"family {info.get('family')}, {len(groups)} group(s), state {', '.join(keys)}, "
                f"{_size(nbytes)}"
            )
        elif kind in ("scheduler", "stateful"):
            detail = info.get("class", "")
        lines.append(f"  {name:20s} {kind:10s} {detail}")
    return lines


def run(args: argparse.Namespace) -> int:
    from accelkit.checkpoint.formats.transfer import local_paths
    from accelkit.checkpoint.store import store_for
    from accelkit.errors import CheckpointError

    try:
        # a checkpoint in object storage is downloaded first; what is printed names its location
        store = store_for(args.checkpoint)
        remote = store.local_directory(str(args.checkpoint)) is None
        cited = store.resolve(str(args.checkpoint)) if remote else str(args.checkpoint)
        with local_paths(args.checkpoint) as (local, _, _):
            return _inspect(args, local, cited)
    except CheckpointError as err:
        print(f"accelkit inspect: {err}", file=sys.stderr)
        return 1


def _inspect(args: argparse.Namespace, path: Any, cited: str) -> int:
    from accelkit.checkpoint import CheckpointReader

    reader = CheckpointReader(path)
    with reader:
        if args.json:
            print(json.dumps(reader.manifest.data, indent=1))
        else:
            print("\n".join(summary_lines(reader, cited if str(path) != cited else None)))
        if args.tensors:
            print("tensors")
            for e in reader.manifest.tensors:
                alias = f"  (aliases {', '.join(e.aliases)})" if e.aliases else ""
                print(
                    f"  {e.object}:{e.kind}:{e.fqn}  {list(e.shape)} {e.dtype}  "
                    f"{len(e.fragments)} fragment(s){alias}"
                )
        if args.no_verify:
            print("checksums   not verified (--no-verify)")
            return 0
        total = sum(int(i.get("bytes", 0)) for i in reader.manifest.files.values())
        bar = None
        if args.progress or (args.progress is None and total >= 256 << 20):
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify")
        try:
            problems = reader.verify_all(progress=bar)
        finally:
            if bar is not None:
                bar.close()
        fragments = sum(len(e.fragments) for e in reader.manifest.tensors)
        if problems:
            print(f"checksums   {len(problems)} of {fragments} fragment(s) FAILED", file=sys.stderr)
            for problem in problems:
                if str(path) != cited:  # a downloaded copy: name the objects
                    problem = problem.replace(str(reader.directory), cited)
                print(f"  {problem}", file=sys.stderr)
            return 1
        print(f"checksums   all {fragments} fragments OK")
    return 0
