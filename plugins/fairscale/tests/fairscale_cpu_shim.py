"""TEST-ONLY workaround that lets FairScale 0.4.13's FullyShardedDataParallel run on a CPU.

Not part of the plugin, and never imported by it. FairScale's FSDP drives CUDA streams
unconditionally (``torch.cuda.stream(self._streams["all_gather"])``, ``record_stream``, a
``.cuda()`` in ``clip_grad_norm_``), so on a machine without CUDA its first forward fails with
``KeyError: 'all_gather'``. This module replaces, inside FairScale's FSDP module only, the
``torch`` name with a view of torch whose ``cuda`` streams are no-ops, and makes
``Tensor.record_stream`` a no-op for CPU tensors (the one process-wide patch).

Tests that import it are named ``*_shim``, do not count as coverage of ``fairscale_fsdp``,
and each has a GPU twin marked ``gpu`` that runs FairScale unpatched.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

_applied = False


class _NoOpStream:
    """Stands for a ``torch.cuda.Stream``: work on the CPU is already ordered."""

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _FakeCuda(types.SimpleNamespace):
    """``torch.cuda`` as FairScale's FSDP sees it under the shim: streams that do nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._default = _NoOpStream()
        self._current = self._default
        self.Stream = _NoOpStream

    def is_available(self) -> bool:
        return True  # FSDP then builds its (no-op) streams instead of leaving the dict empty

    def current_stream(self, device: Any = None) -> _NoOpStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: _NoOpStream) -> Iterator[None]:
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self, device: Any = None) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchView(types.ModuleType):
    """``torch`` with its ``cuda`` attribute replaced; everything else is the real module."""

    def __init__(self, cuda: _FakeCuda) -> None:
        super().__init__("torch")
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _NormWithIdentityCuda(torch.Tensor):
    """The local norm in ``clip_grad_norm_`` is moved with ``.cuda()``; keep it where it is."""

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor)


def apply() -> None:
    """Patch FairScale's FSDP module for CPU use, once per process. Only call it without CUDA."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the FairScale CPU shim is for machines without CUDA only")
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module

    fsdp_module.torch = _TorchView(_FakeCuda())

    real_norm = fsdp_module.calc_grad_norm

    def calc_grad_norm(parameters: Any, p: float) -> torch.Tensor:
        return real_norm(parameters, p).as_subclass(_NormWithIdentityCuda)

    fsdp_module.calc_grad_norm = calc_grad_norm

    real_record_stream = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type == "cpu":
            return
        real_record_stream(self, stream)

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
    _applied = True
