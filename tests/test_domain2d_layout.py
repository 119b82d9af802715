"""Two-dimensional (lat x lon) domains: the config, the rank layout, the meshes and the manager
(SPEC §3b).  Pure index math exhaustively, meshes under the fake process group, the manager's
groups on real gloo ranks."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist
from torch import nn

from credit_parallel.domain.manager import DomainParallelManager, TiledDomainManager
from credit_parallel.layout.config import (
    ParallelDims,
    domain_degrees,
    parse_domain_option,
    parse_parallelism_block,
    parse_parallelism_conf,
)
from credit_parallel.layout.mesh import build_device_mesh, data_parallel_coords, dp_world_size
from credit_parallel.testing import fake_process_group, run_on_ranks


# --------------------------------------------------------------------------- the config
def test_domain_mapping_parses_to_int_when_lon_is_one_else_a_mapping():
    assert parse_parallelism_block({"domain": {"lat": 2, "lon": 3}})["domain"] == {
        "lat": 2,
        "lon": 3,
    }
    assert parse_parallelism_block({"domain": {"lat": "4", "lon": "1"}})["domain"] == 4
    assert parse_parallelism_block({"domain": {"lon": 2, "lat": 1}})["domain"] == {
        "lat": 1,
        "lon": 2,
    }
    conf = {"trainer": {"parallelism": {"data": "ddp", "domain": {"lat": 3, "lon": 2}}}}
    assert parse_parallelism_conf(conf) == {
        "data": "ddp",
        "tensor": 1,
        "domain": {"lat": 3, "lon": 2},
    }
    assert domain_degrees(4) == (4, 1) and domain_degrees({"lat": 3, "lon": 2}) == (3, 2)


@pytest.mark.parametrize(
    "domain, key, words",
    [
        ({"lat": 2}, "lon", "missing"),
        ({"lon": 2}, "lat", "missing"),
        ({"lat": 2, "lon": 2, "x": 1}, "x", "not a key"),
        ({"lat": True, "lon": 2}, "lat", "bool"),
        ({"lat": 2, "lon": False}, "lon", "bool"),
        ({"lat": 2.0, "lon": 2}, "lat", "float"),
        ({"lat": 2, "lon": 1.5}, "lon", "float"),
        ({"lat": 0, "lon": 2}, "lat", ">= 1"),
        ({"lat": 2, "lon": -1}, "lon", ">= 1"),
        ({"lat": "2a", "lon": 2}, "lat", "string of decimal digits"),
    ],
)
def test_bad_domain_mappings_name_the_key(domain, key, words):
    with pytest.raises(ValueError) as err:
        parse_parallelism_block({"domain": domain})
    assert f"trainer.parallelism.domain.{key}" in str(err.value)
    assert words in str(err.value)


def test_domain_option_of_the_command_line():
    assert parse_domain_option("4") == "4"
    assert parse_domain_option("2x3") == {"lat": "2", "lon": "3"}
    assert parse_domain_option("lat=2,lon=3") == {"lat": "2", "lon": "3"}
    block = parse_parallelism_block({"domain": parse_domain_option("2x3")})
    assert block["domain"] == {"lat": 2, "lon": 3}


# --------------------------------------------------------------------------- ParallelDims
@pytest.mark.parametrize(
    "tp, lat, lon, dp", list(itertools.product((1, 2), (1, 2, 3), (1, 2, 3), (1, 2)))
)
def test_rank_layout_is_row_major_over_dp_tp_lat_lon(tp, lat, lon, dp):
    world = dp * tp * lat * lon
    dims = ParallelDims("fsdp2", tp, {"lat": lat, "lon": lon}, world)
    assert dims.domain == lat * lon and dims.domain_shape == (lat, lon)
    assert dims.dp == dp == dp_world_size({"domain": {"lat": lat, "lon": lon}, "tensor": tp}, world)
    assert dims.is_2d == (lon > 1)
    seen = set()
    for g in range(world):
        c = dims.coords(g)
        # SPEC §3b: lon = g % Q, lat = (g // Q) % P, tp = (g // (P*Q)) % tensor, dp = g // (tensor*P*Q)
        exp_lon, exp_lat = g % lon, (g // lon) % lat
        assert c["domain"] == exp_lat * lon + exp_lon
        assert c["tp"] == (g // (lat * lon)) % tp and c["dp"] == g // (tp * lat * lon)
        if lon > 1:
            assert (c["domain_lat"], c["domain_lon"]) == (exp_lat, exp_lon)
        assert dims.tile_layout.coords(g) == (c["dp"], c["tp"], exp_lat, exp_lon)
        assert dims.tile_layout.rank_of((c["dp"], c["tp"], exp_lat, exp_lon)) == g
        seen.add((c["dp"], c["tp"], exp_lat, exp_lon))
    assert len(seen) == world
    # the ranks of one latitude band (same lat) are consecutive; a longitude column strides by Q
    layout = dims.tile_layout
    for g in range(world):
        band = layout.ranks_along_dim("domain_lon", g)
        column = layout.ranks_along_dim("domain_lat", g)
        assert band == list(range(g - g % lon, g - g % lon + lon))
        assert column == [g - ((g // lon) % lat) * lon + i * lon for i in range(lat)]


def test_lon_one_is_the_latitude_only_layout():
    a = ParallelDims("fsdp2", 2, {"lat": 3, "lon": 1}, 12)
    b = ParallelDims("fsdp2", 2, 3, 12)
    assert a == b and a.mesh_axes == b.mesh_axes and not a.is_2d
    assert [a.coords(g) for g in range(12)] == [b.coords(g) for g in range(12)]


@pytest.mark.parametrize(
    "data, tp, lat, lon, world, axes",
    [
        ("fsdp2", 1, 2, 2, 4, (("dp", 1), ("domain_lat", 2), ("domain_lon", 2))),
        ("none", 1, 1, 2, 2, (("domain_lon", 2),)),
        ("none", 2, 3, 2, 24, (("dp", 2), ("tp", 2), ("domain_lat", 3), ("domain_lon", 2))),
        ("ddp", 1, 2, 3, 6, (("dp", 1), ("domain_lat", 2), ("domain_lon", 3))),
    ],
)
def test_mesh_axes_of_a_tiled_domain(data, tp, lat, lon, world, axes):
    dims = ParallelDims(data, tp, {"lat": lat, "lon": lon}, world)
    assert dims.mesh_axes == axes
    assert not dims.is_trivial and dims.parallelizes_model
    assert dims.fsdp_over_domain == (data == "fsdp2")


def test_layout_problems_name_lat_and_lon():
    problems = ParallelDims.problems("fsdp2", 2, {"lat": 2, "lon": 3}, 8)
    assert len(problems) == 1
    assert "tensor*domain.lat*domain.lon = 2*2*3 = 12" in problems[0]
    with pytest.raises(ValueError, match="domain.lat\\*domain.lon"):
        ParallelDims("fsdp2", 1, {"lat": 2, "lon": 3}, 8)
    problems = ParallelDims.problems("fsdp2", 1, {"lat": 0, "lon": "x"}, 8)
    assert any("trainer.parallelism.domain.lat" in p for p in problems)
    assert any("trainer.parallelism.domain.lon" in p for p in problems)
    with pytest.raises(ValueError, match="domain.lon"):
        dp_world_size({"domain": {"lat": 2, "lon": 2}}, 6)


# --------------------------------------------------------------------------- meshes (fake pg)
@pytest.mark.parametrize(
    "world, tp, lat, lon", [(16, 2, 2, 2), (24, 1, 3, 2), (64, 2, 4, 2), (12, 1, 1, 3)]
)
def test_tile_mesh_at_larger_world_sizes_with_fake_process_group(world, tp, lat, lon):
    block = {"data": "fsdp2", "tensor": tp, "domain": {"lat": lat, "lon": lon}}
    for rank in sorted({0, 1, world // 2 + 1, world - 1}):
        with fake_process_group(rank, world):
            mesh, subs = build_device_mesh(block, device="cpu")
            names = tuple(mesh.mesh_dim_names)
            assert "domain_lon" in names and "domain" not in names
            assert ("domain_lat" in names) == (lat > 1) and ("tp" in names) == (tp > 1)
            coords = dict(zip(names, mesh.get_coordinate()))
            g_lon, g_lat = rank % lon, (rank // lon) % lat
            assert coords["domain_lon"] == g_lon and coords.get("domain_lat", 0) == g_lat
            band = dist.get_process_group_ranks(subs["domain_lon"].get_group())
            assert band == list(range(rank - g_lon, rank - g_lon + lon))
            column = dist.get_process_group_ranks(subs["domain_lat"].get_group())
            assert column == [rank - g_lat * lon + i * lon for i in range(lat)]
            flat = dist.get_process_group_ranks(subs["domain"].get_group())
            first = rank - g_lat * lon - g_lon
            assert flat == list(range(first, first + lat * lon))
            assert data_parallel_coords({"trainer": {"parallelism": block}}) == (
                rank // (tp * lat * lon),
                world // (tp * lat * lon),
            )


# --------------------------------------------------------------------------- the manager
def _manager_worker(rank, world, block):
    mesh, _ = build_device_mesh(block, device="cpu")
    m = DomainParallelManager.from_device_mesh(mesh)
    out = {
        "type": type(m).__name__,
        "shape": m.domain_shape,
        "coords": m.domain_coords,
        "domain_rank": m.domain_rank,
        "domain_ranks": m.domain_ranks,
        "neighbors": m.neighbor_ranks(),
        "first_last": (m.is_first_domain_rank, m.is_last_domain_rank),
        "dp": (m.dp_rank, m.dp_world_size),
    }
    # every manager answers the tile's axis views; at Q = 1 the latitude view is the manager
    # itself and the longitude view one rank with nothing to exchange
    out["lat_is_self"] = m.lat is m
    if m.domain_shape[1] == 1:
        out["lon_alone"] = (m.lon.domain_ranks, m.lon_group, m.global_width(nn.Identity(), 5))
    if isinstance(m, TiledDomainManager):
        out["lat_ranks"] = m.lat.domain_ranks
        out["lon_ranks"] = m.lon.domain_ranks
        out["lon_neighbors"] = m.lon_neighbor_ranks()
        out["lat_group"] = m.lat_group is not None
        try:
            m.global_length(object(), 3)
        except ValueError as err:
            out["refusal"] = str(err)
    return out


@pytest.mark.parametrize("lat, lon, dp", [(2, 2, 1), (1, 2, 2), (2, 3, 1), (3, 1, 1)])
def test_manager_groups_of_a_tile_on_gloo_ranks(lat, lon, dp):
    world = lat * lon * dp
    block = {"data": "ddp" if dp > 1 else "none", "domain": {"lat": lat, "lon": lon}}
    results = run_on_ranks(_manager_worker, world, block)
    for g, r in enumerate(results):
        g_lon, g_lat, d = g % lon, (g // lon) % lat, g // (lat * lon)
        assert r["shape"] == (lat, lon) and r["coords"] == (g_lat, g_lon)
        assert r["domain_rank"] == g_lat * lon + g_lon
        base = d * lat * lon
        assert r["domain_ranks"] == list(range(base, base + lat * lon))
        north = base + (g_lat - 1) * lon + g_lon if g_lat > 0 else None
        south = base + (g_lat + 1) * lon + g_lon if g_lat < lat - 1 else None
        assert r["neighbors"] == (north, south)
        assert r["first_last"] == (g_lat == 0, g_lat == lat - 1)
        assert r["dp"] == (d, dp)
        if lon == 1:
            assert r["type"] == "DomainParallelManager"
            assert r["lat_is_self"] and r["lon_alone"] == ([g], None, 5)
            continue
        assert not r["lat_is_self"]
        assert r["type"] == "TiledDomainManager"
        assert r["lat_ranks"] == [base + i * lon + g_lon for i in range(lat)]
        assert r["lon_ranks"] == [base + g_lat * lon + j for j in range(lon)]
        band = base + g_lat * lon
        assert r["lon_neighbors"] == (band + (g_lon - 1) % lon, band + (g_lon + 1) % lon)
        assert r["lat_group"] == (lat > 1)
        assert "two-dimensional (lat x lon) domains do not support" in r["refusal"]
        assert "object" in r["refusal"]


def _own_mesh_worker(rank, world):
    m = TiledDomainManager(world, (2, 2))
    return m.domain_coords, m.lat.domain_ranks, m.lon.domain_ranks, m.dp_world_size


def test_tiled_manager_builds_its_own_mesh():
    results = run_on_ranks(_own_mesh_worker, 4)
    assert results[3] == ((1, 1), [1, 3], [2, 3], 1)
    assert results[0] == ((0, 0), [0, 2], [0, 1], 1)
    with pytest.raises(ValueError, match="lat must be an integer"):
        from credit_parallel.domain.manager import _check_shape

        _check_shape((0, 2))


# --------------------------------------------------------------------------- plan and preflight
def test_plan_and_preflight_accept_a_tiled_domain_and_report_what_it_refuses():
    import copy

    from credit_parallel.layout.config import load_config
    from credit_parallel.planner import make_plan
    from credit_parallel.train.preflight import validate_run

    conf = copy.deepcopy(load_config("src/credit_parallel/configs/demo_unet.yaml"))
    conf.pop("data", None)
    conf["trainer"]["parallelism"] = {"data": "fsdp2", "domain": {"lat": 2, "lon": 2}}
    plan = make_plan(conf, 8)
    assert plan.dp == 2
    assert plan.mesh_axes == (("dp", 2), ("domain_lat", 2), ("domain_lon", 2))
    assert any("two-dimensional domain 2 x 2" in note for note in plan.notes)
    from credit_parallel.planner import format_plan

    text = format_plan(plan)
    assert "domain=2x2 (lat x lon)" in text
    assert "[17:33) of 33 x cols [32:64) of 64" in text  # rank 3: tile (1, 1)
    # every layer of the U-Net is exact on tiles: nothing refused
    assert not [v for v in plan.violations if "do not support it yet" in v]
    # the CrossFormer's window attention runs on latitude strips (tiles_relayout.py): nothing
    # refused either, by the plan or the preflight
    cross = copy.deepcopy(load_config("src/credit_parallel/configs/demo_crossformer.yaml"))
    cross.pop("data", None)
    cross["trainer"]["parallelism"] = conf["trainer"]["parallelism"]
    assert not [v for v in make_plan(cross, 4).violations if "do not support it yet" in v]
    assert not [v for v in validate_run(cross, 4) if "do not support it yet" in v]
    bad = validate_run(conf, 6)
    assert any("tensor*domain.lat*domain.lon = 1*2*2 = 4" in v for v in bad)
