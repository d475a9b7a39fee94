"""``accelkit convert CKPT OUT --to dcp`` (issue 25): a checkpoint of any backend becomes a
torch.distributed.checkpoint directory. The reference side (``_restore``, ``_one_step``) is raw
PyTorch: ``dcp.load`` into a fresh plain model, ``get_state_dict``/``set_state_dict`` for a
fresh AdamW; it imports nothing from accelkit. Weights and the step after a restore are
compared bit for bit (``torch.equal``) with the run that saved the checkpoint."""

from __future__ import annotations

import json
import shutil
import warnings
import weakref
from pathlib import Path

import pytest
import test_checkpoint_reference as ref
import torch
from dcp_export_workers import next_batch, train_and_save

from accelkit.cli import main as cli
from accelkit.testing import run_ranks

HERE = Path(__file__).parent


# ---- the reference side: raw torch.distributed.checkpoint -------------------------------------
def _restore(
    directory: Path, *, with_optimizer: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh plain model and AdamW (other weights, other lr and weight decay: the load must
    replace them all), filled from the DCP directory by torch alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(7)
    model = ref.Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        if with_optimizer:
            model_state, optim_state = get_state_dict(model, opt)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=str(directory))
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        else:
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=str(directory))
            model.load_state_dict(state["model"])
    return model, opt


def _one_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    tokens, targets = next_batch()
    ref.lm_loss(model(tokens), targets).backward()
    opt.step()
    opt.zero_grad()


def _assert_weights(model: torch.nn.Module, dumped: dict) -> None:
    expected = {
        k[len("model/") :]: v for k, v in dumped["tensors"].items() if k.startswith("model/")
    }
    actual = model.state_dict()
    assert sorted(expected) == sorted(actual)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


# ---- the runs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp-cpu")
    train_and_save(str(out), "cpu")
    return out


def _convert(ck: Path, out: Path, *extra: str) -> int:
    return cli(["convert", str(ck), str(out), "--to", "dcp", *extra])


def test_weights_load_with_raw_dcp_bit_for_bit(cpu_run, tmp_path):
    assert _convert(cpu_run / "ck", tmp_path / "dcp") == 0
    model, _ = _restore(tmp_path / "dcp", with_optimizer=False)
    _assert_weights(model, ref.undump(cpu_run / "saved"))  # tied, frozen and buffer included


def test_with_the_optimizer_the_next_step_continues_the_original(cpu_run, tmp_path):
    assert _convert(cpu_run / "ck", tmp_path / "dcp", "--with-optimizer") == 0
    model, opt = _restore(tmp_path / "dcp", with_optimizer=True)
    assert opt.param_groups[0]["lr"] == ref.LR and opt.param_groups[0]["weight_decay"] == 0.1
    _one_step(model, opt)
    _assert_weights(model, ref.undump(cpu_run / "continued"))


def test_without_the_optimizer_state_the_next_step_differs(cpu_run, tmp_path):
    """The twin of the test above: a fresh AdamW's step does not land on the original's, so
    the comparison there sees the optimizer state."""
    assert _convert(cpu_run / "ck", tmp_path / "dcp") == 0
    model, opt = _restore(tmp_path / "dcp", with_optimizer=False)
    _one_step(model, opt)
    with pytest.raises(AssertionError):
        _assert_weights(model, ref.undump(cpu_run / "continued"))


def test_the_export_holds_one_source_tensor_at_a_time(cpu_run, tmp_path, monkeypatch):
    """Peak memory is one tensor: each is read from the checkpoint when DCP writes it, and
    released before the next one is read."""
    from accelkit.checkpoint.read.reader import CheckpointReader

    read = CheckpointReader.read
    alive: list[weakref.ref] = []
    most = [0]

    def counting_read(self, entry, **kwargs):
        tensor = read(self, entry, **kwargs)
        alive.append(weakref.ref(tensor))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return tensor

    monkeypatch.setattr(CheckpointReader, "read", counting_read)
    assert _convert(cpu_run / "ck", tmp_path / "dcp", "--with-optimizer") == 0
    assert len(alive) > 20 and most[0] == 1


