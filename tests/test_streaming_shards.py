"""Streams split by their shards (issue 26, item 1): a dataset with ``n_shards`` and
``shard(num_shards, index)`` whose shards divide evenly among the readers (data-parallel ranks x
DataLoader workers) has each reader read only its own shards; the union over the readers is
every sample once; a resume with the same ranks and workers continues exactly; a resume at
another world size is refused by name; an uneven shard count falls back to the stride, said
in a log line. The default-tier tests build each rank's loader in one process; the two-process
runs (gloo) are in the slow tier."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

import accelkit
from accelkit.data import AcceleratedDataLoader, ShardedStream, StridedStream, rebuild_dataloader
from accelkit.errors import ConfigError
from accelkit.testing import run_ranks

HERE = Path(__file__).parent
PER_FILE = 12
BATCH = 4


class Files(IterableDataset):
    """A list-of-files stream with the shard protocol; each file opened is logged to
    ``opens`` (a folder: one empty file per open, named by process and file), so the test sees
    which reader opened what, also from DataLoader workers and other ranks."""

    def __init__(self, paths: list[str], opens: str) -> None:
        self.paths = list(paths)
        self.opens = opens

    @property
    def n_shards(self) -> int:
        return len(self.paths)

    def shard(self, num_shards: int, index: int) -> Files:
        per = len(self.paths) // num_shards
        return Files(self.paths[index * per : (index + 1) * per], self.opens)

    def __iter__(self):
        for path in self.paths:
            Path(self.opens, f"{os.getpid()}-{Path(path).stem}").touch()
            with open(path) as file:
                for line in file:
                    yield json.loads(line)["x"]


class Unsharded(IterableDataset):
    """A stream without the shard protocol."""

    def __iter__(self):
        yield from range(8)


def write_files(root: Path, sizes: list[int]) -> list[str]:
    """JSON-lines files of records {"x": i}, numbered on across the files."""
    root.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for f, size in enumerate(sizes):
        path = root / f"part-{f}.jsonl"
        path.write_text("".join(json.dumps({"x": start + i}) + "\n" for i in range(size)))
        paths.append(str(path))
        start += size
    return paths


def opened(opens: Path) -> list[str]:
    return sorted(p.name.split("-", 1)[1] for p in opens.iterdir())


def clear(opens: Path) -> None:
    for p in opens.iterdir():
        p.unlink()


def numbers(batch) -> list[int]:
    return (batch["x"] if isinstance(batch, dict) else batch).tolist()


@pytest.fixture
def files(tmp_path: Path) -> tuple[list[str], Path]:
    opens = tmp_path / "opens"
    opens.mkdir()
    return write_files(tmp_path / "data", [PER_FILE] * 4), opens


@pytest.fixture
def log_lines():
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.INFO)
    logger = logging.getLogger("accelkit")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def rank_loader(dataset, rank: int, world: int = 2, **options) -> DataLoader:
    """Rank ``rank``'s rebuilt loader, as setup_dataloader builds it on that rank."""
    loader, _ = rebuild_dataloader(
        DataLoader(dataset, batch_size=BATCH, num_workers=options.pop("num_workers", 0)),
        num_replicas=world,
        rank=rank,
        seed=0,
        shuffle=None,
        seed_workers=False,
        **options,
    )
    return loader


def hf_stream(paths: list[str]):
    import datasets

    return datasets.load_dataset("json", data_files=paths, split="train", streaming=True)


# ---- each rank reads only its shards ------------------------------------------------------------
def test_each_rank_opens_only_its_shards_and_the_ranks_read_every_sample_once(files):
    paths, opens = files
    union = []
    for rank in range(2):
        clear(opens)
        loader = rank_loader(Files(paths, str(opens)), rank)
        assert isinstance(loader.dataset, ShardedStream)
        mine = [i for _, _, batch in loader for i in batch.tolist()]
        assert opened(opens) == [f"part-{2 * rank}", f"part-{2 * rank + 1}"]
        assert mine == list(range(2 * rank * PER_FILE, (2 * rank + 2) * PER_FILE))
        union += mine
    assert sorted(union) == list(range(4 * PER_FILE))


