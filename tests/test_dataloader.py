"""``setup_dataloader``: sharding by rank, per-epoch order, mid-epoch resume at the same or
another world size, padded samples in ``gather_for_metrics``, worker seeding
(docs/architecture.md, "Semantics that hold on every backend": data).

The expected orders are written from the documented rule of ``ResumableSampler``, not read
from it: the global order of epoch ``e`` is ``torch.randperm(n)`` from a generator seeded
``seed + e`` when shuffling, else ``arange(n)``; rank ``r`` of ``W`` takes ``order[r::W]``.
"""

from __future__ import annotations

import json

import pytest
import torch

import accelkit
from accelkit.testing import run_ranks

SEED = 3


def documented_order(n: int, epoch: int, seed: int = SEED) -> list[int]:
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).tolist()


def index_loader(accel, n: int, batch_size: int, **kwargs):
    dataset = torch.utils.data.TensorDataset(torch.arange(n))
    return accel.setup_dataloader(
        torch.utils.data.DataLoader(dataset, batch_size=batch_size, **kwargs)
    )


def take(loader, batches: int | None = None) -> list[int]:
    seen = []
    for i, (batch,) in enumerate(loader):
        seen += batch.tolist()
        if batches is not None and i + 1 == batches:
            break
    return seen


# ---- one process ------------------------------------------------------------------------------
def test_order_follows_the_documented_rule_and_changes_every_epoch():
    accel = accelkit.get("cpu", seed=SEED)
    loader = index_loader(accel, 10, 3, shuffle=True)
    epochs = [take(loader) for _ in range(3)]
    assert epochs == [documented_order(10, e) for e in range(3)]
    assert len({tuple(e) for e in epochs}) == 3  # set_epoch was called every epoch
    assert len(loader) == 4


def test_without_shuffle_the_dataset_order_is_kept():
    accel = accelkit.get("cpu", seed=SEED)
    loader = index_loader(accel, 7, 2)
    assert take(loader) == list(range(7))
    assert take(loader) == list(range(7))


def test_shuffle_argument_overrides_the_loaders_sampler():
    accel = accelkit.get("cpu", seed=SEED)
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    loader = accel.setup_dataloader(
        torch.utils.data.DataLoader(dataset, batch_size=5), shuffle=True
    )
    assert take(loader) == documented_order(10, 0)


def test_mid_epoch_state_continues_the_exact_order():
    accel = accelkit.get("cpu", seed=SEED)
    uninterrupted = index_loader(accel, 11, 2, shuffle=True)
    expected = take(uninterrupted) + take(uninterrupted)

    first = index_loader(accelkit.get("cpu", seed=SEED), 11, 2, shuffle=True)
    seen = take(first)  # epoch 0 complete
    seen += take(first, batches=2)  # epoch 1, two batches in
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state["epoch"] == 1 and state["consumed"] == 4

    resumed = index_loader(accelkit.get("cpu", seed=99), 11, 2, shuffle=True)
    resumed.load_state_dict(state)  # carries the sampler seed: seed=99 above does not matter
    seen += take(resumed)
    assert seen == expected
    assert take(resumed) == documented_order(11, 2)  # and the next epoch follows on


def test_state_saved_at_the_last_batch_resumes_at_the_next_epoch():
    loader = index_loader(accelkit.get("cpu", seed=SEED), 6, 2, shuffle=True)
    take(loader, batches=3)  # the whole epoch, stopped inside the loop body of its last batch
    state = loader.state_dict()
    resumed = index_loader(accelkit.get("cpu", seed=SEED), 6, 2, shuffle=True)
    resumed.load_state_dict(state)
    assert take(resumed) == documented_order(6, 1)


def test_drop_last_is_kept():
    loader = index_loader(accelkit.get("cpu", seed=SEED), 10, 3, drop_last=True)
    assert take(loader) == list(range(9))
    assert len(loader) == 3


def test_iterable_dataset_is_left_as_is(caplog):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    accel = accelkit.get("cpu")
    loader = accel.setup_dataloader(torch.utils.data.DataLoader(Stream(), batch_size=2))
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert loader.sampler is None


