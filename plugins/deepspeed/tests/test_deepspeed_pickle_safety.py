"""``trust_pickle=True`` never runs a DeepSpeed checkpoint's code (issue 35).

DeepSpeed's files are pickles. Under ``trust_pickle=True`` (``--trust-pickle``) both readers of
them, ``accelkit convert``'s importer and ``accel.load(..., format="native")``, go through
accelkit's restricted unpickler with DeepSpeed's allowlist (accelkit_deepspeed.pickles).

* Real checkpoints written by raw DeepSpeed (dsk_pickle_reference.py: ZeRO 0-3, fp32 and bf16,
  2 gloo ranks) import with their fp32 masters bit for bit, and name nothing off the list.
* The same checkpoints with a code-running gadget planted (``os.system``, ``exec``, one nested
  in a dict, one inside a tensor storage's persistent id), in the model file or the optimizer
  files, are refused, naming the gadget's global and what to do; the gadget never runs (its
  marker file is never created) and nothing is written. Each gadget does run under
  ``torch.load(weights_only=False)``, which the importer used before.
* A native save loads natively (ZeRO-3: its tensors carry ``ds_id``), and with a gadget planted
  it is refused on every rank, nothing run. A ZeRO-3 load without the optimizer, which DeepSpeed
  reads with ``zero_to_fp32``'s unrestricted ``torch.load``, is refused.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from dsk_pickle_native import NATIVE_PLANTINGS, PLACES
from dsk_pickle_reference import VARIANTS
from test_deepspeed_training import CPU_ENV

from accelkit.checkpoint.formats.convert import convert
from accelkit.cli import main as cli
from accelkit.sdk import PickleRefused, pickle_globals
from accelkit.testing import run_ranks
from accelkit.testing.pickle_gadgets import gadgets

pytestmark = pytest.mark.slow

#: how torch writes a tensor with attributes (ZeRO-3's ds_id); allowed only as checked
REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"
#: every refusal ends with what to do about it
WHAT_TO_DO = "load it with DeepSpeed in your own code and save it with accel.save"
GADGETS = (*gadgets("marker"), "persistent id")
#: the checkpoints gadgets are planted in: ZeRO-2 (one model file) and ZeRO-3 bf16 (model and
#: optimizer files per rank, tensors with ds_id)
PLANTED_IN = ("z2-fp32", "z3-bf16")


def _refused_global(gadget: str) -> str:
    return gadgets("marker").get(gadget, gadgets("marker")["os.system"])[1]


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ds-raw")
    ranks = run_ranks(
        "dsk_pickle_reference:save_variants", {"root": str(root)}, env=CPU_ENV, timeout=900
    )
    return root, ranks[0]


@pytest.fixture(scope="module")
def planted(raw: tuple[Path, dict[str, Any]]) -> tuple[Path, Path]:
    """Copies of the raw checkpoints with a gadget planted, ``<variant>-<gadget>-<place>``; the
    planting runs in a process of its own (DeepSpeed's classes load there, not here)."""
    root, _ = raw
    marker = root / "gadget-ran"
    plantings = [
        dict(
            source=str(root / variant),
            target=str(root / f"{variant}-{gadget}-{place}"),
            gadget=gadget,
            place=place,
            marker=str(marker),
        )
        for variant in PLANTED_IN
        for gadget in GADGETS
        for place in PLACES
    ]
    run_ranks("dsk_pickle_native:plant_all", {"plantings": plantings}, nproc=1, env=CPU_ENV)
    return root, marker


def _exported_weights(portable: Path, tmp_path: Path) -> dict[str, list[float]]:
    from safetensors.torch import load_file

    convert(portable, tmp_path / "model.safetensors")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    return {k: v.float().reshape(-1).tolist() for k, v in tensors.items() if k != "scale"}


@pytest.mark.parametrize("variant", [f"z{stage}-{precision}" for stage, precision in VARIANTS])
def test_a_real_checkpoint_imports_under_trust_pickle(raw, variant, tmp_path):
    root, reference = raw
    portable = convert(root / variant, tmp_path / "portable", trust_pickle=True)
    # ZeRO-0 bf16: fc3.bias and the frozen head.bias have one shape, so the optimizer's integer
    # ids match two ways; the importer then leaves the optimizer and its fp32 copies out and
    # takes the module's weights, as docs/checkpoint.md says
    expected = "lp" if variant == "z0-bf16" else "weights"
    assert _exported_weights(portable, tmp_path) == reference[variant][expected]


def test_every_global_real_checkpoints_name_is_on_the_list(raw):
    from accelkit_deepspeed import pickles

    root, reference = raw
    assert {r["wrapper"] for r in reference.values()} >= {
        "DeepSpeedZeroOptimizer",
        "DeepSpeedZeroOptimizer_Stage3",
    }
    named = set().union(*(pickle_globals(f) for f in root.glob("z?-*/*/*.pt")))
    assert named - pickles.import_allowlist().names == {REBUILD_FROM_TYPE}  # ZeRO-3's ds_id
    assert named & set(pickles.CHECKPOINT_CLASSES) == {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    }


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("gadget", GADGETS)
@pytest.mark.parametrize("variant", PLANTED_IN)
def test_a_planted_gadget_is_refused_and_never_runs(planted, variant, gadget, place, tmp_path):
    root, marker = planted
    with pytest.raises(PickleRefused, match=WHAT_TO_DO) as refusal:
        convert(root / f"{variant}-{gadget}-{place}", tmp_path / "out", trust_pickle=True)
    assert _refused_global(gadget) in refusal.value.refused
    assert "nothing in the file was run" in str(refusal.value)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_the_reported_gadget(planted, tmp_path):
    """The report's case: ``accelkit convert DS_FOLDER out --trust-pickle`` on a checkpoint whose
    ``mp_rank_00_model_states.pt`` holds an ``os.system`` reduce."""
    root, marker = planted
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = cli(
            [
                "convert",
                str(root / "z2-fp32-os.system-model"),
                str(tmp_path / "out"),
                "--trust-pickle",
            ]
        )
    assert code == 1
    assert (
        f"mp_rank_00_model_states.pt: refused to unpickle: it names {_refused_global('os.system')},"
        in stderr.getvalue()
    )
    assert WHAT_TO_DO in stderr.getvalue()
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gadget", GADGETS)
def test_each_gadget_runs_under_an_unrestricted_load(planted, gadget):
    """The negative tests can fail: what the importer did before runs each gadget."""
    root, marker = planted
    file = next((root / f"z2-fp32-{gadget}-model").rglob("mp_rank_00_model_states.pt"))
    with contextlib.suppress(Exception):  # the persistent-id gadget runs, then torch fails
        torch.load(file, map_location="cpu", weights_only=False)
    assert marker.exists()
    marker.unlink()


def test_native_load_refuses_gadgets_and_loads_a_real_checkpoint(tmp_path):
    marker = tmp_path / "gadget-ran"
    ranks = run_ranks(
        "dsk_pickle_native:run",
        {"root": str(tmp_path), "stage": 3, "marker": str(marker)},
        env=CPU_ENV,
        timeout=900,
    )
    for result in ranks:
        assert "error" not in result["load"], result["load"]["error"]
        assert result["load"]["loaded"] == result["save"]["saved"]
        for gadget, place in NATIVE_PLANTINGS:
            error = result[f"{gadget} in the {place} file"]["error"]
            assert error.startswith("PickleRefused: ")
            assert f"it names {_refused_global(gadget)}" in error and WHAT_TO_DO in error
        model_only = result["model only"]["error"]
        assert model_only.startswith("UnsupportedError: ")
        assert "ZeRO-3 without the optimizer in state" in model_only
        assert not result["marker"]
    assert not marker.exists()
