"""Communication-avoiding halos (``domain/layers/halo_chain.py``): a run of stencil layers in an
``nn.Sequential`` exchanges once per chain.  Forward, input and every parameter gradient equal
the single process in float64 (1e-10) at 2, 3 and 4 ranks, uneven rows, both poles (zeros,
reflect, replicate, circular, the periodic conv, pads, strides, GroupNorm statistics from owned
rows inside a chain, a rank without rows falling back to the unchained layers), and the step
makes exactly the exchanges the chains predict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel, plan_conversion
from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.layers.halo_chain import (
    ChainCosts,
    chain_geometry,
    chain_heights,
    chain_pieces,
)
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import plan_exchange, shard_range
from credit_parallel.layout.small_collectives import record_small_collectives
from credit_parallel.models.periodic import PeriodicConv2d
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks


def _cases():
    return [
        # (name, build, in channels, height, halo_chains mode)
        ("convs_k5_stride", lambda: nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.SiLU(), nn.Conv2d(6, 6, 5, padding=2), nn.ReLU(),
            nn.Conv2d(6, 4, 3, stride=2, padding=1), nn.Conv2d(4, 4, 3, padding=1),
        ), 3, 13, 4),
        ("periodic", lambda: nn.Sequential(
            PeriodicConv2d(2, 4, 3, padding=1), nn.GELU(), PeriodicConv2d(4, 4, 3, padding=1),
            PeriodicConv2d(4, 2, 3, padding=1),
        ), 2, 11, 3),
        ("pads_and_modes", lambda: nn.Sequential(
            nn.ReflectionPad2d((1, 1, 1, 1)), nn.Conv2d(2, 4, 3), nn.ZeroPad2d((0, 0, 2, 1)),
            nn.Conv2d(4, 4, 3, padding=(0, 1), padding_mode="replicate"),
            nn.Conv2d(4, 2, 3, padding=1, padding_mode="circular"),
        ), 2, 12, 5),
        ("norms_inside", lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
            nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4, affine=False), nn.Tanh(),
            nn.Conv2d(4, 2, 3, padding=1),
        ), 2, 9, 3),
        # 3 rows over 4 ranks: a rank without rows, the chain does not apply (unchained, exact)
        ("rank_without_rows", lambda: nn.Sequential(
            nn.Conv2d(2, 2, 3, padding=1), nn.SiLU(), nn.Conv2d(2, 2, 3, padding=1),
        ), 2, 3, 2),
    ]  # fmt: skip


def _worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = {}
    for i, (name, build, c, h, mode) in enumerate(_cases()):
        x = torch.randn(2, c, h, 8, generator=torch.Generator().manual_seed(i))
        # unchained: every stencil exchanges alone (no pad + conv fusion either)
        for label, chains in (("chained", mode), ("unchained", None)):
            with record_exchange_stats() as stats:
                errors = domain_parity_errors(
                    build,
                    x,
                    mgr,
                    convert=lambda m, g, k=chains: convert_to_domain_parallel(
                        m, g, halo_chains=k or False, fuse_exchanges=k is not None
                    ),
                )
            assert_parity(errors)
            out[(name, label)] = stats.p2p_calls
    return out


def _calls(run, h: int, n: int, c: int, rank: int, chained: bool) -> int:
    """Batched P2P calls of ``rank`` in one forward + backward: one per exchange it moves rows
    in, each way (a chain: its one exchange; else each stencil's own)."""
    heights = chain_heights(run.layers, h)
    cut = run.pieces(h, n, (2, c, h, 8), 8, "cpu") if chained else ((0, len(run.layers), None),)
    calls = 0
    for a, b, geo in cut:
        if geo is not None:
            plans = [geo.plans[rank]]
        else:
            plans = [
                plan_exchange(heights[j], n, layer.input_windows(heights[j], n))[rank]
                for j, (role, layer) in enumerate(run.layers[a:b], start=a)
                if role == "stencil"
            ]
        calls += 2 * sum(1 for p in plans if p.sends or p.recvs)
    return calls


@pytest.mark.parametrize("world", [2, 3, 4])
def test_halo_chains_are_exact_and_exchange_once_per_chain(world):
    results = run_on_ranks(_worker, world)
    for name, build, c, h, mode in _cases():
        (fusion,) = plan_conversion(build(), None, halo_chains=mode).halo_chains
        run = fusion.run
        chains = sum(1 for *_, geo in run.pieces(h, world, (2, c, h, 8), 8, "cpu") if geo)
        assert chains == (0 if name == "rank_without_rows" and world == 4 else 1), name
        for rank, per_rank in enumerate(results):
            # the worker's parity helper runs one forward + backward of each form
            assert per_rank[(name, "chained")] == _calls(run, h, world, c, rank, True), name
            assert per_rank[(name, "unchained")] == _calls(run, h, world, c, rank, False), name


def test_chain_geometry_holds_what_the_owned_outputs_read():
    """Pure: the rows each rank receives for a chain of two 3x3 convs are its own rows and 2
    more on each interior side; at the poles nothing beyond the globe."""
    build = lambda: nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.Conv2d(1, 1, 3, padding=1))  # noqa: E731
    (fusion,) = plan_conversion(build(), None, halo_chains=2).halo_chains
    geo = chain_geometry(fusion.run.layers, 10, 3)
    assert [(w[0], w[-1] + 1) for w in geo.windows] == [(0, 6), (2, 9), (5, 10)]
    for r in range(3):
        assert geo.steps[r][-1].rows_out == shard_range(10, 3, r)
    # 3 ranks x 1 row each of a 2-row grid: rank 2 owns nothing, the chain does not apply
    assert chain_geometry(fusion.run.layers, 2, 3) is None