@pytest.mark.parametrize(
    "make_sampler, allowed",
    [
        (lambda ds: torch.utils.data.SubsetRandomSampler([0, 2, 4]), {0, 2, 4}),
        (lambda ds: torch.utils.data.WeightedRandomSampler([0, 0, 0, 0, 0, 1.0], 4), {5}),
        (lambda ds: torch.utils.data.RandomSampler(ds, replacement=True, num_samples=9), None),
    ],
    ids=["subset", "weighted", "with-replacement"],
)
def test_custom_sampler_is_kept(make_sampler, allowed):
    """A sampler that draws other samples than a permutation must not be swapped out."""
    dataset = torch.utils.data.TensorDataset(torch.arange(6))
    original = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=make_sampler(dataset))
    loader = accelkit.get("cpu", seed=SEED).setup_dataloader(original)
    seen = take(loader)
    assert len(seen) == len(original.sampler)
    if allowed is not None:
        assert set(seen) <= allowed


def test_a_distributed_sampler_from_a_ddp_loop_is_replaced_with_its_intent():
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True)
    loader = accelkit.get("cpu", seed=SEED).setup_dataloader(
        torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    )
    assert take(loader) == documented_order(10, 0)
    assert take(loader) == documented_order(10, 1)  # set_epoch is now called for the user


def test_gather_for_metrics_at_the_last_batch_on_one_process():
    accel = accelkit.get("cpu")
    loader = index_loader(accel, 5, 2)
    means, labels = [], []
    for (batch,) in loader:
        means += accel.gather_for_metrics(batch.float().mean()).tolist()  # a 0-d tensor
        labels += accel.gather_for_metrics({"label": batch})["label"].tolist()
    assert means == [0.5, 2.5, 4.0]
    assert labels == list(range(5))


def test_last_batch_closes_the_accumulation_window():
    """The loader tells the accelerator where an epoch ends (the short-window rule)."""
    accel = accelkit.get("cpu", accumulation_steps=3)
    model = torch.nn.Linear(1, 1)
    model, _opt = accel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = index_loader(accel, 5, 1)
    applied = []
    for _ in range(2):
        for (x,) in loader:
            accel.backward(model(x.float()[:, None]).sum())
            applied.append(accel.step())
    assert applied == [False, False, True, False, True] * 2


