"""Tiles of a two-dimensional (lat x lon) domain (SPEC §3b): the balanced rows x columns layout,
shard / gather (exact adjoints), shard_batch, unpad_shard_interp and shard_lat_weights, uneven
H and W, at (P, Q) in {(1,2), (2,1), (2,2), (3,2), (2,3), (4,2), (1,3)}."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from credit_parallel.domain.manager import TiledDomainManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.domain.sharding import (
    gather_tensor,
    shard_batch,
    shard_tensor,
    unpad_shard_interp,
)
from credit_parallel.domain.tiles import column_range, column_sizes, tile_range, tile_shapes
from credit_parallel.parallel.credit_api import shard_lat_weights
from credit_parallel.testing import run_on_ranks

SHAPES = [(1, 2), (2, 1), (2, 2), (3, 2), (2, 3), (4, 2), (1, 3)]


# --------------------------------------------------------------------------- pure layout
def test_tiles_partition_the_grid_exhaustively():
    for h, w, p, q in itertools.product(range(1, 10), range(1, 10), range(1, 5), range(1, 5)):
        owner = {}
        for lat, lon in itertools.product(range(p), range(q)):
            (r0, r1), (c0, c1) = tile_range(h, w, (p, q), (lat, lon))
            assert (r1 - r0, c1 - c0) == tile_shapes(h, w, (p, q))[lat][lon]
            for cell in itertools.product(range(r0, r1), range(c0, c1)):
                assert cell not in owner
                owner[cell] = (lat, lon)
        assert len(owner) == h * w
        # the first W % Q column shards are one column wider (the row rule)
        sizes = column_sizes(w, q)
        assert sizes == tuple(w // q + (1 if j < w % q else 0) for j in range(q))
        assert [column_range(w, q, j) for j in range(q)] == [shard_range(w, q, j) for j in range(q)]
        # torch.tensor_split along both dims gives the same tiles
        grid = torch.arange(h * w).reshape(h, w)
        for lat, rows in enumerate(torch.tensor_split(grid, p, 0)):
            for lon, tile in enumerate(torch.tensor_split(rows, q, 1)):
                (r0, r1), (c0, c1) = tile_range(h, w, (p, q), (lat, lon))
                assert torch.equal(tile, grid[r0:r1, c0:c1])
    with pytest.raises(ValueError, match="outside the domain"):
        tile_range(4, 4, (2, 2), (2, 0))


# --------------------------------------------------------------------------- multi-rank
def _tile_of(x, shape, coords, hdim=-2):
    h, w = x.shape[hdim], x.shape[-1]
    (r0, r1), (c0, c1) = tile_range(h, w, shape, coords)
    return x.narrow(hdim, r0, r1 - r0)[..., c0:c1]


def _moves_worker(rank, world, shape, grids):
    m = TiledDomainManager(world, shape)
    coords = m.domain_coords
    out = {}
    for h, w in grids:
        torch.manual_seed(0)
        x = torch.randn(2, 3, h, w, dtype=torch.float64, requires_grad=True)
        g = torch.randn(2, 3, h, w, dtype=torch.float64)
        y = shard_tensor(x, -2, m)
        assert torch.equal(y, _tile_of(x, shape, coords))
        (y * _tile_of(g, shape, coords)).sum().backward()
        out[("shard_grad", h, w)] = float((x.grad - g).abs().max())  # backward all-gathers
        # gather: each rank's gradient is the sum over ranks of the gradients of its tile
        local = _tile_of(x.detach(), shape, coords).clone().requires_grad_(True)
        z = gather_tensor(local, -2, m)
        out[("gather", h, w)] = float((z - x).abs().max())
        torch.manual_seed(100 + rank)
        gr = torch.randn(2, 3, h, w, dtype=torch.float64)
        (z * gr).sum().backward()
        total = sum(
            (torch.manual_seed(100 + r), torch.randn(2, 3, h, w, dtype=torch.float64))[1]
            for r in range(world)
        )
        out[("gather_grad", h, w)] = float(
            (local.grad - _tile_of(total, shape, coords)).abs().max()
        )
        # 5-D along dim 3 (B, C, T, H, W) and shard_batch
        x5 = torch.randn(1, 2, 3, h, w, dtype=torch.float64)
        batch = shard_batch(
            {"x": x5, "y": x5[:, :, 0], "t": torch.arange(3), "s": "keep"}, manager=m
        )
        out[("batch", h, w)] = (
            torch.equal(batch["x"], _tile_of(x5, shape, coords, 3))
            and torch.equal(batch["y"], _tile_of(x5[:, :, 0], shape, coords))
            and torch.equal(batch["t"], torch.arange(3))
            and batch["s"] == "keep"
        )
        out[("gather5", h, w)] = torch.equal(gather_tensor(batch["x"], 3, m), x5)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_shard_gather_are_exact_adjoints_on_uneven_tiles(shape):
    world = shape[0] * shape[1]
    grids = [(7, 11), (5, 3)] if world <= 4 else [(7, 11)]
    for result in run_on_ranks(_moves_worker, world, shape, grids):
        for key, value in result.items():
            if isinstance(value, bool):
                assert value, key
            else:
                assert value <= 1e-12, (key, value)


def _unpad_worker(rank, world, shape):
    m = TiledDomainManager(world, shape)
    coords = m.domain_coords
    torch.manual_seed(1)
    padded = torch.randn(1, 2, 9 + 3, 10 + 4, dtype=torch.float64)
    opt = {"pad_lat": (1, 2), "pad_lon": [3, 1]}
    local = shard_tensor(padded, -2, m)
    y = unpad_shard_interp(local, opt, m, 9, 10)
    expected = _tile_of(padded[:, :, 1:-2, 3:-1], shape, coords)
    # a grid other than the un-padded one: bilinear interpolation on the tiles, exact
    interp = unpad_shard_interp(local, opt, m, 13, 8)
    reference = F.interpolate(padded[:, :, 1:-2, 3:-1], size=(13, 8), mode="bilinear")
    interp_err = float((interp - _tile_of(reference, shape, coords)).abs().max())
    weights = torch.randn(12, 14, dtype=torch.float64)
    column = torch.randn(12, 1, dtype=torch.float64)
    (r0, r1), (c0, c1) = tile_range(12, 14, shape, coords)
    lw = shard_lat_weights(weights, r1 - r0, m)
    lc = shard_lat_weights(column, r1 - r0, m)
    return (
        torch.equal(y, expected),
        interp_err,
        torch.equal(lw, weights[r0:r1, c0:c1]),
        torch.equal(lc, column[r0:r1]),
    )


@pytest.mark.parametrize("shape", [(2, 2), (1, 3), (2, 1)])
def test_unpad_and_lat_weights_on_tiles(shape):
    for same, interp_err, weights_ok, column_ok in run_on_ranks(
        _unpad_worker, shape[0] * shape[1], shape
    ):
        assert same and weights_ok and column_ok
        assert interp_err <= 1e-12
