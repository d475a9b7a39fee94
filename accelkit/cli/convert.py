"""``accelkit convert SRC DST``: portable checkpoint <-> one file or a foreign format."""

from __future__ import annotations

import argparse
import sys


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Convert a portable checkpoint into one state-dict file (.safetensors, or .pt) that "
        "model.load_state_dict accepts, or a plain state-dict file, a "
        "torch.distributed.checkpoint directory or a Lightning/Fabric checkpoint into a "
        "portable checkpoint. Pickled inputs need --trust-pickle. With --to mmengine, a "
        "checkpoint written by AccelkitRunner/AccelkitStrategy becomes the .pth that plain "
        "MMEngine's Runner resumes (weights, optimizer, schedulers, message hub, meta)."
    )
    parser.add_argument("src", help="a portable checkpoint, or a file/directory to import")
    parser.add_argument("dst", help="the file to export to, or the checkpoint directory to create")
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow unpickling the input (.pt/.pth/.ckpt, DCP .metadata): runs code it carries",
    )
    parser.add_argument(
        "--format",
        choices=("safetensors", "pt"),
        default=None,
        help="export format (default: from DST's suffix, else safetensors)",
    )
    parser.add_argument(
        "--to",
        choices=("mmengine",),
        default=None,
        help="write a training framework's own checkpoint file instead (mmengine: the .pth "
        "Runner.resume loads; a pickle, as MMEngine's own)",
    )
    parser.add_argument("--object", default=None, help="which module of the checkpoint to export")
    parser.add_argument(
        "--strip-prefix", default=None, help="drop this prefix from imported names ('model.')"
    )
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", action="store_true", default=None, help="always show a bar")
    progress.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show a progress bar"
    )


def run(args: argparse.Namespace) -> int:
    from accelkit.checkpoint.convert import convert
    from accelkit.errors import CheckpointError
    from accelkit.log import configure

    configure()
    try:
        out = convert(
            args.src,
            args.dst,
            trust_pickle=args.trust_pickle,
            fmt=args.format,
            obj=args.object,
            strip_prefix=args.strip_prefix,
            progress=args.progress,
            to=args.to,
        )
    except CheckpointError as err:
        print(f"accelkit convert: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
