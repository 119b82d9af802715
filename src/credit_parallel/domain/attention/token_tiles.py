"""Token attention on lat x lon tiles (SPEC §3b): a bare ``nn.MultiheadAttention`` whose input is
the tokens of this rank's tile (its parent flattened the tile, H outermost: ``x.flatten(2)``).

Softmax attention without a mask does not depend on the order of the key tokens, and each
query's output depends on that query alone (``tokens.py``): gathered in domain-rank order (tile
by tile) instead of the global row-major order, the keys give the single-process output.  Two
things do depend on the global layout, and this module supplies them:

* the check that the tokens are whole tiles (the counts of the P x Q ranks are
  ``rows[lat] * cols[lon]`` of the balanced tiles of some H x W: :func:`tile_grids`), where a
  latitude shard checks whole rows;
* the key order of the attention WEIGHTS ``nn.MultiheadAttention`` returns by default: the
  weights over the gathered keys are put in global row-major order (:func:`global_key_order`)
  when the counts determine the grid; where several grids give the same counts (e.g. every
  tile equal) the order is unknown and ``need_weights=True`` raises, naming the module.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..rows import shard_range, shard_sizes

__all__ = ["global_key_order", "tile_grids"]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@lru_cache(maxsize=256)
def tile_grids(counts: tuple[int, ...], shape: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Every global ``(H, W)`` whose balanced ``shape`` = (P, Q) tiles hold ``counts`` tokens
    (domain rank ``lat * Q + lon``); empty when none does (the tokens are not whole tiles)."""
    p, q = shape
    grid = [counts[lat * q : (lat + 1) * q] for lat in range(p)]
    if not any(counts):
        return ((0, 0),)
    first = math.gcd(*grid[0])
    found = []
    for rows0 in _divisors(first) if first else ():
        cols = [c // rows0 for c in grid[0]]
        if not cols[0] or tuple(cols) != shard_sizes(sum(cols), q):
            continue
        if any(row[0] % cols[0] for row in grid):
            continue
        rows = [row[0] // cols[0] for row in grid]
        if tuple(rows) != shard_sizes(sum(rows), p):
            continue
        if all(grid[a][b] == rows[a] * cols[b] for a in range(p) for b in range(q)):
            found.append((sum(rows), sum(cols)))
    return tuple(found)


@lru_cache(maxsize=64)
def _order(height: int, width: int, shape: tuple[int, int]) -> tuple[int, ...]:
    p, q = shape
    offsets, at = {}, 0
    for lat in range(p):
        for lon in range(q):
            (r0, r1), (c0, c1) = shard_range(height, p, lat), shard_range(width, q, lon)
            offsets[lat, lon] = (at, r0, c0, c1 - c0)
            at += (r1 - r0) * (c1 - c0)
    rows_of = [next(a for a in range(p) if shard_range(height, p, a)[1] > r) for r in range(height)]
    cols_of = [next(b for b in range(q) if shard_range(width, q, b)[1] > c) for c in range(width)]
    out = []
    for r in range(height):
        for c in range(width):
            start, r0, c0, w = offsets[rows_of[r], cols_of[c]]
            out.append(start + (r - r0) * w + (c - c0))
    return tuple(out)


def global_key_order(counts: list[int], shape, name: str, device) -> torch.Tensor:
    """Positions, among the keys gathered in domain-rank order (tile after tile, each tile
    row-major), of the global tokens in row-major order; ``ValueError`` naming ``name`` when
    the counts do not determine the grid."""
    grids = tile_grids(tuple(counts), tuple(shape))
    if len(grids) != 1:
        raise ValueError(
            f"{name}: nn.MultiheadAttention with need_weights=True on lat x lon tiles: the key "
            f"order of its attention weights is the global token order, which the tile token "
            f"counts {list(counts)} do not determine (grids {list(grids)}); call it with "
            "need_weights=False, or use an int (latitude-only) domain"
        )
    return torch.tensor(_order(*grids[0], tuple(shape)), dtype=torch.long, device=device)
