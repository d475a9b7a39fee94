"""``accelkit convert`` of ColossalAI's own sharded checkpoints (``booster.save_model`` /
``save_optimizer`` with ``shard=True``, written by raw ColossalAI on 2 gloo processes), loaded
afterwards on the ``cpu`` backend: weights and Adam state equal to what ColossalAI's own gather
(``LowLevelZeroOptimizer.state_dict()``) held at the save. The shards are pickles, so the
conversion needs ``trust_pickle``; without it, and with a shard missing, it fails clearly.

``trust_pickle`` never runs a shard's code: with a code-running gadget planted in a model shard,
an optimizer shard or the param-group file (``os.system``, ``exec``, one nested in a dict, one
inside a tensor storage's persistent id), the conversion is refused naming the gadget's global
and what to do, the gadget's marker file is never created and nothing is written."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch

pytest.importorskip("colossalai")

import accelkit
from accelkit.checkpoint.formats.convert import convert
from accelkit.errors import CheckpointError
from accelkit.sdk import PickleRefused, conversion_allowlist, restricted_torch_load
from accelkit.testing import run_ranks
from accelkit.testing.pickle_gadgets import gadgets, persistent_id_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("colossalai-native")
    reference = run_ranks("cai_reference:booster_sharded_save", {"path": str(root / "ck")})[0]
    return root, reference


def _cpu_state(path):
    accel = accelkit.get("cpu")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(7, 13),
        torch.nn.Tanh(),
        torch.nn.Linear(13, 13),
        torch.nn.Tanh(),
        torch.nn.Linear(13, 5),
    )
    model, opt = accel.setup(net, torch.optim.Adam(net.parameters(), lr=1.0))
    accel.load(path, {"model": model, "optimizer": opt})
    names = [n for n, _ in net.named_parameters()]
    params = {k: v.float().reshape(-1).tolist() for k, v in net.state_dict().items()}
    optim = {
        f"{names[i]}.{k}": v.float().reshape(-1).tolist()
        for i, entry in opt.state_dict()["state"].items()
        for k, v in entry.items()
        if isinstance(v, torch.Tensor)
    }
    return params, optim, opt.param_groups[0]["lr"]


def test_sharded_booster_checkpoint_converts_exactly(saved):
    root, reference = saved
    assert len(list((root / "ck" / "model").glob("pytorch_model-*.bin"))) > 1  # really sharded
    dst = convert(root / "ck", root / "portable", trust_pickle=True)
    params, optim, lr = _cpu_state(dst)
    assert params == reference["params"]
    assert optim == reference["optim"]
    assert len(optim) == 3 * 6
    assert lr == 0.05  # the saved param group's, not the target's 1.0


def test_pickled_shards_need_trust(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match="is a pickle"):
        convert(root / "ck", root / "untrusted")


def test_missing_shard_fails_naming_it(saved):
    root, _ = saved
    broken = root / "broken"
    shutil.copytree(root / "ck", broken)
    victim = sorted((broken / "optimizer").glob("pytorch_optim-*.bin"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        convert(broken, root / "from-broken", trust_pickle=True)


#: the files a gadget is planted in
PLANT_PLACES = {
    "model shard": "model/pytorch_model-00001.bin",
    "optimizer shard": "optimizer/pytorch_optim-00006.bin",
    "param groups": "optimizer/pytorch_optim_group.bin",
}
GADGETS = (*gadgets("marker"), "persistent id")


@pytest.mark.parametrize("place", PLANT_PLACES)
@pytest.mark.parametrize("gadget", GADGETS)
def test_a_planted_gadget_is_refused_and_never_runs(saved, gadget, place, tmp_path):
    root, _ = saved
    copy = tmp_path / "ck"
    shutil.copytree(root / "ck", copy)
    file = copy / PLANT_PLACES[place]
    state = restricted_torch_load(file, conversion_allowlist(), hint="")
    marker = tmp_path / "gadget-ran"
    holder = state[0] if isinstance(state, list) else state  # the param groups are a list
    if gadget == "persistent id":  # rides on a tensor's storage record (the groups have none)
        holder["hook"] = torch.ones(1)
        torch.save(state, file, pickle_module=persistent_id_module(marker))
    else:
        holder["hook"] = gadgets(marker)[gadget][0]
        torch.save(state, file)
    refused = gadgets(marker).get(gadget, gadgets(marker)["os.system"])[1]
    with pytest.raises(PickleRefused, match="load it with ColossalAI's Booster") as refusal:
        convert(copy, tmp_path / "out", trust_pickle=True)
    assert refusal.value.refused == (refused,)
    assert str(refusal.value).startswith(f"{file}: refused to unpickle: it names {refused},")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
    with contextlib.suppress(Exception):  # the negative can fail: a plain load runs the gadget
        torch.load(file, weights_only=False)
    assert marker.exists()
