"""``apex_distributed_adam`` against the fake DistributedFusedAdam (CPU, gloo).

The fake models Apex's bucket layout (buckets of 200 bytes here, so parameters are cut across
buckets and, on two ranks, across ranks' shards) and its API; the tests check accelkit's use of
it: construction arguments, the model left unwrapped, accumulation through ``no_sync``,
clipping and the norm through the optimizer, fp16 overflow, and the checkpoint's mapping of
sharded state to parameter ranges. Numbers: against raw torch AdamW, tolerance 1e-5 (the fake's
Adam is FusedAdam's; floor in test_apex_swap.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from apex_reference import batches, make_net, param_groups, train_raw, train_raw_data_parallel

import accelkit
from accelkit.errors import ConfigError, UnsupportedError

HERE = Path(__file__).resolve().parent
TOL = 1e-5
TINY = dict(bucket_cap_mb=200 / 2**20)


def build(make_opt=None, **options):
    accel = accelkit.get("apex_distributed_adam", **{**TINY, **options})
    model = make_net()
    opt = (make_opt or (lambda m: torch.optim.AdamW(param_groups(m), lr=1e-2)))(model)
    model, opt = accel.setup(model, opt)
    return accel, model, opt


def train(accel, model, data):
    losses, norms = [], []
    for x, y in data:
        with accel.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accel.backward(loss)
            if accel.step() and accel.grad_norm is not None:
                norms.append(float(accel.grad_norm))
        losses.append(loss.item())
    return losses, norms


def rel(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def test_setup_builds_distributed_fused_adam_on_the_unwrapped_model(on_cpu):
    accel, model, opt = build(overlap_grad_sync=False, pipeline_size=3)
    call = [c for c in on_cpu.CALLS if c["class"] == "DistributedFusedAdam"][-1]
    kwargs = call["kwargs"]
    assert kwargs["adam_w_mode"] is True and kwargs["dtype"] == torch.float32
    assert kwargs["grad_sync_dtype"] == kwargs["param_sync_dtype"] == torch.float32
    assert kwargs["overlap_grad_sync"] is False and kwargs["pipeline_size"] == 3
    assert kwargs["bucket_cap_mb"] == TINY["bucket_cap_mb"]
    assert [g["weight_decay"] for g in call["groups"]] == [0.1, 0.0]
    assert [g["lr"] for g in call["groups"]] == [1e-2, 5e-3]
    assert type(accel.unwrap(model)).__name__ == "Net" and not hasattr(model, "module")
    inner = opt.optimizer
    assert all("fragments" in inner.state[p] for p in model.parameters())  # init_params done
    assert len(inner.state["buckets"]) > 3  # parameters span several buckets
    assert accel.backend.swaps == ["AdamW -> DistributedFusedAdam"]


def test_bf16_true_syncs_in_bf16_and_keeps_fp32_state(on_cpu):
    build(precision="bf16-true")
    kwargs = [c for c in on_cpu.CALLS if c["class"] == "DistributedFusedAdam"][-1]["kwargs"]
    assert kwargs["grad_sync_dtype"] == kwargs["param_sync_dtype"] == torch.bfloat16
    assert kwargs["dtype"] == torch.float32


@pytest.mark.parametrize(
    ("make_model", "make_opt", "match", "error"),
    [
        (make_net, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "Adam or AdamW", ConfigError),
        (
            make_net,
            lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True),
            "amsgrad",
            ConfigError,
        ),
    ],
)
def test_what_it_refuses(on_cpu, make_model, make_opt, match, error):
    accel = accelkit.get("apex_distributed_adam")
    model = make_model()
    with pytest.raises(error, match=match):
        accel.setup(model, make_opt(model))


def test_two_optimizers_and_compile_are_refused(on_cpu):
    accel = accelkit.get("apex_distributed_adam")
    model = make_net()
    with pytest.raises(ConfigError, match="one optimizer per accelerator"):
        other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        accel.setup(model, torch.optim.AdamW(model.parameters()), other)
    with pytest.raises(UnsupportedError, match="compile"):
        accel.setup(model, torch.optim.AdamW(model.parameters()), compile=True)


def test_trains_like_torch_adamw_with_accumulation_and_clipping(on_cpu):
    """One rank: gradients accumulate in DistributedFusedAdam's buckets, and the clip and the
    reported norm come from the optimizer's own grad_norm (it clears param.grad)."""
    data = batches(12)
    raw = make_net()
    ref = train_raw(
        raw, torch.optim.AdamW(param_groups(raw), lr=1e-2), data, max_norm=0.5, accumulation=3
    )
    accel, model, opt = build(max_grad_norm=0.5, accumulation_steps=3)
    losses, norms = train(accel, model, data)
    assert rel(ref["losses"], losses) < TOL and rel(ref["norms"], norms) < TOL
    assert opt.optimizer.events.count("clip_grad_norm(0.5)") == 4
    assert "no_sync" not in opt.optimizer.events  # one process: nothing to skip
    for p, q in zip(raw.parameters(), model.parameters(), strict=True):
        assert (p - q).abs().max() <= TOL * p.abs().max()


def test_manual_clip_and_tracked_norm(on_cpu):
    data = batches(4)
    raw = make_net()
    ref = train_raw(raw, torch.optim.AdamW(param_groups(raw), lr=1e-2), data, max_norm=0.25)
    accel, model, _ = build(track_grad_norm=True)
    norms = []
    for x, y in data:
        accel.backward(F.mse_loss(model(x), y))
        norms.append(float(accel.clip_grad_norm(0.25)))
        accel.step()
    assert rel(ref["norms"], norms) < TOL


