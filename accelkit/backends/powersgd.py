"""PowerSGD for ``ddp``'s ``comm_hook="powersgd"``, with state that resumes exactly.

torch's ``PowerSGDState`` keys its error feedback and low-rank factors by bucket index. A DDP
model starts in its initial bucket order and rebuilds its buckets after the first step, so after
a resume an index names other gradients than it did when the state was saved. Here the state is
kept by parameter name: before torch's hook runs on a bucket whose parameters differ from the
ones last seen at that index, the bucket's entries are built from the per-parameter state, and a
save splits them back by parameter. The factors and the step count (the same on every rank) go
to the backend's shared state, the error feedback (each rank's own) to its per-rank state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

PIECES = ("error", "p", "q")


@dataclass(frozen=True)
class _Slice:
    """Where one parameter's state sits in its bucket's flat tensors."""

    name: str
    offset: int  # in the bucket's gradient buffer (and its error feedback)
    numel: int
    p: tuple[int, int] | None  # (start, length) in the bucket's P factors; None: not compressed
    q: tuple[int, int] | None


class PowerSGDKeeper:
    """torch's PowerSGD state and hook, with the state kept by parameter across bucket changes.

    Made before ``setup`` (a load may come first); :meth:`attach` builds torch's state and
    registers the hook once DDP has wrapped the model."""

    def __init__(self, rank: int, start_iter: int) -> None:
        self.rank, self.start_iter = rank, start_iter
        self.state: Any = None
        self._names: dict[int, str] = {}  # id(param) -> name in the wrapped module
        self._layouts: dict[int, list[_Slice]] = {}  # bucket index -> what torch's entry holds
        self._params: dict[int, tuple[int, ...]] = {}  # bucket index -> ids of its parameters
        self._adopted: set[int] = set()  # indices handed to torch's hook in this step
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # by name, in no bucket yet
        self._shared: dict[str, Any] | None = None  # step count and RNG loaded before attach

    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Build torch's state for ``ddp`` and register the hook on it."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        self.state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.start_iter,
            random_seed=0,
        )
        self._names = {id(p): name for name, p in ddp.module.named_parameters()}
        self._layouts.clear()
        self._params.clear()
        if self._shared is not None:
            self._apply_shared(self._shared)
        ddp.register_comm_hook(self, _hook)

    # ---- the step -------------------------------------------------------------------------------
    def adopt(self, bucket: Any) -> None:
        """Make torch's entries at ``bucket.index()`` hold this bucket's parameters' state."""
        index = bucket.index()
        params = tuple(id(p) for p in bucket.parameters())
        if self._params.get(index) == params:
            self._adopted.add(index)
            return
        # the buckets changed (DDP's rebuild after its first step, or a resume): every entry not
        # yet used in this step goes back to per-parameter state (those used are in flight)
        for other in [i for i in self._layouts if i not in self._adopted]:
            self._split(other)
        layout = self._layout(bucket)
        self._join(index, layout, bucket.buffer())
        self._layouts[index], self._params[index] = layout, params
        self._adopted.add(index)

    def _layout(self, bucket: Any) -> list[_Slice]:
        """Each gradient's place in the bucket, P and Q as torch's hook lays them out: the
        compressed gradients grouped by matrix shape, in order of each shape's first one."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        buffer = bucket.buffer()
        base, size = buffer.data_ptr(), buffer.element_size()
        found, by_shape = [], {}
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            n = grad.shape[0]
            m = grad.numel() // n
            rank = min(n, m, self.state.matrix_approximation_rank)
            compress = _should_compress(n, m, rank, self.state.min_compression_rate)[0]
            offset = (grad.data_ptr() - base) // size
            found.append((self._names[id(param)], offset, grad.numel(), (n, m, rank), compress))
            if compress:
                by_shape.setdefault((n, m), []).append(len(found) - 1)
        places: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
        p_at = q_at = 0
        for (n, m), members in by_shape.items():
            for i in members:
                rank = found[i][3][2]
                places[i] = ((p_at, n * rank), (q_at, m * rank))
                p_at, q_at = p_at + n * rank, q_at + m * rank
        return [
            _Slice(name, offset, numel, *places.get(i, (None, None)))
            for i, (name, offset, numel, _, _) in enumerate(found)
        ]

    def _split(self, index: int) -> None:
        """torch's entries at ``index`` back to per-parameter state."""
        layout = self._layouts.pop(index)
        self._params.pop(index, None)
        flats = {
            "error": self.state.error_dict.pop(index, None),
            "p": self.state.p_memory_dict.pop(index, None),
            "q": self.state.q_memory_dict.pop(index, None),
        }
        for name, pieces in _cut(layout, flats):
            self._pending[name] = pieces

    def _join(self, index: int, layout: list[_Slice], buffer: torch.Tensor) -> None:
        """torch's entries at ``index`` from the per-parameter state of ``layout``'s
        parameters, where each has it (else torch starts that entry afresh)."""
        entries = [self._pending.pop(s.name, {}) for s in layout]
        like = {"dtype": buffer.dtype, "device": buffer.device}
        errors = [e.get("error") for e in entries]
        if all(t is not None and t.numel() == s.numel for s, t in zip(layout, errors)):
            error = torch.zeros(buffer.numel(), **like)
            for s, t in zip(layout, errors):
                error[s.offset : s.offset + s.numel] = t
            self.state.error_dict[index] = error
        compressed = [(s, e) for s, e in zip(layout, entries) if s.p is not None]
        fits = all(
            e.get(k) is not None and e[k].numel() == getattr(s, k)[1]
            for s, e in compressed
            for k in ("p", "q")
        )
        if compressed and fits:
            for key, dictionary in (
                ("p", self.state.p_memory_dict),
                ("q", self.state.q_memory_dict),
            ):
                flat = torch.empty(sum(getattr(s, key)[1] for s, _ in compressed), **like)
                for s, e in compressed:
                    start, length = getattr(s, key)
                    flat[start : start + length] = e[key]
                dictionary[index] = flat

    # ---- checkpoints ------------------------------------------------------------------------
    def by_parameter(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's state now (copies), torch's entries included."""
        out = {
            name: {k: v.clone() for k, v in pieces.items()}
            for name, pieces in self._pending.items()
        }
        if self.state is None:
            return out
        for index, layout in self._layouts.items():
            flats = {
                "error": self.state.error_dict.get(index),
                "p": self.state.p_memory_dict.get(index),
                "q": self.state.q_memory_dict.get(index),
            }
            out.update(_cut(layout, flats))
        return out

    def shared_state(self) -> dict[str, Any]:
        """The step count, the RNG that seeds new factors, and the factors: the same on every
        rank, so saved once."""
        state = self.state
        if state is None:
            return dict(self._shared or {})
        kind, keys, position, has_gauss, gauss = state.rng.get_state()
        factors = {
            name: {k: v for k, v in pieces.items() if k != "error"}
            for name, pieces in self.by_parameter().items()
        }
        return {
            "iter": state.iter,
            "rank": state.matrix_approximation_rank,
            "rng": [kind, torch.from_numpy(keys.astype("int64")), position, has_gauss, gauss],
            "factors": {name: f for name, f in factors.items() if f},
        }

    def rank_state(self) -> dict[str, Any]:
        """This rank's error feedback, by parameter name."""
        errors = {n: p["error"] for n, p in self.by_parameter().items() if "error" in p}
        return {"error": errors} if errors else {}

    def load_shared(self, saved: dict[str, Any]) -> None:
        """Take the saved step count and factors (the error feedback comes next, per rank)."""
        self._pending = {name: dict(pieces) for name, pieces in saved.get("factors", {}).items()}
        if self.state is None:
            self._shared = saved
        else:
            self._apply_shared(saved)

    def load_rank_state(self, saved: dict[str, Any]) -> None:
        """Take this rank's saved error feedback."""
        for name, error in saved.get("error", {}).items():
            self._pending.setdefault(name, {})["error"] = error

    def _apply_shared(self, saved: dict[str, Any]) -> None:
        import numpy as np

        state = self.state
        state.iter = int(saved["iter"])
        if "rng" in saved:
            kind, keys, position, has_gauss, gauss = saved["rng"]
            state.rng.set_state(
                (kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, gauss)
            )
        # torch's entries, if any, are stale now: per-parameter state replaces them (factors of
        # another powersgd_rank do not fit their slices, and torch starts those afresh)
        for dictionary in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            dictionary.clear()
        self._layouts.clear()
        self._params.clear()


def _cut(
    layout: list[_Slice], flats: dict[str, torch.Tensor | None]
) -> Iterable[tuple[str, dict[str, torch.Tensor]]]:
    """Each parameter's pieces of a bucket's flat tensors (copies)."""
    for s in layout:
        pieces = {}
        spans = {"error": (s.offset, s.numel), "p": s.p, "q": s.q}
        for key in PIECES:
            flat, span = flats[key], spans[key]
            if flat is not None and span is not None:
                pieces[key] = flat[span[0] : span[0] + span[1]].clone()
        yield s.name, pieces


def _hook(keeper, bucket):  # type: ignore[no-untyped-def]
    """torch's PowerSGD hook, given the bucket's state by parameter first. Not annotated: DDP
    checks a hook's annotations against its own classes, and here they would be strings."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    if keeper.state.iter >= keeper.state.start_powerSGD_iter:
        keeper.adopt(bucket)
    future = powerSGD_hook(keeper.state, bucket)
    if bucket.is_last():
        keeper._adopted.clear()
    return future
