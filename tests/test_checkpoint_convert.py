"""``accelkit convert`` and ``accelkit inspect`` (issue 4, items 6 and 3).

Exports are checked by the plain PyTorch path (``safetensors.torch.load_file`` /
``torch.load`` + ``model.load_state_dict(strict=True)``); imports by loading the portable
result into fresh objects and comparing bit for bit with the source objects.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import test_checkpoint_reference as ref
import torch

from accelkit.checkpoint import load, save
from accelkit.cli import main as cli
from accelkit.errors import CheckpointError


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A trained model + AdamW + scheduler, and its portable checkpoint."""
    torch.manual_seed(0)
    model = ref.Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ref.LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    data = ref.Samples()
    for i in range(3):
        tokens, targets, _ = data[i]
        ref.lm_loss(model(tokens[None]), targets[None]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    path = tmp_path_factory.mktemp("convert") / "ckpt"
    save(None, path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 3})
    return {"model": model, "opt": opt, "sched": sched, "path": path}


def _fresh():
    torch.manual_seed(1)
    model = ref.Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5)
    return model, opt


def _assert_model_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _assert_optimizer_equal(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"])
    for pid in sa["state"]:
        for key, value in sa["state"][pid].items():
            assert torch.equal(value, sb["state"][pid][key]), (pid, key)


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


# ---- export -------------------------------------------------------------------------------------------
def test_export_safetensors_loads_into_a_plain_model(source, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert cli(["convert", str(source["path"]), str(out)]) == 0
    model = ref.Net()
    model.load_state_dict(load_file(str(out)), strict=True)  # tied names included
    _assert_model_equal(model, source["model"])


def test_export_pt_on_request(source, tmp_path):
    out = tmp_path / "model.bin"
    assert cli(["convert", str(source["path"]), str(out), "--format", "pt"]) == 0
    model = ref.Net()
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    _assert_model_equal(model, source["model"])


def test_export_shows_progress_when_asked(source, tmp_path, capfd):
    assert cli(["convert", str(source["path"]), str(tmp_path / "m.safetensors"), "--progress"]) == 0
    assert "export m.safetensors" in capfd.readouterr().err


def test_large_conversions_show_progress_by_default(source, tmp_path, capfd, monkeypatch):
    """The bar appears on its own from PROGRESS_BYTES up (lowered here to this small state),
    not below it, and never with --no-progress."""
    import accelkit.checkpoint.progress as progress_module

    assert cli(["convert", str(source["path"]), str(tmp_path / "small.safetensors")]) == 0
    assert "export small.safetensors" not in capfd.readouterr().err
    monkeypatch.setattr(progress_module, "PROGRESS_BYTES", 1)
    assert cli(["convert", str(source["path"]), str(tmp_path / "big.safetensors")]) == 0
    assert "export big.safetensors" in capfd.readouterr().err
    out = tmp_path / "quiet.safetensors"
    assert cli(["convert", str(source["path"]), str(out), "--no-progress"]) == 0
    assert "export quiet.safetensors" not in capfd.readouterr().err


def test_export_of_a_damaged_checkpoint_fails(source, tmp_path, capfd):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(source["path"], bad)
    _flip(bad, "blocks.1.down.weight")
    assert cli(["convert", str(bad), str(tmp_path / "m.safetensors")]) == 1
    assert "failed its checksum" in capfd.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()


# ---- import -----------------------------------------------------------------------------------------------
def test_import_plain_safetensors(source, tmp_path):
    from safetensors.torch import save_file

    plain = {"module." + k: v.clone() for k, v in source["model"].state_dict().items()}  # DDP-style
    save_file(plain, str(tmp_path / "plain.safetensors"))
    assert cli(["convert", str(tmp_path / "plain.safetensors"), str(tmp_path / "imported")]) == 0
    model, _ = _fresh()
    load(None, tmp_path / "imported", {"model": model})
    _assert_model_equal(model, source["model"])


def test_import_pickled_files_need_trust(source, tmp_path, capfd):
    path = tmp_path / "weights.pt"
    torch.save(source["model"].state_dict(), path)
    assert cli(["convert", str(path), str(tmp_path / "no")]) == 1
    assert "is a pickle" in capfd.readouterr().err and not (tmp_path / "no").exists()
    assert cli(["convert", str(path), str(tmp_path / "yes"), "--trust-pickle"]) == 0
    model, _ = _fresh()
    load(None, tmp_path / "yes", {"model": model})
    _assert_model_equal(model, source["model"])


def _plain_run():
    """A model whose optimizer holds all its parameters (what Lightning/Fabric users write)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def _plain_fresh():
    model, _opt, _sched = _plain_run()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2)


def test_import_fabric_style_checkpoint_with_optimizer(tmp_path):
    model0, opt0, sched0 = _plain_run()
    path = tmp_path / "fabric.ckpt"
    state = {"model": model0.state_dict(), "optimizer": opt0.state_dict()}
    torch.save({**state, "scheduler": sched0.state_dict(), "step": 3}, path)
    assert cli(["convert", str(path), str(tmp_path / "out"), "--trust-pickle"]) == 0
    model, opt, sched = _plain_fresh()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    load(None, tmp_path / "out", state)
    _assert_model_equal(model, model0)
    _assert_optimizer_equal(opt, opt0)
    assert sched.state_dict() == sched0.state_dict() and state["step"] == 3


def test_import_names_optimizer_ids_around_frozen_params_and_buffers(source, tmp_path):
    """ref.Net's optimizer skips a frozen parameter, and the state dict holds a float buffer:
    the ids are still matched to names unambiguously, by the shapes of their state."""
    path = tmp_path / "net.ckpt"
    state = {"model": source["model"].state_dict(), "optimizer": source["opt"].state_dict()}
    torch.save(state, path)
    assert cli(["convert", str(path), str(tmp_path / "out"), "--trust-pickle"]) == 0
    model, opt = _fresh()
    load(None, tmp_path / "out", {"model": model, "optimizer": opt})
    _assert_model_equal(model, source["model"])
    _assert_optimizer_equal(opt, source["opt"])


def test_import_with_ambiguous_optimizer_ids_keeps_the_model_only(tmp_path, caplog):
    """A frozen LayerNorm weight shaped like the trainable bias next to it: which of the two
    is the optimizer's third parameter cannot be told, so only the model is imported."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    model[1].weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "ambiguous.ckpt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    assert cli(["convert", str(path), str(tmp_path / "out"), "--trust-pickle"]) == 0
    assert "cannot be matched" in caplog.text
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    load(None, tmp_path / "out", {"model": fresh})
    _assert_model_equal(fresh, model)
    with pytest.raises(CheckpointError, match="missing from the checkpoint: optimizer"):
        load(
            None,
            tmp_path / "out",
            {"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters())},
        )


def test_import_lightning_checkpoint(tmp_path):
    """The layout Lightning's ModelCheckpoint writes (built by hand: no lightning installed)."""
    model0, opt0, sched0 = _plain_run()
    path = tmp_path / "epoch=0-step=3.ckpt"
    prefixed = {f"net.{k}": v for k, v in model0.state_dict().items()}
    torch.save(
        {
            "epoch": 0,
            "global_step": 3,
            "pytorch-lightning_version": "2.4.0",
            "state_dict": prefixed,
            "optimizer_states": [opt0.state_dict()],
            "lr_schedulers": [sched0.state_dict()],
            "callbacks": {"ModelCheckpoint": {"best_model_path": ""}},
        },
        path,
    )
    code = cli(
        ["convert", str(path), str(tmp_path / "out"), "--trust-pickle", "--strip-prefix", "net."]
    )
    assert code == 0
    model, opt, sched = _plain_fresh()
    rest = load(None, tmp_path / "out", {"model": model, "optimizer": opt, "scheduler": sched})
    _assert_model_equal(model, model0)
    _assert_optimizer_equal(opt, opt0)
    assert sched.state_dict() == sched0.state_dict()
    assert rest["global_step"] == 3 and rest["lightning_version"] == "2.4.0"


def test_import_dcp_directory(source, tmp_path, capfd):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(source["model"], source["opt"])
    with pytest.warns(UserWarning):
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "dcp"))
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "no")]) == 1
    assert "is a pickle" in capfd.readouterr().err and not (tmp_path / "no").exists()
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "out"), "--trust-pickle"]) == 0
    model, opt = _fresh()
    load(None, tmp_path / "out", {"model": model, "optimizer": opt})
    _assert_model_equal(model, source["model"])
    _assert_optimizer_equal(opt, source["opt"])


