"""The seed's read-only views ``halo_width`` / ``halo_exchange`` on the domain-parallel
convolutions (``credit.domain_parallel`` lists them on every conv layer and on HaloExchange):
the rows of other ranks each rank reads, per rank, on uneven shards and at the poles, checked
against the layer's own exchange plan and, on 3 gloo ranks, against a real forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel import (
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
    DomainParallelManager,
    HaloExchange,
    gather_tensor,
    shard_tensor,
)
from credit_parallel.testing import run_on_ranks


def _width(before, after):
    return before if before == after else (before, after)


@pytest.mark.parametrize(
    "conv, per_rank",
    [
        # H = 13 over 3 ranks: shards 5, 4, 4 (uneven); the poles read nothing beyond the globe
        (nn.Conv2d(2, 2, 3, padding=1), [(0, 1), 1, (1, 0)]),
        (nn.Conv2d(2, 2, 5, padding=2), [(0, 2), 2, (2, 0)]),
        # circular padding wraps the poles onto the far shard
        (nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"), [1, 1, 1]),
        # "valid": 11 output rows in the balanced layout 4, 4, 3 read rows 0-5, 4-9, 8-12
        (nn.Conv2d(2, 2, (3, 1), padding=0), [(0, 1), 1, (1, 0)]),
    ],
)
def test_conv2d_halo_width_per_rank_uneven_h13_domain3(conv, per_rank):
    layer = DomainParallelConv2d(conv)
    for rank, expected in enumerate(per_rank):
        layer._call_geometry(13, 3, rank)  # what a forward on that rank computes first
        assert layer.halo_width == expected, (rank, layer.halo_width)
        before, after = (expected, expected) if isinstance(expected, int) else expected
        assert before + after == layer._calls[(13, 3, rank, False)].plan.rows_received
        exchange = layer.halo_exchange
        assert isinstance(exchange, HaloExchange)
        assert (exchange.halo_before, exchange.halo_after) == (before, after)
        assert exchange.halo_width == expected
        assert exchange.dim == layer.shard_dim
        layer._calls.clear()


def test_nominal_halo_before_any_forward_matches_the_kernel():
    assert DomainParallelConv2d(nn.Conv2d(2, 2, 3, padding=1)).halo_width == 1
    assert DomainParallelConv2d(nn.Conv2d(2, 2, 7, padding=3)).halo_width == 3
    assert DomainParallelConv2d(nn.Conv2d(2, 2, 3, padding=0)).halo_width == (0, 2)
    assert DomainParallelConv3d(nn.Conv3d(2, 2, 3, padding=1)).halo_width == 1
    assert DomainParallelConvTranspose2d(nn.ConvTranspose2d(2, 2, 2, stride=2)).halo_width == 0
    assert DomainParallelConvTranspose3d(nn.ConvTranspose3d(2, 2, 2, stride=2)).halo_width == 0
    assert (
        DomainParallelConvTranspose2d(nn.ConvTranspose2d(2, 2, 3, stride=1, padding=1)).halo_width
        == 1
    )


def test_halo_exchange_halo_width_int_or_pair():
    assert HaloExchange(2).halo_width == 2
    assert HaloExchange((1, 3)).halo_width == (1, 3)
    assert HaloExchange((2, 2)).halo_width == 2


def _forward_worker(rank, world):
    torch.manual_seed(0)
    mgr = DomainParallelManager(world, world)
    cases = [
        (DomainParallelConv2d, nn.Conv2d(2, 3, 3, padding=1), (1, 2, 13, 6)),
        (DomainParallelConv2d, nn.Conv2d(2, 3, 3, stride=2, padding=1), (1, 2, 13, 6)),
        (DomainParallelConvTranspose2d, nn.ConvTranspose2d(2, 3, 4, 2, padding=1), (1, 2, 7, 6)),
        (DomainParallelConv3d, nn.Conv3d(2, 3, 3, padding=1), (1, 2, 2, 13, 6)),
        (DomainParallelConvTranspose3d, nn.ConvTranspose3d(2, 3, 3, 1, 1), (1, 2, 2, 13, 6)),
    ]
    out = []
    for cls, conv, shape in cases:
        conv = conv.double()
        x = torch.randn(shape, dtype=torch.float64)
        dim = -2 if len(shape) == 4 else 3
        layer = cls(conv, dim, manager=mgr)
        y = gather_tensor(layer(shard_tensor(x, dim, manager=mgr)), dim, manager=mgr)
        err = (y - conv(x)).abs().max().item()
        key = next(iter(layer._calls))
        received = layer._calls[key].plan.rows_received
        out.append((cls.__name__, layer.halo_width, received, err))
    return out


def test_halo_width_after_a_real_forward_domain3_uneven():
    results = run_on_ranks(_forward_worker, 3)
    for rank, cases in enumerate(results):
        for name, width, received, err in cases:
            assert err <= 1e-10, (name, rank, err)
            before, after = (width, width) if isinstance(width, int) else width
            assert before + after == received, (name, rank, width, received)
    # a 3x3 "same" conv: the north pole reads only below, the south pole only above
    assert results[0][0][1] == (0, 1)
    assert results[1][0][1] == 1
    assert results[2][0][1] == (1, 0)
