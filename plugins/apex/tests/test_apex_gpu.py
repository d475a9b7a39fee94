"""The Apex backends against the REAL NVIDIA Apex on a CUDA GPU (tests marked ``gpu``).

Run on the GPU machine after building Apex from its source with ``--cpp_ext --cuda_ext
--distributed_adam`` (docs/backends/apex.md)::

    ACCELKIT_REQUIRE_APEX=1 ACCELKIT_GPU_REPORT=/some/dir \\
        python3 -m pytest -q -m gpu -o addopts="" plugins/apex/tests

Without Apex these tests skip, unless ``ACCELKIT_REQUIRE_APEX=1`` (then they fail). With an
``apex`` that is the tests' fake, or lacks the compiled ``amp_C``, they fail. Every test reports
what it measured (end of the run: "apex GPU summary"; and ``$ACCELKIT_GPU_REPORT/apex-gpu.jsonl``).

Tolerances are measured in the same run, never assumed:

- bf16: the Apex run must be as close to raw torch in bf16 as bf16 is to fp32 (``floor``: max
  relative loss difference between raw torch in bf16 and in fp32 on the same model and data),
  within a factor of 2;
- fp16: a fixed relative bound on the losses (FP16_LOSS_RTOL, from the committed H200 logs; the
  fp16-vs-fp32 distance is no floor there, because the loss scaler skips steps fp32 never does);
- resume: against the run-to-run difference of two identical uninterrupted runs (1e-6 if that
  is 0: the kernels are deterministic and a resume must then be bit-exact up to that).

Each has a negative twin that must leave the tolerance.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from apex_reference import batches, make_net, param_groups, train_raw_amp
from apex_testlib import FAKE_ROOT, report_gpu

import accelkit

pytestmark = pytest.mark.gpu

WIDTH, BATCH, STEPS, LR = 512, 64, 40, 1e-3


def _data(n: int = STEPS, seed: int = 1):
    return batches(n, seed=seed, batch=BATCH, width=WIDTH)


def _net():
    return make_net(0, WIDTH)


@pytest.fixture(scope="module")
def real_apex():
    assert str(FAKE_ROOT) not in sys.path, "the fake apex is on sys.path"
    if importlib.util.find_spec("apex") is None:
        if os.environ.get("ACCELKIT_REQUIRE_APEX") == "1":
            pytest.fail("ACCELKIT_REQUIRE_APEX=1 but no apex is importable")
        pytest.skip("NVIDIA Apex is not installed here (build it: docs/backends/apex.md)")
    import amp_C
    import apex
    import fused_layer_norm_cuda
    from apex.multi_tensor_apply import multi_tensor_applier

    assert not getattr(apex, "ACCELKIT_FAKE", False), apex.__file__
    assert FAKE_ROOT not in Path(apex.__file__).resolve().parents, apex.__file__
    for module in (amp_C, fused_layer_norm_cuda):
        assert Path(module.__file__).suffix == ".so", module.__file__
        assert not getattr(module, "ACCELKIT_FAKE", False)
    assert multi_tensor_applier.available
    return apex


def rel(a, b):
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))


def train_accel(accel, model, data, *, overflow_at=()):
    losses, skipped, norms = [], [], []
    for i, (x, y) in enumerate(data):
        x, y = x.cuda(), y.cuda()
        loss = F.mse_loss(model(x).float(), y)
        accel.backward(loss * float("inf") if i in overflow_at else loss)
        accel.step()
        losses.append(loss.item())
        skipped.append(accel.step_was_skipped)
        if accel.grad_norm is not None:
            norms.append(float(accel.grad_norm))
    return {"losses": losses, "skipped": skipped, "norms": norms}


def raw(dtype, *, scaler=False, max_norm=None, overflow_at=(), data=None, lr=LR):
    torch.manual_seed(0)
    model = _net().cuda()
    opt = torch.optim.AdamW(param_groups(model, lr), lr=lr, fused=True)
    grad_scaler = torch.amp.GradScaler("cuda") if scaler else None
    return train_raw_amp(
        model,
        opt,
        data or _data(),
        dtype=dtype,
        scaler=grad_scaler,
        max_norm=max_norm,
        overflow_at=overflow_at,
    )


def test_the_real_apex_is_imported(real_apex):
    import amp_C

    accel = accelkit.get("apex", fused_norm=True)
    model, opt = accel.setup(_net(), torch.optim.AdamW(_net().parameters()))
    assert type(opt.optimizer).__module__ == "apex.optimizers.fused_adam"
    assert type(model.blocks[0].norm).__module__ == "apex.normalization.fused_layer_norm"
    from accelkit_apex.probe import env_report

    report_gpu(
        "real_apex",
        apex=real_apex.__file__,
        amp_C=amp_C.__file__,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(),
        env=env_report(),
    )


def test_fused_adam_and_norms_track_torch_adamw_in_bf16(real_apex):
    data = _data()
    fp32 = raw(None, data=data)["losses"]
    bf16 = raw(torch.bfloat16, data=data)["losses"]
    floor = rel(fp32, bf16)

    def apex_run(lr=LR, fused_norm=True):
        accel = accelkit.get("apex", precision="bf16-mixed", fused_norm=fused_norm)
        model = _net()
        model, opt = accel.setup(model, torch.optim.AdamW(param_groups(model, lr), lr=lr))
        assert type(opt.optimizer).__name__ == "FusedAdam"
        return train_accel(accel, model, data)["losses"]

    fused = apex_run()
    optimizer_only = apex_run(fused_norm=False)
    twin = apex_run(lr=3 * LR)  # negative twin: a wrong learning rate
    figures = dict(
        floor_bf16_vs_fp32=floor,
        apex_vs_torch_bf16=rel(bf16, fused),
        apex_optimizer_only_vs_torch_bf16=rel(bf16, optimizer_only),
        twin_lr3x_vs_torch_bf16=rel(bf16, twin),
        first_last_loss=(bf16[0], bf16[-1], fused[-1]),
    )
    report_gpu("bf16_trajectory", **figures)
    assert floor > 0
    assert figures["apex_vs_torch_bf16"] <= 2 * floor
    assert figures["apex_optimizer_only_vs_torch_bf16"] <= 2 * floor
    assert figures["twin_lr3x_vs_torch_bf16"] > 2 * floor


#: apex 16-mixed (FusedAdam + fused LayerNorm) against raw torch 16-mixed (fused AdamW +
#: GradScaler), max relative loss difference over the 40 steps. Measured on the H200
#: (bench/results/2026-12-03-h200-callD/c1/apex-gpu.jsonl): 1.1e-3; in bf16 the same kernel
#: swap measured 7.2e-3 (FusedAdam alone 1.5e-3). The fp16-vs-fp32 distance of raw torch (0.20)
#: is no floor: GradScaler skips step 1 in fp16 and never in fp32, so it measures a skipped step;
#: 2x it passed callC's 0.178, when the test built Apex's param groups at 10x the reference's
#: learning rate. 1e-2 leaves 9x over the measured 1.1e-3 and 1.4x over bf16's kernel noise,
#: and fails that 0.178 and the 3x-lr twin below.
FP16_LOSS_RTOL = 1e-2


def test_fp16_with_loss_scaling(real_apex):
    data = _data()
    overflow = (10,)
    # reported, not a bound: fp32 cannot skip the steps the fp16 scaler skips (see above)
    fp32 = raw(None, max_norm=1.0, data=data)["losses"]
    floor = rel(fp32, raw(torch.float16, scaler=True, max_norm=1.0, data=data)["losses"])
    ref = raw(torch.float16, scaler=True, max_norm=1.0, overflow_at=overflow, data=data)

    def apex_run(lr: float = LR):
        accel = accelkit.get("apex", precision="16-mixed", fused_norm=True, max_grad_norm=1.0)
        model = _net()
        model, opt = accel.setup(model, torch.optim.AdamW(param_groups(model, lr), lr=lr))
        return accel, opt, train_accel(accel, model, data, overflow_at=overflow)

    accel, opt, got = apex_run()
    twin = apex_run(lr=3 * LR)[2]  # negative twin: a wrong learning rate must leave the bound
    skipped = [i for i, s in enumerate(got["skipped"]) if s]
    ref_skipped = [i for i, s in enumerate(ref["skipped"]) if s]
    scale = accel.backend.precision.scaler.get_scale()
    figures = dict(
        floor_fp16_vs_fp32=floor,
        apex_vs_torch_fp16=rel(ref["losses"], got["losses"]),
        twin_lr3x_vs_torch_fp16=rel(ref["losses"], twin["losses"]),
        bound=FP16_LOSS_RTOL,
        skipped=skipped,
        torch_skipped=ref_skipped,
        scale=scale,
        torch_scale=ref["scales"][-1],
        group_steps=[g["step"] for g in opt.optimizer.param_groups],
    )
    report_gpu("fp16_loss_scaling", **figures)
    assert 10 in skipped and skipped == ref_skipped
    assert scale == ref["scales"][-1]
    assert figures["group_steps"] == [STEPS - len(skipped)] * 2
    assert figures["apex_vs_torch_fp16"] <= FP16_LOSS_RTOL
    assert figures["twin_lr3x_vs_torch_fp16"] > FP16_LOSS_RTOL


def test_checkpoint_round_trip(real_apex, tmp_path):
    """FusedAdam -> FusedAdam (same run), FusedAdam -> torch AdamW(fused) and back."""
    data = _data(14)

    def apex_accel():
        accel = accelkit.get("apex", precision="bf16-mixed", fused_norm=True)
        model = _net()
        model, opt = accel.setup(model, torch.optim.AdamW(param_groups(model), lr=LR))
        return accel, model, opt

    def torch_accel():
        accel = accelkit.get("cuda", precision="bf16-mixed")
        model = _net()
        model, opt = accel.setup(model, torch.optim.AdamW(param_groups(model), lr=LR, fused=True))
        return accel, model, opt

    whole = train_accel(*apex_accel()[:2], data)["losses"]
    whole_again = train_accel(*apex_accel()[:2], data)["losses"]
    noise = rel(whole, whole_again)
    tol = max(4 * noise, 1e-6)

    accel, model, opt = apex_accel()
    first = train_accel(accel, model, data[:8])["losses"]
    saved = {
        n: {k: v.clone() for k, v in opt.optimizer.state[p].items()}
        for n, p in model.named_parameters()
    }
    steps = [g["step"] for g in opt.optimizer.param_groups]
    accel.save(tmp_path / "apex", {"model": model, "optimizer": opt})

    again, model2, opt2 = apex_accel()
    again.load(tmp_path / "apex", {"model": model2, "optimizer": opt2})
    same = rel(whole, first + train_accel(again, model2, data[8:])["losses"])

    twin, model3, _ = apex_accel()
    twin.load(tmp_path / "apex", {"model": model3})  # negative twin: no optimizer state
    without_state = rel(whole, first + train_accel(twin, model3, data[8:])["losses"])

    cuda, model4, opt4 = torch_accel()
    cuda.load(tmp_path / "apex", {"model": model4, "optimizer": opt4})
    exact = all(
        torch.equal(opt4.optimizer.state[p][k], saved[n][k])
        for n, p in model4.named_parameters()
        for k in ("exp_avg", "exp_avg_sq")
    )
    torch_steps = {float(opt4.optimizer.state[p]["step"]) for p in model4.parameters()}
    cuda.save(tmp_path / "torch", {"model": model4, "optimizer": opt4})
    back, model5, opt5 = apex_accel()
    back.load(tmp_path / "torch", {"model": model5, "optimizer": opt5})
    exact_back = all(
        torch.equal(opt5.optimizer.state[p][k], opt4.optimizer.state[q][k])
        for p, q in zip(model5.parameters(), model4.parameters(), strict=True)
        for k in ("exp_avg", "exp_avg_sq")
    )
    figures = dict(
        run_to_run=noise,
        tol=tol,
        apex_resume_vs_uninterrupted=same,
        twin_without_state=without_state,
        fused_to_torch_exact=exact,
        fused_to_torch_back_exact=exact_back,
        steps=(steps, sorted(torch_steps), [g["step"] for g in opt5.optimizer.param_groups]),
    )
    report_gpu("checkpoint_round_trip", **figures)
    assert exact and exact_back and torch_steps == {8.0} and steps == [8, 8]
    assert [g["step"] for g in opt5.optimizer.param_groups] == [8, 8]
    assert same <= tol
    assert without_state > 10 * tol


def _dfa_state(opt, model):
    """DistributedFusedAdam's own gather (its state_dict, format 2), by parameter name."""
    sd = opt.state_dict()
    index = {}
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            index[id(p)] = sd["param_groups"][g]["params"][i]
    return {n: sd["state"][index[id(p)]] for n, p in model.named_parameters()}, sd["state"]["step"]


