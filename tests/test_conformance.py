"""The core backends pass the conformance suite, and the suite and its launcher can fail.

The suite itself is accelkit/testing/conformance.py; each plugin's tests carry the same lines.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import accelkit
from accelkit.backends.single import SingleDeviceBackend
from accelkit.testing import RanksFailed, run_ranks
from accelkit.testing.conformance import BackendContract, backend_contract

TestCpuContract = backend_contract(
    "cpu", world_sizes=(1,), resume_world_sizes=(1,), resume_with=("ddp", 2)
)
TestDdpContract = backend_contract("ddp", world_sizes=(1, 2))
TestFsdpContract = backend_contract("fsdp", world_sizes=(1, 2))


# ---- the suite can fail: a backend that forgets to clip ------------------------------------
@dataclass
class UnclippedOptions:
    pass


class UnclippedBackend(SingleDeviceBackend):
    """The cpu backend, except that it steps without clipping (a bug the suite must catch)."""

    options_class = UnclippedOptions

    def launch(self) -> None:
        self._device = torch.device("cpu")

    def optimizer_step(self, model, optimizer, *, max_grad_norm, track_grad_norm):
        return super().optimizer_step(model, optimizer, max_grad_norm=None, track_grad_norm=True)


class UnclippedPlugin:
    @accelkit.hookimpl
    def accelkit_register_backends(self, registry: Any) -> None:
        registry.add("unclipped_cpu", UnclippedBackend, description="test: never clips")


class _Unclipped(BackendContract):  # not collected: run by hand below
    backend = "unclipped_cpu"
    plugin = "test_conformance:UnclippedPlugin"
    world_sizes = (1,)


def test_the_contract_fails_a_backend_that_does_not_clip():
    contract = _Unclipped()
    contract.test_setup_returns_torch_optimizers(1)  # the rest of its contract holds
    with pytest.raises(AssertionError, match=r"pre-clip norms|weights|losses"):
        contract.test_accumulation_and_clipping_match_a_raw_loop(1)


def test_backend_contract_refuses_an_unknown_attribute():
    with pytest.raises(TypeError, match="world_size"):
        backend_contract("cpu", world_size=2)


# ---- the launcher ------------------------------------------------------------------------------
def test_run_ranks_returns_by_rank_without_importing_accelkit():
    assert run_ranks("launcher_workers:rank_worker", nproc=2, timeout=60) == [
        {"rank": 0, "accelkit": False},  # a raw reference process stays free of accelkit
        {"rank": 1, "accelkit": False},
    ]


def test_a_failing_rank_is_named_with_its_stderr():
    with pytest.raises(RanksFailed) as caught:
        run_ranks("launcher_workers:failing_worker", {"message": "boom-on-one"}, timeout=60)
    text = str(caught.value)
    assert "--- rank 1 stderr ---" in text and "RuntimeError: boom-on-one" in text
    assert "--- rank 0 stderr ---" in text


def test_a_hung_run_times_out_clearly():
    with pytest.raises(RanksFailed, match="did not finish on 2 processes within 5 s"):
        run_ranks("launcher_workers:sleeping_worker", {"seconds": 60}, timeout=5)


def test_a_target_that_is_not_importable_fails_before_launching():
    with pytest.raises(ValueError, match="not importable"):
        run_ranks("no_such_module_xq:main")
    with pytest.raises(ValueError, match="module:function"):
        run_ranks("test_conformance")


def test_import_accelkit_does_not_import_the_testing_package():
    code = "import sys, accelkit; accelkit.get; print([m for m in sys.modules if 'testing' in m and m.startswith('accelkit')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
