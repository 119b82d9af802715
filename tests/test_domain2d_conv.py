"""Convolutions on lat x lon tiles (SPEC §3b): forward and every gradient, float64, 1e-10 against
one process, uneven H and W, every padding_mode, PeriodicConv2d (longitude wraps across the
longitude ranks, also at Q = 2 where west and east are one rank), at (P, Q) in {(1,2), (2,1),
(2,2), (3,2), (2,3), (4,2), (1,3)}; the exchange is planned once and replayed, with at most 4
messages per direction pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.layers.conv import (
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
    DomainParallelPeriodicConv2d,
)
from credit_parallel.domain.manager import TiledDomainManager
from credit_parallel.models import PeriodicConv2d
from credit_parallel.testing import domain_parity_errors, run_on_ranks

TOL = 1e-10


def _conv(**kw):
    return lambda: nn.Conv2d(3, 4, dtype=torch.float64, **kw)


# (name, build, wrapper, input shape (B, C, H, W) with uneven H and W)
CASES = {
    "k3_zeros": (_conv(kernel_size=3, padding=1), DomainParallelConv2d, (2, 3, 9, 11)),
    "k3_circular": (
        _conv(kernel_size=3, padding=1, padding_mode="circular"),
        DomainParallelConv2d,
        (2, 3, 9, 11),
    ),
    "k3_reflect": (
        _conv(kernel_size=3, padding=1, padding_mode="reflect"),
        DomainParallelConv2d,
        (1, 3, 10, 9),
    ),
    "k5x3_replicate": (
        _conv(kernel_size=(5, 3), padding=(2, 1), padding_mode="replicate"),
        DomainParallelConv2d,
        (1, 3, 11, 10),
    ),
    "k1x3_lon_only_circular": (
        _conv(kernel_size=(1, 3), padding=(0, 1), padding_mode="circular"),
        DomainParallelConv2d,
        (1, 3, 7, 9),
    ),
    "k3_stride2_same_odd": (
        _conv(kernel_size=4, padding=(1, 2), stride=2),
        DomainParallelConv2d,
        (1, 3, 11, 13),
    ),
    "k3_dilation2_circular": (
        _conv(kernel_size=3, padding=2, dilation=2, padding_mode="circular"),
        DomainParallelConv2d,
        (1, 3, 10, 12),
    ),
    "k2_even_valid": (_conv(kernel_size=2), DomainParallelConv2d, (1, 3, 9, 11)),
    "same_even": (_conv(kernel_size=(2, 4), padding="same"), DomainParallelConv2d, (1, 3, 8, 11)),
    "groups": (
        lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2, dtype=torch.float64),
        DomainParallelConv2d,
        (1, 4, 9, 10),
    ),
    "periodic_p1": (
        lambda: PeriodicConv2d(3, 4, 3, padding=1).double(),
        DomainParallelPeriodicConv2d,
        (2, 3, 9, 11),
    ),
    "periodic_p2_k5": (
        lambda: PeriodicConv2d(3, 2, 5, padding=2).double(),
        DomainParallelPeriodicConv2d,
        (1, 3, 11, 12),
    ),
    "conv3d_circular": (
        lambda: nn.Conv3d(2, 3, 3, padding=1, padding_mode="circular", dtype=torch.float64),
        lambda m, manager: DomainParallelConv3d(m, manager=manager),
        (1, 2, 3, 9, 10),
    ),
    "transpose3d": (
        lambda: nn.ConvTranspose3d(
            2, 2, (1, 3, 2), stride=(1, 2, 2), padding=(0, 1, 0), dtype=torch.float64
        ),
        lambda m, manager: DomainParallelConvTranspose3d(m, manager=manager),
        (1, 2, 2, 5, 6),
    ),
    "transpose_k3_s2": (
        lambda: nn.ConvTranspose2d(
            3, 2, 3, stride=2, padding=1, output_padding=1, dtype=torch.float64
        ),
        DomainParallelConvTranspose2d,
        (1, 3, 5, 7),
    ),
    "transpose_k2_s2": (
        lambda: nn.ConvTranspose2d(3, 2, 2, stride=2, dtype=torch.float64),
        DomainParallelConvTranspose2d,
        (1, 3, 5, 7),
    ),
    "transpose_k3_s3_dil2": (
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=3, padding=2, dilation=2, dtype=torch.float64),
        DomainParallelConvTranspose2d,
        (1, 3, 5, 6),
    ),
}

SHAPES = [(1, 2), (2, 1), (2, 2), (3, 2), (2, 3), (4, 2), (1, 3)]
# the 6- and 8-rank layouts run a few cases (kept tiny); the rest run everything
FEW = ("k3_circular", "periodic_p1", "k3_stride2_same_odd", "transpose_k3_s2")


def _parity_worker(rank, world, shape, names):
    m = TiledDomainManager(world, shape)
    out = {}
    for name in names:
        build, wrap, in_shape = CASES[name]
        torch.manual_seed(7)
        x = torch.randn(in_shape, dtype=torch.float64)
        hdim = -2 if len(in_shape) == 4 else 3
        errors = domain_parity_errors(
            build, x, m, convert=lambda mod, mgr, wrap=wrap: wrap(mod, manager=mgr), shard_dim=hdim
        )
        out[name] = errors
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_convolutions_exact_on_tiles(shape):
    world = shape[0] * shape[1]
    names = list(CASES) if world <= 4 else list(FEW)
    for result in run_on_ranks(_parity_worker, world, shape, names, timeout=300):
        for name, errors in result.items():
            for key, (err, ref) in errors.items():
                assert err <= TOL, (shape, name, key, err, ref)
                assert ref > 0, (shape, name, key)


def _wrap_worker(rank, world, shape):
    """Q = 2: the west and the east halo come from ONE rank and must not swap; a marker input
    whose value is its global column shows where every halo column came from."""
    m = TiledDomainManager(world, shape)
    conv = nn.Conv2d(1, 2, (1, 3), padding=(0, 1), padding_mode="circular", bias=False)
    conv = conv.double()
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[0, 0, 0, 0] = 1.0  # output channel 0 reads the west column
        conv.weight[1, 0, 0, 2] = 1.0  # output channel 1 reads the east column
    w = 7
    cols = torch.arange(w, dtype=torch.float64).expand(1, 1, 3, w)
    layer = DomainParallelConv2d(conv, manager=m)
    from credit_parallel.domain.sharding import shard_tensor

    y = layer(shard_tensor(cols, -2, m))
    c0 = [0, 4][m.domain_coords[1]] if shape[1] == 2 else 0
    local_cols = range(c0, c0 + y.shape[-1])
    west = [float((c - 1) % w) for c in local_cols]
    east = [float((c + 1) % w) for c in local_cols]
    return y[0, 0, 0].tolist() == west and y[0, 1, 0].tolist() == east


@pytest.mark.parametrize("shape", [(1, 2), (2, 2), (1, 1)])
def test_circular_wrap_does_not_swap_halos_at_q2_and_wraps_locally_at_q1(shape):
    assert all(run_on_ranks(_wrap_worker, shape[0] * shape[1], shape))


def _traffic_worker(rank, world, shape):
    m = TiledDomainManager(world, shape)
    conv = PeriodicConv2d(2, 2, 3, padding=1).double()
    layer = DomainParallelPeriodicConv2d(conv, manager=m)
    from credit_parallel.domain.sharding import shard_tensor

    x = shard_tensor(torch.randn(1, 2, 12, 16, dtype=torch.float64), -2, m)
    layer(x)  # plans (and learns the global height and width)
    calls_before = dict(layer.__dict__["_tile_calls"])
    x.requires_grad_(True)
    with record_exchange_stats() as stats:
        layer(x).sum().backward()
    same_plan = layer.__dict__["_tile_calls"] == calls_before
    return stats.messages, stats.p2p_calls, same_plan


def test_tile_exchange_is_planned_once_and_sends_few_messages():
    # 3 x 2 tiles of 4 x 8: interior latitude ranks have a north and a south neighbour, and
    # one longitude neighbour that is both west and east
    results = run_on_ranks(_traffic_worker, 6, (3, 2))
    for rank, (messages, calls, same_plan) in enumerate(results):
        lat = rank // 2
        lat_peers = (lat > 0) + (lat < 2) + (lat in (0, 2))  # reflect at the poles: own rows
        assert same_plan
        # forward + backward: (north/south peers + one west-east peer) per pass, <= 4 each
        per_pass = messages / 2
        assert per_pass <= 4, (rank, messages)
        assert messages == 2 * ((lat > 0) + (lat < 2) + 1), (rank, messages, lat_peers)
        assert calls == 4  # one batched call per axis per direction


def _bytes_worker(rank, world, shape, hw, kind):
    from dataclasses import replace

    from credit_parallel.domain.layers.conv_geometry import conv_windows
    from credit_parallel.domain.rows import FILL
    from credit_parallel.domain.sharding import shard_tensor
    from credit_parallel.domain.tiles import tile_range

    m = TiledDomainManager(world, shape)
    if kind == "periodic":
        layer = DomainParallelPeriodicConv2d(PeriodicConv2d(2, 2, 3, padding=1).double(), manager=m)
    else:
        layer = DomainParallelConv2d(nn.Conv2d(2, 2, 5, padding=2).double(), manager=m)
    x = shard_tensor(torch.randn(1, 2, *hw, dtype=torch.float64), -2, m)
    layer(x)
    with record_exchange_stats() as stats:
        layer(x)
    (r0, r1), (c0, c1) = tile_range(*hw, shape, m.domain_coords)
    geo = layer.geometry
    lat, lon = m.domain_coords
    rows = {g for g in conv_windows(geo, 0, hw[0], shape[0])[0][lat] if g != FILL}
    geo_w = replace(geo, edge_mode=geo.other_mode)
    cols = {g for g in conv_windows(geo_w, 1, hw[1], shape[1])[0][lon] if g != FILL}
    # the distinct elements of other tiles this tile reads (corners included), 2 x float64
    received = (len(rows) * len(cols) - (r1 - r0) * (c1 - c0)) * 2 * 8
    return stats.by_direction["forward"], received


@pytest.mark.parametrize(
    "shape, hw, kind",
    [
        ((2, 2), (9, 11), "zeros"),
        ((3, 2), (10, 7), "periodic"),
        ((2, 3), (8, 10), "zeros"),
        ((2, 2), (9, 8), "periodic"),
    ],
)
def test_tile_halo_bytes_are_the_minimum(shape, hw, kind):
    """The bytes sent equal the distinct elements of other tiles the tiles read, corners
    included: the two-hop corners (rows first, then columns of the H-extended tensor) and the
    rows beyond the poles (zeros, or reflected rows) cost nothing beyond the minimum."""
    results = run_on_ranks(_bytes_worker, shape[0] * shape[1], shape, hw, kind)
    assert sum(s for s, _ in results) == sum(r for _, r in results)
    assert all(r > 0 for _, r in results)


def test_tile_plan_at_one_column_is_the_row_exchange():
    # Q = 1: the row window is planned as it is (the 1-D exchange: no compaction, no local
    # expansion copy); Q = 2: the rows are fetched compact and expanded locally
    from credit_parallel.domain.exchange.halo import compact_windows, halo_window, tile_plan
    from credit_parallel.domain.rows import plan_exchange

    height, width, p = 9, 8, 3
    rows = tuple(halo_window(height, p, r, 2, 2, "reflect") for r in range(p))
    for lat in range(p):
        one = tile_plan(height, width, (p, 1), (lat, 0), rows, ((0, 1, 7, 0),))
        assert one.expand is None and one.rows == plan_exchange(height, p, rows)[lat]
        assert not one.cols.sends and not one.cols.recvs
        two = tile_plan(
            height, width, (p, 2), (lat, 0), rows, ((7, 0, 1, 2, 3, 4), (3, 4, 5, 6, 7, 0))
        )
        compact, expand = compact_windows(rows)
        assert two.rows == plan_exchange(height, p, compact)[lat] and two.expand == expand[lat]
        # the same rows cross either way (each once per peer)
        assert one.rows.rows_received == two.rows.rows_received
    assert any(e is not None for e in compact_windows(rows)[1])  # the poles repeat rows
