"""Precision strings on the torch-native backends (issue 2, item 5).

Every precision runs the accelkit-side loop of ``test_reference`` against the raw reference of
``reference_raw`` (torch.autocast / GradScaler / ``module.to(dtype)`` written by hand).

Noise floor, measured on torch 2.13 CPU with the configuration below (batch 6): the raw
reference against itself with every micro-batch fed in reverse sample order (the same mathematics
in another floating-point order) moves the losses by at most 2.1e-7 relative in every precision,
the grad norms by at most 8.7e-8, the final weights by 2.6e-8. accelkit ``cpu`` against the raw
reference: 0 (bit-identical) in all five precisions. The effect of the precision itself (each
low precision against 32-true) is at least 2.4e-4 (16-mixed losses). Tolerance, fixed from these
numbers: relative 1e-5 on cpu in every precision -- 50x the floor, and 24x below the smallest
effect, which each test also checks so that a precision silently running in fp32 fails.

On ``ddp`` (2 gloo processes) the reference is torch DDP by hand in the same processes (see the
ddp section for why the global-batch reference cannot serve in low precision): measured
bit-identical, held to the same 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from reference_raw import train_reference
from test_reference import (
    CONFIG,
    FEATURES,
    Net,
    assert_same_run,
    make_data,
    max_relative_error,
    max_weight_error,
    train_with_accelkit,
)

import accelkit
from accelkit.testing import run_ranks

PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
CPU_RTOL = 1e-5
#: batch 6 over 66 samples: 11 micro-batches per epoch, windows 3, 3, 3, 2
BATCH = 6
N_SAMPLES = 66


def assert_differs_from_fp32(run: dict, fp32: dict, rtol: float) -> None:
    """The precision really ran: its losses are farther from fp32's than the tolerance, by 10x."""
    effect = max_relative_error(run["losses"], fp32["losses"])
    assert effect > 10 * rtol, f"losses within {effect:.2g} of fp32: precision not applied?"


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    return make_data(N_SAMPLES)


@pytest.fixture(scope="module")
def fp32_reference(data) -> dict:
    return train_reference(*data, batch_size=BATCH, **CONFIG)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_cpu_precision_matches_raw_reference(precision, data, fp32_reference):
    expected = train_reference(*data, batch_size=BATCH, precision=precision, **CONFIG)
    actual = train_with_accelkit("cpu", *data, batch_size=BATCH, precision=precision, **CONFIG)
    assert_same_run(actual, expected, CPU_RTOL)
    if precision != "32-true":
        assert_differs_from_fp32(expected, fp32_reference, CPU_RTOL)
    if precision == "16-mixed":
        assert actual["scales"] == expected["scales"]
        assert actual["scales"] and all(s > 1 for s in actual["scales"])


def test_fp16_overflow_run_matches_raw_reference(data):
    """A window with an inf loss is skipped in both, and the runs stay identical afterwards."""
    poison = (4, 15)  # inside the 2nd window of each epoch
    expected = train_reference(
        *data, batch_size=BATCH, precision="16-mixed", poison_micro=poison, **CONFIG
    )
    actual = train_with_accelkit(
        "cpu", *data, batch_size=BATCH, precision="16-mixed", poison_micro=poison, **CONFIG
    )
    assert expected["skipped"] == [False, True, False, False, False, True, False, False]
    assert actual["skipped"] == expected["skipped"]
    assert actual["scales"] == expected["scales"]
    assert actual["grad_norms"][1] == math.inf and actual["grad_norms"][5] == math.inf
    keep = [i for i, s in enumerate(expected["skipped"]) if not s]
    assert (
        max_relative_error(
            [actual["grad_norms"][i] for i in keep], [expected["grad_norms"][i] for i in keep]
        )
        <= CPU_RTOL
    )
    assert max_relative_error(actual["losses"], expected["losses"]) <= CPU_RTOL
    assert max_relative_error(actual["lrs"], expected["lrs"]) <= CPU_RTOL
    assert actual["scheduler_steps"] == 6  # 8 windows, 2 skipped
    assert max_weight_error(actual["final"], expected["final"]) <= CPU_RTOL


