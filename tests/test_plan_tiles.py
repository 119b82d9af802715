"""The planner's lat x lon tiles (SPEC §3b, planner/tiles.py) against real exchanges: per rank,
the bytes sent forward and backward, the messages and the batched calls the tile exchange of
each layer family makes, counted by ``record_exchange_stats``, equal the plan's arithmetic;
and ``make_plan`` on a 2-D layout reports tiles, per-rank halo bytes and tile memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.layers.conv import (
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelPeriodicConv2d,
)
from credit_parallel.domain.layers.padding import DomainParallelPad
from credit_parallel.domain.layers.pixel_shuffle import (
    DomainParallelPixelShuffle,
    DomainParallelPixelUnshuffle,
)
from credit_parallel.domain.layers.resample import DomainParallelInterpolate
from credit_parallel.domain.manager import TiledDomainManager
from credit_parallel.models import PeriodicConv2d
from credit_parallel.planner.tiles import tile_halo_bytes, tile_layer_plan, tile_p2p_calls
from credit_parallel.testing import run_on_ranks


def _f64(module):
    return module.double()


# name -> (build the domain layer for a manager, per-sample input shape (C, [T,] H, W))
LAYERS = {
    "conv_k5_zeros": (
        lambda m: DomainParallelConv2d(_f64(nn.Conv2d(2, 3, 5, padding=2)), manager=m),
        (2, 9, 11),
    ),
    "conv_k3_circular_s2": (
        lambda m: DomainParallelConv2d(
            _f64(nn.Conv2d(2, 2, 3, stride=2, padding=1, padding_mode="circular")), manager=m
        ),
        (2, 11, 10),
    ),
    "conv_reflect": (
        lambda m: DomainParallelConv2d(
            _f64(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")), manager=m
        ),
        (2, 10, 9),
    ),
    "periodic_k5": (
        lambda m: DomainParallelPeriodicConv2d(_f64(PeriodicConv2d(2, 2, 5, padding=2)), manager=m),
        (2, 11, 12),
    ),
    "conv3d": (
        lambda m: DomainParallelConv3d(
            _f64(nn.Conv3d(2, 2, 3, padding=1, padding_mode="circular")), manager=m
        ),
        (2, 3, 9, 10),
    ),
    "transpose_k3_s2": (
        lambda m: DomainParallelConvTranspose2d(
            _f64(nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, output_padding=1)), manager=m
        ),
        (2, 5, 7),
    ),
    "pad_reflect": (
        lambda m: DomainParallelPad(nn.ReflectionPad2d((2, 1, 1, 2)), manager=m),
        (2, 9, 10),
    ),
    "pad_circular": (
        lambda m: DomainParallelPad(nn.CircularPad2d((1, 2, 0, 0)), manager=m),
        (2, 8, 9),
    ),
    "pixel_shuffle": (
        lambda m: DomainParallelPixelShuffle(nn.PixelShuffle(2), manager=m),
        (8, 5, 7),
    ),
    "pixel_unshuffle": (
        lambda m: DomainParallelPixelUnshuffle(nn.PixelUnshuffle(2), manager=m),
        (2, 10, 12),
    ),
    "interp_bilinear_up": (
        lambda m: DomainParallelInterpolate(scale_factor=2, mode="bilinear", manager=m),
        (2, 7, 9),
    ),
    "interp_nearest_down": (
        lambda m: DomainParallelInterpolate(size=(5, 4), mode="nearest", manager=m),
        (2, 11, 10),
    ),
}
SHAPES = [(2, 2), (3, 2), (1, 3), (2, 3), (4, 2), (2, 1)]


def _counted_worker(rank, world, shape, names):
    from credit_parallel.domain.sharding import shard_tensor

    m = TiledDomainManager(world, shape)
    out = {}
    for name in names:
        build, sample = LAYERS[name]
        layer = build(m)
        torch.manual_seed(3)
        x = shard_tensor(torch.randn(2, *sample, dtype=torch.float64), len(sample) - 1, m)
        layer(x)  # learns the global sizes (an all-gather, not counted below)
        x.requires_grad_(True)
        with record_exchange_stats() as stats:
            y = layer(x)
            fwd_messages, fwd_calls = stats.messages, stats.p2p_calls
            y.backward(torch.ones_like(y))
        out[name] = (
            stats.by_direction["forward"],
            stats.by_direction["backward"],
            fwd_messages,
            stats.messages - fwd_messages,
            stats.p2p_calls,
            fwd_calls,
        )
    return out


def _planned(name, shape):
    build, sample = LAYERS[name]
    layer = build(None)
    x = torch.zeros(1, *sample, dtype=torch.float64)
    y = layer.wrapped(x) if hasattr(layer, "wrapped") else None
    if y is None:  # interpolation: its output size
        from credit_parallel.domain.layers.interp_rows import interp_output_size

        (oh, ow), _ = interp_output_size(
            sample[-2:], layer.size, layer.scale_factor, layer.recompute_scale_factor
        )
        out_shape = (1, sample[0], oh, ow)
    else:
        out_shape = tuple(y.shape)
    return tile_layer_plan(name, layer, (1, *sample), out_shape, shape, double=True)


@pytest.mark.parametrize("shape", SHAPES)
def test_tile_plan_equals_the_counted_exchange(shape):
    """Per rank and per layer family: forward bytes, backward bytes, messages each way and
    batched calls, as counted on the real exchange (batch 2, float64)."""
    results = run_on_ranks(_counted_worker, shape[0] * shape[1], shape, list(LAYERS))
    for name in LAYERS:
        plan = _planned(name, shape)
        assert plan.error is None, (name, plan.error)
        for rank, counted in enumerate(results):
            lat, lon = divmod(rank, shape[1])
            fwd, bwd = plan.pass_elements(lat, lon)
            expected = (
                sum(fwd) * 2 * 8,
                sum(bwd) * 2 * 8,
                *plan.messages(lat, lon),
                tile_p2p_calls([plan], rank),
                plan.rank_calls(rank),
            )
            assert counted[name] == expected, (name, shape, (lat, lon), counted[name], expected)
            assert tile_halo_bytes([plan], batch_size=2, dtype_bytes=8, domain_rank=rank) == (
                expected[0] + expected[1]
            )
    # a 5x5 conv reads other tiles at every shape of more than one rank
    assert tile_halo_bytes([_planned("conv_k5_zeros", shape)], batch_size=1, dtype_bytes=8) > 0


def test_tile_plan_messages_and_the_minimum_on_a_periodic_conv():
    """A 3x3 periodic conv on 3 x 2 tiles of 12 x 16: an interior latitude rank sends one
    message north, one south and one west-east (the same rank at Q = 2) per pass; the total
    bytes are the distinct elements of other tiles every tile reads (corners included)."""
    layer = DomainParallelPeriodicConv2d(PeriodicConv2d(2, 2, 3, padding=1).double())
    plan = tile_layer_plan("c", layer, (1, 2, 12, 16), (1, 2, 12, 16), (3, 2))
    assert plan.messages(1, 0) == (3, 3)
    assert plan.messages(0, 1) == (2, 2)  # reflect at the pole: own rows, one row peer
    # each tile reads (own rows + 2) x (own cols + 2) minus its own, except at the poles where
    # the reflected rows are its own: 4 rows x 8 cols tiles
    interior = (6 * 10 - 4 * 8) * 2
    polar = (5 * 10 - 4 * 8) * 2
    assert sum(plan.sent_elements(a, b) for a in range(3) for b in range(2)) == 2 * (
        2 * interior + 4 * polar
    )


# --------------------------------------------------------------------------- make_plan
def _demo_conf(lat: int, lon: int):
    from credit_parallel.layout.config import load_config

    conf = copy.deepcopy(load_config("src/credit_parallel/configs/demo_unet.yaml"))
    conf.pop("data", None)
    domain = {"lat": lat, "lon": lon} if lon > 1 else lat
    conf["trainer"]["parallelism"] = {"data": "fsdp2", "domain": domain}
    return conf


def _tile_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Conv2d(3, 3, 3, stride=2, padding=1),  # 19 x 14 -> 10 x 7
        PeriodicConv2d(3, 4, 3, padding=1),
        nn.Upsample(size=(19, 14), mode="bilinear"),
        nn.ConvTranspose2d(4, 2, 3, stride=1, padding=1),
        nn.GroupNorm(1, 2),
        nn.ZeroPad2d((1, 1, 2, 0)),  # a pad then a conv: fused (one exchange)
        nn.Conv2d(2, 2, 3),
    ).double()


def _model_step_worker(rank, world, shape):
    from credit_parallel.domain import convert_to_domain_parallel
    from credit_parallel.domain.sharding import shard_tensor

    torch.set_default_dtype(torch.float64)
    m = TiledDomainManager(world, shape)
    model = convert_to_domain_parallel(_tile_model(), m)
    x = shard_tensor(torch.randn(2, 2, 19, 14, generator=torch.Generator().manual_seed(0)), 2, m)
    model(x)  # learns the global sizes
    with record_exchange_stats() as stats:
        model(x.clone()).square().sum().backward()  # an input without gradient (a step's)
    return stats.bytes_sent, stats.p2p_calls


@pytest.mark.parametrize("shape", [(2, 2), (1, 3), (3, 2)])
def test_make_plan_on_tiles_equals_a_real_step(shape):
    """``make_plan`` at {lat: P, lon: Q}: the halo bytes per rank and the batched P2P calls of
    the busiest rank equal those of a real converted step; the tiles per grid size are the
    balanced rows x columns; FSDP2 shards over dp x P x Q."""
    from credit_parallel.planner import make_plan

    p, q = shape
    conf = {
        "trainer": {
            "parallelism": {"data": "fsdp2", "domain": {"lat": p, "lon": q}},
            "batch_size": 2,
        }
    }
    plan = make_plan(conf, 2 * p * q, model=_tile_model(), input_shapes=[(2, 19, 14)])
    assert plan.violations == []
    assert plan.domain_shape == shape
    measured = run_on_ranks(_model_step_worker, p * q, shape)
    assert plan.halo_bytes_per_rank == tuple(b for b, _ in measured)
    assert all(b > 0 for b, _ in measured)
    assert plan.halo_bytes_per_step == sum(b for b, _ in measured)
    assert plan.collectives["domain_p2p"] == max(c for _, c in measured)
    from credit_parallel.domain.rows import shard_sizes

    grids = {(h, w): (rows, cols) for h, w, rows, cols in plan.tile_levels}
    assert grids[(19, 14)] == (shard_sizes(19, p), shard_sizes(14, q))
    assert grids[(10, 7)] == (shard_sizes(10, p), shard_sizes(7, q))
    params = sum(t.numel() for t in _tile_model().parameters())
    assert plan.memory.param_bytes < params * 4  # sharded over 2 x P x Q, dim 0


def test_tile_memory_scales_with_the_tile():
    """The activations of the demo U-Net at {lat: 2, lon: 2} are about half of those at
    domain 2 (latitude only) and about those of domain 4; the report lists the tiles."""
    from credit_parallel.planner import format_plan, make_plan

    one_d = make_plan(_demo_conf(2, 1), 2)
    two_d = make_plan(_demo_conf(2, 2), 4)
    four = make_plan(_demo_conf(4, 1), 4)
    ratio = two_d.memory.activation_bytes / one_d.memory.activation_bytes
    assert 0.45 < ratio < 0.56, ratio
    assert 0.9 < two_d.memory.activation_bytes / four.memory.activation_bytes < 1.1
    assert two_d.memory.batch_bytes < 0.56 * one_d.memory.batch_bytes
    text = format_plan(two_d)
    assert "grid 0: 33 x 64  rows [17, 16] x cols [32, 32]  largest tile 17 x 32" in text
    assert "== Tile exchanges" in text and "r3 (1, 1):" in text
    assert len(two_d.halo_bytes_per_rank) == 4


# --------------------------------------------------------------------------- when 2-D pays
def test_domain_splits_and_the_tile_projection_of_one_conv():
    """Every P x Q of D; one 3x3 periodic conv on 2 x 2 tiles of 8 x 12, projected with a
    pure-latency link (each pass one alpha, forward and backward) and a pure-bandwidth link
    (the busiest rank's larger of sent / received per pass)."""
    from credit_parallel.planner.projection import Cluster, ComputeProfile, Link, project_tiles
    from credit_parallel.planner.split import domain_splits

    assert domain_splits(8) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert domain_splits(7) == [(7, 1), (1, 7)]
    layer = DomainParallelPeriodicConv2d(PeriodicConv2d(2, 2, 3, padding=1).double())
    plan = tile_layer_plan("c", layer, (1, 2, 8, 12), (1, 2, 8, 12), (2, 2))
    profile = ComputeProfile({"c": 4.0})
    latency = Cluster(8, Link("a", 1.0, 0.0), Link("a", 1.0, 0.0))
    p = project_tiles([plan], profile, shape=(2, 2), dp=1, cluster=latency)
    assert p.halo_s == 4.0  # 2 passes x (forward + backward)
    assert p.compute_s == 1.0  # a quarter of the grid on the busiest tile
    bandwidth = Cluster(8, Link("b", 0.0, 1.0), Link("b", 0.0, 1.0))
    p = project_tiles([plan], profile, shape=(2, 2), dp=1, cluster=bandwidth, dtype_bytes=8)
    # each tile 4 x 6: 1 row of 6 columns north or south (the pole reflects its own rows),
    # then 2 columns (west + east, one rank at Q = 2) of the 5 rows of the row-extended tile
    assert p.halo_s == 2 * (1 * 6 + 2 * 5) * 2 * 8


def test_tile_projection_at_q1_equals_the_latitude_projection():
    """Q = 1 is the latitude split: the tile projection of a model without exchange fusion
    gives the 1-D projection's halo and compute."""
    from credit_parallel.planner import make_plan
    from credit_parallel.planner.projection import (
        DEFAULT_CLUSTER,
        ComputeProfile,
        project_step,
        project_tiles,
    )

    def model():
        return nn.Sequential(*list(_tile_model())[:6])  # no pad + conv (fused at 1-D)

    conf = {"trainer": {"parallelism": {"data": "none", "domain": 3}, "batch_size": 2}}
    plan = make_plan(conf, 3, model=model(), input_shapes=[(2, 19, 14)])
    layers = plan.layers
    from credit_parallel.planner.tiles import tile_layer_plans
    from credit_parallel.planner.trace import conversion_plan, plan_targets, trace_model

    meta = model().to("meta")
    targets = plan_targets(conversion_plan(meta))
    tiles = tile_layer_plans(trace_model(meta, [(2, 19, 14)], targets), (3, 1), True)
    profile = ComputeProfile({lay.path: 1.0 for lay in layers})
    one = project_step(layers, profile, domain=3, dp=1, cluster=DEFAULT_CLUSTER, batch_size=2)
    two = project_tiles(tiles, profile, shape=(3, 1), dp=1, cluster=DEFAULT_CLUSTER, batch_size=2)
    assert one.halo_s == pytest.approx(two.halo_s, rel=1e-12) and one.halo_s > 0
    assert one.compute_s == pytest.approx(two.compute_s, rel=1e-12)
    assert [lay.rows_sent for lay in layers[:5]] == [t.rows_sent for t in tiles[:5]]
    assert tiles[5].kind == "group_norm" and not tiles[5].exchanges


def _grid_conf(height: int, width: int, domain):
    return {
        "model": {
            "type": "unet", "in_channels": 2, "out_channels": 2, "image_height": height,
            "image_width": width, "base_channels": 8, "channel_mults": [1, 2], "norm_groups": 4,
        },
        "trainer": {"parallelism": {"data": "none", "domain": domain}, "batch_size": 1},
    }  # fmt: skip


@pytest.mark.parametrize("hw, expect_2d", [((24, 512), True), ((512, 24), False)])
def test_plan_suggests_the_split_with_the_least_projected_step(hw, expect_2d):
    """``plan --world-size 8`` on a latitude split of 8: a wide flat grid is best split in
    longitude (its rows would be 3 per rank, its halo rows 512 wide), a tall narrow one in
    latitude; the note names the split with the least projected step and the configured one."""
    from credit_parallel.planner import make_plan

    plan = make_plan(_grid_conf(*hw, 8), 8)
    assert [s.shape for s in plan.splits] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    best = min(plan.splits, key=lambda s: s.step_s)
    assert (best.shape[1] > 1) == expect_2d
    assert all(s.refused is None and s.step_s > 0 for s in plan.splits)
    (note,) = [n for n in plan.notes if n.startswith("split of the 8 domain ranks")]
    assert f"lat x lon = {best.shape[0]} x {best.shape[1]}" in note
    if best.shape != (8, 1):
        configured = next(s for s in plan.splits if s.shape == (8, 1))
        assert f"{configured.step_s / best.step_s:.2f}x the best" in note
        assert best.halo_bytes < configured.halo_bytes
    else:
        assert "(the configured split)" in note


def test_attention_runs_on_strips_in_every_split():
    """The CrossFormer's window attention runs on latitude strips on tiles
    (``domain/tiles_relayout.py``): every split of 4 runs, and each attention call counts the
    two all-to-alls (forward and backward) on every rank instead of being refused, and its own
    row exchange on the strips (the rows in and back: two calls each way)."""
    from credit_parallel.layout.config import load_config
    from credit_parallel.planner import make_plan

    cross = copy.deepcopy(load_config("src/credit_parallel/configs/demo_crossformer.yaml"))
    cross.pop("data", None)
    cross["trainer"]["parallelism"] = {"data": "none", "domain": {"lat": 2, "lon": 2}}
    plan = make_plan(cross, 4)
    assert [s.refused is None for s in plan.splits] == [True, True, True]
    assert not [v for v in plan.violations if "tiles" in v], plan.violations
    attention = [lay for lay in plan.tile_layers if lay.strips_sent]
    assert attention and all(lay.error is None for lay in plan.tile_layers)
    for lay in attention:
        assert all(lay.sent_elements(*divmod(r, 2)) > 0 for r in range(4)), lay
        assert lay.rank_calls(0) == 2 + lay.strip_calls(0)
        assert lay.strip_returns and lay.strip_calls(0) in (0, 2)
    assert any(lay.strip_calls(0) == 2 for lay in attention)


def test_projection_benchmark_prints_1d_against_every_split(capsys):
    """benchmarks/projection.py --splits: the 0.25-degree U-Net at 4 domain ranks, every
    split, the best marked, its ratio to 1-D."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "projection_benchmark"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "projection.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    rows = sys.modules[name].main(["--splits", "4", "--models", "unet"])
    assert [r["split"].shape for r in rows] == [(4, 1), (2, 2), (1, 4)]
    out = capsys.readouterr().out
    best = min(rows, key=lambda r: r["split"].step_s)["split"]
    assert f"{best.shape[0]:>2}x{best.shape[1]:<3}" in out and " *" in out
    # the 721 x 1440 grid: a longitude split moves fewer bytes than the latitude split
    assert rows[2]["split"].halo_bytes < rows[0]["split"].halo_bytes


def test_tile_floor_benchmark_times_both_splits_on_a_tiny_stack():
    """benchmarks/tile_floor.py: the floor (each rank's own tile, no communication) and ours
    (converted on a TiledDomainManager) run for (1,2) and (2,1); the timings themselves are
    taken on a quiet machine only (docs/performance.md)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "tile_floor_benchmark"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "tile_floor.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    bench = sys.modules[name]
    from efficiency import Workload

    w = Workload("tiny", "conv_stack", 8, 9, 14)
    times = bench.time_splits(w, [(1, 2), (2, 1)], rounds=1, steps=1, warmup=0)
    assert set(times) == {(1, 2), (2, 1)}
    assert all(t["floor"] > 0 and t["ours"] > 0 for t in times.values())


def test_plan_command_names_the_best_split(capsys):
    """``credit-parallel plan --world-size 8`` on the demo (domain 2): its notes name the split
    of the 2 domain ranks with the least projected step, against the configured 2 x 1."""
    from credit_parallel import cli

    assert cli.main(["plan", "--config", "demo", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "split of the 2 domain ranks" in x]
    assert "lat x lon = " in line and "ms (compute" in line
    assert "the configured 2 x 1" in line or "(the configured split)" in line


def test_a_layer_not_runnable_on_its_strips_keeps_the_reason_in_the_plan(monkeypatch):
    """A layer run on latitude strips whose 1-D windows cannot be made on them (the 1-D
    geometry's ValueError) carries that error in its tile plan instead of dropping the
    exchange silently."""
    from credit_parallel.layout.config import load_config
    from credit_parallel.planner import make_plan
    from credit_parallel.planner import tiles as planner_tiles

    def refused(layer, height, n, double=False):
        raise ValueError(f"{height} rows on {n} strips: too few")

    monkeypatch.setattr(planner_tiles, "input_windows_of", refused)
    cross = copy.deepcopy(load_config("src/credit_parallel/configs/demo_crossformer.yaml"))
    cross.pop("data", None)
    cross["trainer"]["parallelism"] = {"data": "none", "domain": {"lat": 2, "lon": 2}}
    plan = make_plan(cross, 4)
    stripped = [lay for lay in plan.tile_layers if lay.strips_sent]
    assert stripped
    for lay in stripped:
        assert lay.error is not None and "on 4 latitude strips" in lay.error, lay
        assert "strips: too few" in lay.error and not lay.strip_rows_sent, lay
