"""Argument checks and selections of ``ERA5Dataset``: variable-name lists, row ranges, level
blocks and channel labels (pure functions, no store access)."""

from __future__ import annotations

import numpy as np

from ..domain.rows import shard_range

__all__ = [
    "format_level",
    "level_index",
    "name_list",
    "positive_int",
    "row_range",
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


def row_range(rows, domain_shard, height: int) -> tuple[int, int] | None:
    if domain_shard is not None:
        if rows is not None:
            raise ValueError("ERA5Dataset: pass rows or domain_shard, not both")
        ok = isinstance(domain_shard, tuple | list) and len(domain_shard) == 2
        if not ok or not 0 <= domain_shard[0] < domain_shard[1]:
            raise ValueError(
                "ERA5Dataset: domain_shard must be (domain_rank, domain_size) with "
                f"0 <= domain_rank < domain_size, got {domain_shard!r}"
            )
        return shard_range(height, int(domain_shard[1]), int(domain_shard[0]))
    if rows is None:
        return None
    ok = isinstance(rows, tuple | list) and len(rows) == 2
    ok = ok and all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in rows)
    if not ok or not 0 <= rows[0] <= rows[1] <= height:
        raise ValueError(
            f"ERA5Dataset: rows must be a (start, stop) pair of ints with 0 <= start <= stop <= "
            f"{height} (the store's latitude count), got {rows!r}"
        )
    return int(rows[0]), int(rows[1])


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
