"""Exchange fusion on lat x lon tiles (issue 26 item 4, ``domain/fusion.py`` with ``tiles=True``):
a padding layer and the conv after it exchange the pad's input ONCE with the row and the column
maps composed (corners, the longitude wrap at Q = 2 and Q = 1, the poles), and a GroupNorm's
statistics travel with the next conv's first exchange pass (no statistics collective).  Output,
input gradient and every parameter gradient equal one process (float64, 1e-10) on uneven H and
W; the synchronisations (batched P2P calls + small collectives) drop against the unfused
conversion; ``plan``'s tile counts (``planner/tile_fusions.py``) equal the counted ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.manager import TiledDomainManager
from credit_parallel.layout.small_collectives import record_small_collectives
from credit_parallel.models import PeriodicConv2d, UNet
from credit_parallel.models.crossformer import CrossScaleEmbedding
from credit_parallel.testing import domain_parity_errors, run_on_ranks

TOL = 1e-10


def _stack() -> nn.Module:
    """3x3 convs (zero and circular padding, PeriodicConv2d) with the pads and norms fusion
    links: 3 pad + conv pairs (zero, circular, reflect: the wrap and the poles), 3 norm + conv
    links (zero, circular, periodic conv), one conv not fused (after a softmax)."""
    torch.manual_seed(11)
    return nn.Sequential(
        nn.ZeroPad2d((1, 2, 2, 1)),
        nn.Conv2d(2, 4, 3),  # 1: pad + conv, zero
        nn.GroupNorm(2, 4),
        nn.SiLU(),
        nn.Conv2d(4, 4, 3, padding=1),  # 4: norm + conv, zero padding
        nn.CircularPad2d(1),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"),  # 6: pad + conv, circular
        nn.GroupNorm(2, 4),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"),  # 8: norm + conv, circular
        nn.GroupNorm(1, 4),
        nn.ReLU(),
        PeriodicConv2d(4, 4, 3, padding=1),  # 11: norm + periodic conv
        nn.ReflectionPad2d((1, 1, 1, 1)),
        nn.Conv2d(4, 3, 3),  # 13: pad + conv, reflect at the poles and in longitude
        nn.Softmax(dim=1),
        PeriodicConv2d(3, 2, 3, padding=1),  # 15: alone
    ).double()


class _Stack(nn.Module):
    """Same-shaped convs in a ModuleList applied one after the other (not siblings)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(2, 2, k, padding=k // 2, padding_mode="circular") for k in (3, 5, 3)
        )

    def forward(self, x):
        for conv in self.convs:
            x = conv(x)
        return x


def _cross() -> nn.Module:
    """CREDIT's cross-scale embedding (sibling convs on one input), then a linked norm."""
    torch.manual_seed(5)
    return nn.Sequential(
        CrossScaleEmbedding(2, 8, kernel_sizes=(2, 4, 8), stride=2),
        nn.GroupNorm(2, 8),
        nn.SiLU(),
        nn.Conv2d(8, 2, 3, padding=1),
    ).double()


def _unet(hw):
    return lambda: UNet(2, 2, *hw, base_channels=4).double()


def _convert(fuse: bool):
    return lambda model, mgr: convert_to_domain_parallel(model, mgr, fuse_exchanges=fuse)


