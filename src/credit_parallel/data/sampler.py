"""Sample sharding over the data-parallel axis only, and the DataLoaders built on it.

The sampler contract (SPEC section 2): ranks that differ only in their tensor or domain
coordinate must see the same batch, so indices are split by ``dp_rank`` / ``dp_size`` as returned
by ``credit_parallel.data_parallel_coords(conf)`` -- never by the global rank.  The order of an
epoch depends only on ``(seed, epoch)``, so every rank computes the same permutation without
communicating and then takes its own stride of it.

``StepBatchSampler`` numbers the micro-batches of a run globally (``m = step * grad_accum +
micro``), epoch after epoch, so the batch of micro-batch ``m`` is a pure function of ``(seed, m,
dp rank)``: a resumed run starts its sampler at ``m = start_step * grad_accum`` and continues the
exact order of an uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["DistributedDPSampler", "StepBatchSampler", "make_dataloader"]


def _int_at_least(value, minimum: int, key: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{owner}: {key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class DistributedDPSampler(Sampler[int]):
    """Indices of data-parallel rank ``dp_rank`` out of ``dp_size`` for one epoch.

    Each epoch permutes ``range(dataset_len)`` (when ``shuffle``; a permutation determined by
    ``(seed, epoch)`` alone) and gives rank ``r`` the positions ``r, r + dp_size, ...`` of it, so
    the ranks' shares are disjoint and no sample appears twice in an epoch.
    ``drop_last=True`` (default) first drops the ``dataset_len % dp_size`` last indices of the
    permutation so every rank gets exactly ``dataset_len // dp_size`` samples -- required when
    every step runs collectives (DDP/FSDP), or ranks would disagree on the number of steps.
    ``drop_last=False`` keeps every sample and ranks ``r < dataset_len % dp_size`` get one more.
    Call ``set_epoch(e)`` before each epoch, with the same ``e`` on every rank.
    """

    def __init__(
        self,
        dataset_len: int,
        dp_rank: int,
        dp_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        owner = "DistributedDPSampler"
        self.dataset_len = _int_at_least(dataset_len, 0, "dataset_len", owner)
        self.dp_size = _int_at_least(dp_size, 1, "dp_size", owner)
        self.dp_rank = _int_at_least(dp_rank, 0, "dp_rank", owner)
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"{owner}: dp_rank {dp_rank} is not < dp_size {dp_size}")
        self.seed = _int_at_least(seed, 0, "seed", owner)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if self.drop_last and self.dataset_len < self.dp_size:
            raise ValueError(
                f"{owner}: {self.dataset_len} samples cannot give each of {self.dp_size} "
                "data-parallel ranks one sample with drop_last=True; use more data or fewer "
                "dp ranks"
            )
        used = self.dataset_len - self.dataset_len % self.dp_size if drop_last else dataset_len
        self._used = used
        self._num_samples = len(range(self.dp_rank, used, self.dp_size))

    def set_epoch(self, epoch: int) -> None:
        """Select the order of epoch ``epoch`` (the same on every rank for the same value)."""
        self.epoch = _int_at_least(epoch, 0, "epoch", "DistributedDPSampler.set_epoch")

    def epoch_order(self) -> np.ndarray:
        """The full order of the current epoch, before it is split over the dp ranks."""
        if not self.shuffle:
            return np.arange(self.dataset_len)
        # a SeedSequence over (seed, epoch): distinct pairs never alias as seed + epoch would
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.dataset_len)

    def __iter__(self):
        order = self.epoch_order()[: self._used]
        return iter(order[self.dp_rank :: self.dp_size].tolist())

    def __len__(self) -> int:
        return self._num_samples


class StepBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` indices of dp rank ``dp_rank``, numbered across epochs.

    Micro-batch ``m`` is batch ``j`` of epoch ``e`` with ``e, j = divmod(m, batches_per_epoch)``:
    positions ``j * batch_size .. (j + 1) * batch_size - 1`` of the rank's share of the epoch's
    order (``DistributedDPSampler`` with ``drop_last=True``, so every dp rank has the same number
    of batches; the incomplete last batch of an epoch is dropped).  Iteration yields micro-batches
    ``start_batch, start_batch + 1, ...``: ``num_batches`` of them, or without end when ``None``
    (the trainer takes what it needs).  ``set_epoch(e)`` selects exactly the batches of epoch
    ``e`` instead, for epoch-style loops.  The sampler runs in the main process; DataLoader
    workers only read the indices it yields, so their number never changes the order.
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        start_batch: int = 0,
        num_batches: int | None = None,
    ):
        owner = "StepBatchSampler"
        self.batch_size = _int_at_least(batch_size, 1, "batch_size", owner)
        self._epochs = DistributedDPSampler(
            dataset_len, dp_rank, dp_size, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.batches_per_epoch = len(self._epochs) // self.batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"{owner}: batch_size {batch_size} is larger than the {len(self._epochs)} samples "
                f"each of the {dp_size} dp ranks gets per epoch; lower batch_size or add data"
            )
        self.start_batch = _int_at_least(start_batch, 0, "start_batch", owner)
        self.num_batches = (
            None if num_batches is None else _int_at_least(num_batches, 0, "num_batches", owner)
        )

    def set_epoch(self, epoch: int) -> None:
        """Iterate exactly the ``batches_per_epoch`` batches of epoch ``epoch``."""
        epoch = _int_at_least(epoch, 0, "epoch", "StepBatchSampler.set_epoch")
        self.start_batch = epoch * self.batches_per_epoch
        self.num_batches = self.batches_per_epoch

    def batch_indices(self, micro_batch: int) -> list[int]:
        """The sample indices of global micro-batch ``micro_batch`` (pure)."""
        epoch, j = divmod(int(micro_batch), self.batches_per_epoch)
        return self._epoch_share(epoch)[j * self.batch_size : (j + 1) * self.batch_size]

    def _epoch_share(self, epoch: int) -> list[int]:
        self._epochs.set_epoch(epoch)
        return list(self._epochs)

    def __iter__(self):
        m = self.start_batch
        stop = None if self.num_batches is None else self.start_batch + self.num_batches
        epoch, share = None, None
        while stop is None or m < stop:
            e, j = divmod(m, self.batches_per_epoch)
            if e != epoch:  # one permutation per epoch, not per batch
                epoch, share = e, self._epoch_share(e)
            yield share[j * self.batch_size : (j + 1) * self.batch_size]
            m += 1

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("StepBatchSampler without num_batches has no length (it never ends)")
        return self.num_batches


def make_dataloader(
    dataset: Dataset,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    *,
    drop_last: bool = True,
    pin_memory: bool = False,
) -> DataLoader:
    """DataLoader over the share of data-parallel rank ``dp_rank`` of ``dp_size``.

    ``batch_size`` is PER DATA-PARALLEL RANK: the global batch is ``batch_size * dp_size``, and
    every tensor/domain rank inside one dp replica loads the same ``batch_size`` samples.  Its
    sampler (``loader.sampler``, a ``DistributedDPSampler``) needs ``set_epoch(e)`` each epoch.
    ``drop_last`` goes to the sampler (equal share per rank); the last batch of a rank may be
    smaller than ``batch_size``, the same size on every rank.  A ``torch.Generator`` seeded with
    ``seed`` makes worker seeding reproducible.
    """
    batch_size = _int_at_least(batch_size, 1, "batch_size", "make_dataloader")
    num_workers = _int_at_least(num_workers, 0, "num_workers", "make_dataloader")
    sampler = DistributedDPSampler(
        len(dataset), dp_rank, dp_size, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        generator=generator,
        pin_memory=pin_memory,
        drop_last=False,
        persistent_workers=num_workers > 0,
    )
