"""``accelkit run``: launch a training script on several processes or machines.

A thin front for ``torch.distributed.run`` (torchrun): the flags below are torchrun's and are
passed through unchanged, so the elastic agent, rendezvous and restarts behave as torchrun's do.
"""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("accelkit")

EPILOG = """\
examples:
  accelkit run --nproc-per-node 2 train.py --lr 3e-4
  accelkit run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 \\
      --nproc-per-node 8 train.py
  accelkit run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job7 \\
      --nproc-per-node gpu train.py

The script needs nothing accelkit-specific to be launched: accelkit.get() reads RANK,
WORLD_SIZE and LOCAL_RANK, so a script started by torchrun directly works unchanged, and so
does one started by srun under SLURM (SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID are mapped
onto them when no launcher set them). CPU processes use gloo, CUDA processes nccl.
OMP_NUM_THREADS defaults to 1 per process when several run on a node (as torchrun does).
"""

#: torchrun flags accelkit passes through: (flag, underscore alias or None, takes a value, help)
TORCHRUN_FLAGS: list[tuple[str, str | None, bool, str]] = [
    ("--nproc-per-node", "--nproc_per_node", True, "processes per node: N, 'gpu', 'cpu' or 'auto'"),
    ("--nnodes", None, True, "number of nodes, or MIN:MAX for elastic jobs"),
    ("--node-rank", "--node_rank", True, "rank of this node (static rendezvous)"),
    ("--master-addr", "--master_addr", True, "address of node 0 (static rendezvous)"),
    ("--master-port", "--master_port", True, "port on node 0 (static rendezvous)"),
    ("--rdzv-backend", "--rdzv_backend", True, "rendezvous backend (static, c10d, etcd)"),
    ("--rdzv-endpoint", "--rdzv_endpoint", True, "rendezvous HOST:PORT"),
    ("--rdzv-id", "--rdzv_id", True, "job id shared by every node"),
    ("--rdzv-conf", "--rdzv_conf", True, "extra rendezvous settings, KEY=VALUE,..."),
    ("--standalone", None, False, "single node with a local rendezvous on a free port"),
    ("--max-restarts", "--max_restarts", True, "restarts of the worker group on failure"),
    ("--monitor-interval", "--monitor_interval", True, "seconds between worker checks"),
    ("--start-method", "--start_method", True, "spawn, fork or forkserver"),
    ("--role", None, True, "worker role name"),
    ("--log-dir", "--log_dir", True, "directory for worker logs"),
    ("--redirects", "-r", True, "redirect worker std streams to files (0-3 or per-rank map)"),
    ("--tee", "-t", True, "also write worker std streams to files (0-3 or per-rank map)"),
    ("--local-ranks-filter", "--local_ranks_filter", True, "only show logs of these local ranks"),
    ("--local-addr", "--local_addr", True, "address of this node"),
    ("--module", "-m", False, "run SCRIPT as a module, like python -m"),
    ("--no-python", "--no_python", False, "run SCRIPT as an executable, not through python"),
    ("--run-path", "--run_path", False, "run SCRIPT with runpy.run_path"),
]


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.allow_abbrev = False  # the script's own flags must never match a prefix of ours
    parser.epilog = EPILOG
    for flag, alias, takes_value, help_text in TORCHRUN_FLAGS:
        names = [flag] if alias is None else [flag, alias]
        if takes_value:
            parser.add_argument(*names, dest=_dest(flag), help=help_text)
        else:
            parser.add_argument(*names, dest=_dest(flag), action="store_true", help=help_text)
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The argument list for ``torch.distributed.run.main`` equivalent to ``args``."""
    argv: list[str] = []
    for flag, _, takes_value, _ in TORCHRUN_FLAGS:
        value = getattr(args, _dest(flag), None)
        if takes_value and value is not None:
            argv += [flag, str(value)]
        elif not takes_value and value:
            argv.append(flag)
    return [*argv, args.script, *args.script_args]


def _several_per_node(nproc_per_node: str | None) -> bool:
    if nproc_per_node is None:
        return False
    return not (nproc_per_node.isdigit() and int(nproc_per_node) <= 1)


def launch(argv: list[str]) -> int:
    """Do what ``torch.distributed.run.main(argv)`` does; return the exit code instead of raising.

    torchrun's parser matches abbreviated flags even among the script's own arguments (a
    script flag ``--nproc`` is "ambiguous"); parsing with ``allow_abbrev=False`` avoids that.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False
    try:
        record(torchrun.run)(parser.parse_args(argv))
    except ChildFailedError as err:
        codes = [f.exitcode for f in err.failures.values() if f.exitcode and f.exitcode > 0]
        return codes[0] if codes else 1
    return 0


def run(args: argparse.Namespace) -> int:
    if "OMP_NUM_THREADS" not in os.environ and _several_per_node(args.nproc_per_node):
        # What torchrun does (with a warning): several processes must not each spawn a
        # thread per core. Set it here quietly; export OMP_NUM_THREADS to choose another value.
        os.environ["OMP_NUM_THREADS"] = "1"
    return launch(torchrun_argv(args))
