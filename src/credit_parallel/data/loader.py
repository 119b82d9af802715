"""The training DataLoader of a domain-parallel run: each rank reads only its own latitude rows.

``build_train_loader`` builds, for one rank, an ``ERA5Dataset`` restricted to the rows the
balanced layout gives its domain rank (``domain.rows.shard_range``; on a lat x lon domain, its
tile: rows x columns, ``domain.tiles.tile_range``) and a ``torch`` DataLoader
over it: worker processes, prefetch, pinned host memory when the batches go to a CUDA device, and
a ``StepBatchSampler`` so that the batches are a pure function of ``(trainer.seed, micro-batch
number, dp rank)``.  Ranks that differ only in their tensor-parallel coordinate get the same
rows of the same samples; ranks of one dp replica get the same samples.

A dataset that cannot read rows (an in-memory or user dataset, anything whose ``rows`` is not
set) is wrapped in :class:`RowView`: each sample is read whole and cut to the rank's rows, so the
trainer has one code path; only ``ERA5Dataset`` row reads save the I/O.

A batch read already sharded never passes through ``shard_batch``, which is where the domain
manager learns the global shape of the coming forward (the token the layers key their global
heights by).  ``register_row_batch`` registers exactly the token ``shard_batch`` would have
registered for the whole-globe batch, without building it.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from ..domain.sharding import local_extent, shard_batch
from ..layout.device import batch_to_device
from ..layout.run_config import DataConfig, TrainerConfig
from .dataset import dataset_from_conf
from .sampler import StepBatchSampler
from .selection import tile_window

__all__ = [
    "DEFAULT_NUM_WORKERS",
    "DEFAULT_PREFETCH_FACTOR",
    "RowView",
    "batch_to_device",  # credit_parallel.device's, re-exported for the data API
    "build_train_loader",
    "global_width",
    "register_row_batch",
]

DEFAULT_NUM_WORKERS = DataConfig.num_workers
DEFAULT_PREFETCH_FACTOR = DataConfig.prefetch_factor
# validation draws its batches from a different stream than training (as the trainer always has)
_VALID_SEED_OFFSET = 10_000


class RowView(Dataset):
    """The rows ``shard_range(H, domain_size, domain_rank)`` of every sample of a whole-globe
    dataset (with ``domain_size`` = (P, Q): the tile of domain rank ``lat * Q + lon``, rows x
    columns): each sample is read whole, then every 3-D / 4-D tensor (a sample of a 4-D / 5-D
    batch) is cut along dim -2 (and -1), as ``shard_batch`` cuts the batch.  Other attributes
    are the wrapped dataset's (``lat_weights``, ``forecast_len``, ...); ``rows``, ``columns``
    and ``row_lat_weights`` are this rank's.  ``(H, W)`` is ``dataset.grid_shape`` when it has
    one, else read from its first sample.
    """

    def __init__(self, dataset, domain_rank: int, domain_size):
        self.dataset = dataset
        self.grid = _global_grid(dataset)
        self.rows, self.columns = tile_window(None, (domain_rank, domain_size), self.grid)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        start, stop = self.rows
        west, east = self.columns if self.columns is not None else (0, self.grid[1])
        return {
            key: value[..., start:stop, west:east]
            if isinstance(value, torch.Tensor) and value.dim() in (3, 4)
            else value
            for key, value in self.dataset[index].items()
        }

    @property
    def row_lat_weights(self) -> torch.Tensor:
        return self.dataset.lat_weights[self.rows[0] : self.rows[1]]

    def __getattr__(self, name):
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _global_grid(dataset) -> tuple[int, int]:
    grid = getattr(dataset, "grid_shape", None)
    if grid is not None:
        return int(grid[0]), int(grid[1])
    for value in dataset[0].values():
        if isinstance(value, torch.Tensor) and value.dim() in (3, 4):
            return int(value.shape[-2]), int(value.shape[-1])
    raise ValueError("build_train_loader: the dataset's samples have no (C, H, W) tensor")


def global_width(dataset) -> int:
    """The global W of a (row, tile or whole-globe) dataset: ``grid_shape[1]``, else read from
    its first sample (whose width is the global one unless it reads a tile)."""
    if isinstance(dataset, RowView):
        return dataset.grid[1]
    return _global_grid(dataset)[1]


def _rank_rows(dataset, domain_rank: int, domain_size):
    """``dataset`` when it already reads this rank's rows (tile), else a ``RowView`` of it."""
    if getattr(dataset, "rows", None) is None:
        return RowView(dataset, domain_rank, domain_size)
    grid = _global_grid(dataset)
    expected = tile_window(None, (domain_rank, domain_size), grid)
    got = (tuple(dataset.rows), getattr(dataset, "columns", None))
    got = (got[0], None if got[1] is None else tuple(got[1]))
    if got != expected:
        what = (f"rows {{}} of {grid[0]}", "rows {} and columns {} of " + f"{grid}")
        which = int(expected[1] is not None or got[1] is not None)
        raise ValueError(
            f"build_train_loader: the dataset reads {what[which].format(*got)} but domain rank "
            f"{domain_rank} of {domain_size} owns {what[which].format(*expected)}"
        )
    return dataset