def _parity_worker(rank, world, shape, hw, with_unet):
    m = TiledDomainManager(world, shape)
    x = torch.randn(2, 2, *hw, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    builds = {"stack": _stack, **({"unet": _unet(hw)} if with_unet else {})}
    out = {}
    for name, build in builds.items():
        for fuse in (True, False):
            with record_exchange_stats() as stats, record_small_collectives() as small:
                errors = domain_parity_errors(build, x, m, convert=_convert(fuse))
            syncs = (stats.p2p_calls, sum(small.values()), stats.messages, stats.bytes_sent)
            out[name, fuse] = (errors, syncs)
        fused = convert_to_domain_parallel(build(), m)
        out[name, "links"] = (
            sum(getattr(mod.options, "fused_pad", None) is not None for mod in fused.modules()
                if hasattr(mod, "options")),
            sum(getattr(mod.options, "fused_norm", None) is not None for mod in fused.modules()
                if hasattr(mod, "options") and hasattr(mod, "geometry")),
        )  # fmt: skip
    return out


@pytest.mark.parametrize(
    "shape, hw, with_unet",
    [
        ((1, 2), (9, 11), True),
        ((2, 1), (9, 11), False),  # Q = 1: the longitude wrap stays local
        ((2, 2), (17, 20), True),
        ((3, 2), (19, 14), True),
        ((2, 3), (17, 19), True),
    ],
)
def test_fused_exchanges_exact_on_tiles_with_fewer_synchronisations(shape, hw, with_unet):
    results = run_on_ranks(_parity_worker, shape[0] * shape[1], shape, hw, with_unet, timeout=600)
    for rank, out in enumerate(results):
        for name in ("stack", "unet") if with_unet else ("stack",):
            for fuse in (True, False):
                errors, _ = out[name, fuse]
                for key, (err, ref) in errors.items():
                    assert err <= TOL and ref > 0, (shape, name, fuse, key, err, ref)
            (f_calls, f_small, _, f_bytes), (u_calls, u_small, _, u_bytes) = (
                out[name, True][1],
                out[name, False][1],
            )
            # the halo bytes of a norm + conv link are the unfused conv's; a fused pad moves
            # no more than the pad and the conv apart
            assert f_bytes <= u_bytes, (name, rank, f_bytes, u_bytes)
            assert f_calls + f_small < u_calls + u_small, (name, rank, out[name, True][1])
        assert out["stack", "links"] == (3, 3)
        if with_unet:
            # both norms of every residual block linked (the block declares them)
            assert out["unet", "links"][1] > 0
    # the stack at every rank: the pad + conv pairs save the pads' exchanges, the 3 linked
    # norms their forward all-gather and backward all-reduce
    stack = [(out["stack", True][1], out["stack", False][1]) for out in results]
    assert all(u[1] - f[1] == 3 * 2 for f, u in stack)
    if shape[0] > 1 and shape[1] > 1:
        assert all(f[0] < u[0] for f, u in stack), stack


def _wrap_worker(rank, world, shape):
    """Q = 2: west and east are one rank; a marker input whose value is its global column shows
    where every column of a circularly padded, then fused, conv came from."""
    from credit_parallel.domain.sharding import shard_tensor

    m = TiledDomainManager(world, shape)
    conv = nn.Conv2d(1, 2, (1, 3), bias=False).double()
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[0, 0, 0, 0] = 1.0  # channel 0 reads the west column
        conv.weight[1, 0, 0, 2] = 1.0  # channel 1 reads the east column
    model = convert_to_domain_parallel(nn.Sequential(nn.CircularPad2d((1, 1, 0, 0)), conv), m)
    w = 7
    cols = torch.arange(w, dtype=torch.float64).expand(1, 1, 3, w)
    with record_exchange_stats() as stats:
        y = model(shard_tensor(cols, -2, m))
    c0 = [0, 4][m.domain_coords[1]] if shape[1] == 2 else 0
    local = range(c0, c0 + y.shape[-1])
    west = [float((c - 1) % w) for c in local]
    east = [float((c + 1) % w) for c in local]
    fused = model[1].options.fused_pad is not None
    return fused, y[0, 0, 0].tolist() == west, y[0, 1, 0].tolist() == east, stats.messages


@pytest.mark.parametrize("shape", [(1, 2), (2, 2), (2, 1)])
def test_fused_circular_pad_wraps_without_swapping_at_q2_and_locally_at_q1(shape):
    for fused, west, east, messages in run_on_ranks(_wrap_worker, shape[0] * shape[1], shape):
        assert fused and west and east
        assert messages == (1 if shape[1] == 2 else 0)  # one message: both halos, one peer


def _siblings_worker(rank, world, shape, hw):
    m = TiledDomainManager(world, shape)
    x = torch.randn(2, 2, *hw, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out = {}
    for name, build in (("cross", _cross), ("stack", lambda: _Stack().double())):
        for fuse in (True, False):
            with record_exchange_stats() as stats:
                errors = domain_parity_errors(build, x, m, convert=_convert(fuse))
            out[name, fuse] = (errors, stats.p2p_calls, stats.bytes_sent)
        model = convert_to_domain_parallel(build(), m)
        out[name, "shared"] = sum(
            getattr(mod.options, "shared_input", None) is not None
            for mod in model.modules()
            if hasattr(mod, "geometry")
        )
    return out


@pytest.mark.parametrize(
    "shape, hw", [((1, 2), (10, 14)), ((2, 2), (18, 22)), ((3, 2), (20, 14)), ((2, 3), (14, 20))]
)
def test_sibling_convs_share_one_tile_exchange_and_a_stack_stops_sharing(shape, hw):
    """CrossEmbed's three convs on one tile: ONE exchange of the union windows (rows, then
    columns of the row-extended tile), fewer calls and bytes; the same-shaped convs of a
    ModuleList applied one after the other are grouped too but stop sharing (still exact)."""
    for out in run_on_ranks(_siblings_worker, shape[0] * shape[1], shape, hw, timeout=300):
        for name in ("cross", "stack"):
            for fuse in (True, False):
                for key, (err, ref) in out[name, fuse][0].items():
                    assert err <= TOL and ref > 0, (shape, name, fuse, key, err, ref)
        assert out["cross", "shared"] == 3 and out["stack", "shared"] == 3
        (_, f_calls, f_bytes), (_, u_calls, u_bytes) = out["cross", True], out["cross", False]
        assert f_calls < u_calls and f_bytes < u_bytes, (f_calls, u_calls, f_bytes, u_bytes)


# --------------------------------------------------------------------------- plan's counts
_PLANNED = {"stack": _stack, "cross": _cross}


def _plan_step_worker(rank, world, shape, hw, name):
    from credit_parallel.domain.sharding import shard_tensor

    torch.set_default_dtype(torch.float64)
    m = TiledDomainManager(world, shape)
    model = convert_to_domain_parallel(_PLANNED[name](), m)
    x = shard_tensor(torch.randn(2, 2, *hw, generator=torch.Generator().manual_seed(0)), 2, m)
    model(x)  # learns the global sizes
    with record_exchange_stats() as stats, record_small_collectives() as small:
        model(x.clone()).square().sum().backward()  # an input without gradient (a step's)
    return stats.bytes_sent, stats.p2p_calls, stats.messages, dict(small)


@pytest.mark.parametrize(
    "shape, hw, name",
    [
        ((2, 2), (9, 11), "stack"),
        ((1, 3), (8, 13), "stack"),
        ((3, 2), (11, 9), "stack"),
        ((2, 2), (14, 18), "cross"),
        ((2, 3), (16, 14), "cross"),
    ],
)
def test_plan_counts_the_fused_tile_exchanges(shape, hw, name):
    """``make_plan`` at {lat: P, lon: Q}: per rank the halo bytes, the batched P2P calls and
    the messages of a real converted step (pads fused into their convs, siblings sharing one
    exchange, norms linked); the statistics collectives of the linked norms are gone."""
    from credit_parallel.planner import make_plan

    p, q = shape
    conf = {
        "trainer": {
            "parallelism": {"data": "none", "domain": {"lat": p, "lon": q}},
            "batch_size": 2,
        }
    }
    plan = make_plan(conf, p * q, model=_PLANNED[name](), input_shapes=[(2, *hw)])
    assert plan.violations == []
    measured = run_on_ranks(_plan_step_worker, p * q, shape, hw, name)
    assert plan.halo_bytes_per_rank == tuple(b for b, *_ in measured)
    assert plan.collectives["domain_p2p"] == max(c for _, c, _, _ in measured)
    for r, (_, calls, messages, small) in enumerate(measured):
        lat, lon = divmod(r, q)
        assert sum(sum(lay.messages(lat, lon)) for lay in plan.tile_layers) == messages, r
        assert sum(lay.rank_step_calls(r) for lay in plan.tile_layers) == calls, r
        assert sum(small.values()) == 0, small  # every norm linked: no statistics collective
    assert plan.collectives["domain_all_gather"] == 0
    linked = [lay for lay in plan.tile_layers if lay.stats_pass]
    assert {lay.stats_pass for lay in linked} == {"rows" if p > 1 else "cols"}
    if name == "stack":
        pads = [lay for lay in plan.tile_layers if lay.kind == "pad"]
        assert len(pads) == 3 and not any(lay.exchanges for lay in pads) and len(linked) == 3
    else:  # one of the three sibling convs exchanges for all
        convs = [lay for lay in plan.tile_layers if ".convs." in lay.path]
        assert [lay.exchanges for lay in convs] == [True, False, False], convs
