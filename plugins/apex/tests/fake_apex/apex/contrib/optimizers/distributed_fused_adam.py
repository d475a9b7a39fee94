"""FAKE ``apex.contrib.optimizers.distributed_fused_adam`` (tests only; see ../../../README.md).

A model of Apex's DistributedFusedAdam on the CPU with gloo: the same constructor keywords, the
state layout Apex documents (``state["buckets"]`` of ``StateBucket`` with ``exp_avg_shard``,
``exp_avg_sq_shard``, ``params_shard``; ``state[param]["fragments"]`` of ``ParameterFragment``;
one ``state["step"]``), gradients copied into flat buckets by a post-accumulate hook and
reduce-scattered (here: all-reduced, then cut), and the methods accelkit uses: ``no_sync``,
``grad_sync``, ``grad_norm``, ``clip_grad_norm``, ``unscale_grads``, ``init_params``,
``zero_grad``, ``step(grad_scaler=...)``. The Adam update is FusedAdam's (fp32 state and copy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import amp_C  # noqa: F401  (Apex's module imports its compiled kernels at load, so does this)
import distributed_adam_cuda  # noqa: F401
import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

import apex

ACCELKIT_FAKE = True
ALIGNMENT = 4  # elements; Apex aligns fragments to 128 bytes


@dataclass
class ParameterFragment:
    param_group_id: int
    param_id: int
    bucket_id: int
    param_range: tuple[int, int]
    bucket_range: tuple[int, int]
    in_local_shard: bool
    shard_range: tuple[int, int] | None
    shard_bucket_range: tuple[int, int] | None
    shard_param_range: tuple[int, int] | None


class StateBucket:
    def __init__(self, bucket_size: int, shard_size: int, dtype: torch.dtype, store_params: bool):
        self.bucket_size = bucket_size
        self.shard_size = shard_size
        self.dtype = dtype
        self.filled_size = 0
        self.fragments: list[ParameterFragment] = []
        self.params_shard = torch.zeros(shard_size, dtype=dtype) if store_params else None
        self.exp_avg_shard = torch.zeros(shard_size, dtype=dtype)
        self.exp_avg_sq_shard = torch.zeros(shard_size, dtype=dtype)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


class DistributedFusedAdam(torch.optim.Optimizer):
    ParameterFragment = ParameterFragment
    StateBucket = StateBucket
    _step_supports_amp_scaling = True
    _custom_amp_unscale_grads = True

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        dtype=torch.float32,
        grad_sync_dtype=None,
        param_sync_dtype=None,
        device="cuda",
        process_group=None,
        distributed_process_group=None,
        redundant_process_group=None,
        average_grad_sync=True,
        overlap_grad_sync=True,
        overlap_param_sync=False,
        bucket_cap_mb=100.0,
        pipeline_size=2,
        contiguous_param_buffer=False,
        contiguous_grad_buffer=False,
        store_params=True,
        store_param_remainders=False,
        with_scaled_states=False,
        nccl_ub=False,
        capturable=False,
    ):
        if amsgrad:
            raise RuntimeError("DistributedFusedAdam does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        apex.record(
            "DistributedFusedAdam",
            kwargs=dict(
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                adam_w_mode=adam_w_mode,
                dtype=dtype,
                grad_sync_dtype=grad_sync_dtype,
                param_sync_dtype=param_sync_dtype,
                device=device,
                overlap_grad_sync=overlap_grad_sync,
                overlap_param_sync=overlap_param_sync,
                bucket_cap_mb=bucket_cap_mb,
                pipeline_size=pipeline_size,
                contiguous_grad_buffer=contiguous_grad_buffer,
                contiguous_param_buffer=contiguous_param_buffer,
                store_params=store_params,
            ),
            groups=[{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            events=[],
        )
        self.events = apex.CALLS[-1]["events"]
        self.adam_w_mode = adam_w_mode
        self.dtype = dtype
        self.grad_sync_dtype = grad_sync_dtype or dtype
        self.param_sync_dtype = param_sync_dtype or dtype
        self.store_params = store_params
        self.distributed_rank = dist.get_rank()
        self.distributed_size = dist.get_world_size()
        bucket = max(int(bucket_cap_mb * 2**20 / 4), ALIGNMENT * self.distributed_size)
        self.default_shard_size = _round_up(bucket // self.distributed_size, ALIGNMENT)
        self.greedy_grad_copy = True
        self.overlap_grad_sync = overlap_grad_sync
        self.state["buckets"] = []
        self.state["step"] = 0
        self._grads: dict[int, torch.Tensor] = {}  # bucket id -> local contribution (whole bucket)
        self._grads_shard: dict[int, torch.Tensor] = {}  # bucket id -> reduced local shard
        self._grad_scale = torch.ones((), dtype=torch.float32)
        self._grad_norm: torch.Tensor | None = None
        for p in self.parameters():
            dist.broadcast(p.data, src=0)  # Apex makes the replicas equal at construction
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._post_backward)

    # ---- layout ----------------------------------------------------------------------------
    def parameters(self):
        for group in self.param_groups:
            yield from group["params"]

    def parameter(self, fragment: ParameterFragment) -> torch.nn.Parameter:
        return self.param_groups[fragment.param_group_id]["params"][fragment.param_id]

    def _ids(self) -> dict[int, tuple[int, int]]:
        return {
            id(p): (g, i)
            for g, group in enumerate(self.param_groups)
            for i, p in enumerate(group["params"])
        }

    def init_params(self, params=None, dtype=None, grad_sync_dtype=None, param_sync_dtype=None):
        params = list(self.parameters() if params is None else params)
        ids = self._ids()
        for p in params:
            if "fragments" not in self.state[p]:
                self._init_param_state(p, *ids[id(p)])

    def _new_bucket(self) -> StateBucket:
        size = self.default_shard_size
        bucket = StateBucket(size * self.distributed_size, size, self.dtype, self.store_params)
        self.state["buckets"].append(bucket)
        return bucket

    @torch.no_grad()
    def _init_param_state(self, p: torch.Tensor, group_id: int, param_id: int) -> None:
        self.state[p]["fragments"] = []
        rank, numel = self.distributed_rank, p.numel()
        if not self.state["buckets"]:
            self._new_bucket()
        start = 0
        while start < numel:
            bucket_id = len(self.state["buckets"]) - 1
            bucket = self.state["buckets"][bucket_id]
            bucket_start = _round_up(bucket.filled_size, ALIGNMENT)
            size = min(numel - start, bucket.bucket_size - bucket_start)
            if size <= 0:
                self._new_bucket()
                continue
            shard_lo = bucket.shard_size * rank
            s0 = min(max(bucket_start - shard_lo, 0), bucket.shard_size)
            s1 = min(max(bucket_start + size - shard_lo, 0), bucket.shard_size)
            local = s0 < s1
            frag = ParameterFragment(
                group_id,
                param_id,
                bucket_id,
                (start, start + size),
                (bucket_start, bucket_start + size),
                local,
                (s0, s1) if local else None,
                (s0 + shard_lo, s1 + shard_lo) if local else None,
                (s0 + shard_lo - bucket_start + start, s1 + shard_lo - bucket_start + start)
                if local
                else None,
            )
            self.state[p]["fragments"].append(frag)
            bucket.fragments.append(frag)
            bucket.filled_size = bucket_start + size
            if local and bucket.params_shard is not None:
                a, b = frag.shard_param_range
                bucket.params_shard[s0:s1].copy_(p.detach().reshape(-1)[a:b])
            start += size

    # ---- gradients ---------------------------------------------------------------------------
    def _post_backward(self, p: torch.Tensor) -> None:
        if "fragments" not in self.state[p]:
            self._init_param_state(p, *self._ids()[id(p)])
        if self.greedy_grad_copy:
            self._grad_copy(p)

    @torch.no_grad()
    def _grad_copy(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        flat = p.grad.detach().reshape(-1)
        for frag in self.state[p]["fragments"]:
            bucket = self.state["buckets"][frag.bucket_id]
            buf = self._grads.setdefault(
                frag.bucket_id, torch.zeros(bucket.bucket_size, dtype=self.grad_sync_dtype)
            )
            (a, b), (c, d) = frag.param_range, frag.bucket_range
            buf[c:d] += flat[a:b].to(buf.dtype)
        p.grad = None

    @contextlib.contextmanager
    def no_sync(self, greedy_grad_copy=False):
        self.events.append("no_sync")
        old = self.greedy_grad_copy, self.overlap_grad_sync
        self.greedy_grad_copy, self.overlap_grad_sync = greedy_grad_copy, False
        try:
            yield
        finally:
            self.greedy_grad_copy, self.overlap_grad_sync = old

    @torch.no_grad()
    def grad_sync(self) -> None:
        self.init_params()
        for p in self.parameters():
            if p.grad is not None:
                self._grad_copy(p)
        for bucket_id, buf in sorted(self._grads.items()):
            bucket = self.state["buckets"][bucket_id]
            if self.distributed_size > 1:
                dist.all_reduce(buf)
                buf /= self.distributed_size
            lo = bucket.shard_size * self.distributed_rank
            shard = buf[lo : lo + bucket.shard_size].to(self.dtype)
            if bucket_id in self._grads_shard:
                self._grads_shard[bucket_id] += shard
            else:
                self._grads_shard[bucket_id] = shard.clone()
            self._grad_norm = None
        self._grads.clear()

    def grad_norm(self, parameters=None, norm_type=2.0, force=False):
        if force or self._grad_norm is None:
            self.grad_sync()
            sq = torch.zeros((), dtype=torch.float32)
            for shard in self._grads_shard.values():
                sq += shard.float().pow(2).sum()
            if self.distributed_size > 1:
                dist.all_reduce(sq)
            self._grad_norm = sq.sqrt()
        return (self._grad_norm * self._grad_scale).detach()

    def clip_grad_norm(self, max_norm, parameters=None, norm_type=2.0):
        self.events.append(f"clip_grad_norm({max_norm})")
        total = self.grad_norm()
        self._grad_scale *= torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    @torch.no_grad()
    def unscale_grads(self, *args, inv_scale=None, grad_scaler=None):
        self.events.append("unscale_grads")
        found_inf = torch.logical_not(torch.isfinite(self.grad_norm()))
        per_device = {found_inf.device: found_inf.float()}
        if grad_scaler is not None:
            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is not OptState.READY:
                raise RuntimeError("unscale_grads has already been called since the last update")
            inv_scale = grad_scaler._scale.double().reciprocal().float()
            state["found_inf_per_device"] = per_device
            state["stage"] = OptState.UNSCALED
        self._grad_scale *= inv_scale.reshape(())
        return per_device

    # ---- step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        self.events.append("step" if grad_scaler is None else "step(grad_scaler)")
        loss = closure() if closure is not None else None
        self.init_params()
        self.grad_sync()
        if grad_scaler is not None and grad_scaler._enabled:
            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is OptState.READY:
                self.unscale_grads(grad_scaler=grad_scaler)
            if float(sum(v.sum() for v in state["found_inf_per_device"].values())):
                return loss
        self.state["step"] += 1
        step = self.state["step"]
        for bucket_id, bucket in enumerate(self.state["buckets"]):
            grads = self._grads_shard.get(bucket_id)
            for frag in bucket.fragments:
                if not frag.in_local_shard:
                    continue
                group = self.param_groups[frag.param_group_id]
                s = slice(*frag.shard_range)
                g = (
                    grads[s] if grads is not None else torch.zeros(s.stop - s.start)
                ) * self._grad_scale
                if bucket.params_shard is not None:
                    w = bucket.params_shard[s]
                else:
                    a, b = frag.shard_param_range
                    w = self.parameter(frag).detach().reshape(-1)[a:b].float()
                m, v = bucket.exp_avg_shard[s], bucket.exp_avg_sq_shard[s]
                beta1, beta2 = group["betas"]
                lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
                bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
                bc2 = 1 - beta2**step if group["bias_correction"] else 1.0
                if not self.adam_w_mode:
                    g = g + decay * w
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode:
                    update = update + decay * w
                new = w - lr * update
                if bucket.params_shard is not None:
                    bucket.params_shard[s] = new
                else:
                    a, b = frag.shard_param_range
                    self.parameter(frag).detach().reshape(-1)[a:b].copy_(new)
        self._param_sync()
        return loss

    def param_sync(self) -> None:
        """Apex: finish overlapped parameter all-gathers. The fake's are never left pending."""
        self.events.append("param_sync")

    @torch.no_grad()
    def _param_sync(self) -> None:
        """All-gather every bucket's updated shards and copy them into the parameters."""
        for bucket in self.state["buckets"]:
            shard = bucket.params_shard
            if shard is None:
                continue
            parts = [torch.empty_like(shard) for _ in range(self.distributed_size)]
            if self.distributed_size > 1:
                dist.all_gather(parts, shard)
            else:
                parts = [shard]
            full = torch.cat(parts)
            for frag in bucket.fragments:
                p = self.parameter(frag)
                (a, b), (c, d) = frag.param_range, frag.bucket_range
                p.detach().reshape(-1)[a:b].copy_(full[c:d].to(p.dtype))

    def zero_grad(self, set_to_none=False):
        self._grads.clear()
        self._grads_shard.clear()
        self._grad_scale = torch.ones((), dtype=torch.float32)
        self._grad_norm = None
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ---- for the tests: the whole state of one parameter, gathered independently -------------
    @torch.no_grad()
    def full_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """exp_avg, exp_avg_sq and the fp32 copy of ``p``, gathered from every rank's shards."""
        out = {}
        for key in ("exp_avg", "exp_avg_sq", "params"):
            flat = torch.zeros(p.numel(), dtype=self.dtype)
            for frag in self.state[p]["fragments"]:
                if frag.in_local_shard:
                    shard = getattr(self.state["buckets"][frag.bucket_id], f"{key}_shard")
                    if shard is not None:
                        a, b = frag.shard_param_range
                        flat[a:b] = shard[slice(*frag.shard_range)]
            if self.distributed_size > 1:
                dist.all_reduce(flat)  # each element is held by exactly one rank
            out[key] = flat.reshape(p.shape)
        out["step"] = torch.tensor(float(self.state["step"]))
        return out
