"""Argument checks and selections of ``ERA5Dataset``: variable-name lists, row and tile ranges,
the latitude weights, level blocks and channel labels (pure functions, no store access)."""

from __future__ import annotations

import numpy as np
import torch

from ..domain.rows import shard_range
from ..domain.tiles import tile_range

__all__ = [
    "every_timestep",
    "format_level",
    "level_coord_dim",
    "latitude_weights",
    "level_index",
    "name_list",
    "positive_int",
    "select_times",
    "select_levels",
    "tile_window",
    "time_label",
]


def name_list(names, key: str) -> list[str]:
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"ERA5Dataset: {key} must be variable names, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"ERA5Dataset: {key} lists a variable twice: {names}")
    return names


def positive_int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"ERA5Dataset: {key} must be an integer >= 1, got {value!r}")
    return int(value)


def _domain_shard(domain_shard) -> tuple[int, tuple[int, int] | None, int]:
    """``(domain_rank, (P, Q) or None, domain size)`` of a ``domain_shard`` argument."""
    ok = isinstance(domain_shard, tuple | list) and len(domain_shard) == 2
    rank, size = domain_shard if ok else (None, None)
    shape = None
    if isinstance(size, tuple | list) and len(size) == 2:  # a lat x lon domain (P, Q)
        shape = tuple(size)
        ok = all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in shape)
        size = shape[0] * shape[1] if ok and min(shape) >= 1 else None
    ok = ok and isinstance(rank, int | np.integer) and isinstance(size, int | np.integer)
    if not ok or not 0 <= rank < size:
        raise ValueError(
            "ERA5Dataset: domain_shard must be (domain_rank, domain_size) or (domain_rank, "
            "(P, Q)) with 0 <= domain_rank < domain_size (= P * Q; the rank is lat * Q + lon), "
            f"got {domain_shard!r}"
        )
    return int(rank), None if shape is None else (int(shape[0]), int(shape[1])), int(size)


def tile_window(rows, domain_shard, grid_shape: tuple[int, int]) -> tuple:
    """``(rows, columns)`` a dataset reads: ``(start, stop)`` ranges, or None for all of them.

    ``domain_shard=(domain_rank, domain_size)``: the balanced latitude rows of that domain rank,
    every column; ``(domain_rank, (P, Q))``: the tile of domain rank ``lat * Q + lon`` of a
    lat x lon domain (SPEC §3b, ``domain.tiles.tile_range``).  ``rows=(start, stop)`` instead:
    those global rows, every column."""
    height, width = grid_shape
    if domain_shard is not None:
        if rows is not None:
            raise ValueError("ERA5Dataset: pass rows or domain_shard, not both")
        rank, shape, size = _domain_shard(domain_shard)
        if shape is None:
            return shard_range(height, size, rank), None
        coords = (rank // shape[1], rank % shape[1])
        return tile_range(height, width, shape, coords)
    if rows is None:
        return None, None
    ok = isinstance(rows, tuple | list) and len(rows) == 2
    ok = ok and all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in rows)
    if not ok or not 0 <= rows[0] <= rows[1] <= height:
        raise ValueError(
            f"ERA5Dataset: rows must be a (start, stop) pair of ints with 0 <= start <= stop <= "
            f"{height} (the store's latitude count), got {rows!r}"
        )
    return (int(rows[0]), int(rows[1])), None


