"""Tiles of a two-dimensional (lat x lon) domain: which rows and columns a rank owns, and the
moves between the global tensor and the tiles (SPEC §3b).

The tile of domain rank (lat, lon) is the balanced row shard ``lat`` of P (``rows.shard_range``)
crossed with the balanced column shard ``lon`` of Q: the same rule applied to W, the last dim,
so the first W % Q column shards are one column wider.  Everything that moves data does it one
axis at a time through the manager's axis views (``manager.DomainParallelManager.lat`` / ``.lon``)
and the 1-D collectives and exchange (``exchange/collectives.py``, ``exchange/halo.py``): the
adjoints and the uneven shards are theirs.
"""

from __future__ import annotations

import weakref

import torch

from .exchange.collectives import all_gather_rows, scatter_rows
from .rows import shard_range, shard_sizes

__all__ = [
    "column_range",
    "column_sizes",
    "gather_tile",
    "shard_tile",
    "tile_range",
    "tile_shapes",
    "unpad_tile",
]


# one interpolator per (manager, target size), so its global-size lookups stay cached
_INTERPOLATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------- pure layout
def column_sizes(width: int, q: int) -> tuple[int, ...]:
    """Columns owned by each of ``q`` longitude ranks: the row rule applied to W."""
    return shard_sizes(width, q)


def column_range(width: int, q: int, lon: int) -> tuple[int, int]:
    """``[start, stop)`` of the columns owned by longitude rank ``lon`` of ``q``."""
    return shard_range(width, q, lon)


def tile_range(
    height: int, width: int, shape: tuple[int, int], coords: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((row start, row stop), (column start, column stop))`` of the tile at ``coords`` =
    (lat, lon) of a ``shape`` = (P, Q) domain over a ``height`` x ``width`` grid."""
    (p, q), (lat, lon) = shape, coords
    if not (0 <= lat < p and 0 <= lon < q):
        raise ValueError(f"tile coords {coords} outside the domain {shape}")
    return shard_range(height, p, lat), column_range(width, q, lon)


def tile_shapes(height: int, width: int, shape: tuple[int, int]) -> list[list[tuple[int, int]]]:
    """``[lat][lon] -> (rows, columns)`` of every tile."""
    rows, cols = shard_sizes(height, shape[0]), column_sizes(width, shape[1])
    return [[(h, w) for w in cols] for h in rows]


# --------------------------------------------------------------------------- moves
def _width_dim(x: torch.Tensor, dim: int, what: str) -> int:
    w = x.dim() - 1
    if dim == w:
        raise ValueError(
            f"{what}: under a two-dimensional domain the sharded dim {dim} is latitude and the "
            f"last dim is longitude; they must differ (got a {x.dim()}-D tensor)"
        )
    return w


def shard_tile(x: torch.Tensor, dim: int, manager) -> torch.Tensor:
    """This rank's tile of the global ``x``: rows along ``dim`` (non-negative), columns along
    the last dim.  Differentiable; its backward all-gathers (both axes)."""
    w = _width_dim(x, dim, "shard_tensor")
    for axis, d in ((manager.lat, dim), (manager.lon, w)):
        if axis.domain_world_size > 1:  # a one-rank axis has no group of its own
            x = scatter_rows(x, d, axis)
    return x


def gather_tile(x: torch.Tensor, dim: int, manager, owner) -> torch.Tensor:
    """The global tensor from every rank's tile (uneven rows and columns); the exact adjoint of
    :func:`shard_tile` (each rank's gradient is the sum over ranks of its tile's gradients).
    ``owner`` names the caller in a global-length lookup's errors (never cached)."""
    w = _width_dim(x, dim, "gather_tensor")
    for axis, d in ((manager.lon, w), (manager.lat, dim)):
        if axis.domain_world_size > 1:  # a one-rank axis has no group of its own
            length = axis.global_length(owner, x.shape[d], cached=False)
            x = all_gather_rows(x, d, length, axis)
    return x


def _strip(x: torch.Tensor, dim: int, before: int, after: int, axis, owner) -> tuple:
    """Remove ``before`` leading and ``after`` trailing global rows along ``dim`` from the
    shards of ``axis`` (a manager view), re-balanced; returns (tensor, new global length)."""
    from .exchange.halo import exchange_rows

    length = axis.global_length(owner, x.shape[dim], cached=False)
    new = length - before - after
    if new < 1:
        raise ValueError(f"unpad_shard_interp: {new} rows/columns left after removing the padding")
    if before == 0 and after == 0:
        return x, length
    n = axis.domain_world_size
    windows = tuple(
        tuple(range(a + before, b + before)) for a, b in (shard_range(new, n, r) for r in range(n))
    )
    return exchange_rows(x, windows, length, dim, axis), new


def unpad_tile(y: torch.Tensor, pads: tuple, manager, image_h: int, image_w: int, owner):
    """``unpad_shard_interp`` on tiles: ``pads`` = (north, south, west, east) global rows and
    columns stripped, the tiles re-balanced (exactly ``shard_tensor`` of the un-padded global
    output), then bilinearly interpolated to ``image_h`` x ``image_w`` if that differs."""
    north, south, west, east = pads
    dim = y.dim() - 2
    y, height = _strip(y, dim, north, south, manager.lat, owner)
    y, width = _strip(y, dim + 1, west, east, manager.lon, owner)
    if (height, width) != (image_h, image_w):
        from .layers.resample import DomainParallelInterpolate

        cache = _INTERPOLATORS.setdefault(manager, {})
        interp = cache.get((image_h, image_w))
        if interp is None:
            interp = DomainParallelInterpolate(
                size=(image_h, image_w), mode="bilinear", manager=manager
            )
            cache[(image_h, image_w)] = interp
        y = interp(y)
    return y