@pytest.mark.parametrize("max_norm", [1.0, None], ids=["clipped", "unclipped"])
def test_distributed_fused_adam_on_one_gpu(real_apex, tmp_path, max_norm):
    """apex_distributed_adam at world size 1 (what one GPU allows): the optimizer's own grad sync,
    accumulation and clipping against raw torch AdamW in bf16, and its sharded state in the
    portable checkpoint read by torch AdamW (compared with DistributedFusedAdam's own gather)."""
    pytest.importorskip("apex.contrib.optimizers.distributed_fused_adam")
    data = _data()
    ref_fp32 = raw(None, max_norm=max_norm, data=data)
    ref = raw(torch.bfloat16, max_norm=max_norm, data=data)
    floor = rel(ref_fp32["losses"], ref["losses"])
    accel = accelkit.get("apex_distributed_adam", precision="bf16-mixed", max_grad_norm=max_norm)
    model = _net()
    model, opt = accel.setup(model, torch.optim.AdamW(param_groups(model, LR), lr=LR))
    got = train_accel(accel, model, data)
    state, step = _dfa_state(opt.optimizer, model)
    accel.save(tmp_path / "dfa", {"model": model, "optimizer": opt})
    cuda = accelkit.get("cuda", precision="bf16-mixed")
    model2 = _net()
    model2, opt2 = cuda.setup(
        model2, torch.optim.AdamW(param_groups(model2, LR), lr=LR, fused=True)
    )
    cuda.load(tmp_path / "dfa", {"model": model2, "optimizer": opt2})
    exact = all(
        torch.equal(opt2.optimizer.state[p][k].cpu(), state[n][k])
        for n, p in model2.named_parameters()
        for k in ("exp_avg", "exp_avg_sq")
    )
    weights = all(torch.equal(p.cpu(), state[n]["param"]) for n, p in model2.named_parameters())
    figures = dict(
        floor_bf16_vs_fp32=floor,
        dfa_vs_torch_bf16=rel(ref["losses"], got["losses"]),
        dfa_norms_vs_torch=rel(ref["norms"], got["norms"]) if max_norm else 0.0,
        step=int(step),
        to_torch_exact=exact,
        weights_exact=weights,
    )
    report_gpu(f"distributed_fused_adam_1gpu_{'clipped' if max_norm else 'unclipped'}", **figures)
    assert int(step) == STEPS and exact and weights
    assert figures["dfa_vs_torch_bf16"] <= 2 * floor
    assert figures["dfa_norms_vs_torch"] <= 2 * floor


def test_distributed_fused_adam_fp16_overflow(real_apex):
    pytest.importorskip("apex.contrib.optimizers.distributed_fused_adam")
    data = _data(12)
    accel = accelkit.get("apex_distributed_adam", precision="16-mixed", track_grad_norm=True)
    model = _net()
    model, opt = accel.setup(model, torch.optim.AdamW(param_groups(model, LR), lr=LR))
    got = train_accel(accel, model, data, overflow_at=(5,))
    figures = dict(
        skipped=[i for i, s in enumerate(got["skipped"]) if s],
        step=int(opt.optimizer.state["step"]),
        scale=accel.backend.precision.scaler.get_scale(),
        norm_at_overflow=got["norms"][5],
    )
    report_gpu("distributed_fused_adam_fp16", **figures)
    assert 5 in figures["skipped"] and figures["norm_at_overflow"] == float("inf")
    assert figures["step"] == len(data) - len(figures["skipped"])