def test_auto_chains_where_latency_outweighs_the_redundant_rows():
    build = lambda: nn.Sequential(  # noqa: E731
        nn.Conv2d(8, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1),
        nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1),
    )  # fmt: skip
    plan = plan_conversion(build(), None, halo_chains="auto")
    # the norm links to the last conv (it rides that exchange); the first two convs chain
    assert [f.paths for f in plan.halo_chains] == [("0", "1", "2")]
    assert [(f.norm_path, f.conv_path) for f in plan.norm_conv] == [("3", "5")]
    run = plan.halo_chains[0].run
    cheap = ChainCosts(1e-3, 1e-12, 1e15)  # latency dominates: chain
    dear = ChainCosts(1e-9, 1e-12, 1e3)  # compute dominates: no chain
    args = (run.layers, "auto", 64, 2, 1, 8, 32, 4)
    assert [geo is not None for *_, geo in chain_pieces(*args, cheap)] == [True]
    assert [geo is not None for *_, geo in chain_pieces(*args, dear)] == [False, False]
    assert "halo chain (cut by the cost model): 0, 1, 2" in str(plan)


def _planned_model():
    return nn.Sequential(
        nn.Conv2d(4, 4, 3, padding=1), nn.SiLU(), nn.Conv2d(4, 4, 3, padding=1),
        nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 4, 3, padding=1),
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
    )  # fmt: skip


def _conf(world: int, chains) -> dict:
    parallelism = {"data": "none", "tensor": 1, "domain": world}
    trainer = {"parallelism": parallelism, "batch_size": 1, "domain_halo_chains": chains}
    return {"trainer": trainer, "model": {"type": "custom"}}


def _counted_step_worker(rank, world, modes):
    from credit_parallel.parallel.composition import get_domain_manager, parallelize
    from credit_parallel.tools.bench.measure import _collective_counter

    out = {}
    for chains in modes:
        torch.manual_seed(0)
        model = parallelize(_planned_model(), _conf(world, chains))
        manager = get_domain_manager(model)
        a, b = shard_range(12, world, rank)
        x = torch.randn(1, 4, 12, 8, generator=torch.Generator().manual_seed(1))[:, :, a:b]
        x = x.contiguous()  # a training step's input: no gradient
        for _ in range(2):  # the second call is counted (heights cached)
            manager.begin_forward(("chains", chains))
            counter = _collective_counter()
            with counter, record_exchange_stats() as ex, record_small_collectives() as small:
                model(x).square().sum().backward()
        counts = dict(counter.counts + small)
        out[chains] = (ex.p2p_calls, counts.get("all_gather", 0), counts.get("all_reduce", 0))
    return out


def test_plan_counts_the_exchanges_of_a_real_step_with_chains():
    """``plan``'s collectives for a model with halo chains (a fixed length, the cost model on
    this machine's device type, and off) are the ones a real forward + backward issues."""
    from credit_parallel.planner.make import make_plan

    modes = (2, "auto", False)
    world = 2
    counted = run_on_ranks(_counted_step_worker, world, modes)
    for chains in modes:
        plan = make_plan(
            _conf(world, chains), world, model=_planned_model(), input_shapes=[(4, 12, 8)],
            device="cpu",
        )  # fmt: skip
        c = plan.collectives
        busiest = max(per_rank[chains] for per_rank in counted)
        assert busiest == (
            c["domain_p2p"],
            c["domain_all_gather"],
            c["domain_all_reduce_norm"],
        ), chains
        if chains == 2:  # [0..2] one chain, the norm in [3..5] alone-ish, [5..8] chained
            assert c["domain_p2p"] < make_plan(
                _conf(world, False), world, model=_planned_model(), input_shapes=[(4, 12, 8)],
                device="cpu",
            ).collectives["domain_p2p"]  # fmt: skip
            assert any("halo chains of <root>" in note for note in plan.notes), plan.notes


def test_trainer_key_reads_off_auto_and_a_length():
    from credit_parallel.layout.run_config import TrainerConfig

    def read(value):
        return TrainerConfig.from_conf(
            {"trainer": {"domain_halo_chains": value}}
        ).domain_halo_chains

    assert read(False) is False and read(True) == "auto" and read("auto") == "auto"
    assert read(3) == 3
    for bad in (1, "yes", 2.0):
        with pytest.raises(ValueError, match="domain_halo_chains"):
            read(bad)