def test_a_datasets_stream_is_split_by_its_files(files):
    """datasets' streaming json over 4 local files has 4 shards: each rank reads 2 whole files
    (datasets' split_dataset_by_node deals them out), the ranks' files differ."""
    pytest.importorskip("datasets")
    paths, _ = files
    stream = hf_stream(paths)
    assert stream.n_shards == 4
    union, files_read = [], []
    for rank in range(2):
        loader = rank_loader(stream, rank)
        mine = [i for _, _, batch in loader for i in numbers(batch)]
        files_read.append({i // PER_FILE for i in mine})
        assert len(mine) == 2 * PER_FILE and len(files_read[rank]) == 2
        union += mine
    assert files_read[0].isdisjoint(files_read[1])
    assert sorted(union) == list(range(4 * PER_FILE))


def test_a_shuffled_datasets_stream_reshuffles_its_shards_each_epoch(files):
    """The split keeps the stream's shuffling: epoch 1's order is not epoch 0's (datasets'
    own ``shard`` would give the same order every epoch)."""
    pytest.importorskip("datasets")
    paths, _ = files
    stream = hf_stream(paths).shuffle(seed=0, buffer_size=8)
    loader = rank_loader(stream, 0)
    epochs = []
    for epoch in range(2):
        loader.dataset.epoch = epoch  # what setup_dataloader's loader sets at each pass
        epochs.append([i for _, _, batch in loader for i in numbers(batch)])
    assert epochs[0] != epochs[1] and len(epochs[0]) == len(epochs[1]) == 2 * PER_FILE


def test_workers_read_their_own_shards_and_a_resume_continues_exactly(files):
    """One process, 2 DataLoader workers: 4 shards, one reader per worker. A position saved
    mid-pass resumes into the same batches, in the same order, as the pass that was not
    interrupted."""
    paths, opens = files
    accel = accelkit.get("cpu", seed=0)

    def loader() -> AcceleratedDataLoader:
        built = DataLoader(Files(paths, str(opens)), batch_size=BATCH, num_workers=2)
        return accel.setup_dataloader(built)

    whole = [b.tolist() for b in loader()]
    assert opened(opens) == [f"part-{i}" for i in range(4)]
    pids = {p.name.split("-", 1)[0] for p in opens.iterdir()}
    assert len(pids) == 2 and os.getpid() not in {int(p) for p in pids}  # the workers read
    assert sorted(i for b in whole for i in b) == list(range(4 * PER_FILE))

    first = loader()
    seen = []
    for step, batch in enumerate(first):
        seen.append(batch.tolist())
        if step == 4:  # worker 0 three batches in, worker 1 two
            break
    state = json.loads(json.dumps(first.state_dict()))
    assert state["split"] == "shards" and state["reader_counts"] == [[12, 8]]
    assert state["next_readers"] == [1]  # worker 1's turn: the resumed pass starts with it
    assert state["consumed"] == 20
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert seen + rest == whole


# ---- resume at another split: refused -------------------------------------------------------------
def shard_position(paths: list[str], opens: Path) -> dict:
    accel = accelkit.get("cpu", seed=0)
    loader = accel.setup_dataloader(
        DataLoader(Files(paths, str(opens)), batch_size=BATCH, num_workers=2)
    )
    next(iter(loader))
    return json.loads(json.dumps(loader.state_dict()))


def test_a_shard_position_is_refused_at_another_world_size(files):
    paths, opens = files
    state = shard_position(paths, opens)
    accel = accelkit.get("cpu", seed=0)
    two_ranks = AcceleratedDataLoader(rank_loader(Files(paths, str(opens)), 0), None, accel, False)
    with pytest.raises(ConfigError, match="stream_split='stride'") as refused:
        two_ranks.check_state_dict(state)
    assert "1 data-parallel ranks x 2 DataLoader workers" in str(refused.value)
    one_process = accel.setup_dataloader(DataLoader(Files(paths, str(opens)), batch_size=BATCH))
    with pytest.raises(ConfigError, match="stream_split='stride'"):  # 1 x 1 strides, refused
        one_process.load_state_dict(state)
    strided = accel.setup_dataloader(  # the same split, but strided on request
        DataLoader(Files(paths, str(opens)), batch_size=BATCH, num_workers=2),
        stream_split="stride",
    )
    with pytest.raises(ConfigError, match="split by shards, but this loader splits it by stride"):
        strided.load_state_dict(state)
    stride_state = strided.state_dict()
    sharded = accel.setup_dataloader(
        DataLoader(Files(paths, str(opens)), batch_size=BATCH, num_workers=2)
    )
    with pytest.raises(ConfigError, match="split by stride, but this loader splits it by shards"):
        sharded.load_state_dict(stride_state)


def test_a_checkpoint_with_a_shard_position_changes_nothing_when_refused(files, tmp_path):
    """The refusal comes from the load's validate phase: the model is not written."""
    paths, opens = files
    accel = accelkit.get("cpu", seed=0)
    loader = accel.setup_dataloader(
        DataLoader(Files(paths, str(opens)), batch_size=BATCH, num_workers=2)
    )
    next(iter(loader))
    accel.save(tmp_path / "ck", {"model": accel.setup(torch.nn.Linear(2, 2)), "loader": loader})
    other = accel.setup(torch.nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    one_worker = accel.setup_dataloader(
        DataLoader(Files(paths, str(opens)), batch_size=BATCH), stream_split="shards"
    )
    with pytest.raises(accelkit.CheckpointError, match="same world size, num_workers"):
        accel.load(tmp_path / "ck", {"model": other, "loader": one_worker})
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


# ---- when the shards cannot be split --------------------------------------------------------------
def test_an_uneven_shard_count_falls_back_to_the_stride_with_a_log_line(tmp_path, log_lines):
    opens = tmp_path / "opens"
    opens.mkdir()
    paths = write_files(tmp_path / "data", [PER_FILE] * 3)
    union = []
    for rank in range(2):
        clear(opens)
        loader = rank_loader(Files(paths, str(opens)), rank)
        assert isinstance(loader.dataset, StridedStream)
        union += [i for batch in loader for i in batch.tolist()]
        assert opened(opens) == ["part-0", "part-1", "part-2"]  # every rank reads all
    assert sorted(union) == list(range(3 * PER_FILE))
    said = [line for line in log_lines if "split by stride, not by shards" in line]
    assert len(said) == 1 and "3 shards do not divide evenly among 2" in said[0]  # rank 0 only


def test_asking_for_shards_that_cannot_be_split_fails_clearly(tmp_path):
    opens = tmp_path / "opens"
    opens.mkdir()
    paths = write_files(tmp_path / "data", [PER_FILE] * 3)
    with pytest.raises(ConfigError, match="cannot be split by shards: its 3 shards"):
        rank_loader(Files(paths, str(opens)), 0, stream_split="shards")
    with pytest.raises(ConfigError, match="no n_shards"):
        rank_loader(Unsharded(), 0, stream_split="shards")
    with pytest.raises(ConfigError, match="stream_split must be one of"):
        rank_loader(Files(paths, str(opens)), 0, stream_split="files")


def test_persistent_workers_fall_back_to_the_stride(files, log_lines):
    """A persistent worker keeps its first copy of the stream (and where it started)."""
    paths, opens = files
    loader, _ = rebuild_dataloader(
        DataLoader(
            Files(paths, str(opens)), batch_size=BATCH, num_workers=2, persistent_workers=True
        ),
        num_replicas=1,
        rank=0,
        seed=0,
        shuffle=None,
        seed_workers=False,
    )
    assert isinstance(loader.dataset, StridedStream)
    assert any("persistent DataLoader workers" in line for line in log_lines)


def test_the_stride_can_be_forced_and_one_reader_strides(files):
    paths, opens = files
    forced = rank_loader(Files(paths, str(opens)), 0, stream_split="stride")
    assert isinstance(forced.dataset, StridedStream)
    one = rank_loader(Files(paths, str(opens)), 0, world=1)  # one reader: nothing to split
    assert isinstance(one.dataset, StridedStream)


# ---- two processes (slow tier) ------------------------------------------------------------------
def ddp_shard_job(root: str, save_after: int | None = None, resume: bool = False) -> dict:
    """On each of 2 ranks: a datasets stream over the json files, split by shards; either a
    whole pass, or a pass saved after ``save_after`` steps, or the rest after a resume. Every
    step all-reduces, as a DDP backward would: a rank stepping once more would hang."""
    accel = accelkit.get("ddp", seed=0)
    paths = sorted(str(p) for p in (Path(root) / "data").glob("*.jsonl"))
    loader = accel.setup_dataloader(DataLoader(hf_stream(paths), batch_size=BATCH))
    assert isinstance(loader.dataset, ShardedStream)
    if resume:
        accel.load(Path(root) / "ck", {"loader": loader})
    seen = []
    for step, batch in enumerate(loader):
        seen += numbers(batch)
        dist.all_reduce(torch.ones(1))
        if save_after is not None and step + 1 == save_after:
            accel.save(Path(root) / "ck", {"loader": loader})
            break
    return {"seen": seen}


@pytest.mark.slow
def test_two_ranks_read_their_shards_and_resume_exactly_at_the_same_world_size(tmp_path):
    pytest.importorskip("datasets")
    write_files(tmp_path / "data", [PER_FILE] * 4)
    job = "test_streaming_shards:ddp_shard_job"
    whole = run_ranks(job, {"root": str(tmp_path)}, path=[HERE])
    files_read = [{i // PER_FILE for i in result["seen"]} for result in whole]
    assert len(files_read[0]) == len(files_read[1]) == 2  # whole files, each rank its own
    assert sorted(whole[0]["seen"] + whole[1]["seen"]) == list(range(4 * PER_FILE))
    first = run_ranks(job, {"root": str(tmp_path), "save_after": 2}, path=[HERE])
    rest = run_ranks(job, {"root": str(tmp_path), "resume": True}, path=[HERE])
    for rank in range(2):
        assert first[rank]["seen"] + rest[rank]["seen"] == whole[rank]["seen"]

    accel = accelkit.get("cpu", seed=0)  # one process: refused, with the option to use
    paths = sorted(str(p) for p in (tmp_path / "data").glob("*.jsonl"))
    loader = accel.setup_dataloader(DataLoader(hf_stream(paths), batch_size=BATCH))
    with pytest.raises(accelkit.CheckpointError, match="stream_split='stride'"):
        accel.load(tmp_path / "ck", {"loader": loader})


def uneven_shard_job(root: str) -> list[int]:
    """Rank 0's shards hold 2 batches, rank 1's hold 3: both must step twice."""
    accel = accelkit.get("ddp", seed=0)
    paths = sorted(str(p) for p in (Path(root) / "data").glob("*.jsonl"))
    loader = accel.setup_dataloader(DataLoader(Files(paths, root), batch_size=BATCH))
    seen = []
    for batch in loader:
        seen += batch.tolist()
        dist.all_reduce(torch.ones(1))
    return seen


@pytest.mark.slow
def test_uneven_shards_end_the_pass_for_every_rank_together(tmp_path):
    write_files(tmp_path / "data", [BATCH, BATCH, BATCH, 2 * BATCH])
    ranks = run_ranks(
        "test_streaming_shards:uneven_shard_job", {"root": str(tmp_path)}, path=[HERE], timeout=120
    )
    assert ranks[0] == list(range(2 * BATCH))
    assert ranks[1] == list(range(2 * BATCH, 4 * BATCH))  # its third batch is left out