def test_the_export_imports_back_into_a_portable_checkpoint(cpu_run, tmp_path):
    """DCP -> portable (the dcp importer) gives the same tensors: the layouts agree."""
    from accelkit.checkpoint import load

    assert _convert(cpu_run / "ck", tmp_path / "dcp", "--with-optimizer") == 0
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "back"), "--trust-pickle"]) == 0
    torch.manual_seed(7)
    model = ref.Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5)
    load(None, tmp_path / "back", {"model": model, "optim": opt})
    _one_step(model, opt)
    _assert_weights(model, ref.undump(cpu_run / "continued"))


# ---- negative twins -------------------------------------------------------------------------------
def _flip(path: Path, fqn: str) -> None:
    """Flip one bit of model tensor ``fqn``'s stored bytes."""
    from accelkit.checkpoint.format.safetensors_io import read_header

    manifest = json.loads((path / "accelkit.json").read_text())
    entry = next(t for t in manifest["tensors"] if t["fqn"] == fqn and t["object"] == "model")
    target = path / entry["fragments"][0]["file"]
    header, start = read_header(target)
    offset = start + header[entry["fragments"][0]["key"]]["data_offsets"][0]
    raw = bytearray(target.read_bytes())
    raw[offset + 1] ^= 0x04
    target.write_bytes(bytes(raw))


def test_a_damaged_checkpoint_fails_and_leaves_no_output(cpu_run, tmp_path, capfd):
    bad = tmp_path / "bad"
    shutil.copytree(cpu_run / "ck", bad)
    _flip(bad, "blocks.1.down.weight")
    assert _convert(bad, tmp_path / "dcp", "--with-optimizer") == 1
    err = capfd.readouterr().err
    assert "failed its checksum" in err and "blocks.1.down.weight" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no output, no temporary


def test_a_non_empty_output_directory_is_refused(cpu_run, tmp_path, capfd):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "keep.txt").write_text("mine")
    assert _convert(cpu_run / "ck", tmp_path / "dcp") == 1
    assert "not empty" in capfd.readouterr().err
    assert [p.name for p in (tmp_path / "dcp").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()  # an empty one is fine
    assert _convert(cpu_run / "ck", tmp_path / "empty") == 0
    assert (tmp_path / "empty" / ".metadata").is_file()


def test_optimizer_requests_that_cannot_be_met_fail_clearly(cpu_run, tmp_path, capfd):
    from accelkit.checkpoint import save

    assert _convert(cpu_run / "ck", tmp_path / "a", "--with-optimizer", "nope") == 1
    assert "no optimizer 'nope'" in capfd.readouterr().err
    save(None, tmp_path / "weights-only", {"model": ref.Net()})
    assert _convert(tmp_path / "weights-only", tmp_path / "b", "--with-optimizer") == 1
    assert "no optimizer of module 'model'" in capfd.readouterr().err
    hf = ["convert", str(cpu_run / "ck"), str(tmp_path / "c"), "--to", "hf", "--with-optimizer"]
    assert cli(hf) == 1
    assert "--with-optimizer applies to --to dcp only" in capfd.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abc")


# ---- two processes (slow tier) ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_a_two_rank_checkpoint_exports_what_it_trained(backend, tmp_path):
    run_ranks(
        "dcp_export_workers:train_and_save",
        {"out": str(tmp_path), "backend": backend},
        nproc=2,
        timeout=300,
        path=[HERE],
    )
    assert _convert(tmp_path / "ck", tmp_path / "dcp", "--with-optimizer") == 0
    model, opt = _restore(tmp_path / "dcp", with_optimizer=True)
    _assert_weights(model, ref.undump(tmp_path / "saved"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's ranks ran (OMP_NUM_THREADS=1): the same sums
    try:
        _one_step(model, opt)
    finally:
        torch.set_num_threads(threads)
    _assert_weights(model, ref.undump(tmp_path / "continued"))
