"""``accelkit run``: launch a training script on several processes or machines.

A thin front for ``torch.distributed.run`` (torchrun): the flags below are torchrun's and are
passed through unchanged. Two things differ, both so that elastic jobs work:

- in a job that can restart (``--max-restarts`` above 0, or ``--nnodes MIN:MAX``), the workers
  build a store of their own for each attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) instead
  of sharing the rendezvous agent's, which outlives worker restarts: with torch's default, a
  restarted group's gloo init reads the previous attempt's addresses (fails, or hangs for
  minutes) and a rejoining node fails with ``DistStoreError`` (pytorch #135712, #167288). A job
  that cannot restart keeps torch's default: one attempt meets no earlier one, and the agent's
  store is already listening (a fresh one is bound later, on a port another process may take);
- a signal to the launcher ends it with one line and status 128 + the signal (SIGTERM: 143,
  SIGINT: 130), after torchrun has passed the signal on to its workers, instead of a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

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

elastic jobs, and any job that can restart (--nnodes MIN:MAX, --max-restarts N > 0): accelkit
run sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so each attempt's workers get a fresh store of
their own (rank 0 hosts it). torch's default shares the rendezvous agent's store with the
workers; it outlives worker restarts, and with it a restarted group's gloo init reads the
previous attempt's addresses and a rejoining node fails with DistStoreError after 60 s (pytorch
#135712, #167288). Export the variable yourself (0 keeps torch's default), or pass
--share-rdzv-store, to choose.
The node at --rdzv-endpoint hosts the rendezvous: if it goes, the job goes; start it on the
node least likely to be preempted. A signal to this command is passed on to the workers (they
save and stop: accelkit.preemption) and ends it with status 128 + the signal (SIGTERM: 143).
See docs/multi-node.md.
"""

#: torch's switch between the rendezvous agent's store and one per attempt (pytorch #135712)
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

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
    parser.add_argument(
        "--share-rdzv-store",
        dest="share_rdzv_store",
        action="store_true",
        help="let the workers share the rendezvous agent's store, torch's default (breaks "
        "elastic restarts: pytorch #135712); accelkit gives each attempt its own",
    )
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
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False
    try:
        record(torchrun.run)(parser.parse_args(argv))
    except ChildFailedError as err:
        codes = [f.exitcode for f in err.failures.values() if f.exitcode and f.exitcode > 0]
        return codes[0] if codes else 1
    except SignalException as err:  # the agent has stopped its workers already
        _ended_by(signal.Signals(err.sigval))
    except KeyboardInterrupt:  # SIGINT before the agent installed its handlers
        _ended_by(signal.SIGINT)
    return 0


def _ended_by(sig: signal.Signals) -> NoReturn:
    """One line instead of the agent's traceback, and the shell's status for a signal's death.

    The process ends here, without the interpreter's shutdown: a rendezvous thread of torch's
    (C++) may still run after a signal, and its destruction at exit aborts the agent ("terminate
    called without an active exception", status -6 instead of 143: 1 of about 20 runs)."""
    status = 128 + int(sig)
    sys.stderr.write(f"accelkit run: stopped by {sig.name}; exit status {status}\n")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def can_restart(args: argparse.Namespace) -> bool:
    """Whether the job may run a second attempt: restarts, or an elastic node count."""
    restarts = str(getattr(args, "max_restarts", None) or "0").strip()
    low, _, high = str(getattr(args, "nnodes", None) or "").partition(":")
    return (restarts.isdigit() and int(restarts) > 0) or (bool(high) and high != low)


def choose_store_sharing(
    share: bool, restarts: bool, environ: dict[str, str] | None = None
) -> None:
    """Give each attempt's workers a store of their own in a job that can restart, unless the
    user chose (the variable is set, or ``--share-rdzv-store``): torch's shared store breaks
    restarts. A job of one attempt keeps torch's default."""
    environ = os.environ if environ is None else environ
    if SHARE_STORE_ENV in environ:
        return
    if share:
        environ[SHARE_STORE_ENV] = "0"
    elif restarts:
        environ[SHARE_STORE_ENV] = "1"


def run(args: argparse.Namespace) -> int:
    if "OMP_NUM_THREADS" not in os.environ and _several_per_node(args.nproc_per_node):
        # What torchrun does (with a warning): several processes must not each spawn a
        # thread per core. Set it here quietly; export OMP_NUM_THREADS to choose another value.
        os.environ["OMP_NUM_THREADS"] = "1"
    choose_store_sharing(args.share_rdzv_store, can_restart(args))
    return launch(torchrun_argv(args))