@pytest.mark.parametrize("inject", ["loss", "grad_hook"])
def test_fp16_inf_gradient_skips_step_backs_off_scale_and_holds_scheduler(inject):
    accel = accelkit.get("cpu", precision="16-mixed", max_grad_norm=1.0, seed=0)
    model = Net(FEATURES, 16)
    model, optimizer = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scheduler = accel.setup_scheduler(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    )
    scaler = accel.backend.precision.scaler
    x, y = make_data(4)

    accel.backward(F.mse_loss(model(x), y))
    assert accel.step()
    assert not accel.step_was_skipped
    assert math.isfinite(float(accel.grad_norm))
    assert scheduler.last_epoch == 1

    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    momentum = {k: v["momentum_buffer"].clone() for k, v in optimizer.state.items()}
    scale, lr = scaler.get_scale(), optimizer.param_groups[0]["lr"]
    loss = F.mse_loss(model(x), y)
    if inject == "loss":
        loss = loss * math.inf
    else:
        handle = model.mid.weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
    accel.backward(loss)
    if inject == "grad_hook":
        handle.remove()
    assert accel.step()  # the window closed ...
    assert accel.step_was_skipped  # ... without applying
    for name, value in model.state_dict().items():
        assert torch.equal(value, params[name]), f"{name} changed on a skipped step"
    for p, buf in momentum.items():
        assert torch.equal(optimizer.state[p]["momentum_buffer"], buf)
    assert scaler.get_scale() == scale * 0.5
    assert float(accel.grad_norm) == math.inf
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == lr
    assert all(p.grad is None for p in model.parameters())  # the window's gradients are gone

    accel.backward(F.mse_loss(model(x), y))
    assert accel.step()
    assert not accel.step_was_skipped
    assert scheduler.last_epoch == 2
    assert not torch.equal(model.state_dict()["mid.weight"], params["mid.weight"])


