"""The script every rank runs: ``python <this file> module:function OUTDIR``.

It is run by its path, not as ``accelkit.testing._rank``, so that a rank imports only the named
module: a raw-PyTorch reference process holds no accelkit. The folders to find the module in come
from ``ACCELKIT_TESTING_PATH`` (set by :func:`accelkit.testing.run_ranks`); the function is
called with ``OUTDIR/kwargs.json`` and what it returns (JSON) is written to
``OUTDIR/rank-<r>.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

#: where run_ranks lists the folders of the worker's module (os.pathsep-separated)
PATH_ENV = "ACCELKIT_TESTING_PATH"
#: how long a rank releases the GIL for gloo's worker threads before the interpreter finalizes
GLOO_DRAIN_S = 0.1


def _leave_group() -> None:
    """Destroy a process group the worker left open, then release the GIL for a moment.

    A gloo worker thread drops its last finished work a moment after the caller saw it complete;
    dropping it needs the GIL, and once the interpreter is finalizing that aborts the process
    ("terminate called without an active exception"; bench/gloo_exit_abort.sh counts it, and
    accelkit/distributed.py's ``_leave_group_at_exit`` says why). accelkit leaves its own group
    at exit; a raw reference that did not destroy its group is left here, and either way the
    sleep lets the threads drop their work before finalization starts.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as err:  # exiting anyway; the result is already written
            print(f"destroy_process_group at exit failed: {err}", file=sys.stderr)
    time.sleep(GLOO_DRAIN_S)


def main() -> None:
    target, outdir = sys.argv[1], Path(sys.argv[2])
    here = str(Path(__file__).resolve().parent)
    if sys.path and sys.path[0] == here:  # this folder is not where workers live
        sys.path.pop(0)
    for folder in reversed([p for p in os.environ.get(PATH_ENV, "").split(os.pathsep) if p]):
        sys.path.insert(0, folder)
    module_name, _, function_name = target.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(**json.loads((outdir / "kwargs.json").read_text()))
    rank = int(os.environ.get("RANK", "0"))
    (outdir / f"rank-{rank}.json").write_text(json.dumps(result))
    _leave_group()


if __name__ == "__main__":
    main()
