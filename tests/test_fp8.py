"""``precision="fp8-mixed"`` (issue 26, item 4): float8 Linear layers through torchao.

Reference: ``fp8_reference.train_raw`` (raw torch + torchao's ``convert_to_float8_training`` with
the documented layer filter written out by hand, under bf16 autocast; it imports nothing from
accelkit).

Measured on torch 2.13 CPU, torchao 0.18 (torch's CPU ``_scaled_mm``, a reference kernel: 0.1 s
for a 256 x 64 x 192 product, so the batch is kept at 2 sequences and the default tier's fp8 tests
take about 45 s), one thread, TinyGPT width 64, 2 blocks, seq 32, batch 2, AdamW 3e-3, clipping
at 1.0, 30 steps (the loss falls from 5.59 to 5.03):

- accelkit ``cpu`` fp8-mixed against the raw reference: 0 (bit-identical losses and weights), so
  the tolerance is 0.
- fp8-mixed against bf16-mixed (both raw): the per-step losses differ by at most 7.8e-4 relative
  (5-step trailing means 3.3e-4); at batch 8 it was 4.8e-4 (1.4e-3 over 40 steps). bf16-mixed
  against 32-true on the same run: 1.5e-4. Tolerance 5e-3: 6.4x the gap measured here, 3.6x the
  largest gap seen. The reference's fp8 run must also differ from its bf16 run by more than
  5e-5 (15x below the gap), or float8 was not in force. (accelkit's bf16-mixed equals the raw
  loop bit for bit, tests/test_precision.py, and so does its fp8-mixed, below: the gap is
  accelkit's too.)
"""

from __future__ import annotations

import builtins
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accelkit
from accelkit.errors import ConfigError, PluginMissingError
from accelkit.testing import run_ranks

pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (pip install torchao)")

from fp8_reference import TinyGPT, float8_layers, markov_tokens, smoothed, train_raw

MODEL = {"vocab": 256, "width": 64, "layers": 2, "heads": 4, "seq": 32}
STEPS, BATCH, LR = 30, 2, 3e-3
#: fp8-mixed against bf16-mixed, per-step relative loss gap (measured 7.8e-4, see above)
FP8_VS_BF16_RTOL = 5e-3
#: fp8-mixed must differ from bf16-mixed by more than this (15x below the measured gap)
FP8_EFFECT_MIN = 5e-5
#: the tiny model's Linear layers are 64 wide: the default fp8_min_features (1024) keeps them all
SMALL = {"fp8_min_features": 16}
BLOCK_LAYERS = {f"blocks.{i}.{n}" for i in range(2) for n in ("qkv", "proj", "fc1", "fc2")}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One CPU thread: the CI box has 2 shared cores, where two threads spin against each other
    (40 steps took 45 s with 2 threads on a loaded box, 4 s with one), and fixes the op order."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def train_accelkit(
    precision: str, steps: int = STEPS, backend: str = "cpu", **options: Any
) -> dict[str, Any]:
    """The loop of the docs on ``backend``: the same model, data and optimizer as ``train_raw``."""
    accel = accelkit.get(backend, precision=precision, max_grad_norm=1.0, **options)
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accel.setup(model, optimizer)
    x, y = markov_tokens(steps * BATCH, MODEL["seq"], MODEL["vocab"])
    losses = []
    for step in range(steps):
        window = slice(step * BATCH, (step + 1) * BATCH)
        loss = model(accel.to_device(x[window]), accel.to_device(y[window]))
        accel.backward(loss)
        accel.step()
        losses.append(loss.item())
    return {"accel": accel, "model": model, "optimizer": optimizer, "losses": losses}