class _Probe(torch.nn.Module):
    """Records the dtypes its forward sees; returns a float tensor and an int tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.emb = torch.nn.Embedding(5, 3)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x, idx, *, extra):
        hidden = self.lin(x)
        self.seen.update(x=x.dtype, idx=idx.dtype, extra=extra.dtype, hidden=hidden.dtype)
        return {"out": hidden + self.emb(idx) + extra[:, None], "idx": idx}


@pytest.mark.parametrize(
    "precision, low, cast_inputs, low_params",
    [
        ("32-true", torch.float32, False, False),
        ("bf16-mixed", torch.bfloat16, False, False),
        ("16-mixed", torch.float16, False, False),
        ("bf16-true", torch.bfloat16, True, True),
        ("16-true", torch.float16, True, True),
    ],
)
def test_forward_runs_under_policy_and_returns_fp32(precision, low, cast_inputs, low_params):
    accel = accelkit.get("cpu", precision=precision)
    model = accel.setup(_Probe())
    out = model(torch.randn(2, 4), torch.tensor([1, 4]), extra=torch.randn(2))
    seen = model.seen
    assert seen["x"] == seen["extra"] == (low if cast_inputs else torch.float32)
    assert seen["idx"] == torch.int64  # integer inputs are never cast
    assert seen["hidden"] == low  # the compute dtype inside the forward
    assert out["out"].dtype == torch.float32
    assert out["idx"].dtype == torch.int64
    assert {p.dtype for p in model.parameters()} == {low if low_params else torch.float32}


def test_autocast_context_for_code_outside_the_forward():
    accel = accelkit.get("cpu", precision="bf16-mixed")
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with accel.autocast():
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("precision", [None, "bf16-mixed", "16-mixed"])
def test_cuda_without_a_gpu_fails_at_get(precision):
    with pytest.raises(accelkit.ConfigError, match=r"needs a CUDA device.*'cpu'"):
        accelkit.get("cuda", precision=precision)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_ddp_on_cuda_without_a_gpu_fails_at_get_before_joining_a_group():
    with pytest.raises(accelkit.ConfigError, match="no CUDA device"):
        accelkit.get("ddp", device="cuda")
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an MPS device")
def test_mps_without_a_device_fails_at_get():
    with pytest.raises(accelkit.ConfigError, match="MPS"):
        accelkit.get("mps")


def test_unknown_precision_lists_the_valid_ones():
    with pytest.raises(accelkit.ConfigError) as info:
        accelkit.get("cpu", precision="fp4-mixed")
    message = str(info.value)
    assert "fp4-mixed" in message
    for name in [*PRECISIONS, "fp8-mixed"]:
        assert name in message


def loss_scale(accel) -> float:
    """The current loss scale, read the way a checkpoint reads it."""
    return float(accel.backend.state_dict()["precision"]["scale"])


def test_fp16_two_optimizers_in_one_step_share_one_scale_update():
    """Like torch's recipe ``scaler.step(a); scaler.step(b); scaler.update()``: one overflow
    halves the scale once, and each optimizer is unscaled by the scale its gradients carry."""
    torch.manual_seed(0)
    x, y = make_data(6)
    raw = Net(FEATURES, 8)
    initial = {k: v.clone() for k, v in raw.state_dict().items()}
    accel = accelkit.get("cpu", precision="16-mixed")
    model = Net(FEATURES, 8)
    model.load_state_dict(initial)
    opt_a = torch.optim.SGD(model.inp.parameters(), lr=0.1)
    opt_b = torch.optim.SGD([*model.mid.parameters(), *model.out.parameters()], lr=0.1)
    model, opt_a, opt_b = accel.setup(model, opt_a, opt_b)

    raw_a = torch.optim.SGD(raw.inp.parameters(), lr=0.1)
    raw_b = torch.optim.SGD([*raw.mid.parameters(), *raw.out.parameters()], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    skipped = []
    for step, poison in enumerate([False, False, True, False, False]):
        factor = math.inf if poison else 1.0
        accel.backward(F.mse_loss(model(x), y) * factor)
        assert accel.step()
        with torch.autocast("cpu", dtype=torch.float16):
            out = raw(x)
        scaler.scale(F.mse_loss(out.float(), y) * factor).backward()
        scale_before = scaler.get_scale()
        scaler.step(raw_a)
        scaler.step(raw_b)
        scaler.update()
        raw_a.zero_grad()
        raw_b.zero_grad()
        skipped.append(scaler.get_scale() < scale_before)
        assert accel.step_was_skipped is skipped[-1], step
        assert loss_scale(accel) == scaler.get_scale(), step
        for name, value in raw.state_dict().items():
            assert torch.equal(accel.unwrap(model).state_dict()[name], value), (step, name)
    assert skipped[2] and not skipped[-1]


@pytest.mark.parametrize(
    "precision, dtype", [("bf16-true", torch.bfloat16), ("16-true", torch.float16)]
)
def test_init_module_builds_true_precision_weights_directly(precision, dtype):
    accel = accelkit.get("cpu", precision=precision)
    with accel.init_module():
        model = Net(FEATURES, 8)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert torch.get_default_dtype() == torch.float32  # restored on exit
    model = accel.setup(model)
    assert model(torch.randn(2, FEATURES)).dtype == torch.float32


# ---- ddp -------------------------------------------------------------------------------------
# Against the single-process reference on the global batch, ddp matches in 32-true (1.3e-7,
# test_reference) but not in low precision: each rank rounds its own half-batch gradient to
# bf16/fp16 before the all-reduce, so the run differs from the global batch at the precision's own
# error (measured: bf16-mixed 2.9e-4 loss / 1.5e-3 grad norm, 16-mixed 3.2e-5 / 1.3e-4, bf16-true
# 2.6e-3 / 8.4e-3, 16-true 1.1e-4 / 7.5e-4 -- as large as the effect of the precision itself).
# The reference for ddp is therefore torch DDP written by hand (reference_raw, distributed=True)
# in the same two processes: the same partition, measured bit-identical, held to CPU_RTOL.


def ddp_precision_worker(
    features: list, targets: list, precisions: list, poison_micro: list, config: dict
) -> dict:
    features_t, targets_t = torch.tensor(features), torch.tensor(targets)
    results = {}
    for precision in precisions:
        poison = poison_micro if precision == "16-mixed" else []
        expected = train_reference(
            features_t,
            targets_t,
            precision=precision,
            distributed=True,
            poison_micro=poison,
            **config,
        )
        actual = train_with_accelkit(
            "ddp", features_t, targets_t, precision=precision, poison_micro=poison, **config
        )
        applied = [i for i, skipped in enumerate(expected["skipped"]) if not skipped]
        results[precision] = {
            "losses": [actual["losses"], expected["losses"]],
            "grad_norms": [[run["grad_norms"][i] for i in applied] for run in (actual, expected)],
            "skipped_norms": [
                n for n, s in zip(actual["grad_norms"], actual["skipped"], strict=True) if s
            ],
            "lrs": [actual["lrs"], expected["lrs"]],
            "scales": [actual["scales"], expected["scales"]],
            "skipped": [actual["skipped"], expected["skipped"]],
            "weights": max_weight_error(actual["final"], expected["final"]),
        }
    return results


@pytest.mark.slow
def test_ddp_precisions_match_raw_ddp_reference():
    features, targets = make_data(2 * N_SAMPLES)
    config = {**CONFIG, "batch_size": BATCH}
    ranks = run_ranks(
        "test_precision:ddp_precision_worker",
        {
            "features": features.tolist(),
            "targets": targets.tolist(),
            "precisions": PRECISIONS,
            "poison_micro": [4],  # 16-mixed only: a skipped window on both ranks
            "config": config,
        },
    )
    for precision in PRECISIONS:
        for rank, result in enumerate(ranks):
            run = result[precision]
            where = f"{precision} rank {rank}"
            for key in ("losses", "grad_norms", "lrs"):
                actual, expected = run[key]
                err = max_relative_error(actual, expected)
                assert err <= CPU_RTOL, f"{where} {key}: relative error {err:.3g}"
            assert run["weights"] <= CPU_RTOL, where
            assert run["skipped"][0] == run["skipped"][1], where
            assert run["scales"][0] == run["scales"][1], where
        assert ranks[0][precision]["losses"][0] != ranks[1][precision]["losses"][0]
    for result in ranks:  # the poisoned window was skipped on both ranks, its norm is inf
        assert result["16-mixed"]["skipped"][0][1] is True
        assert result["16-mixed"]["skipped_norms"] == [math.inf]


# ---- GPU twins (the lead runs these on the H200: `pytest -m gpu tests/test_precision.py`) -----
#: not measured in CI (no GPU); the same ops in the same order are expected to match bit for bit
#: as they do on the CPU, so the CPU tolerance applies.
GPU_RTOL = 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_cuda_mixed_precision_matches_raw_reference(precision, data):
    fp32 = train_reference(*data, batch_size=BATCH, device="cuda", **CONFIG)
    expected = train_reference(
        *data, batch_size=BATCH, precision=precision, device="cuda", **CONFIG
    )
    actual = train_with_accelkit("cuda", *data, batch_size=BATCH, precision=precision, **CONFIG)
    assert_same_run(actual, expected, GPU_RTOL)
    assert_differs_from_fp32(expected, fp32, GPU_RTOL)
    if precision == "16-mixed":
        assert actual["scales"] == expected["scales"]
