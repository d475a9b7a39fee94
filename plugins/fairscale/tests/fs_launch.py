"""The script every rank runs: ``python -m torch.distributed.run ... fs_launch.py module:function
OUTDIR``. It imports only the named module (so a raw reference process holds no accelkit), calls
the function with ``OUTDIR/kwargs.json`` and writes ``OUTDIR/rank-<r>.json``."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    target, outdir = sys.argv[1], Path(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    module_name, _, function_name = target.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(**json.loads((outdir / "kwargs.json").read_text()))
    rank = int(os.environ.get("RANK", "0"))
    (outdir / f"rank-{rank}.json").write_text(json.dumps(result))
    # A raw reference destroys its gloo group itself; gloo's worker threads drop their last work
    # a moment later and abort the process if the interpreter is finalizing by then (see
    # accelkit/distributed.py, _leave_group_at_exit). Release the GIL for them first.
    time.sleep(0.1)


if __name__ == "__main__":
    main()
