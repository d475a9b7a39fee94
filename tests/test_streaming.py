"""Streams (``IterableDataset``) through ``setup_dataloader``: sharded by data-parallel rank
(each sample once across ranks, also under DataLoader workers), resumed by position at another
world size (each remaining sample once), both ends of an uneven stream with every rank stepping
the same number of times, and the streams that cannot be split or resumed refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

import accelkit
from accelkit.errors import ConfigError
from accelkit.testing import run_ranks

HERE = Path(__file__).parent
SAMPLES = 64
BATCH = 4
SAVE_AFTER = 3  # steps before the midway save


class Numbered(IterableDataset):
    """A plain generator-backed stream of numbered samples: no shards, no state of its own."""

    def __init__(self, count: int = SAMPLES) -> None:
        self.count = count

    def __iter__(self):
        yield from range(self.count)


def write_json_shards(root: Path, files: int = 4) -> list[str]:
    """``SAMPLES`` records {"x": i} over ``files`` local JSON-lines files."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    per_file = SAMPLES // files
    for f in range(files):
        path = root / f"part-{f}.jsonl"
        lines = (json.dumps({"x": f * per_file + i}) for i in range(per_file))
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def hf_stream(files: list[str]):
    import datasets

    return datasets.load_dataset("json", data_files=files, split="train", streaming=True)


def make_dataset(kind: str, root: str):
    if kind == "plain":
        return Numbered()
    return hf_stream(sorted(str(f) for f in (Path(root) / "json").glob("*.jsonl")))


def numbers(batch) -> list[int]:
    return (batch["x"] if isinstance(batch, dict) else batch).tolist()


def ddp_job(kind: str, root: str) -> dict:
    """On each of 2 ranks: a whole pass, then a new run that saves after SAVE_AFTER steps.
    Strided (the json files' 4 shards would split by shards): its position resumes at any
    world size."""
    accel = accelkit.get("ddp", seed=0)
    loader = accel.setup_dataloader(
        DataLoader(make_dataset(kind, root), batch_size=BATCH), stream_split="stride"
    )
    whole = [i for batch in loader for i in numbers(batch)]
    again = accel.setup_dataloader(
        DataLoader(make_dataset(kind, root), batch_size=BATCH), stream_split="stride"
    )
    before_save = []
    for step, batch in enumerate(again):
        before_save += numbers(batch)
        if step + 1 == SAVE_AFTER:
            break
    accel.save(Path(root) / "ckpt", {"loader": again})
    return {"whole": whole, "before_save": before_save}


def resumed_on_one_process(kind: str, root: str, **loader_kwargs) -> list[int]:
    accel = accelkit.get("cpu", seed=0)
    loader = accel.setup_dataloader(
        DataLoader(make_dataset(kind, root), batch_size=BATCH, **loader_kwargs)
    )
    accel.load(Path(root) / "ckpt", {"loader": loader})
    return [i for batch in loader for i in numbers(batch)]


@pytest.mark.parametrize("kind", ["plain", pytest.param("hf", marks=pytest.mark.slow)])
def test_two_ranks_split_the_stream_and_one_process_resumes_the_rest(tmp_path, kind):
    if kind == "hf":
        pytest.importorskip("datasets")
    write_json_shards(tmp_path / "json")  # once, before the ranks read it
    ranks = run_ranks(
        "test_streaming:ddp_job", {"kind": kind, "root": str(tmp_path)}, nproc=2, path=[HERE]
    )
    whole = ranks[0]["whole"] + ranks[1]["whole"]
    assert sorted(whole) == list(range(SAMPLES))  # every sample once across the ranks
    assert len(ranks[0]["whole"]) == len(ranks[1]["whole"])

    seen = ranks[0]["before_save"] + ranks[1]["before_save"]
    assert len(seen) == len(set(seen)) == SAVE_AFTER * BATCH * 2
    rest = resumed_on_one_process(kind, str(tmp_path))
    assert len(rest) == len(set(rest))  # none repeated
    assert set(rest).isdisjoint(seen)
    assert sorted(seen + rest) == list(range(SAMPLES))  # every remaining sample once


@pytest.mark.slow
def test_a_resume_under_dataloader_workers_sees_the_rest_once(tmp_path):
    """World size 2 -> 1 process with 2 workers, each worker reading every other round."""
    run_ranks("test_streaming:ddp_job", {"kind": "plain", "root": str(tmp_path)}, path=[HERE])
    rest = resumed_on_one_process("plain", str(tmp_path), num_workers=2)
    assert sorted(rest) == list(range(SAVE_AFTER * BATCH * 2, SAMPLES))
    assert rest == sorted(rest)  # the workers' batches come back in stream order


def uneven_job(count: int, drop_last: bool) -> list[list[int]]:
    """Each rank's batches of a stream that does not fill its last round; every step all-reduces
    as a DDP backward would, so a rank with one batch more would hang (and time out)."""
    accel = accelkit.get("ddp", seed=0)
    loader = accel.setup_dataloader(
        DataLoader(Numbered(count), batch_size=BATCH, drop_last=drop_last)
    )
    batches = []
    for batch in loader:
        batches.append(batch.tolist())
        dist.all_reduce(torch.ones(1))
    return batches


