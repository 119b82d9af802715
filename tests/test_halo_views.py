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
    DomainParallelPeriodicConv2d,
    HaloExchange,
    gather_tensor,
    shard_tensor,
)
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit


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


# (ours, theirs: the class of credit.domain_parallel.layers, conv)
_SEED_CASES = [
    ("DomainParallelConv2d", nn.Conv2d(8, 16, kernel_size=4, stride=2, padding=1), 1),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, kernel_size=8, stride=2, padding=3), 3),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, kernel_size=16, stride=2, padding=7), 7),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, kernel_size=32, stride=2, padding=15), 15),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, kernel_size=3, stride=2, padding=1), 0),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, kernel_size=2, stride=2), 0),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, kernel_size=(4, 2), stride=(4, 2)), 0),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, 3, padding=1), 1),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, 7, padding=3), 3),
    ("DomainParallelConv2d", nn.Conv2d(2, 2, 3, padding=0), 1),
    ("DomainParallelConv3d", nn.Conv3d(2, 2, 3, padding=1), 1),
    ("DomainParallelConv3d", nn.Conv3d(2, 2, (1, 4, 4), stride=(1, 2, 2), padding=(0, 1, 1)), 1),
    ("DomainParallelConvTranspose2d", nn.ConvTranspose2d(2, 2, 2, stride=2), 0),
    ("DomainParallelConvTranspose2d", nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1), 1),
    ("DomainParallelConvTranspose2d", nn.ConvTranspose2d(2, 2, 3, stride=1, padding=1), 1),
    ("DomainParallelConvTranspose3d", nn.ConvTranspose3d(2, 2, 2, stride=2), 0),
    ("DomainParallelConvTranspose3d", nn.ConvTranspose3d(2, 2, (1, 4, 4), (1, 2, 2), (0, 1, 1)), 1),
]


@pytest.mark.parametrize("name, conv, width", _SEED_CASES)
def test_halo_width_before_any_forward_is_miles_credits(name, conv, width):
    """Before its first forward a layer reports the value miles-credit's own class of the same
    name assigns: (kernel - stride) // 2 when strided (k4/8/16/32 s2 -> 1/3/7/15), (kernel -
    1) // 2 at stride 1, a transposed conv's padding when kernel > stride, else 0."""
    import credit_parallel

    theirs = getattr(import_credit("credit.domain_parallel.layers"), name)(conv)
    ours = getattr(credit_parallel, name)(conv)
    assert theirs.halo_width == width
    assert ours.halo_width == width
    assert ours.halo_exchange.halo_width == width


def test_periodic_conv_halo_width_before_any_forward_is_its_padding():
    from credit_parallel.models import PeriodicConv2d

    credit_layers = import_credit("credit.domain_parallel.layers")
    periodic = PeriodicConv2d(2, 2, kernel_size=5, padding=2)
    theirs = credit_layers.DomainParallelPeriodicConv2d(periodic)
    ours = DomainParallelPeriodicConv2d(periodic)
    assert ours.halo_width == theirs.halo_exchange.halo_width == 2


def test_strided_halo_width_after_a_forward_is_exact_per_rank():
    """After a forward the same k4 s2 p1 layer reports the rows it really read, per rank: H = 13
    over 3 ranks gives 6 output rows (2, 2, 2) reading input rows -1..4, 3..8, 7..12 of the
    shards 0-4, 5-8, 9-12: nothing, two rows above, two rows above."""
    layer = DomainParallelConv2d(nn.Conv2d(8, 16, kernel_size=4, stride=2, padding=1))
    assert layer.halo_width == 1
    for rank, expected in enumerate([0, (2, 0), (2, 0)]):
        layer._call_geometry(13, 3, rank)
        assert layer.halo_width == expected, (rank, layer.halo_width)
        layer._calls.clear()


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