class _LitNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        )


def test_import_a_checkpoint_written_by_lightning(tmp_path):
    """A checkpoint the real Lightning Trainer wrote (skipped where lightning is absent)."""
    lightning = pytest.importorskip("lightning")

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _LitNet().net

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    module = Module()
    trainer = lightning.Trainer(
        max_steps=3,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert cli(["convert", str(tmp_path / "last.ckpt"), str(tmp_path / "no")]) == 1
    code = cli(
        [
            "convert",
            str(tmp_path / "last.ckpt"),
            str(tmp_path / "out"),
            "--trust-pickle",
            "--strip-prefix",
            "net.",
        ]
    )
    assert code == 0
    model = _LitNet().net
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    rest = load(None, tmp_path / "out", {"model": model, "optimizer": opt, "scheduler": sched})
    _assert_model_equal(model, module.net)
    _assert_optimizer_equal(opt, trainer.optimizers[0])
    assert sched.state_dict() == trainer.lr_scheduler_configs[0].scheduler.state_dict()
    assert rest["global_step"] == 3 and rest["lightning_version"] == lightning.__version__


def test_import_a_checkpoint_written_by_fabric(tmp_path):
    """A checkpoint the real Fabric.save wrote (skipped where lightning is absent)."""
    lightning = pytest.importorskip("lightning")
    torch.manual_seed(0)
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    net = _LitNet().net
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(net, sgd)
    for _ in range(2):
        fabric.backward(model(torch.randn(3, 4)).square().mean())
        opt.step()
        opt.zero_grad()
    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": opt, "step": 2})
    assert (
        cli(["convert", str(tmp_path / "fabric.ckpt"), str(tmp_path / "out"), "--trust-pickle"])
        == 0
    )
    fresh = _LitNet().net
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    load(None, tmp_path / "out", state)
    _assert_model_equal(fresh, net)
    _assert_optimizer_equal(fresh_opt, sgd)
    assert state["step"] == 2


def test_unknown_input_lists_the_importers(tmp_path, capfd):
    (tmp_path / "x.txt").write_text("hello")
    assert cli(["convert", str(tmp_path / "x.txt"), str(tmp_path / "out")]) == 1
    err = capfd.readouterr().err
    assert "no importer recognises it" in err and "dcp" in err and "safetensors" in err


def test_a_plugin_importer_is_found_through_the_hook(tmp_path):
    import accelkit
    from accelkit.checkpoint.formats.convert import Imported, importers, write_portable

    class MyFormat:
        def detect(self, path):
            return str(path).endswith(".myfmt")

        def convert(self, path, dst, *, trust_pickle=False):
            weights = {("model", "param", "w"): torch.full((2, 2), 7.0)}
            imported = Imported(weights, {"model": {"type": "module"}}, {}, "import:myfmt")
            write_portable(imported, dst)

    class Plugin:
        @accelkit.hookimpl
        def accelkit_checkpoint_importers(self):
            return {"myfmt": MyFormat(), "safetensors": MyFormat()}  # cannot shadow a native one

    accelkit.register_plugin(Plugin(), "myfmt-plugin")
    found = importers()
    assert isinstance(found["myfmt"], MyFormat) and not isinstance(found["safetensors"], MyFormat)
    (tmp_path / "a.myfmt").write_text("")
    assert cli(["convert", str(tmp_path / "a.myfmt"), str(tmp_path / "out")]) == 0
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(2, 2))
    load(None, tmp_path / "out", {"model": module})
    assert torch.equal(module.w.detach(), torch.full((2, 2), 7.0))


