"""Dataloaders that shard by data-parallel rank, move batches, and resume mid-epoch.

The sampler orders the whole dataset once per epoch (seeded by epoch) and hands out the
not-yet-consumed part in rank strides. Its position is counted in *global* samples, so a run
resumed at another world size sees each remaining sample once.

An ``IterableDataset`` (a stream) is wrapped in a :class:`StridedStream`: every rank reads the
whole stream and keeps its own block of each *round* (``world_size * batch_size`` samples), and
within a rank each DataLoader worker keeps every ``num_workers``-th round. After any number of
steps the consumed samples are a prefix of the stream, so the position is one global count and a
run resumed at another world size or worker count sees each remaining sample once.

A stream that knows its shards (``n_shards`` and ``shard(num_shards, index)``, as
``datasets.IterableDataset`` has) whose shard count divides evenly among the readers (data-parallel
ranks x DataLoader workers) is split by shards instead (:class:`ShardedStream`): each reader reads
only its own shards. The ranks agree after every batch that each one has a next batch, so they
step the same number of times (the pass ends for all when the first rank's shards run out). The
position is each reader's sample count, which holds only for the same ranks, workers and shards:
a resume at another world size is refused, naming ``stream_split="stride"``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from accelkit.errors import ConfigError
from accelkit.seed import worker_init_fn

log = logging.getLogger("accelkit")

#: the Accelerator that set the loader up (``Any``: the facade imports this module)
_Accelerator = Any


class ResumableSampler(Sampler[int]):
    """Like ``DistributedSampler``, plus a start position in global samples."""

    def __init__(
        self,
        dataset_len: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_order(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_len, generator=gen).tolist()
        return list(range(self.dataset_len))

    def _remaining(self) -> list[int]:
        rest = self.global_order()[self.start :]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % self.num_replicas]
        pad = (-len(rest)) % self.num_replicas
        if pad and rest:
            rest = rest + (rest * math.ceil(pad / len(rest)))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        rest = max(self.dataset_len - self.start, 0)
        if self.drop_last:
            return rest // self.num_replicas
        return math.ceil(rest / self.num_replicas)


class StridedStream(torch.utils.data.IterableDataset):
    """One rank's share of a stream: its block of every round, this worker's rounds only.

    A round is ``world_size * batch_size`` consecutive samples; rank ``r`` keeps samples
    ``[r * batch_size, (r + 1) * batch_size)`` of it, so every rank steps once per round and the
    samples consumed after ``k`` steps are the first ``k`` rounds, whatever the world size.
    A last, incomplete round of ``n`` samples is split into equal contiguous parts: with
    ``drop_last`` each rank gets ``n // world_size`` (at most ``world_size - 1`` samples are
    left out), else ``ceil(n / world_size)``, the round padded by repeating its first samples.
    Either way every rank steps the same number of times, so none waits for a batch that never
    comes.
    """

    def __init__(
        self, dataset: Any, *, num_replicas: int, rank: int, batch_size: int, drop_last: bool
    ) -> None:
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.start = 0  # global samples of this pass to skip
        self.start_state: dict[str, Any] | None = None  # the dataset's own state at ``start``
        #: the dataset's own state at the start of each round read since ``start`` (main
        #: process only, when the dataset has ``state_dict``): a resume that skips nothing
        self.round_states: dict[int, Any] = {}

    @property
    def round_size(self) -> int:
        return self.num_replicas * self.batch_size

    def _source(self) -> Iterator[Any]:
        if self.start_state is not None:
            self.dataset.load_state_dict(self.start_state)
            return iter(self.dataset)
        return itertools.islice(iter(self.dataset), self.start, None)

    def _last_round(self, chunk: list[Any]) -> list[Any]:
        if self.drop_last:
            share = len(chunk) // self.num_replicas
        else:
            share = math.ceil(len(chunk) / self.num_replicas)
            chunk = list(itertools.islice(itertools.cycle(chunk), share * self.num_replicas))
        return chunk[self.rank * share : (self.rank + 1) * share]

    def __iter__(self) -> Iterator[Any]:
        worker = torch.utils.data.get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        track = worker is None and callable(getattr(self.dataset, "state_dict", None))
        self.round_states = {}
        source = self._source()
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        for index in itertools.count():
            if track:
                # a copy: datasets hands out its live state, which moves on as it is read
                self.round_states[index] = copy.deepcopy(self.dataset.state_dict())
                self.round_states.pop(index - 4, None)  # the loader is at most 2 rounds behind
            chunk = list(itertools.islice(source, self.round_size))
            if len(chunk) < self.round_size:
                if chunk and index % workers == worker_id:
                    yield from self._last_round(chunk)
                return
            if index % workers == worker_id:
                yield from chunk[mine]

    def state_at(self, rounds: int) -> Any:
        """The dataset's own state after ``rounds`` rounds of this pass, if it was recorded."""
        return self.round_states.get(rounds)