def latitude_weights(lat_degrees, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``cos(lat)`` normalised to mean 1, shape ``(H,)``; the poles keep their exact (tiny) value."""
    if isinstance(lat_degrees, torch.Tensor):
        lat_degrees = lat_degrees.detach().cpu().numpy()
    lat = np.asarray(lat_degrees, dtype=np.float64)
    if lat.ndim != 1 or lat.size == 0:
        raise ValueError(
            f"latitude_weights: lat_degrees must be a non-empty 1-D array, got shape {lat.shape}"
        )
    if not np.all(np.isfinite(lat)) or np.any(np.abs(lat) > 90.0):
        raise ValueError(
            "latitude_weights: lat_degrees must be finite degrees in [-90, 90], got "
            f"min {lat.min()} max {lat.max()}"
        )
    weights = np.cos(np.deg2rad(lat))
    if weights.sum() <= 0.0:
        raise ValueError("latitude_weights: all latitudes are poles; cos(lat) has no mass")
    return torch.as_tensor(weights / weights.mean(), dtype=dtype)


def level_index(positions) -> tuple:
    """The level selection of one read: ``(slice, True)`` when the positions are one ascending
    block of the store's levels (a basic selection, one request), else ``(array, False)``."""
    if not positions:
        return slice(0, 0), True
    first = positions[0]
    if list(positions) == list(range(first, first + len(positions))):
        return slice(first, first + len(positions)), True
    return np.asarray(positions), False


def time_label(offset: int) -> str:
    return "t" if offset == 0 else f"t{offset:+d}"


def format_level(level: float) -> str:
    return str(int(level)) if float(level).is_integer() else str(level)


def level_coord_dim(dims, level_coord: str | None, path) -> str | None:
    """The store's level dimension: ``level_coord`` when given (it must be a dim), else the
    first of ``LEVEL_NAMES`` present."""
    from .store import LEVEL_NAMES, find_dim

    if level_coord is None:
        return find_dim(dims, LEVEL_NAMES)
    if level_coord not in dims:
        raise ValueError(
            f"ERA5Dataset: level_coord {level_coord!r} is not a dimension of {str(path)!r} "
            f"(dims are {list(dims)})"
        )
    return level_coord


def every_timestep(dataset, timestep):
    """The dataset's selected ``(positions, times)`` ``timestep`` apart ("6h"): the store's
    spacing or a multiple of it (every k-th time); ``ValueError`` naming both otherwise."""
    import pandas as pd

    positions, times, path = dataset._time_positions, dataset.times, dataset.path

    try:
        want = pd.Timedelta(timestep)
    except ValueError as err:
        raise ValueError(f"ERA5Dataset: timestep {timestep!r} is not a duration") from err
    if times.size < 2:
        return positions, times
    have = pd.Timedelta(times[1] - times[0])
    if want <= pd.Timedelta(0) or want % have != pd.Timedelta(0):
        raise ValueError(
            f"ERA5Dataset: timestep {timestep!r} is not a multiple of the store's time spacing "
            f"{have} in {str(path)!r}"
        )
    k = int(want // have)
    return positions[::k], times[::k]


def select_times(index, time_slice):
    """``(positions, times)`` of the time axis ``index`` (a ``pandas.Index``: every store's times,
    in order) that ``time_slice`` selects: a ``slice`` (or ``(start, stop)`` pair) of integer
    positions, or of labels (inclusive, as ``.sel``); evenly spaced or a ``ValueError``."""
    positions = np.arange(len(index))
    if time_slice is not None:
        if isinstance(time_slice, tuple | list) and len(time_slice) == 2:
            time_slice = slice(*time_slice)
        if not isinstance(time_slice, slice):
            raise ValueError(
                f"ERA5Dataset: time_slice must be a slice or a (start, stop) pair, "
                f"got {time_slice!r}"
            )
        ends = (time_slice.start, time_slice.stop)
        if all(end is None or isinstance(end, int | np.integer) for end in ends):
            positions = positions[time_slice]
        else:
            positions = positions[index.slice_indexer(time_slice.start, time_slice.stop)]
            positions = positions[:: time_slice.step or 1]
        if positions.size and np.any(np.diff(positions) != positions[1] - positions[0]):
            raise ValueError(f"ERA5Dataset: time_slice {time_slice!r} is not evenly spaced")
    return positions, np.asarray(index.values)[positions]


def select_levels(store_levels, levels, path, dim: str = "level"):
    """``(positions, values)`` of the requested pressure ``levels`` (matched with ``np.isclose``)
    in the store's level coordinate ``store_levels`` (dim ``dim``) (``None``: no upper-air variable; ``levels``
    ``None``: all of them); ``ValueError`` naming a missing or repeated level."""
    if store_levels is None:
        return [], ()
    store_levels = np.asarray(store_levels, dtype=np.float64)
    if levels is None:
        return list(range(store_levels.size)), tuple(store_levels.tolist())
    if isinstance(levels, int | float | np.number):
        levels = [levels]
    positions = []
    for level in levels:
        matches = np.flatnonzero(np.isclose(store_levels, float(level)))
        if matches.size == 0:
            raise ValueError(
                f"ERA5Dataset: level {level!r} is not in {str(path)!r}; available "
                f"{dim} values: {[format_level(v) for v in store_levels]}"
            )
        positions.append(int(matches[0]))
    if len(set(positions)) != len(positions):
        raise ValueError(f"ERA5Dataset: levels lists a level twice: {list(levels)}")
    if not positions:
        raise ValueError("ERA5Dataset: levels is empty but upper-air variables were requested")
    return positions, tuple(float(store_levels[p]) for p in positions)