def build_train_loader(
    conf: dict,
    *,
    dp_rank: int,
    dp_size: int,
    domain_rank: int,
    domain_size: int | tuple[int, int],
    device,
    start_step: int = 0,
    split: str = "train",
    num_workers: int | None = None,
    dataset=None,
) -> DataLoader:
    """The DataLoader of this rank: its domain rows of its dp share, one micro-batch per item.

    Micro-batch ``m`` (``m = step * trainer.grad_accum + micro``) holds ``trainer.batch_size``
    samples (per dp rank); the loader starts at ``m = start_step * grad_accum`` and never ends
    (take ``grad_accum`` batches per optimizer step).  ``split="valid"`` reads
    ``data.valid_time_slice`` with its own seed stream.  Workers: ``num_workers``, else
    ``data.num_workers`` (default 2); prefetch ``data.prefetch_factor`` batches per worker
    (default 2).  Host batches are pinned only when ``device`` is a CUDA device.  ``dataset``: a
    dataset to use instead of building one from ``conf``: a row dataset of this rank's rows, or
    a whole-globe one, wrapped in :class:`RowView`.  A dataset with state of its own (one that
    counts its reads, or looks at the trainer) needs ``num_workers=0``: a worker process reads
    ahead, from its own copy.
    ``domain_size``: an int (latitude rows), or (P, Q) on a lat x lon domain: this rank
    (``domain_rank = lat * Q + lon``) reads its tile only.
    The loader's ``dataset`` has ``row_lat_weights`` (this rank's loss weights) and
    ``lat_weights`` / ``grid_shape`` (global); ``loader.batch_sampler`` is the
    ``StepBatchSampler``.
    """
    if split not in ("train", "valid"):
        raise ValueError(f"build_train_loader: split must be 'train' or 'valid', got {split!r}")
    if dataset is None:
        dataset = dataset_from_conf(conf, split, domain_shard=(domain_rank, domain_size))
    else:
        dataset = _rank_rows(dataset, domain_rank, domain_size)
    tc, dc = TrainerConfig.from_conf(conf), DataConfig.from_conf(conf)
    seed = tc.seed
    sampler = StepBatchSampler(
        len(dataset),
        tc.batch_size,
        dp_rank,
        dp_size,
        seed=seed + (_VALID_SEED_OFFSET if split == "valid" else 0),
        start_batch=int(start_step) * tc.grad_accum,
    )
    workers = dc.num_workers if num_workers is None else int(num_workers)
    generator = torch.Generator()  # seeds the workers' RNGs reproducibly (the data uses none)
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        prefetch_factor=dc.prefetch_factor if workers else None,
        persistent_workers=workers > 0,
        pin_memory=torch.device(device).type == "cuda",
        generator=generator,
    )


def register_row_batch(
    batch: dict,
    global_height: int,
    *,
    manager,
    shard_dim_5d: int = -2,
    shard_dim_4d: int = -2,
    global_width: int | None = None,
) -> None:
    """Register with ``manager`` the forward token ``shard_batch`` registers for the global batch.

    ``batch`` holds this rank's rows (as ``build_train_loader`` delivers them); every 4-D and 5-D
    tensor has the local height of this domain rank along its spatial dim, the global height
    being ``global_height``.  On a lat x lon domain (a tiled manager, SPEC §3b) the last dim
    holds the tile's columns of ``global_width`` (required there).  ``shard_batch`` itself is
    called on shape-only (meta) tensors of the global shapes, so the token is the one it
    registers, by construction, with no memory and no communication.  A tensor whose local
    height (width) is not this rank's share raises ``ValueError`` (a batch read for another
    rank or another grid).
    """
    if manager is None or manager.domain_world_size == 1:
        return
    expect = local_extent(manager, int(global_height), global_width, what="register_row_batch")
    placeholders = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() in (4, 5):
            dim = (shard_dim_5d if value.dim() == 5 else shard_dim_4d) % value.dim()
            shape = list(value.shape)
            for d, (local, size, what) in zip((dim, value.dim() - 1), expect):
                if value.shape[d] != local:
                    raise ValueError(
                        f"register_row_batch: batch[{key!r}] has {value.shape[d]} {what} along "
                        f"dim {d} but domain rank {manager.domain_rank} of "
                        f"{manager.domain_world_size} owns {local} of {size} {what}"
                    )
                shape[d] = size
            value = torch.empty(shape, dtype=value.dtype, device="meta")
        placeholders[key] = value
    shard_batch(
        placeholders,
        shard_dim_5d=shard_dim_5d,
        shard_dim_4d=shard_dim_4d,
        manager=manager,
    )
