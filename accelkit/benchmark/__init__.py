"""What ``accelkit bench`` and ``accelkit plan`` share: the workloads (models with a synthetic
batch), the benchmark runner and its worker processes, and the per-backend memory estimates.

Nothing here is imported by ``import accelkit``; the CLI loads it when one of the two commands runs.
"""

from accelkit.benchmark.workloads import Workload, get_workload

__all__ = ["Workload", "get_workload"]