# ---- two processes ----------------------------------------------------------------------------
class RandomDraws(torch.utils.data.Dataset):
    """Each item is a draw from the loading worker's RNG stream."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(())


def data_worker(resume_state: dict, n: int) -> dict:
    accel = accelkit.get("ddp", seed=SEED, timeout=60.0)
    out: dict = {"rank": accel.rank}

    loader = index_loader(accel, n, 2, shuffle=True)
    out["epochs"] = [take(loader) for _ in range(2)]
    out["partial"] = take(loader, batches=2)  # epoch 2, two batches in
    out["partial_state"] = loader.state_dict()

    resumed = index_loader(accel, n, 2, shuffle=True)
    resumed.load_state_dict(resume_state)
    out["resumed"] = take(resumed)

    # evaluation over 7 samples: rank 1's last batch holds a padded duplicate of sample 0
    evaluation = index_loader(accel, 7, 2)
    tensors, objects, local, means, pairs, tokens = [], [], [], [], [], []
    for (batch,) in evaluation:
        local += batch.tolist()
        tensors += accel.gather_for_metrics(batch * 10).tolist()
        objects += accel.gather_for_metrics([f"s{i}" for i in batch.tolist()])
        means.append(accel.gather_for_metrics(batch.float().mean()).tolist())  # one per rank
        gathered = accel.gather_for_metrics({"pred": batch * 10, "label": batch})
        pairs += list(zip(gathered["pred"].tolist(), gathered["label"].tolist()))
        # not one entry per sample (two tokens per sample): nothing to drop
        tokens.append(len(accel.gather_for_metrics(batch.repeat_interleave(2))))
    out["eval_local"], out["eval_tensors"], out["eval_objects"] = local, tensors, objects
    out["eval_means"], out["eval_pairs"], out["eval_tokens"] = means, pairs, tokens

    # validation run inside the last training batch, before its step (a common loop shape):
    # the eval loader's gathers must not use the train loader's padding, and the train window
    # must still close at the train loader's end
    model = torch.nn.Linear(1, 1)
    accel3 = accelkit.get("ddp", accumulation_steps=3)
    model, _ = accel3.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train = index_loader(accel3, 7, 2)  # rank 1's last batch is padded
    validation = index_loader(accel3, 8, 2)  # no padding
    out["nested_eval"], out["nested_applied"] = [], []
    for (batch,) in train:
        accel3.backward(model(batch.float()[:, None]).sum())
        if train.is_last_batch:
            seen = []
            for (v,) in validation:
                seen += accel3.gather_for_metrics(v).tolist()
            out["nested_eval"] = sorted(seen)
        out["nested_applied"].append(accel3.step())

    draws = accel.setup_dataloader(
        torch.utils.data.DataLoader(RandomDraws(), batch_size=2, num_workers=1)
    )
    out["worker_draws"] = [x for batch in draws for x in batch.tolist()]
    return out


N = 12


@pytest.fixture(scope="module")
def world1_partial() -> tuple[list[int], dict]:
    """A one-process run stopped 3 batches (6 samples) into epoch 1."""
    loader = index_loader(accelkit.get("cpu", seed=SEED), N, 2, shuffle=True)
    take(loader)
    seen = take(loader, batches=3)
    return seen, json.loads(json.dumps(loader.state_dict()))


@pytest.fixture(scope="module")
def ranks(world1_partial) -> list[dict]:
    return run_ranks("test_dataloader:data_worker", {"resume_state": world1_partial[1], "n": N})


def test_two_ranks_see_disjoint_shards_covering_the_dataset(ranks):
    for epoch in range(2):
        shards = [r["epochs"][epoch] for r in ranks]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(N))
        for rank, shard in enumerate(shards):
            assert shard == documented_order(N, epoch)[rank::2]
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]


def test_world2_state_resumes_at_world1_with_each_sample_once(ranks):
    states = [r["partial_state"] for r in ranks]
    assert states[0] == states[1]
    assert states[0]["epoch"] == 2 and states[0]["consumed"] == 8
    seen = ranks[0]["partial"] + ranks[1]["partial"]
    loader = index_loader(accelkit.get("cpu", seed=SEED), N, 2, shuffle=True)
    loader.load_state_dict(json.loads(json.dumps(states[0])))
    rest = take(loader)
    assert rest == documented_order(N, 2)[8:]
    assert sorted(seen + rest) == list(range(N))


def test_world1_state_resumes_at_world2_with_each_sample_once(ranks, world1_partial):
    seen, _ = world1_partial
    rest = [r["resumed"] for r in ranks]
    order = documented_order(N, 1)
    assert seen == order[:6]
    assert rest[0] == order[6:][0::2] and rest[1] == order[6:][1::2]
    assert sorted(seen + rest[0] + rest[1]) == list(range(N))


def test_gather_for_metrics_drops_padded_duplicates(ranks):
    assert ranks[0]["eval_local"] == [0, 2, 4, 6]
    assert ranks[1]["eval_local"] == [1, 3, 5, 0]  # the sampler padded with sample 0
    for rank in ranks:
        assert sorted(rank["eval_tensors"]) == [10 * i for i in range(7)]
        assert sorted(rank["eval_objects"]) == sorted(f"s{i}" for i in range(7))
        assert sorted(rank["eval_pairs"]) == [[10 * i, i] for i in range(7)]
        # a 0-d result per rank is not per-sample: one entry per rank, even at the last batch
        assert rank["eval_means"] == [[1.0, 2.0], [5.0, 2.5]]
        assert rank["eval_tokens"] == [8, 8]


def test_evaluation_inside_the_last_training_batch(ranks):
    for rank in ranks:
        assert rank["nested_eval"] == list(range(8))
        assert rank["nested_applied"] == [False, True]  # 2 batches per rank; closes at the end


def test_dataloader_workers_get_distinct_streams_per_rank(ranks):
    """Same seed on both ranks, yet their workers draw different numbers (seeded by rank)."""
    assert len(ranks[0]["worker_draws"]) == 2  # 4 items, sharded
    assert ranks[0]["worker_draws"] != ranks[1]["worker_draws"]
