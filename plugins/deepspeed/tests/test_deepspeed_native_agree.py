"""A native DeepSpeed load whose bad file only one rank reads fails every rank at once (issue 35).

DeepSpeed's ``load_checkpoint`` has every rank read its own files between collectives: a rank
whose file raised used to leave the others waiting there until the process group's timeout (30
minutes by default). Now each rank reads its files before DeepSpeed does, and the ranks agree:
rank 1's damaged, refused or missing file fails both ranks with one error that names rank 1 and
the file. The workers' process group times out after ``GROUP_TIMEOUT_S``: a rank left waiting
would fail with gloo's timeout instead, so the equal, clear errors are the bound, and a regression
fails in about a minute rather than hanging.
"""

from __future__ import annotations

from typing import Any

import pytest
from dsk_native_agree import DAMAGES
from test_deepspeed_training import CPU_ENV

from accelkit.testing import run_ranks

pytestmark = pytest.mark.slow

GROUP_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ds-native-agree")
    marker = root / "gadget-ran"
    results = run_ranks(
        "dsk_native_agree:run",
        {"root": str(root), "marker": str(marker), "group_timeout": GROUP_TIMEOUT_S},
        env=CPU_ENV,
        timeout=900,
    )
    assert not marker.exists()
    return results


@pytest.mark.parametrize("stage", [2, 3])
def test_an_untampered_native_checkpoint_loads_bit_exact(ranks, stage):
    for result in ranks:
        load = result[f"load z{stage}"]
        assert "error" not in load, load["error"]
        assert load["loaded"] == result[f"save z{stage}"]["saved"]


EXPECTED = {
    "flipped byte": ("CheckpointError: ", "damaged (Bad CRC-32"),
    "gadget": ("PickleRefused: ", "refused to unpickle: it names posix.system"),
    "missing": ("CheckpointError: ", "missing from the native checkpoint"),
}


@pytest.mark.parametrize("name,stage,file_name,how", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_rank_1s_bad_file_fails_every_rank_with_one_clear_error(ranks, name, stage, file_name, how):
    errors = [result[name].get("error") for result in ranks]
    assert errors[0] is not None and errors[0] == errors[1]  # the same error on both ranks
    kind, why = EXPECTED[name.rsplit(" ", 1)[0]]
    assert errors[0].startswith(kind)
    assert "before DeepSpeed read anything, as 1 of 2 ranks cannot read their files" in errors[0]
    assert f"rank 1: {kind}" in errors[0] and "rank 0:" not in errors[0]
    assert f"/global_step2/{file_name}: {why}" in errors[0]
    assert not any(result["marker"] for result in ranks)
    if how == "flip":  # the byte is in tensor data: torch alone loads the file
        assert ranks[0][name]["loads_under_torch"]
