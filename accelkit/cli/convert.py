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
        "MMEngine's Runner resumes (weights, optimizer, schedulers, message hub, meta). With "
        "--to dcp, a torch.distributed.checkpoint directory that dcp.load reads (the weights, "
        "and with --with-optimizer the optimizer state set_state_dict restores)."
    )
    parser.add_argument("src", help="a portable checkpoint, or a file/directory to import")
    parser.add_argument("dst", help="the file to export to, or the checkpoint directory to create")
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help=(
            "read a pickled input (.pt/.pth/.bin/.ckpt, DCP .metadata, DeepSpeed and ColossalAI "
            "checkpoints) with accelkit's restricted unpickler: tensors, containers, numpy values "
            "and the classes the input's library writes; it never runs code the file carries"
        ),
    )
    parser.add_argument(
        "--format",
        choices=("safetensors", "pt"),
        default=None,
        help="export format (default: from DST's suffix, else safetensors)",
    )
    parser.add_argument(
        "--to",
        choices=("mmengine", "hf", "dcp"),
        default=None,
        help="write a training framework's own checkpoint instead (mmengine: the .pth "
        "Runner.resume loads, a pickle as MMEngine's own; hf: DST is a directory of sharded "
        "safetensors with an index, as save_pretrained writes; dcp: DST is a "
        "torch.distributed.checkpoint directory holding {'model': weights}, streamed)",
    )
    parser.add_argument(
        "--with-optimizer",
        nargs="?",
        const=True,
        default=None,
        metavar="NAME",
        help="--to dcp: add the optimizer's state under 'optim', keyed by parameter name as "
        "get_state_dict gives it (NAME: which optimizer, where the checkpoint holds several)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="--to hf: the largest shard (bytes, or with KB/MB/GB), default 5GB",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="--to hf: cast floating-point weights (default: as stored)",
    )
    config = parser.add_mutually_exclusive_group()
    config.add_argument(
        "--config",
        default=None,
        help="--to hf: the config.json (or its folder) to write beside the weights; default: "
        "the one the checkpoint stored (a Transformers model's), else the one beside the "
        "pretrained source it was loaded from",
    )
    config.add_argument(
        "--no-config",
        dest="config",
        action="store_false",
        help="--to hf: write the weights without a config.json",
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


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)


def _hf_options(args: argparse.Namespace) -> dict:
    if args.to != "hf":
        return {}
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return {
        "max_shard_bytes": _size(args.max_shard_size),
        "dtype": dtypes.get(args.dtype) if args.dtype else None,
        "config": args.config,
    }


def run(args: argparse.Namespace) -> int:
    from accelkit.checkpoint.formats.convert import convert
    from accelkit.checkpoint.formats.transfer import local_paths
    from accelkit.errors import CheckpointError
    from accelkit.log import configure

    configure()
    try:
        # s3:// on either side: the source is downloaded, the result uploaded (manifest last)
        with local_paths(args.src, args.dst) as (src, dst, publish):
            out = publish(_convert(convert, src, dst, args))
    except CheckpointError as err:
        print(f"accelkit convert: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _convert(convert, src, dst, args: argparse.Namespace):
    return convert(
        src,
        dst,
        trust_pickle=args.trust_pickle,
        fmt=args.format,
        obj=args.object,
        strip_prefix=args.strip_prefix,
        progress=args.progress,
        to=args.to,
        optimizer=args.with_optimizer,
        **_hf_options(args),
    )
