"""The fast paths of checkpoint I/O keep every byte: GPU tensors streamed to the file through
pinned slots in pieces, small GPU reads batched, checksums checked in runs and split over the
ranks by bytes, and the asynchronous save's device-side first snapshot.

Every comparison is against the live tensors, read back with plain torch (``.cpu()``), never
through accelkit; each path has a damaged-file twin that must fail and change nothing.
"""

from __future__ import annotations

import time

import pytest
import torch

from accelkit.checkpoint import CheckpointReader, load, save
from accelkit.checkpoint.format import pinned as staging
from accelkit.checkpoint.read.verify import verify_share
from accelkit.checkpoint.write import background
from accelkit.errors import CheckpointError


class Mixed(torch.nn.Module):
    """Many tensors of mixed sizes, as a real model has: a tied embedding larger than a
    staging slot, 2-D weights, 1-D norms and biases of a few bytes."""

    def __init__(self, vocab: int = 3000, width: int = 64, layers: int = 6) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).float().logsumexp(-1).mean()


def _trained(device: str, seed: int = 0, fused: bool = False):
    torch.manual_seed(seed)
    model = Mixed().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    for _ in range(2):
        model(torch.randint(0, 3000, (4, 16), device=device)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _plain(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, on the CPU, by plain torch."""
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for key, value in opt.state[p].items():
            out[f"opt.{i}.{key}"] = torch.as_tensor(value).detach().cpu().clone()
    return out


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _flip_a_byte(directory, at: float = 0.5) -> None:
    path = directory / "rank-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x40
    path.write_bytes(bytes(data))


def test_checksums_split_over_ranks_check_each_fragment_once(tmp_path, monkeypatch):
    """Every fragment is checked by exactly one rank, in runs of back-to-back fragments."""
    model, opt = _trained("cpu")
    save(None, tmp_path / "c", {"model": model, "optimizer": opt}, rng=False)
    fragments = set()
    seen: list[set] = []
    for rank in range(3):
        with CheckpointReader(tmp_path / "c") as reader:
            fragments = {(f.file, f.key) for t in reader.manifest.tensors for f in t.fragments}
            verify_share(reader, rank, 3)
            seen.append(set(reader._verified))
    assert set().union(*seen) == fragments
    assert sum(len(s) for s in seen) == len(fragments)  # no fragment twice
    assert all(seen)  # the bytes are split: every rank has a share


@pytest.mark.parametrize("at", [0.02, 0.5, 0.98])
def test_a_flipped_byte_fails_the_run_check_and_changes_nothing(tmp_path, at):
    model, opt = _trained("cpu")
    save(None, tmp_path / "c", {"model": model, "optimizer": opt}, rng=False)
    _flip_a_byte(tmp_path / "c", at)
    other, other_opt = _trained("cpu", seed=1)
    before = _plain(other, other_opt)
    with pytest.raises(CheckpointError, match="failed its checksum"):
        load(None, tmp_path / "c", {"model": other, "optimizer": other_opt}, rng=False)
    _assert_equal(_plain(other, other_opt), before)


class Transposed(torch.nn.Module):
    """A parameter stored transposed (not contiguous), as a tensor-parallel shard of a
    column-split weight is: the loader reads it whole, then copies it in."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(48, 32).t())
        self.bias = torch.nn.Parameter(torch.randn(48))


def test_a_target_that_is_not_contiguous_is_filled_before_the_load_returns(tmp_path, monkeypatch):
    """Inside the loader's parallel reads, a read the caller uses at once (a non-contiguous
    target's staging copy) must not be left in flight: reads on the reader's threads are
    slowed down here, so one the caller did not wait for would leave garbage behind."""
    slow_read = CheckpointReader._read_task

    def late(self, *args):
        time.sleep(0.05)
        return slow_read(self, *args)

    monkeypatch.setattr(CheckpointReader, "_read_task", late)
    torch.manual_seed(0)
    source = Transposed()
    assert not source.weight.is_contiguous()
    save(None, tmp_path / "c", {"model": source}, rng=False)
    torch.manual_seed(1)
    target = Transposed()
    load(None, tmp_path / "c", {"model": target}, rng=False)
    assert torch.equal(target.weight.detach(), source.weight.detach())
    assert torch.equal(target.bias.detach(), source.bias.detach())


@pytest.mark.gpu
def test_gpu_state_streams_through_small_slots_and_loads_bit_exact(tmp_path, monkeypatch):
    """Slots of 64 KB: the embedding goes out in many pieces; fused AdamW's step tensors (4
    bytes on the GPU) come back in batched reads; the same on the CPU and the GPU."""
    monkeypatch.setattr(staging, "SLOT_BYTES", 64 << 10)
    monkeypatch.setattr(staging, "_slots", None)
    model, opt = _trained("cuda", fused=True)
    expected = _plain(model, opt)
    save(None, tmp_path / "c", {"model": model, "optimizer": opt}, rng=False)
    for device in ("cuda", "cpu"):
        other, other_opt = _trained(device, seed=1, fused=device == "cuda")
        load(None, tmp_path / "c", {"model": other, "optimizer": other_opt}, rng=False)
        torch.cuda.synchronize()
        _assert_equal(_plain(other, other_opt), expected)
    assert other.head.weight is other.tok.weight  # the tie survives


@pytest.mark.gpu
def test_gpu_load_of_a_flipped_byte_changes_nothing(tmp_path):
    model, opt = _trained("cuda", fused=True)
    save(None, tmp_path / "c", {"model": model, "optimizer": opt}, rng=False)
    _flip_a_byte(tmp_path / "c", 0.3)
    other, other_opt = _trained("cuda", seed=1, fused=True)
    before = _plain(other, other_opt)
    with pytest.raises(CheckpointError, match="failed its checksum"):
        load(None, tmp_path / "c", {"model": other, "optimizer": other_opt}, rng=False)
    _assert_equal(_plain(other, other_opt), before)


@pytest.mark.gpu
def test_gpu_async_save_holds_the_moment_it_was_taken(tmp_path, monkeypatch):
    """The first save snapshots into device memory, then the host staging is pinned in the
    background; the second copies into that pinned staging, which the writer process writes. Training steps run while each
    writes; each checkpoint holds the state of its save call, bit for bit."""
    from accelkit.checkpoint.profile import last_save

    monkeypatch.setattr(background, "_buffer", None)
    monkeypatch.setattr(background, "_pinned", False)
    monkeypatch.setattr(background, "_shared", None)
    monkeypatch.setattr(background, "_grow_to", 0)
    model, opt = _trained("cuda", fused=True)
    for name, writer in (("first", "threads"), ("second", "process")):
        expected = _plain(model, opt)
        save(None, tmp_path / name, {"model": model, "optimizer": opt}, asynchronous=True)
        for _ in range(3):  # training changes the state while the save writes
            model(torch.randint(0, 3000, (4, 16), device="cuda")).backward()
            opt.step()
            opt.zero_grad()
        background.wait()
        assert background._buffer is not None and background._buffer.is_pinned()
        # the first writes from its device snapshot; the second from shared, pinned staging
        assert background._pinned and last_save().writer == writer
        other, other_opt = _trained("cuda", seed=1, fused=True)
        load(None, tmp_path / name, {"model": other, "optimizer": other_opt}, rng=False)
        _assert_equal(_plain(other, other_opt), expected)
        assert not torch.equal(expected["model.tok.weight"], model.tok.weight.cpu())
