"""The plan counts what runs on latitude strips and CREDIT's boundary padding (issue 26 items 3
and 5): per rank, the halo bytes, the messages and the batched P2P calls ``make_plan`` predicts
equal those ``record_exchange_stats`` counts in a real converted step:

* on lat x lon tiles, the CrossFormer's attention (and the Swin blocks) run in a
  ``TileStripRelayout``: two all-to-alls AND the module's own 1-D row exchange over the P x Q
  strips (the rows of its windows in, the output rows back:
  ``DomainRowGroupAttention.returns_rows``);
* miles-credit's FuXi (without its ``TensorPadding``) runs whole on the strips on tiles: the
  two moves of the model's input and output, and every layer's 1-D exchange over the strips;
* at 1-D, that row-group attention's way back too;
* ``DomainPaddedModel`` (CREDIT's ``TensorPadding`` in miles-credit's CrossFormer): one row
  exchange per ``pad`` / ``unpad`` on latitude shards, a move to strips, the row exchange there
  and a move back on tiles (``PaddingCall``).
"""

from __future__ import annotations

import pytest
import torch

from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.models import CrossFormer, SwinNet
from credit_parallel.planner import make_plan
from credit_parallel.planner.tiles import tile_messages
from credit_parallel.testing import run_on_ranks
from test_fuxi import WIDTH as FUXI_WIDTH

H, W = 24, 16  # the bundled CrossFormer: level 0 12 x 8


def _bundled():
    torch.manual_seed(0)
    return CrossFormer(
        3, 2, H, W, dims=(8, 8), depths=(2, 2), dim_head=4, window_sizes=(2, 2)
    ).double()


def _swin():
    torch.manual_seed(0)
    return SwinNet(
        3, 2, 24, 8, dim=8, depth=2, dim_head=4, window_size=4, mlp_ratio=2, norm_groups=2
    ).double()


def _fuxi():
    from test_fuxi import fuxi

    torch.manual_seed(0)
    return fuxi(32, 2).double()


def _credit(mode):
    from test_domain2d_relayout import _credit_crossformer

    torch.manual_seed(0)
    padding = {"activate": True, "mode": mode, "pad_lat": [5, 11], "pad_lon": [8, 8]}
    return _credit_crossformer(32, padding)


# name -> (build, per-sample input shape)
MODELS = {
    "crossformer": (_bundled, (3, H, W)),
    "swin": (_swin, (3, 24, 8)),  # shifted windows across the tile corners, on strips
    "fuxi": (_fuxi, (2, 2, 32, FUXI_WIDTH)),  # miles-credit's FuXi: the whole model on strips
    "credit_earth": (lambda: _credit("earth"), (3, 1, 48, 32)),
    "credit_mirror": (lambda: _credit("mirror"), (3, 1, 48, 32)),
}


def _step_worker(rank, world, name, shape):
    from credit_parallel.domain import convert_to_domain_parallel
    from credit_parallel.domain.manager import DomainParallelManager, TiledDomainManager
    from credit_parallel.domain.sharding import shard_tensor

    torch.set_default_dtype(torch.float64)
    build, sample = MODELS[name]
    m = TiledDomainManager(world, shape) if shape[1] > 1 else DomainParallelManager(world, world)
    model = convert_to_domain_parallel(build(), m)
    x = torch.randn(2, *sample, generator=torch.Generator().manual_seed(0))
    x = shard_tensor(x, len(sample) - 1, m)
    model(x)  # learns the global sizes (an all-gather, not counted)
    with record_exchange_stats() as stats:
        model(x.clone()).square().sum().backward()  # an input without gradient (a step's)
    return stats.bytes_sent, stats.messages, stats.p2p_calls


