"""The portable checkpoint with ``fairscale_fsdp`` -- under the TEST-ONLY CPU shim (see
``fairscale_cpu_shim.py`` and ``test_fairscale_fsdp_shim.py``). Named ``*_shim``: not coverage
of FairScale FSDP itself; the GPU twin is ``test_fairscale_fsdp.py::test_checkpoint_round_trip_gpu``.

FairScale FSDP keeps each unit's parameters as one flat parameter cut into equal chunks (the
last padded); accelkit writes each rank's chunk as ranges of the original parameters and reads
them back at any world size. Checked, as in ``test_fairscale_checkpoint.py``: bit-exact resume
on the same backend, bit-for-bit transfer (target's own gather vs the source's) to and from
``ddp`` x2 and ``cpu`` x1, FSDP at world size 1 (where FairScale's own optimizer-state gather
fails), the loss curve after a resume, and a flipped byte in a flat-parameter fragment.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_fairscale_checkpoint import LOSS_RTOL, flip_byte_of

from accelkit.testing import run_ranks

pytestmark = pytest.mark.slow

TOTAL, SAVE_AT = 10, 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fairscale-fsdp-ckpt")
    names = ("fsdp", "ddp", "fsdp_w1", "fsdp16", "fsdp2", "fsdp_w1_16", "cpu_skew")
    ck = {name: str(root / name) for name in names}
    common = dict(total=TOTAL, save_at=SAVE_AT)
    shim = dict(backend="fairscale_fsdp", shim=True)
    shim16 = dict(shim, options={"precision": "16-mixed"})
    two = run_ranks(
        "fs_workers:ckpt_jobs",
        {
            "jobs": [
                dict(name="fsdp", save_to=ck["fsdp"], **shim, **common),
                dict(name="ddp", backend="ddp", save_to=ck["ddp"], **common),
                dict(name="fsdp2", backend="fsdp", save_to=ck["fsdp2"], **common),
                dict(
                    name="fsdp16",
                    save_to=ck["fsdp16"],
                    options={"precision": "16-mixed"},
                    **shim,
                    **common,
                ),
            ]
        },
    )
    one = run_ranks(
        "fs_workers:ckpt_jobs",
        {
            "jobs": [
                dict(name="fsdp_w1", batch=4, save_to=ck["fsdp_w1"], **shim, **common),
                dict(
                    name="fsdp_w1<-fsdp_w1", batch=4, total=TOTAL, load_from=ck["fsdp_w1"], **shim
                ),
                dict(name="cpu<-fsdp", backend="cpu", batch=4, total=TOTAL, load_from=ck["fsdp"]),
                dict(name="fsdp_w1_16", batch=4, save_to=ck["fsdp_w1_16"], **shim16, **common),
                dict(
                    name="fsdp_w1_16<-fsdp_w1_16",
                    batch=4,
                    total=TOTAL,
                    load_from=ck["fsdp_w1_16"],
                    **shim16,
                ),
                dict(
                    name="cpu<-fsdp_w1_16",
                    backend="cpu",
                    batch=4,
                    total=TOTAL,
                    load_from=ck["fsdp_w1_16"],
                ),
                # steps that differ inside one flat parameter: refused before the fill
                dict(
                    name="cpu_skew",
                    backend="cpu",
                    batch=4,
                    save_to=ck["cpu_skew"],
                    skew_step=True,
                    **common,
                ),
                dict(
                    name="fsdp_w1<-cpu_skew",
                    batch=4,
                    total=SAVE_AT + 1,
                    load_from=ck["cpu_skew"],
                    refused=True,
                    **shim,
                ),
                dict(
                    name="fsdp_w1<-cpu_skew,loose",
                    batch=4,
                    total=SAVE_AT + 1,
                    load_from=ck["cpu_skew"],
                    strict=False,
                    **shim,
                ),
            ]
        },
        nproc=1,
    )
    flipped = root / "flipped"
    shutil.copytree(ck["fsdp"], flipped)
    flip_byte_of(flipped, "rank-00001.safetensors", "param")
    loads = [
        ("fsdp<-fsdp", "fairscale_fsdp", ck["fsdp"]),
        ("ddp<-fsdp", "ddp", ck["fsdp"]),
        ("fsdp<-ddp", "fairscale_fsdp", ck["ddp"]),
        ("fsdp<-fsdp_w1", "fairscale_fsdp", ck["fsdp_w1"]),
        ("fsdp_not_flat<-fsdp", "fairscale_fsdp", ck["fsdp"]),
        ("fsdp<-flipped", "fairscale_fsdp", str(flipped)),
        ("fsdp16<-fsdp16", "fairscale_fsdp", ck["fsdp16"]),
        ("fsdp2<-fsdp", "fsdp", ck["fsdp"]),
        ("fsdp<-fsdp2", "fairscale_fsdp", ck["fsdp2"]),
        ("ddp<-fsdp16", "ddp", ck["fsdp16"]),
    ]
    jobs = []
    for name, backend, path in loads:
        job: dict[str, Any] = dict(name=name, backend=backend, total=TOTAL, load_from=path)
        if backend == "fairscale_fsdp":
            job["shim"] = True
        if name.startswith("fsdp_not_flat"):
            job["options"] = {"flatten_parameters": False}
        if name.startswith("fsdp16"):
            job["options"] = {"precision": "16-mixed"}
        jobs.append(job)
    two_loads = run_ranks("fs_workers:ckpt_jobs", {"jobs": jobs})
    return {
        "ranks": [{**two[r], **two_loads[r]} for r in range(2)],
        "one": one[0],
        "manifest": json.loads((Path(ck["fsdp"]) / "accelkit.json").read_text()),
    }


def _job(runs: dict[str, Any], name: str, rank: int = 0) -> dict[str, Any]:
    one = name.startswith(("cpu", "fsdp_w1"))
    job = runs["one"][name] if one else runs["ranks"][rank][name]
    assert "error" not in job, job.get("error")
    return job


def _losses(job: dict[str, Any]) -> dict[int, float]:
    return {int(k): v for k, v in job["losses"].items()}


def test_sources_trained_shim(runs):
    for name in ("fsdp", "ddp", "fsdp_w1", "fsdp16", "fsdp2", "fsdp_w1_16"):
        assert sorted(_losses(_job(runs, name))) == list(range(TOTAL))


@pytest.mark.parametrize(
    "name", ["fsdp<-fsdp", "fsdp_w1<-fsdp_w1", "fsdp16<-fsdp16", "fsdp_w1_16<-fsdp_w1_16"]
)
def test_same_backend_resume_is_bit_exact_shim(runs, name):
    """At world size 2, at world size 1 (FairScale's own optimizer gather fails there), and in
    16-mixed at both (fp32 master shards, and the loss scaler's state, travel; at world size 1
    FairScale leaves the gradients in fp16 and accelkit casts them before the step)."""
    resumed, original = _job(runs, name), _job(runs, name.split("<-")[1])
    assert resumed["after_load"] == original["at_save"]
    tail = {k: v for k, v in _losses(original).items() if k >= SAVE_AT}
    assert _losses(resumed) == tail


@pytest.mark.parametrize(
    "name",
    [
        "ddp<-fsdp",
        "fsdp<-ddp",
        "fsdp<-fsdp_w1",
        "cpu<-fsdp",
        "fsdp_not_flat<-fsdp",
        "ddp<-fsdp16",
        "cpu<-fsdp_w1_16",
        "fsdp2<-fsdp",
        "fsdp<-fsdp2",
    ],
)
def test_transfer_is_lossless_shim(runs, name):
    loaded, saved = _job(runs, name), _job(runs, name.split("<-")[1])
    assert loaded["after_load"]["params"] == saved["at_save"]["params"]
    if not name.startswith("fsdp_not_flat"):  # the test-side optimizer gather needs flat units
        assert loaded["after_load"]["optim"] == saved["at_save"]["optim"]


@pytest.mark.parametrize(
    "name",
    [
        "ddp<-fsdp",
        "fsdp<-ddp",
        "fsdp<-fsdp_w1",
        "cpu<-fsdp",
        "fsdp_not_flat<-fsdp",
        "fsdp2<-fsdp",
        "fsdp<-fsdp2",
    ],
)
def test_loss_curve_tracks_the_uninterrupted_run_shim(runs, name):
    resumed = _losses(_job(runs, name))
    original = _losses(_job(runs, name.split("<-")[1]))
    assert sorted(resumed) == list(range(SAVE_AT, TOTAL))
    worst = max(abs(resumed[k] - original[k]) / abs(original[k]) for k in resumed)
    print(name, "max relative loss difference", worst)
    assert worst <= LOSS_RTOL


def test_flipped_byte_in_a_flat_shard_fails_shim(runs):
    for rank in (0, 1):
        error = runs["ranks"][rank]["fsdp<-flipped"].get("error", "")
        assert error.startswith("CheckpointError"), error
        assert "rank-00001.safetensors" in error and "checksum" in error, error


def test_manifest_cuts_flat_shards_into_original_parameters_shim(runs):
    """Parameters are stored under their own names and shapes (no flat_param_0), each as the
    ranges the two ranks held; a parameter straddling the shard boundary has two fragments."""
    manifest = runs["manifest"]
    params = {t["fqn"]: t for t in manifest["tensors"] if t["kind"] == "param"}
    assert "inp.weight" in params and not any("flat_param" in k for k in params)
    assert params["inp.weight"]["shape"] == [16, 12]
    straddling = [t for t in params.values() if len(t["fragments"]) == 2]
    assert straddling, "expected a parameter cut by the shard boundary"
    for entry in straddling:
        files = {f["file"] for f in entry["fragments"]}
        assert files == {"rank-00000.safetensors", "rank-00001.safetensors"}


def test_steps_that_differ_inside_a_flat_parameter_are_refused_before_the_fill_shim(runs):
    """A torch run whose last parameter's AdamW ``step`` lags the others (one flat parameter
    in FairScale, which keeps one ``step`` per flat parameter): under ``strict`` the load is
    refused before anything is written, not halfway through as a PartialLoadError, and the
    live state is what it was; ``strict=False`` takes the largest step."""
    refused = runs["one"]["fsdp_w1<-cpu_skew"]
    error = refused.get("error", "")
    assert error.startswith("CheckpointError: "), refused
    assert "the flat parameter of" in error and "'step'" in error, error
    assert "strict=False" in error, error
    assert refused["unchanged"] is True
    loose = _job(runs, "fsdp_w1<-cpu_skew,loose")
    steps = {name: values["step"] for name, values in loose["after_load"]["optim"].items()}
    assert steps and set(map(tuple, steps.values())) == {(float(SAVE_AT),)}, steps
