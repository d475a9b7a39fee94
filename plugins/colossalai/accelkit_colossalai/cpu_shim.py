"""A workaround that lets ColossalAI 0.5.0's TorchDDP and LowLevelZero plugins run on a CPU.

ColossalAI's ``CpuAccelerator`` raises ``RuntimeError`` from the stream, synchronize and seeding
calls that its plugins make unconditionally, has a ``get_rng_state`` that passes a device to
``torch.get_rng_state`` (TypeError), and ``LowLevelZeroOptimizer`` asserts a CUDA/NPU device.
Applied only when accelkit runs a ColossalAI backend on the CPU (never with CUDA):

* the process's ColossalAI accelerator becomes :class:`CpuShimAccelerator`, a ``CpuAccelerator``
  whose stream calls are no-ops (CPU work is synchronous: there is nothing to wait for) and
  whose RNG calls go to torch's CPU generator;
* ``LowLevelZeroOptimizer._sanity_checks`` keeps its dtype check and drops the device assertion;
* ``torch.distributed.is_hccl_available`` (an Ascend-NPU query ColossalAI's pipeline p2p calls,
  absent from torch 2.13) answers False where torch lacks it, so ``pp`` runs.

What still does not run on the CPU, with or without this: fp16 loss scaling in LowLevelZero
(its scaler calls ``device_count``), ``overlap_communication`` (``record_stream``), and Gemini
(its optimizers are CUDA kernels). The backends refuse those with a clear error instead.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

log = logging.getLogger("accelkit")

_applied = False


def apply() -> None:
    """Install the workaround in this process (idempotent)."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the ColossalAI CPU shim must not be applied where CUDA is available")
    if not hasattr(torch.distributed, "is_hccl_available"):
        # colossalai/pipeline/p2p.py asks it before every pipeline send: no HCCL on a CPU
        torch.distributed.is_hccl_available = lambda: False  # type: ignore[attr-defined]
    from colossalai.accelerator import api
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    class CpuShimAccelerator(CpuAccelerator):
        """``CpuAccelerator`` with CPU meanings for the calls the plugins make."""

        def synchronize(self, device: Any = None) -> None:
            pass

        def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            return None

        def current_stream(self, device: Any = None) -> None:
            return None

        def default_stream(self, device: Any = None) -> None:
            return None

        def stream(self, stream_: Any) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

        def get_rng_state(self, device: Any = None) -> torch.Tensor:
            return torch.get_rng_state()

        def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
            torch.set_rng_state(new_state)

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def empty_cache(self) -> None:
            pass

    def sanity_checks_without_device(self: Any) -> None:
        for group in self.optim.param_groups:
            for param in group["params"]:
                if getattr(param, "skip_zero_check", False):
                    continue
                if param.dtype != self._dtype:
                    raise AssertionError(
                        f"Parameters are expected to have the same dtype `{self._dtype}`, "
                        f"but got `{param.dtype}`"
                    )

    api.set_accelerator(CpuShimAccelerator())
    LowLevelZeroOptimizer._sanity_checks = sanity_checks_without_device
    _applied = True
    log.info("colossalai: CPU workaround applied (accelkit_colossalai.cpu_shim)")