def test_fp16_overflow_is_skipped_by_the_optimizer(on_cpu):
    accel, model, opt = build(precision="16-mixed", track_grad_norm=True)
    x, y = batches(1)[0]
    accel.backward(F.mse_loss(model(x), y) * 1e-3)  # no overflow at the initial scale 2**16
    accel.step()
    assert not accel.step_was_skipped and opt.optimizer.state["step"] == 1
    scale = accel.backend.precision.scaler.get_scale()
    weights = [p.detach().clone() for p in model.parameters()]
    accel.backward(F.mse_loss(model(x), y) * float("inf"))
    accel.step()
    assert accel.step_was_skipped and float(accel.grad_norm) == float("inf")
    assert opt.optimizer.state["step"] == 1
    assert accel.backend.precision.scaler.get_scale() == scale / 2
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert opt.optimizer.events[-2:] == ["unscale_grads", "step(grad_scaler)"]


# ---- checkpoint ------------------------------------------------------------------------------------
def test_checkpoint_to_torch_adamw_and_back(on_cpu, tmp_path):
    data = batches(10)
    accel, model, opt = build()
    first, _ = train(accel, model, data[:6])
    inner = opt.optimizer
    gathered = {n: inner.full_state(p) for n, p in model.named_parameters()}
    accel.save(tmp_path / "ck", {"model": model, "optimizer": opt})
    manifest = json.loads((tmp_path / "ck" / "accelkit.json").read_text())
    info = manifest["objects"]["optimizer"]
    assert info["family"] == "adamw" and info["step_granularity"] == "group"
    split = [
        t for t in manifest["tensors"] if t["kind"] == "optim:exp_avg" and len(t["fragments"]) > 1
    ]
    assert split, "a parameter cut across buckets is written as several fragments"

    cpu = accelkit.get("cpu")
    model2 = make_net()
    model2, opt2 = cpu.setup(model2, torch.optim.AdamW(param_groups(model2), lr=1e-2))
    cpu.load(tmp_path / "ck", {"model": model2, "optimizer": opt2})
    for name, p in model2.named_parameters():
        state = opt2.optimizer.state[p]
        assert torch.equal(state["exp_avg"], gathered[name]["exp_avg"]), name
        assert torch.equal(state["exp_avg_sq"], gathered[name]["exp_avg_sq"]), name
        assert float(state["step"]) == 6.0
    torch_rest, _ = train(cpu, model2, data[6:])
    cpu.save(tmp_path / "ck2", {"model": model2, "optimizer": opt2})

    # and back: torch's checkpoint into DistributedFusedAdam, whose fp32 copy must follow
    accel3, model3, opt3 = build()
    accel3.load(tmp_path / "ck2", {"model": model3, "optimizer": opt3})
    for (name, p), q in zip(model3.named_parameters(), model2.parameters(), strict=True):
        got = opt3.optimizer.full_state(p)
        assert torch.equal(got["exp_avg"], opt2.optimizer.state[q]["exp_avg"]), name
        assert torch.equal(got["params"], q.detach()), name  # the fp32 copy was refreshed
    assert opt3.optimizer.state["step"] == 10

    uninterrupted, _ = train(*build()[:2], data)
    assert rel(uninterrupted, first + torch_rest) < TOL


def test_loading_weights_only_refreshes_the_fp32_copy(on_cpu, tmp_path):
    """DistributedFusedAdam steps its own fp32 copy of the parameters and copies it back: after
    loading older weights, the next step must start from them, not from the copy."""
    data = batches(8)
    accel, model, _ = build()
    train(accel, model, data[:3])
    accel.save(tmp_path / "ck", {"model": model})
    at_save = [p.detach().clone() for p in model.parameters()]
    train(accel, model, data[3:6])
    later = [p.detach().clone() for p in model.parameters()]
    accel.load(tmp_path / "ck", {"model": model})
    assert all(torch.equal(a, p) for a, p in zip(at_save, model.parameters()))
    train(accel, model, data[6:7])
    now = [p.detach() for p in model.parameters()]
    to_save = sum(float((p - a).norm()) for p, a in zip(now, at_save))
    to_later = sum(float((p - b).norm()) for p, b in zip(now, later))
    assert to_save < 0.5 * to_later


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_shard_the_state_and_any_world_size_reads_it(tmp_path):
    """2 gloo processes: accumulation skips the sync (no_sync) except on the closing micro-batch;
    losses and norms match raw data-parallel AdamW; each rank writes its shards' ranges, and one
    process reads the whole state back bit for bit (against the fake's own gather)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        str(HERE / "apex_dfa_worker.py"),
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    import apex_dfa_worker as worker

    # the ranks hold different pieces, and every parameter element exactly once between them
    assert ranks[0]["fragments"] != ranks[1]["fragments"]
    assert all(r["reloaded_equal"] for r in ranks)
    assert all(r["events"].count("no_sync") == worker.MICRO // 2 for r in ranks)

    raw = make_net()
    ref = train_raw_data_parallel(
        raw,
        torch.optim.AdamW(param_groups(raw), lr=1e-2),
        worker.per_rank_data(2),
        accumulation=2,
        max_norm=0.5,
    )
    for r in range(2):
        assert rel(ref["losses"][r], ranks[r]["losses"]) < TOL
        assert rel(ref["norms"], ranks[r]["norms"]) < TOL

    cpu = accelkit.get("cpu")
    model = make_net()
    model, opt = cpu.setup(model, torch.optim.AdamW(param_groups(model), lr=1e-2))
    cpu.load(tmp_path / "ck", {"model": model, "optimizer": opt})
    state = ranks[0]["state"]
    for name, p in model.named_parameters():
        assert p.detach().reshape(-1).tolist() == ranks[0]["weights"][name]
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.optimizer.state[p][key].reshape(-1).tolist() == state[name][key], name
        assert float(opt.optimizer.state[p]["step"]) == worker.MICRO // 2
