"""The exchange of a lat x lon tile: rows over the latitude ranks, then columns of the
H-extended tensor over the longitude ranks (SPEC §3b), each element sent once.

A layer gives the window of global rows (``rows[r]`` per latitude rank, ``FILL`` for a fill row)
and of global columns (``cols[q]`` per longitude rank) its owned outputs read, as for the 1-D
exchange (``rows.plan_exchange``).  The rows are fetched COMPACT: each real row once (no fill
row, no repeat such as the rows a reflect or circular rule maps beyond a pole), so that the
column exchange, which carries the columns of every fetched row (the corners), sends nothing
twice and no zeros.  The window is then expanded locally (repeats copied, fill rows added):
:func:`tile_plan` makes the plans once per geometry, :func:`exchange_tile` replays them.  The
forward sends at most one message per peer per axis; its backward (autograd through the two
exchanges and the local expansion) is the exact adjoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..rows import FILL, RankExchangePlan, plan_exchange
from .halo import exchange_planned
from .windows import assemble_window

__all__ = [
    "TilePlan",
    "compact_windows",
    "exchange_tile",
    "exchange_tile_columns",
    "expand_rows",
    "tile_plan",
]


@dataclass(frozen=True)
class TilePlan:
    """This rank's plans of one tile exchange: ``rows`` (the compact rows over the latitude
    ranks), ``cols`` (the columns over the longitude ranks) and ``expand`` (the local map from
    the compact rows to the row window; None when they are the same)."""

    rows: RankExchangePlan
    cols: RankExchangePlan
    expand: RankExchangePlan | None


@lru_cache(maxsize=1024)
def compact_windows(windows: tuple) -> tuple[tuple, tuple]:
    """``(compact, expand)``: per rank, its window's real rows sorted, each once, and the
    local plan that rebuilds the window from them (None when the window is already that)."""
    compact, expand = [], []
    for window in windows:
        rows = tuple(sorted({g for g in window if g != FILL}))
        compact.append(rows)
        if rows == tuple(window):
            expand.append(None)
            continue
        position = {g: i for i, g in enumerate(rows)}
        mapped = tuple(FILL if g == FILL else position[g] for g in window)
        expand.append(plan_exchange(len(rows), 1, (mapped,))[0])  # own rows and fills only
    return tuple(compact), tuple(expand)


def tile_plan(height: int, width: int, shape, coords, rows: tuple, cols: tuple) -> TilePlan:
    """The :class:`TilePlan` of the tile ``coords`` = (lat, lon) of a ``shape`` = (P, Q)
    domain, for the row windows ``rows`` (one per latitude rank, over ``height`` rows) and the
    column windows ``cols`` (one per longitude rank, over ``width`` columns)."""
    (p, q), (lat, lon) = shape, coords
    compact, expand = compact_windows(rows)
    return TilePlan(
        plan_exchange(height, p, compact)[lat], plan_exchange(width, q, cols)[lon], expand[lat]
    )


def exchange_tile(
    x: torch.Tensor, plan: TilePlan, dims: tuple[int, int], manager, fill_value: float = 0.0
) -> torch.Tensor:
    """The window of the tile ``x`` (rows along ``dims[0]``, columns along ``dims[1]``, both
    non-negative) under the tiled ``manager``.  Differentiable."""
    dim_h, dim_w = dims
    (x,) = exchange_planned([x], [(plan.rows, dim_h, fill_value)], manager.lat)
    return exchange_tile_columns(x, plan, dims, manager, fill_value)


def exchange_tile_columns(
    rows: torch.Tensor, plan: TilePlan, dims: tuple[int, int], manager, fill_value: float = 0.0
) -> torch.Tensor:
    """The second half of :func:`exchange_tile`: from ``rows`` (the compact rows of
    ``plan.rows``, assembled), the columns over the longitude ranks, then the local expansion
    (e.g. after the rows came with a norm's statistics, ``norm_halo.py``).  Differentiable."""
    dim_h, dim_w = dims
    (x,) = exchange_planned([rows], [(plan.cols, dim_w, fill_value)], manager.lon)
    return expand_rows(x, plan, dim_h, fill_value)


def expand_rows(x: torch.Tensor, plan: TilePlan, dim_h: int, fill_value: float = 0.0):
    """The row window from the compact rows ``x`` (repeats copied, fill rows added)."""
    if plan.expand is not None:
        x = assemble_window(x, [], plan.expand, dim_h, fill_value)
    return x