def test_an_uneven_end_is_padded_by_default_so_every_rank_steps_equally():
    count = 2 * BATCH + 5  # one full round, then 5 samples for 2 ranks
    ranks = run_ranks(
        "test_streaming:uneven_job",
        {"count": count, "drop_last": False},
        nproc=2,
        path=[HERE],
        timeout=120,
    )
    # the last round padded to 6 with its first sample: 3 + 3, nothing left out
    assert ranks == [[[0, 1, 2, 3], [8, 9, 10]], [[4, 5, 6, 7], [11, 12, 8]]]


@pytest.mark.slow
def test_drop_last_leaves_out_the_uneven_end_so_every_rank_steps_equally():
    count = 4 * BATCH + 1  # two full rounds, then 1 sample for 2 ranks
    ranks = run_ranks(
        "test_streaming:uneven_job",
        {"count": count, "drop_last": True},
        nproc=2,
        path=[HERE],
        timeout=120,
    )
    assert ranks == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]


def test_one_process_keeps_a_short_last_batch():
    accel = accelkit.get("cpu")
    loader = accel.setup_dataloader(DataLoader(Numbered(10), batch_size=4))
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert sum(len(b) for b in loader) == 10  # a second epoch reads it again


def test_a_datasets_stream_resumes_from_its_own_state(tmp_path):
    """The saved position carries the stream's own state (shard and offset), so a resume starts
    at the shard instead of reading and skipping every consumed sample."""
    pytest.importorskip("datasets")
    files = write_json_shards(tmp_path / "json")
    accel = accelkit.get("cpu", seed=0)
    loader = accel.setup_dataloader(DataLoader(hf_stream(files), batch_size=BATCH))
    seen = []
    for step, batch in enumerate(loader):
        seen += numbers(batch)
        if step == 9:  # 40 samples: in the third file of 16
            break
    state = loader.state_dict()
    assert state["consumed"] == 40
    assert "dataset_state" in state
    resumed = accel.setup_dataloader(DataLoader(hf_stream(files), batch_size=BATCH))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.stream.start_state == state["dataset_state"]
    rest = [i for batch in resumed for i in numbers(batch)]
    assert sorted(seen + rest) == list(range(SAMPLES))


class OneShot(IterableDataset):
    """A stream over one generator made up front: it cannot be read a second time."""

    def __init__(self) -> None:
        self.samples = iter(range(SAMPLES))

    def __iter__(self):
        return self.samples


def test_a_one_shot_stream_is_refused_at_setup():
    accel = accelkit.get("cpu")
    with pytest.raises(ConfigError, match="one-shot stream"):
        accel.setup_dataloader(DataLoader(OneShot(), batch_size=BATCH))
    kept = accel.setup_dataloader(
        DataLoader(OneShot(), batch_size=BATCH), use_distributed_sampler=False
    )
    assert sum(len(b) for b in kept) == SAMPLES  # taken as it is when asked


def test_a_stream_already_split_by_node_is_refused_at_setup(tmp_path):
    pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    split = split_dataset_by_node(hf_stream(write_json_shards(tmp_path)), rank=0, world_size=2)
    accel = accelkit.get("cpu")
    with pytest.raises(ConfigError, match="already split by node"):
        accel.setup_dataloader(DataLoader(split, batch_size=BATCH))


def test_a_datasets_stream_under_workers_is_refused_at_setup(tmp_path):
    pytest.importorskip("datasets")
    accel = accelkit.get("cpu")
    stream = hf_stream(write_json_shards(tmp_path))
    with pytest.raises(ConfigError, match="num_workers=0"):
        accel.setup_dataloader(DataLoader(stream, batch_size=BATCH, num_workers=2))


def test_a_stream_position_is_refused_by_a_map_style_loader():
    accel = accelkit.get("cpu")
    stream = accel.setup_dataloader(DataLoader(Numbered(), batch_size=BATCH))
    next(iter(stream))
    mapped = accel.setup_dataloader(DataLoader(list(range(SAMPLES)), batch_size=BATCH))
    with pytest.raises(ConfigError, match="saved for a stream"):
        mapped.load_state_dict(stream.state_dict())


def test_a_checkpoint_of_a_stream_loaded_into_a_map_style_loader_changes_nothing(tmp_path):
    """The mismatch is found in the load's validate phase: the model is not written."""
    import torch

    import accelkit

    accel = accelkit.get("cpu")
    net = torch.nn.Linear(2, 2)
    model = accel.setup(net)
    stream = accel.setup_dataloader(DataLoader(Numbered(), batch_size=BATCH))
    next(iter(stream))
    accel.save(tmp_path / "ck", {"model": model, "loader": stream})
    other = accel.setup(torch.nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    mapped = accel.setup_dataloader(DataLoader(list(range(SAMPLES)), batch_size=BATCH))
    with pytest.raises(accelkit.CheckpointError, match="saved for a stream"):
        accel.load(tmp_path / "ck", {"model": other, "loader": mapped})
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