@pytest.mark.parametrize(
    "name, shape",
    [
        ("crossformer", (2, 1)),
        ("crossformer", (2, 2)),
        ("crossformer", (1, 3)),
        ("swin", (2, 2)),
        ("fuxi", (2, 2)),
        ("credit_earth", (2, 1)),
        ("credit_earth", (2, 2)),  # the deepest level: 3 rows on 4 strips (one empty)
        ("credit_mirror", (1, 3)),
        ("credit_earth", (3, 1)),
    ],
)
def test_planned_halo_bytes_messages_and_calls_equal_a_real_step(name, shape):
    p, q = shape
    build, sample = MODELS[name]
    domain = {"lat": p, "lon": q} if q > 1 else p
    conf = {"trainer": {"parallelism": {"data": "none", "domain": domain}, "batch_size": 2}}
    plan = make_plan(conf, p * q, model=build(), input_shapes=[sample])
    assert plan.violations == []
    counted = run_on_ranks(_step_worker, p * q, name, shape)
    assert plan.halo_bytes_per_rank == tuple(b for b, _, _ in counted)
    assert plan.collectives["domain_p2p"] == max(c for _, _, c in counted)
    if q > 1:
        assert [tile_messages(plan.tile_layers, r) for r in range(p * q)] == [
            m for _, m, _ in counted
        ]
        # the attention's own exchange on the strips and the padding's are in the plan
        on_strips = [lay for lay in plan.tile_layers if any(lay.strip_rows_sent)]
        assert on_strips
        if name == "fuxi":  # one relayout around the whole model, no tile exchange inside
            assert [lay.path for lay in plan.tile_layers if lay.strips_sent] == ["<root>"]
            assert not any(lay.rows_sent for lay in plan.tile_layers)
        if name.startswith("credit"):
            kinds = {lay.kind for lay in plan.tile_layers if lay.strips_sent}
            assert {"tensor_padding", "tensor_unpadding"} <= kinds
    else:
        kinds = {lay.kind for lay in plan.layers if lay.exchanges}
        if name.startswith("credit"):
            assert {"tensor_padding", "tensor_unpadding"} <= kinds
        assert any(lay.returns and lay.exchanges for lay in plan.layers)


def test_the_split_projection_costs_the_moves_and_the_exchange_on_the_strips():
    """``project_tiles`` of a call run on strips (the demo CrossFormer's attention at 2 x 2):
    with links of only latency (alpha 1 s) its halo time is the busiest rank's message count
    per direction pass: two all-to-alls plus the way in and the way back on the strips, forward
    and backward; with only bandwidth (beta 1 s per byte) the larger of what a rank sends and
    receives in each of them."""
    import copy

    from credit_parallel.layout.config import load_config
    from credit_parallel.planner.projection import Cluster, ComputeProfile, Link, project_tiles

    conf = copy.deepcopy(load_config("src/credit_parallel/configs/demo_crossformer.yaml"))
    conf.pop("data", None)
    conf["trainer"]["parallelism"] = {"data": "none", "domain": {"lat": 2, "lon": 2}}
    plan = make_plan(conf, 4)
    lay = next(x for x in plan.tile_layers if x.strips_sent and any(x.strip_rows_sent))
    assert lay.strip_returns

    def halo(alpha, beta):
        cluster = Cluster(8, Link("a", alpha, beta), Link("b", alpha, beta))
        proj = project_tiles([lay], ComputeProfile({}), shape=(2, 2), dp=1, cluster=cluster)
        return proj.halo_s

    def busiest(per_rank):
        return max(per_rank(r) for r in range(4))

    def moves(r):
        in_s, in_r, out_s, out_r = lay.strips_moves[r]
        rows = max(lay.strip_rows_sent[r], lay.strip_rows_received[r]) * lay.strip_row_elements
        return in_s, in_r, out_s, out_r, rows

    def messages(r):
        in_s, in_r, out_s, out_r, rows = moves(r)
        return 2 * (bool(in_s or in_r) + bool(out_s or out_r)) + 4 * bool(rows)

    def elements(r):
        in_s, in_r, out_s, out_r, rows = moves(r)
        return 2 * (max(in_s, in_r) + max(out_s, out_r)) + 4 * rows

    item = plan.memory.activation_dtype_bytes
    assert halo(1.0, 0.0) == busiest(messages) == 8
    assert halo(0.0, 1.0) == busiest(elements) * item > 0