#: ``setup_dataloader(stream_split=...)``: how a stream is divided among ranks and workers
STREAM_SPLITS = ("auto", "shards", "stride")


def shard_count(dataset: Any) -> int | None:
    """The dataset's shard count where it follows the shard protocol (an ``int`` ``n_shards``
    and a ``shard(num_shards, index)`` method returning that piece), else None."""
    count = getattr(dataset, "n_shards", None)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return None
    return count if callable(getattr(dataset, "shard", None)) else None


class ShardedStream(torch.utils.data.IterableDataset):
    """One rank's shards of a stream: reader ``rank * workers + w`` of ``num_replicas *
    workers`` reads ``dataset.shard(readers, reader)`` from sample ``starts[w]`` on. DataLoader
    worker ``i`` is this rank's reader ``w = (i + offset) % workers``: a resumed pass rotates
    them so that the DataLoader, which asks its workers in turn from worker 0, asks the reader
    whose turn it was when the position was saved."""

    def __init__(self, dataset: Any, *, num_replicas: int, rank: int, workers: int) -> None:
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.workers = max(1, workers)
        self.n_shards = shard_count(dataset)
        self.starts = [0] * self.workers  # samples of each reader's piece already consumed
        self.offset = 0  # the reader DataLoader worker 0 is
        self.epoch = 0

    @property
    def readers(self) -> int:
        return self.num_replicas * self.workers

    def reader(self, worker_id: int) -> int:
        """This rank's reader that DataLoader worker ``worker_id`` is."""
        return (worker_id + self.offset) % self.workers

    def piece(self, reader: int) -> Any:
        """What this rank's reader ``reader`` reads, set to this epoch where it has epochs."""
        if self.readers == 1:
            return self.dataset
        index = self.rank * self.workers + reader
        if type(self.dataset).__module__.startswith("datasets."):
            # datasets' own split by shards keeps the stream's shuffling (its ``shard`` drops
            # it: the same order every epoch); under no DataLoader worker (refused) it splits no
            # further
            from datasets.distributed import split_dataset_by_node

            piece = split_dataset_by_node(self.dataset, rank=index, world_size=self.readers)
        else:
            piece = self.dataset.shard(self.readers, index)
        set_epoch = getattr(piece, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        return piece

    def __iter__(self) -> Iterator[Any]:
        worker = torch.utils.data.get_worker_info()
        reader = self.reader(worker.id if worker else 0)
        yield from itertools.islice(iter(self.piece(reader)), self.starts[reader], None)


class ReaderCountingCollate:
    """A DataLoader's ``collate_fn`` that also says which worker made the batch, of how many
    samples: ``(worker, count, batch)``, so the main process knows each reader's position."""

    def __init__(self, collate_fn: Any, batched: bool) -> None:
        self.collate_fn = collate_fn
        self.batched = batched

    def __call__(self, data: Any) -> tuple[int, int, Any]:
        worker = torch.utils.data.get_worker_info()
        count = len(data) if self.batched else 1
        return (worker.id if worker else 0, count, self.collate_fn(data))


class AcceleratedDataLoader:
    """What :meth:`Accelerator.setup_dataloader` returns: iterate it like the original loader."""

    def __init__(
        self,
        loader: DataLoader,
        sampler: ResumableSampler | None,
        accelerator: _Accelerator,
        move_to_device: bool,
    ) -> None:
        self.loader = loader
        self.sampler = sampler
        self._accel = accelerator
        self._move = move_to_device
        self.stream = loader.dataset if isinstance(loader.dataset, StridedStream) else None
        self.shards = loader.dataset if isinstance(loader.dataset, ShardedStream) else None
        #: samples each reader (rank, worker) has consumed in this epoch (shard split), and
        #: each rank's reader whose turn is next
        self.reader_counts: list[list[int]] = self._zero_counts()
        self.next_readers: list[int] = [0] * len(self.reader_counts)
        self._fetched: list[int] = []  # this rank's counts up to the batch fetched ahead
        self._fetched_next = 0
        self._told_uneven = False
        self._stream_start = 0  # global samples skipped when the current pass began
        self.epoch = 0
        self.consumed = 0  # global samples consumed in this epoch
        self.is_last_batch = False
        # Starting an iterator draws the workers' base seed from the loader's generator, or
        # from the global RNG when it has none: a resumed run starts its iterator at another
        # point of the global stream than the run it resumes, and every random number after
        # (dropout) would differ. A private generator, seeded from (seed, epoch, rank) at each
        # epoch, leaves the global RNG alone.
        self._generator: torch.Generator | None = None
        if sampler is not None and loader.generator is None:
            self._generator = torch.Generator()
            loader.generator = self._generator

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _global_batch(self) -> int:
        if self.stream is not None:
            return self.stream.round_size
        bs = self.loader.batch_size or 1
        return bs * (self.sampler.num_replicas if self.sampler else 1)

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None:
            if self.consumed >= self.sampler.dataset_len:
                self.epoch, self.consumed = self.epoch + 1, 0
            self.sampler.set_epoch(self.epoch)
            self.sampler.start = self.consumed
        if self._generator is not None and self.sampler is not None:
            s = self.sampler
            self._generator.manual_seed((s.seed * 1_000_003 + self.epoch * 1009 + s.rank) % 2**63)
        if self.stream is not None:
            self._begin_stream_pass()
        if self.shards is not None:
            self._begin_shard_pass()
        done = object()
        iterator = iter(self.loader)
        fetch = self._next_agreed if self.shards is not None else next
        try:
            upcoming = fetch(iterator, done)
            while upcoming is not done:
                batch = upcoming
                upcoming = fetch(iterator, done)
                self.is_last_batch = upcoming is done
                if self.sampler is not None:
                    self.consumed = min(
                        self.consumed + self._global_batch(), self.sampler.dataset_len
                    )
                elif self.stream is not None:
                    self.consumed += self._global_batch()
                elif self.shards is not None:
                    batch, (self.reader_counts, self.next_readers) = batch
                    self.consumed = sum(map(sum, self.reader_counts))
                self._accel._on_batch(self)
                yield self._accel.to_device(batch) if self._move else batch
        finally:  # also when the loop leaves early (break): this loader is no longer current
            self.is_last_batch = False
            self._accel._on_epoch_end(self)
        if self.sampler is not None or self.stream is not None or self.shards is not None:
            self.epoch, self.consumed = self.epoch + 1, 0
            self.reader_counts = self._zero_counts()
            self.next_readers = [0] * len(self.reader_counts)

    # ---- shard split ----------------------------------------------------------------------------
    def _zero_counts(self) -> list[list[int]]:
        shards = self.shards
        return [[0] * shards.workers for _ in range(shards.num_replicas)] if shards else []

    def _begin_shard_pass(self) -> None:
        shards = self.shards
        assert shards is not None
        set_epoch = getattr(shards.dataset, "set_epoch", None)
        if callable(set_epoch):  # a shuffling stream reorders by epoch
            set_epoch(self.epoch)
        shards.epoch = self.epoch
        shards.starts = list(self.reader_counts[shards.rank])
        shards.offset = self.next_readers[shards.rank]
        self._fetched = list(shards.starts)
        self._fetched_next = shards.offset

    def _next_agreed(self, iterator: Iterator[Any], done: Any) -> Any:
        """The next ``(batch, (reader counts, next readers) after it)``, or ``done`` for every
        rank at once: the ranks share whether each has a batch (and where its readers are), so
        none steps once more than another, which would leave it waiting in a collective."""
        shards = self.shards
        assert shards is not None
        item = next(iterator, done)
        if item is not done:
            worker, count, item = item
            reader = shards.reader(worker)
            self._fetched[reader] += count
            self._fetched_next = (reader + 1) % shards.workers
        mine = [int(item is not done), self._fetched_next, *self._fetched]
        if shards.num_replicas == 1:
            rows = [mine]
        else:
            from accelkit import distributed

            local = torch.tensor(mine, dtype=torch.int64, device=self._accel.device)
            group = self._accel.backend.data_parallel_group()
            rows = distributed.all_gather(local, group=group).tolist()
        if all(row[0] for row in rows):
            return item, ([row[2:] for row in rows], [row[1] for row in rows])
        ahead = [rank for rank, row in enumerate(rows) if row[0]]
        if ahead and not self._told_uneven and shards.rank == 0:
            self._told_uneven = True
            log.info(
                "stream split by shards: the pass ends for every rank when the first rank's "
                "shards run out; ranks %s had more batches, left out of this pass "
                "(stream_split='stride' reads every sample, the uneven end padded or dropped)",
                ahead,
            )
        return done

    def _begin_stream_pass(self) -> None:
        stream = self.stream
        assert stream is not None
        if stream.start_state is None or stream.start != self.consumed:
            stream.start_state = None  # a loaded dataset state holds only at the loaded position
            set_epoch = getattr(stream.dataset, "set_epoch", None)
            if callable(set_epoch):  # a shuffling stream (datasets' shuffle) reorders by epoch
                set_epoch(self.epoch)
        stream.start = self.consumed
        self._stream_start = self.consumed

    def state_dict(self) -> dict[str, Any]:
        """Position to resume from: epoch, global samples consumed, sampler seed."""
        state: dict[str, Any] = {"epoch": self.epoch, "consumed": self.consumed}
        if self.sampler is not None:
            state.update(
                seed=self.sampler.seed,
                world_size=self.sampler.num_replicas,
                dataset_len=self.sampler.dataset_len,
            )
        if self.shards is not None:
            state.update(
                stream=True,
                split="shards",
                world_size=self.shards.num_replicas,
                workers=self.shards.workers,
                n_shards=self.shards.n_shards,
                reader_counts=[list(row) for row in self.reader_counts],
                next_readers=list(self.next_readers),
            )
        if self.stream is not None:
            state.update(stream=True, world_size=self.stream.num_replicas)
            rounds, partial = divmod(self.consumed - self._stream_start, self.stream.round_size)
            dataset_state = None if partial else self.stream.state_at(rounds)
            if dataset_state is None and self.consumed == self.stream.start:
                dataset_state = self.stream.start_state  # loaded, not iterated since
            if dataset_state is not None:
                state["dataset_state"] = dataset_state
        return state

    def check_state_dict(self, state: Any) -> None:
        """Raise if ``state`` cannot be this loader's position (``accel.load`` calls it in its
        validate phase, before anything is written)."""
        if not isinstance(state, dict) or not {"epoch", "consumed"} <= state.keys():
            raise ConfigError(f"not a loader position: {str(state)[:80]!r}")
        saved_stream = bool(state.get("stream", False))
        if saved_stream != (self.stream is not None or self.shards is not None):
            saved = "a stream (IterableDataset)" if saved_stream else "a map-style dataset"
            here = "not a stream" if saved_stream else "a stream"
            raise ConfigError(
                f"this loader position was saved for {saved}, but the loader it is loaded into "
                f"is {here}: a position in one cannot be found in the other; load it into a "
                "loader over the same dataset"
            )
        if saved_stream:
            self._check_split(state)

    def _check_split(self, state: dict[str, Any]) -> None:
        """A shard-split position holds only in the same split: same ranks, workers, shards."""
        saved = state.get("split", "stride")
        here = "shards" if self.shards is not None else "stride"
        source = self.shards or self.stream
        assert source is not None
        ours = (
            source.num_replicas,
            max(1, self.loader.num_workers),
            shard_count(source.dataset),
        )
        theirs = (state.get("world_size"), state.get("workers"), state.get("n_shards"))
        if saved == "shards" and ours != theirs:
            raise ConfigError(
                "this stream position was saved with the stream split by shards over "
                f"{theirs[0]} data-parallel ranks x {theirs[1]} DataLoader workers "
                f"({theirs[2]} shards); this loader has {ours[0]} x {ours[1]} ({ours[2]} "
                "shards). Each reader's position holds only in the same split: resume with the "
                "same world size, num_workers and shards, or pass setup_dataloader(..., "
                "stream_split='stride') when training, whose position (a prefix of the stream) "
                "resumes at any world size and worker count"
            )
        if saved != here:
            raise ConfigError(
                f"this stream position was saved with the stream split by {saved}, but this "
                f"loader splits it by {here}: one position cannot be found in the other. Load it "
                f"with setup_dataloader(..., stream_split={saved!r})"
            )
        if self.shards is None:
            return
        counts = state.get("reader_counts")
        if (
            not isinstance(counts, list)
            or len(counts) != ours[0]
            or not all(
                isinstance(row, list)
                and len(row) == ours[1]
                and all(isinstance(c, int) and c >= 0 for c in row)
                for row in counts
            )
        ):
            raise ConfigError(f"malformed stream position: reader_counts {str(counts)[:80]}")
        turns = state.get("next_readers")
        if (
            not isinstance(turns, list)
            or len(turns) != ours[0]
            or not all(isinstance(t, int) and 0 <= t < ours[1] for t in turns)
        ):
            raise ConfigError(f"malformed stream position: next_readers {str(turns)[:80]}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        if self.shards is not None:
            self.reader_counts = [list(row) for row in state["reader_counts"]]
            self.next_readers = list(state["next_readers"])
        if self.sampler is not None and "seed" in state:
            self.sampler.seed = int(state["seed"])
        if self.stream is not None:
            self.stream.start = self.consumed
            dataset_state = state.get("dataset_state")
            loadable = callable(getattr(self.stream.dataset, "load_state_dict", None))
            # the dataset's own state is a position in the whole stream, valid in any world
            # size; DataLoader workers each read their own copy, so they count and skip
            use_state = dataset_state is not None and loadable and self.loader.num_workers == 0
            self.stream.start_state = dataset_state if use_state else None


def _is_plain_sampler(sampler: Sampler, dataset_len: int) -> bool:
    """Sequential order, or a permutation of the whole dataset: what ResumableSampler does."""
    if type(sampler) is SequentialSampler:
        return True
    return (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == dataset_len
    )


def rebuild_dataloader(
    loader: DataLoader,
    *,
    num_replicas: int,
    rank: int,
    seed: int,
    shuffle: bool | None,
    seed_workers: bool,
    stream_split: str = "auto",
) -> tuple[DataLoader, ResumableSampler | None]:
    """A copy of ``loader`` with a :class:`ResumableSampler`; unchanged if it cannot be resharded.
    A stream gets a :class:`ShardedStream` or a :class:`StridedStream` (``stream_split``)."""
    if stream_split not in STREAM_SPLITS:
        raise ConfigError(f"stream_split must be one of {STREAM_SPLITS}, got {stream_split!r}")
    dataset = loader.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset):
        if _split_by_shards(loader, num_replicas, rank, stream_split):
            return _sharded_loader(loader, num_replicas, rank, seed_workers), None
        stream_loader = _stream_loader(
            loader, num_replicas=num_replicas, rank=rank, seed_workers=seed_workers
        )
        return stream_loader, None
    if not hasattr(dataset, "__len__"):
        log.warning("dataset without __len__: accelkit cannot shard or resume it")
        return loader, None
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        log.warning("custom batch sampler: accelkit leaves it as is (not sharded, not resumable)")
        return loader, None
    original = loader.sampler
    drop_last = loader.drop_last
    if isinstance(original, DistributedSampler):  # a loop written for DDP: same intent
        shuffle = original.shuffle if shuffle is None else shuffle
        drop_last = drop_last or original.drop_last
    elif not _is_plain_sampler(original, len(dataset)):
        # weighted, subset, with-replacement samplers draw other samples than a permutation:
        # replacing them would silently change what the model trains on
        log.warning(
            "custom sampler %s: accelkit leaves it as is (not sharded by rank, not resumable); "
            "shard it yourself for several processes",
            type(original).__name__,
        )
        return loader, None
    if shuffle is None:
        shuffle = isinstance(original, RandomSampler)
    sampler = ResumableSampler(
        len(dataset),
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    kwargs = _loader_kwargs(loader, seed_workers)
    return DataLoader(dataset, sampler=sampler, **kwargs), sampler


def _loader_kwargs(loader: DataLoader, seed_workers: bool) -> dict[str, Any]:
    """The settings of ``loader`` that a rebuilt loader over another sampler or dataset keeps."""
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn or (worker_init_fn if seed_workers else None),
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def _refuse_unshardable_stream(loader: DataLoader) -> None:
    """Streams that splitting would silently get wrong: refuse them with what to do instead."""
    dataset = loader.dataset
    if getattr(dataset, "_distributed", None) is not None:  # datasets' split_dataset_by_node
        raise ConfigError(
            "this datasets.IterableDataset is already split by node (split_dataset_by_node): "
            "accelkit would split it again and each rank would see a fraction of its share. "
            "Pass the unsplit dataset (accelkit shards it by rank and can resume it at another "
            "world size), or keep your split with setup_dataloader(..., "
            "use_distributed_sampler=False) (then accelkit neither shards nor resumes it)"
        )
    if loader.num_workers > 0 and type(dataset).__module__.startswith("datasets."):
        raise ConfigError(
            "a datasets.IterableDataset under DataLoader workers hands each worker only some of "
            "its shards, so the workers would not read the same stream and accelkit's split "
            "would lose samples: use num_workers=0, or setup_dataloader(..., "
            "use_distributed_sampler=False) and split it yourself"
        )
    first, second = iter(dataset), iter(dataset)
    one_shot = first is second
    for it in (first,) if one_shot else (first, second):
        close = getattr(it, "close", None)  # generators that never ran: nothing was read
        if callable(close):
            close()
    if one_shot:
        raise ConfigError(
            f"{type(dataset).__name__}.__iter__ returns the same iterator every time (a one-shot "
            "stream): it cannot be read again, so accelkit can neither resume it (by skipping "
            "what was consumed) nor start a second epoch, and DataLoader workers would each get "
            "a copy. Make __iter__ start a new pass (a generator function: "
            "`def __iter__(self): yield from ...`), or pass "
            "use_distributed_sampler=False to take it as it is"
        )


def _split_by_shards(loader: DataLoader, num_replicas: int, rank: int, stream_split: str) -> bool:
    """Whether to split this stream by its shards: asked for or possible (``auto``), else the
    stride, said once on rank zero with the reason."""
    if stream_split == "stride":
        return False
    count = shard_count(loader.dataset)
    readers = num_replicas * max(1, loader.num_workers)
    persistent = loader.num_workers > 0 and loader.persistent_workers
    fits = count is not None and count % readers == 0 and not persistent
    if fits and (readers > 1 or stream_split == "shards"):
        return True  # (one reader reads the whole stream either way: the stride's position
        # resumes at any world size)
    if count is not None and readers == 1:
        return False
    if count is None:
        reason = "it has no n_shards/shard(num_shards, index)"
    elif persistent:
        # a persistent worker keeps the copy of the stream it got first: a later pass would
        # start where the first one (a resume) started
        reason = "persistent DataLoader workers keep the first pass's starting points"
    else:
        reason = (
            f"its {count} shards do not divide evenly among {num_replicas} data-parallel "
            f"ranks x {max(1, loader.num_workers)} DataLoader workers"
        )
    if stream_split == "shards":
        raise ConfigError(f"stream_split='shards': this stream cannot be split by shards: {reason}")
    if count is not None and rank == 0:
        log.info(
            "stream split by stride, not by shards: %s (every rank reads the whole stream)", reason
        )
    return False


def _sharded_loader(
    loader: DataLoader, num_replicas: int, rank: int, seed_workers: bool
) -> DataLoader:
    """``loader`` over this rank's shards, batches tagged with their worker and sample count."""
    _refuse_unshardable_stream(loader)
    stream = ShardedStream(
        loader.dataset, num_replicas=num_replicas, rank=rank, workers=loader.num_workers
    )
    kwargs = _loader_kwargs(loader, seed_workers)
    kwargs["collate_fn"] = ReaderCountingCollate(loader.collate_fn, loader.batch_size is not None)
    return DataLoader(stream, **kwargs)


def _stream_loader(
    loader: DataLoader, *, num_replicas: int, rank: int, seed_workers: bool
) -> DataLoader:
    """``loader`` over a :class:`StridedStream` of its dataset (``drop_last`` picks the end)."""
    _refuse_unshardable_stream(loader)
    stream = StridedStream(
        loader.dataset,
        num_replicas=num_replicas,
        rank=rank,
        batch_size=loader.batch_size or 1,
        drop_last=loader.drop_last,
    )
    return DataLoader(stream, **_loader_kwargs(loader, seed_workers))
