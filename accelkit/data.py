"""Dataloaders that shard by data-parallel rank, move batches, and resume mid-epoch.

The sampler orders the whole dataset once per epoch (seeded by epoch) and hands out the
not-yet-consumed part in rank strides. Its position is counted in *global* samples, so a run
resumed at another world size sees each remaining sample once.
"""

from __future__ import annotations

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
                self._accel._on_batch(self)
                yield self._accel.to_device(batch) if self._move else batch
        finally:  # also when the loop leaves early (break): this loader is no longer current
            self.is_last_batch = False
            self._accel._on_epoch_end(self)
        if self.sampler is not None:
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Position to resume from: epoch, global samples consumed, sampler seed."""
        state: dict[str, Any] = {"epoch": self.epoch, "consumed": self.consumed}
        if self.sampler is not None:
            state.update(
                seed=self.sampler.seed,
                world_size=self.sampler.num_replicas,
                dataset_len=self.sampler.dataset_len,
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        if self.sampler is not None and "seed" in state:
            self.sampler.seed = int(state["seed"])


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
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        log.warning("iterable dataset: accelkit cannot shard or resume it; it must shard itself")
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
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size,
        sampler=sampler,
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
    return DataLoader(dataset, **kwargs), sampler