# ---- inspect -----------------------------------------------------------------------------------------------
def test_inspect_prints_the_summary_and_verifies(source, capfd):
    assert cli(["inspect", str(source["path"]), "--tensors"]) == 0
    out = capfd.readouterr().out
    assert "world size  1" in out and "step 3" in out
    assert "optimizer            optimizer  family adamw" in out
    assert "model:param:embed.weight  [19, 6] float32  1 fragment(s)  (aliases head.weight)" in out
    assert "checksums   all" in out and "fragments OK" in out


def test_inspect_fails_on_a_bad_checksum(source, tmp_path, capfd):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(source["path"], bad)
    _flip(bad, "blocks.1.down.weight")
    assert cli(["inspect", str(bad)]) == 1
    err = capfd.readouterr().err
    assert "1 of" in err and "FAILED" in err
    assert "rank-00000.safetensors" in err and "blocks.1.down.weight" in err


def test_inspect_runs_as_a_command(source):
    proc = subprocess.run(
        [sys.executable, "-m", "accelkit.cli", "inspect", str(source["path"]), "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.split("checksums")[0])["format"] == "accelkit.checkpoint"


def test_convert_errors_are_checkpoint_errors(tmp_path):
    from accelkit.checkpoint.formats.convert import convert

    with pytest.raises(CheckpointError, match="no such file"):
        convert(tmp_path / "missing", tmp_path / "out")
    assert not Path(tmp_path / "out").exists()
