"""Dataloaders that shard by data-parallel rank, move batches, and resume mid-epoch.

The sampler orders the whole dataset once per epoch (seeded by epoch) and hands out the
not-yet-consumed part in rank strides. Its position is counted in *global* samples, so a run
resumed at another world size sees each remaining sample once.

An ``IterableDataset`` (a stream) is wrapped in a :class:`StridedStream`: every rank reads the
whole stream and keeps its own block of each *round* (``world_size * batch_size`` samples), and
within a rank each DataLoader worker keeps every ``num_workers``-th round. After any number of
steps the consumed samples are a prefix of the stream, so the position is one global count and a
run resumed at another world size or worker count sees each remaining sample once.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from accelkit.accelerator import Accelerator

log = logging.getLogger("accelkit")


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


class AcceleratedDataLoader:
    """What :meth:`Accelerator.setup_dataloader` returns: iterate it like the original loader."""

    def __init__(
        self,
        loader: DataLoader,
        sampler: ResumableSampler | None,
        accelerator: Accelerator,
        move_to_device: bool,
    ) -> None:
        self.loader = loader
        self.sampler = sampler
        self._accel = accelerator
        self._move = move_to_device
        self.stream = loader.dataset if isinstance(loader.dataset, StridedStream) else None
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
        done = object()
        iterator = iter(self.loader)
        try:
            upcoming = next(iterator, done)
            while upcoming is not done:
                batch = upcoming
                upcoming = next(iterator, done)
                self.is_last_batch = upcoming is done
                if self.sampler is not None:
                    self.consumed = min(
                        self.consumed + self._global_batch(), self.sampler.dataset_len
                    )
                elif self.stream is not None:
                    self.consumed += self._global_batch()
                self._accel._on_batch(self)
                yield self._accel.to_device(batch) if self._move else batch
        finally:  # also when the loop leaves early (break): this loader is no longer current
            self.is_last_batch = False
            self._accel._on_epoch_end(self)
        if self.sampler is not None or self.stream is not None:
            self.epoch, self.consumed = self.epoch + 1, 0

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
        if saved_stream != (self.stream is not None):
            saved = "a stream (IterableDataset)" if saved_stream else "a map-style dataset"
            here = "a stream" if self.stream is not None else "not a stream"
            raise ConfigError(
                f"this loader position was saved for {saved}, but the loader it is loaded into "
                f"is {here}: a position in one cannot be found in the other; load it into a "
                "loader over the same dataset"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
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
) -> tuple[DataLoader, ResumableSampler | None]:
    """A copy of ``loader`` with a :class:`ResumableSampler`; unchanged if it cannot be resharded."""
    dataset = loader.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset):
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
    """Streams that striding would silently get wrong: refuse them with what to do instead."""
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