def converted(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


@pytest.fixture(scope="module")
def raw_runs() -> dict[str, dict[str, Any]]:
    common = {"steps": STEPS, "batch": BATCH, "lr": LR, "model_kwargs": MODEL}
    return {p: train_raw(precision=p, **common) for p in ("fp8-mixed", "bf16-mixed")}


# ---- numerics ---------------------------------------------------------------------------------
@pytest.mark.slow  # with the next test: the raw runs, 16 s, and ours, 16 s
def test_cpu_fp8_mixed_matches_the_raw_torchao_loop(raw_runs):
    run = train_accelkit("fp8-mixed", **SMALL)
    expected = raw_runs["fp8-mixed"]
    assert run["losses"] == expected["losses"]  # measured bit-identical
    assert converted(run["model"]) == set(expected["converted"]) == BLOCK_LAYERS
    state = {k: v.detach().float() for k, v in run["model"].state_dict().items()}
    assert state.keys() == expected["state"].keys()
    assert all(torch.equal(state[k], expected["state"][k]) for k in state)


@pytest.mark.slow
def test_fp8_mixed_tracks_bf16_mixed_within_the_measured_gap(raw_runs):
    fp8, bf16 = raw_runs["fp8-mixed"]["losses"], raw_runs["bf16-mixed"]["losses"]
    gap = relative_gap(fp8, bf16)
    assert FP8_EFFECT_MIN < gap <= FP8_VS_BF16_RTOL, gap
    assert relative_gap(smoothed(fp8, 5), smoothed(bf16, 5)) <= FP8_VS_BF16_RTOL
    assert fp8[-1] < fp8[0] - 0.3  # it learns: 5.59 -> 5.03 over the run


@pytest.mark.slow  # two fp8 loops on the CPU reference kernel: 5-8 s
def test_rowwise_recipe_matches_the_raw_loop():
    expected = train_raw(
        precision="fp8-mixed", steps=4, batch=BATCH, lr=LR, model_kwargs=MODEL, recipe="rowwise"
    )
    run = train_accelkit("fp8-mixed", steps=4, fp8_recipe="rowwise", **SMALL)
    assert run["losses"] == expected["losses"]
    tensorwise = train_raw(precision="fp8-mixed", steps=4, batch=BATCH, lr=LR, model_kwargs=MODEL)
    assert run["losses"] != tensorwise["losses"]  # the recipe is really in force


# ---- which layers convert ------------------------------------------------------------------------
class Kept(torch.nn.Module):
    """One Linear layer for each reason to stay in bf16, and ``body``, the one that converts."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.odd = torch.nn.Linear(32, 40)  # 40: not a multiple of 16
        self.sub = torch.nn.modules.linear.NonDynamicallyQuantizableLinear(32, 32)  # a subclass
        self.body = torch.nn.Linear(32, 32)
        self.tied = torch.nn.Linear(32, 64, bias=False)
        self.tied.weight = self.emb.weight  # shared with the embedding
        self.last = torch.nn.Linear(32, 32)  # the output head: last in module order


def convert_with(model: torch.nn.Module, **options: Any) -> set[str]:
    accel = accelkit.get("cpu", precision="fp8-mixed", **options)
    return converted(accel.setup(model))


def test_the_filter_converts_what_the_docs_say():
    model = TinyGPT(**MODEL)
    assert float8_layers(model, 16) == BLOCK_LAYERS  # the reference's reading of the rule
    assert convert_with(TinyGPT(**MODEL), **SMALL) == BLOCK_LAYERS
    assert convert_with(TinyGPT(**MODEL), fp8_skip_head=False, **SMALL) == BLOCK_LAYERS | {"head"}
    kept = convert_with(TinyGPT(**MODEL), fp8_skip=["blocks.1.*", "*.qkv"], **SMALL)
    assert kept == {"blocks.0.proj", "blocks.0.fc1", "blocks.0.fc2"}
    # fc1 is 64x256 and fc2 256x64: a threshold of 128 keeps every layer with a 64 side
    with pytest.raises(ConfigError, match=r"no nn.Linear layer of this model qualifies"):
        convert_with(TinyGPT(**MODEL), fp8_min_features=128)
    # not a multiple of 16 (40), tied to an embedding, a Linear subclass, the head (last)
    assert convert_with(Kept(), **SMALL) == {"body"}


def test_the_default_threshold_keeps_small_layers_and_names_why():
    with pytest.raises(ConfigError, match=r"64x192: below fp8_min_features=1024"):
        convert_with(TinyGPT(**MODEL))


def test_a_skip_pattern_that_matches_nothing_is_an_error():
    with pytest.raises(ConfigError, match=r"fp8_skip patterns \['lm_head'\] match no nn.Linear"):
        convert_with(TinyGPT(**MODEL), fp8_skip=["lm_head"], **SMALL)


def test_converted_layers_keep_their_parameters():
    """The optimizer built before setup steps the converted weights (Float8Linear takes the
    layer's own Parameter objects), and the names are the plain model's."""
    accel = accelkit.get("cpu", precision="fp8-mixed", **SMALL)
    model = TinyGPT(**MODEL)
    names = list(model.state_dict())
    weight = model.blocks[0].qkv.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accel.setup(model, optimizer)
    assert model.blocks[0].qkv.weight is weight and list(model.state_dict()) == names
    before = weight.detach().clone()
    x, y = markov_tokens(2, MODEL["seq"], MODEL["vocab"])
    accel.backward(model(x, y))
    accel.step()
    assert not torch.equal(before, weight.detach())


# ---- options and refusals ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"fp8_recipe": "delayed"}, r"fp8_recipe' must be one of tensorwise, rowwise"),
        ({"fp8_min_features": 8}, r"fp8_min_features' must be >= 16"),
        ({"fp8_skip": "head"}, r"fp8_skip' must be"),
        ({"fp8_skip_head": "yes"}, r"fp8_skip_head' must be bool"),
    ],
)
def test_bad_fp8_options_fail_at_get(options, pattern):
    with pytest.raises(ConfigError, match=pattern):
        accelkit.get("cpu", precision="fp8-mixed", **options)


def test_fp8_options_with_another_precision_are_refused():
    with pytest.raises(ConfigError, match=r"fp8_recipe apply to precision='fp8-mixed' only"):
        accelkit.get("cpu", precision="bf16-mixed", fp8_recipe="rowwise")
    with pytest.raises(ConfigError, match=r"fp8_skip apply to precision='fp8-mixed' only"):
        accelkit.get("ddp", fp8_skip=["head"])
    accelkit.get("cpu", precision="bf16-mixed")  # the defaults are no fp8 options


def test_fsdp_float8_all_gather_needs_the_tensorwise_recipe():
    with pytest.raises(ConfigError, match="fp8_all_gather' needs fp8_recipe='tensorwise'"):
        accelkit.get("fsdp", precision="fp8-mixed", fp8_recipe="rowwise", fp8_all_gather=True)


def test_the_cuda_only_recipe_is_refused_on_the_cpu():
    with pytest.raises(ConfigError, match="rowwise_with_gw_hp' runs on CUDA only"):
        accelkit.get("cpu", precision="fp8-mixed", fp8_recipe="rowwise_with_gw_hp")


@pytest.mark.parametrize(
    "backend, module", [("deepspeed", "deepspeed"), ("fairscale_oss", "fairscale")]
)
def test_backends_that_do_not_list_fp8_refuse_it(backend, module):
    pytest.importorskip(module)
    with pytest.raises(ConfigError, match=f"backend {backend!r} does not support precision"):
        accelkit.get(backend, precision="fp8-mixed")
    caps = accelkit.describe(backend)["capabilities"]
    assert "fp8-mixed" not in caps["precisions"]


def test_native_backends_list_fp8_mixed():
    for name in ("cpu", "cuda", "ddp", "fsdp"):
        info = accelkit.describe(name)
        assert "fp8-mixed" in info["capabilities"]["precisions"]
        assert "fp8-mixed" in info["dtypes"]


def fake_cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """A CUDA device of ``capability`` for the checks ``get()`` makes (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake A100")


def test_a_gpu_older_than_ada_is_refused_at_get(monkeypatch):
    fake_cuda(monkeypatch, (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8.9 or newer .* Fake A100 has 8.0"):
        accelkit.get("cuda", precision="fp8-mixed")
    accelkit.get("cuda", precision="bf16-mixed")  # the same fake GPU runs bf16


def test_a_hopper_gpu_passes_the_check(monkeypatch):
    fake_cuda(monkeypatch, (9, 0))
    accel = accelkit.get("cuda", precision="fp8-mixed")
    assert accel.precision == "fp8-mixed"


def test_mps_is_refused():
    from accelkit.precision import check_device_supports

    with pytest.raises(ConfigError, match=r"runs on CUDA .* and the CPU only, not on 'mps'"):
        check_device_supports("fp8-mixed", torch.device("mps"))


def test_missing_torchao_says_how_to_install_it(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(PluginMissingError, match=r"pip install torchao"):
        accelkit.get("cpu", precision="fp8-mixed")
    accelkit.get("cpu", precision="bf16-mixed")  # nothing else needs it


# ---- checkpoints ---------------------------------------------------------------------------------
def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


@pytest.mark.parametrize(
    "saved, loaded", [("fp8-mixed", "bf16-mixed"), ("bf16-mixed", "fp8-mixed")]
)
def test_a_checkpoint_moves_between_fp8_and_bf16(tmp_path, saved, loaded):
    """The portable checkpoint of a Float8Linear model has the plain model's names: it loads
    (strict) under another precision, weights and optimizer state equal, and trains on."""
    source = train_accelkit(saved, steps=2, **(SMALL if saved == "fp8-mixed" else {}))
    source["accel"].save(tmp_path / "ckpt", {"model": source["model"], "opt": source["optimizer"]})

    accel = accelkit.get("cpu", precision=loaded, **(SMALL if loaded == "fp8-mixed" else {}))
    torch.manual_seed(1)  # other initial weights: the load must replace them all
    model = TinyGPT(**MODEL)
    model, optimizer = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    accel.load(tmp_path / "ckpt", {"model": model, "opt": optimizer})
    assert_same_weights(model, source["model"])
    assert (converted(model) == BLOCK_LAYERS) == (loaded == "fp8-mixed")
    mine, theirs = optimizer.state_dict()["state"], source["optimizer"].state_dict()["state"]
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[i]["exp_avg"], theirs[i]["exp_avg"]) for i in mine)
    x, y = markov_tokens(BATCH, MODEL["seq"], MODEL["vocab"], seed=5)
    accel.backward(model(x, y))
    accel.step()


# ---- accelkit bench: bf16-mixed against fp8-mixed --------------------------------------------------
def bench_rows(config: Any, backends: str, times: dict[str, list[float]]) -> list[Any]:
    """The rows of ``backends``, finished with the given step times (no process runs)."""
    from accelkit.benchmark import runner

    rows = runner.make_rows(config, backends)
    for row in rows:
        if row.label in times:
            row.status = "ok"
            row.ready = {"device": "cpu", "world_size": 1, "device_name": "x"}
            row.results = [
                {"step_s": t, "peak_memory": 1, "memory_kind": "peak RSS", "loss": 1.0}
                for t in times[row.label]
            ]
    return rows


def test_bench_runs_each_row_in_each_precision_and_compares_within_rounds():
    from accelkit.benchmark import runner
    from accelkit.benchmark.workloads import get_workload
    from accelkit.cli.bench import render

    config = runner.BenchConfig(
        "tiny-gpt", "bf16-mixed", 4, 2, 0, 3, compare_precisions=["fp8-mixed"]
    )
    config.options = {"fp8_min_features": 16, "device_index": 0}
    # round 2 is slow for both rows (drift): the per-round ratios are 0.5, 0.5, 0.8
    times = {"raw": [1.0, 2.0, 1.0], "cpu": [1.0, 2.0, 1.0], "cpu @fp8-mixed": [0.5, 1.0, 0.8]}
    rows = bench_rows(config, "cpu", times)
    by_label = {r.label: r for r in rows}
    assert list(by_label) == ["raw", "cpu", "cpu @fp8-mixed"]  # raw: the first precision only
    assert by_label["cpu"].options == {"device_index": 0}  # fp8_* options: fp8 rows only
    assert by_label["cpu @fp8-mixed"].options == config.options
    peaks = {"bf16-mixed": {"flops": 1e9, "how": "bf16"}, "fp8-mixed": {"flops": 2e9, "how": "f8"}}
    workload = get_workload("tiny-gpt")
    doc = runner.summarize(config, "cpu", workload, rows, peaks["bf16-mixed"], peaks=peaks)
    results = {r["label"]: r for r in doc["results"]}
    fp8, bf16 = results["cpu @fp8-mixed"], results["cpu"]
    assert fp8["precision"] == "fp8-mixed" and bf16["precision"] == "bf16-mixed"
    assert fp8["vs_precision"]["vs"] == "cpu"
    assert fp8["vs_precision"]["median"] == pytest.approx(0.5)
    assert (fp8["vs_precision"]["min"], fp8["vs_precision"]["max"]) == pytest.approx((0.5, 0.8))
    assert "overhead" not in fp8 and bf16["overhead"]["vs"] == "raw"
    flops_per_s = workload.training_flops_per_sample(doc["flops"]["counted_params"]) * 4
    assert fp8["mfu"] == pytest.approx(flops_per_s / 0.8 / 2e9)  # against the fp8 peak
    assert bf16["mfu"] == pytest.approx(flops_per_s / 1.0 / 1e9)  # against the bf16 peak
    assert fp8["peak_tflops"] == pytest.approx(2e-3)
    assert "Peak of the fp8-mixed rows: 2.0 GFLOP/s" in doc["flops"]["statement"]
    assert "| 0.500 [0.500, 0.800] vs cpu |" in render(doc)


def test_bench_rows_that_cannot_run_fp8_say_why():
    from accelkit.benchmark import runner

    pytest.importorskip("accelkit_deepspeed")
    config = runner.BenchConfig("mlp", "bf16-mixed", 2, 1, 0, 1, compare_precisions=["fp8-mixed"])
    rows = {r.label: r for r in runner.make_rows(config, "deepspeed_stage_2")}
    fp8 = rows["deepspeed_stage_2 @fp8-mixed"]
    assert fp8.status == "unavailable" and "'fp8-mixed' is not supported" in fp8.reason
    # fp8-mixed alone: the raw baseline has no such loop and says so, without a process
    alone = runner.BenchConfig("mlp", "fp8-mixed", 2, 1, 0, 1)
    (raw,) = [r for r in runner.make_rows(alone, "cpu") if r.raw]
    assert raw.status == "unavailable" and "--precision bf16-mixed,fp8-mixed" in raw.reason


def test_bench_precision_list_is_checked_before_anything_runs(capsys):
    from accelkit.cli import main as cli_main
    from accelkit.cli.bench import parse_precisions

    assert parse_precisions("bf16, fp8-mixed") == ["bf16-mixed", "fp8-mixed"]
    for bad, message in (("bf16-mixed,bf16", "twice"), ("bf16-mixed,fp9", "unknown precision")):
        assert cli_main(["bench", "--model", "mlp", "--precision", bad]) == 2
        assert message in capsys.readouterr().err


def test_the_float8_peak_is_a_scaled_matmul():
    from accelkit.benchmark.runner import peak_dtype
    from accelkit.benchmark.worker import dense_matmul

    assert peak_dtype("fp8-mixed", "cuda") == "float8_e4m3fn"
    assert peak_dtype("bf16-mixed", "cuda") == "bfloat16"
    assert peak_dtype("fp8-mixed", "cpu") == "float32"  # the CPU's peak is fp32's
    out = dense_matmul(32, torch.float8_e4m3fn, torch.device("cpu"))()
    assert out.shape == (32, 32) and out.dtype == torch.bfloat16


@pytest.mark.slow
def test_bench_cli_compares_bf16_and_fp8_end_to_end(tmp_path, capsys):
    """The command of docs/performance.md on the CPU, tiny-gpt: both rows run, interleaved."""
    from accelkit.cli import main as cli_main

    out = tmp_path / "fp8.json"
    args = ["bench", "--model", "tiny-gpt", "--backends", "cpu", "--no-baseline", "--no-progress"]
    args += ["--precision", "bf16-mixed,fp8-mixed", "--option", "fp8_min_features=16"]
    args += ["--steps", "2", "--warmup", "1", "--repeats", "2", "--threads", "1", "--out", str(out)]
    assert cli_main(args) == 0
    doc = json.loads(out.read_text())
    rows = {r["label"]: r for r in doc["results"]}
    assert rows["cpu"]["status"] == rows["cpu @fp8-mixed"]["status"] == "ok"
    assert rows["cpu @fp8-mixed"]["vs_precision"]["vs"] == "cpu"
    assert set(doc["peaks"]) == {"bf16-mixed", "fp8-mixed"}
    assert "vs cpu |" in capsys.readouterr().out


# ---- ddp and FSDP2 on 2 gloo processes -------------------------------------------------------------
def rank_batches(steps: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the same token stream: batch ``i`` of rank ``r`` is the global
    batch ``i``'s ``r``-th slice."""
    x, y = markov_tokens(steps * BATCH * world, MODEL["seq"], MODEL["vocab"])
    return [
        (x[i : i + BATCH], y[i : i + BATCH])
        for i in range(rank * BATCH, steps * BATCH * world, BATCH * world)
    ]


def ddp_worker(steps: int) -> dict[str, Any]:
    """Raw DistributedDataParallel over a torchao-converted model under bf16 autocast, then
    accelkit ``ddp`` fp8-mixed, on the same seed and batches."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    dist.init_process_group("gloo")
    batches = rank_batches(steps, dist.get_rank(), dist.get_world_size())
    torch.manual_seed(0)
    raw = TinyGPT(**MODEL)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=LR)
    chosen = float8_layers(raw, 16)
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    convert_to_float8_training(raw, module_filter_fn=lambda m, fqn: fqn in chosen, config=config)
    ddp = DistributedDataParallel(raw)
    raw_losses = []
    for xb, yb in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(xb, yb)
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad()
        raw_losses.append(loss.item())

    accel = accelkit.get("ddp", precision="fp8-mixed", **SMALL)  # joins the same group
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    model, _ = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    for xb, yb in batches:
        loss = model(xb, yb)
        accel.backward(loss)
        accel.step()
        losses.append(loss.item())
    inner = accel.unwrap(model)
    return {"raw": raw_losses, "accelkit": losses, "converted": sorted(converted(inner))}


@pytest.mark.slow
def test_ddp_fp8_matches_raw_ddp():
    """2 gloo ranks: accelkit ``ddp`` fp8-mixed equals DDP by hand over the same torchao model
    bit for bit (measured 0)."""
    results = run_ranks("test_fp8:ddp_worker", {"steps": 6}, nproc=2, timeout=400)
    for result in results:
        assert result["accelkit"] == result["raw"]
        assert result["converted"] == sorted(BLOCK_LAYERS)
    assert results[0]["accelkit"] != results[1]["accelkit"]


def fsdp_worker(out: str, steps: int) -> dict[str, Any]:
    """Raw fully_shard + torchao (float8 all-gather, scales precomputed after each step) and
    accelkit ``fsdp`` fp8-mixed on the same seed and data; then accelkit saves its model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = rank_batches(steps, rank, dist.get_world_size())

    torch.manual_seed(0)
    raw = TinyGPT(**MODEL)
    chosen = float8_layers(raw, 16)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # the tensorwise recipe
    convert_to_float8_training(raw, module_filter_fn=lambda m, fqn: fqn in chosen, config=config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in raw.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(raw, mp_policy=policy)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=LR)
    raw_losses = []
    for xb, yb in batches:
        loss = raw(xb, yb)
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(raw)
        raw_losses.append(loss.item())

    accel = accelkit.get("fsdp", precision="fp8-mixed", **SMALL)  # joins the same group
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)  # built on the CPU like the raw one (init_module would use meta)
    model, _ = accel.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    for xb, yb in batches:
        loss = model(xb, yb)
        accel.backward(loss)
        accel.step()
        losses.append(loss.item())
    local = model.blocks[0].qkv.weight._local_tensor  # where torchao keeps the precomputed scale
    accel.save(Path(out) / "ckpt", {"model": model})
    full = accel.backend.full_state_dict(model)
    if rank == 0:
        torch.save({k: v.float().clone() for k, v in full.items()}, Path(out) / "full.pt")

    try:
        accelkit.get("fsdp", precision="fp8-mixed", tp=2, **SMALL)
        tp_refusal = ""
    except ConfigError as err:
        tp_refusal = str(err)

    meta = accelkit.get("fsdp", precision="fp8-mixed", **SMALL)  # the meta-device build
    with meta.init_module():
        built = TinyGPT(**MODEL)
    built = meta.setup(built)
    with torch.no_grad():
        meta_loss = built(*batches[0]).item()
        meta.load(Path(out) / "ckpt", {"model": built})  # the scales follow the loaded weights
        loaded = built.blocks[0].qkv.weight._local_tensor
        return {
            "raw": raw_losses,
            "accelkit": losses,
            "converted": sorted(converted(model)),
            "weight_kind": type(local).__name__,
            "scale_precomputed": getattr(local, "_precomputed_scale", None) is not None,
            "meta_loss": meta_loss,
            "scale_after_load": getattr(loaded, "_precomputed_scale", None) is not None,
            "loaded_loss": built(*batches[0]).item(),
            "trained_loss": model(*batches[0]).item(),
            "tp_refusal": tp_refusal,
        }


@pytest.mark.slow
def test_fsdp_fp8_with_float8_all_gather_matches_raw_fully_shard(tmp_path):
    """2 gloo ranks: float8 all-gather works on the CPU (torchao casts before the gather; gloo
    moves the bytes). accelkit equals raw fully_shard + torchao bit for bit (measured 0), the
    scales are precomputed after each step and after a load, a meta-built model loads the
    checkpoint, and the checkpoint loads on ``cpu`` bf16-mixed."""
    results = run_ranks(
        "test_fp8:fsdp_worker", {"out": str(tmp_path), "steps": 6}, nproc=2, timeout=400
    )
    for result in results:
        assert result["accelkit"] == result["raw"]
        assert result["converted"] == sorted(BLOCK_LAYERS)
        assert result["weight_kind"] == "WeightWithDynamicFloat8CastTensor"
        assert result["scale_precomputed"]
        assert math.isfinite(result["meta_loss"])
        # the meta-built model loads the trained weights and computes what the trained one does
        assert result["scale_after_load"]
        assert result["loaded_loss"] == result["trained_loss"] != result["meta_loss"]
        assert (
            "'fp8-mixed' with tensor parallelism (tp > 1) is not supported"
            in (result["tp_refusal"])
        )
    assert results[0]["accelkit"] != results[1]["accelkit"]  # each rank its own batches

    accel = accelkit.get("cpu", precision="bf16-mixed")
    model = accel.setup(TinyGPT(**MODEL))
    accel.load(tmp_path / "ckpt", {"model": model})
    full = torch.load(tmp_path / "full.pt")
    assert model.state_dict().keys() == full.keys()
    assert all(torch.equal(v.float(), full[k]) for k, v in model.state_dict().items())


# ---- GPU (the lead runs these on the H200: bench/gpu_suite.sh part fp8) ---------------------------
GPU_MODEL = {"vocab": 2048, "width": 1024, "layers": 4, "heads": 16, "seq": 256}
GPU_STEPS, GPU_BATCH, GPU_LR, GPU_WARMUP = 300, 16, 6e-4, 30
#: smoothed (trailing 20 steps) loss curves of fp8-mixed and bf16-mixed, relative gap, after the
#: warm-up. Not measured on a GPU yet (no GPU here): on the CPU the 5-step trailing means differ
#: by at most 1e-3 over 40 steps; the GPU's forward float8 matmul accumulates fast (in lower
#: precision) and the run is longer, so 2e-2 leaves ~20x the CPU's gap; the loss falls by more than 10x this over the run
#: (asserted). The figures go to $ACCELKIT_GPU_REPORT/fp8-gpu.jsonl to fix it from a measurement.
GPU_CURVE_RTOL = 2e-2
#: the mean loss of the last 20 steps, relative
GPU_FINAL_RTOL = 1e-2


def gpu_report(name: str, **figures: Any) -> None:
    """Print what a GPU test measured; append it to $ACCELKIT_GPU_REPORT/fp8-gpu.jsonl."""
    entry = {"test": name, **figures}
    print(json.dumps(entry))
    folder = os.environ.get("ACCELKIT_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "fp8-gpu.jsonl", "a") as out:
            out.write(json.dumps(entry) + "\n")


def train_gpu(precision: str, backend: str = "cuda", steps: int = GPU_STEPS) -> dict[str, Any]:
    accel = accelkit.get(backend, precision=precision, max_grad_norm=1.0)
    torch.manual_seed(0)
    with accel.init_module(empty_init=False):
        model = TinyGPT(**GPU_MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=GPU_LR, weight_decay=0.1)
    model, optimizer = accel.setup(model, optimizer)
    accel.setup_scheduler(
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / GPU_WARMUP))
    )
    x, y = markov_tokens(steps * GPU_BATCH, GPU_MODEL["seq"], GPU_MODEL["vocab"])
    losses = []
    for step in range(steps):
        window = slice(step * GPU_BATCH, (step + 1) * GPU_BATCH)
        loss = model(accel.to_device(x[window]), accel.to_device(y[window]))
        accel.backward(loss)
        accel.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses).tolist(), "model": model, "accel": accel}


@pytest.mark.gpu
def test_gpu_fp8_mixed_loss_curve_tracks_bf16_mixed():
    """A GPT-shaped model (width 1024, 4 blocks, seq 256) for 300 steps on ``cuda``: the
    fp8-mixed loss curve stays within GPU_CURVE_RTOL of bf16-mixed's (both smoothed)."""
    fp8 = train_gpu("fp8-mixed")
    bf16 = train_gpu("bf16-mixed")
    assert converted(fp8["model"]) == {
        f"blocks.{i}.{n}" for i in range(4) for n in ("qkv", "proj", "fc1", "fc2")
    }
    a, b = smoothed(fp8["losses"], 20), smoothed(bf16["losses"], 20)
    curve_gap = relative_gap(a[GPU_WARMUP:], b[GPU_WARMUP:])
    final_gap = abs(a[-1] - b[-1]) / b[-1]
    drop = (b[GPU_WARMUP] - b[-1]) / b[-1]
    gpu_report(
        "cuda fp8-mixed vs bf16-mixed",
        curve_gap=curve_gap,
        final_gap=final_gap,
        step_gap=relative_gap(fp8["losses"], bf16["losses"]),
        bf16_first_last=[bf16["losses"][0], bf16["losses"][-1]],
        fp8_first_last=[fp8["losses"][0], fp8["losses"][-1]],
        relative_drop=drop,
    )
    assert all(math.isfinite(v) for v in fp8["losses"])
    assert drop > 10 * GPU_CURVE_RTOL  # the curves move much more than the tolerance
    assert curve_gap <= GPU_CURVE_RTOL and final_gap <= GPU_FINAL_RTOL


def gpu_fsdp_worker(steps: int) -> dict[str, Any]:
    """World size 1 on CUDA: accelkit ``fsdp`` fp8-mixed (float8 all-gather on by default for
    tensorwise) against ``cuda`` fp8-mixed on the same seed and data."""
    fsdp = train_gpu("fp8-mixed", backend="fsdp", steps=steps)
    local = fsdp["model"].blocks[0].qkv.weight._local_tensor
    single = train_gpu("fp8-mixed", backend="cuda", steps=steps)
    return {
        "fsdp": fsdp["losses"],
        "cuda": single["losses"],
        "weight_kind": type(local).__name__,
        "scale_precomputed": getattr(local, "_precomputed_scale", None) is not None,
    }


@pytest.mark.gpu
def test_gpu_fsdp_fp8_runs_with_float8_all_gather():
    """On one GPU (torchrun, world size 1): the float8 all-gather path runs and trains like the
    single-device run within the fp8 curve tolerance (the gathered float8 weight is cast once per
    step from precomputed scales instead of per matmul, so the two are not bit-equal)."""
    (result,) = run_ranks("test_fp8:gpu_fsdp_worker", {"steps": 60}, nproc=1, timeout=500)
    a, b = smoothed(result["fsdp"], 20), smoothed(result["cuda"], 20)
    gap = relative_gap(a[GPU_WARMUP:], b[GPU_WARMUP:])
    gpu_report("fsdp (world 1) fp8-mixed vs cuda fp8-mixed", curve_gap=gap, **result)
    assert result["weight_kind"] == "WeightWithDynamicFloat8CastTensor"
    assert result["scale_precomputed"]
    assert all(math.isfinite(v) for v in result["fsdp"])
    assert gap <= GPU_CURVE_RTOL
