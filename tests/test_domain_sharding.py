"""shard_tensor / gather_tensor / shard_batch, the DomainParallelManager and its height cache.

* shard/gather: roundtrip for uneven heights and 4-D / 5-D tensors, the two being exact adjoints
  (numerically: backward of gather = per-rank sum of the gradients of its rows, backward of
  shard = all-gather); shard_batch; identities with no manager or a domain size of 1.
* the manager: ranks, groups and neighbours on 4 ranks (domain 2 x dp 2), agreement with the
  device mesh on 8 ranks with tensor 2 (the case where consecutive-rank groups would be wrong),
  the process-wide manager.
* the global-height cache: a repeated forward takes no height collective, and H=9 / H=10 on
  2 ranks (5 local rows on rank 0 for both) are never confused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.layers.conv import DomainParallelConv2d
from credit_parallel.domain.manager import (
    DomainParallelManager,
    get_domain_parallel_manager,
    initialize_domain_parallel,
    set_domain_parallel_manager,
)
from credit_parallel.domain.rows import shard_range
from credit_parallel.domain.sharding import gather_tensor, shard_batch, shard_tensor
from credit_parallel.testing import run_on_ranks

__all__: list[str] = []


def _roundtrip_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = []
    for shape, dim in (
        ((2, 3, 13, 5), -2),
        ((2, 3, 4 * world, 5), -2),
        ((1, 2, 3, world + 1, 4), -2),
        ((1, 2, 3, 11, 4), 3),
        ((2, 7, 5), 1),
        ((world, 3), 0),
    ):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(out)))
        local = shard_tensor(x, dim, mgr)
        d = dim % x.dim()
        a, b = shard_range(x.shape[d], world, rank)
        ok_local = torch.equal(local, x.narrow(d, a, b - a))
        full = gather_tensor(local, dim, mgr)
        out.append((shape, ok_local, torch.equal(full, x)))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gather_of_shard_is_identity_for_uneven_4d_and_5d_tensors(world):
    for per_rank in run_on_ranks(_roundtrip_worker, world):
        for shape, ok_local, ok_full in per_rank:
            assert ok_local and ok_full, shape


def _adjoint_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    h = 11
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, h, 4, generator=gen)
    g_full = torch.randn(world, 2, 3, h, 4, generator=gen)  # rank r's gradient of the gathered x
    a, b = shard_range(h, world, rank)
    # backward of gather_tensor: each rank gets the sum over ranks of the gradients of its rows
    xl = x[..., a:b, :].clone().requires_grad_(True)
    (gather_tensor(xl, -2, mgr) * g_full[rank]).sum().backward()
    gather_err = float((xl.grad - g_full.sum(0)[..., a:b, :]).abs().max())
    # backward of shard_tensor: the all-gather of every rank's gradient of its shard
    g_local = torch.randn(world, 2, 3, h, 4, generator=gen)
    xg = x.clone().requires_grad_(True)
    (shard_tensor(xg, -2, mgr) * g_local[rank][..., a:b, :]).sum().backward()
    expected = torch.cat(
        [g_local[r][..., slice(*shard_range(h, world, r)), :] for r in range(world)], -2
    )
    shard_err = float((xg.grad - expected).abs().max())
    # <gather(u), v> == <u, gather^T(v)> summed over ranks (the dot-product adjoint test)
    u = torch.randn(2, 3, b - a, 4, generator=torch.Generator().manual_seed(10 + rank))
    v = torch.randn(2, 3, h, 4, generator=torch.Generator().manual_seed(20 + rank))
    ul = u.clone().requires_grad_(True)
    lhs = (gather_tensor(ul, -2, mgr) * v).sum()
    lhs.backward()
    dots = torch.stack([lhs.detach(), (u * ul.grad).sum()])
    dist.all_reduce(dots)
    return gather_err, shard_err, float((dots[0] - dots[1]).abs())


@pytest.mark.parametrize("world", [2, 3])
def test_shard_and_gather_are_exact_adjoints(world):
    for gather_err, shard_err, dot_err in run_on_ranks(_adjoint_worker, world):
        assert gather_err <= 1e-12 and shard_err <= 1e-12 and dot_err <= 1e-10


def _batch_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    x4 = torch.randn(2, 3, 9, 5)
    x5 = torch.randn(2, 3, 2, 9, 5)
    x3 = torch.randn(2, 9, 5)
    meta = {"step": 3}
    batch = {"x": x4, "y": x5, "static": x3, "meta": meta, "name": "era5"}
    out = shard_batch(batch, manager=mgr)
    a, b = shard_range(9, world, rank)
    # a 5-D tensor sharded on its dim 2 instead
    alt = shard_batch({"y": x5}, shard_dim_5d=2, manager=mgr)["y"]
    c, d = shard_range(2, world, rank)
    # CREDIT's keyword names (SPEC §3) still work, with a DeprecationWarning
    with pytest.warns(DeprecationWarning, match="spatial_dims_5d"):
        old_5d = shard_batch({"y": x5}, spatial_dims_5d=2, manager=mgr)["y"]
    with pytest.warns(DeprecationWarning, match="spatial_dims_4d"):
        old_4d = shard_batch({"x": x4}, spatial_dims_4d=3, manager=mgr)["x"]
    e, f = shard_range(5, world, rank)
    return (
        out is not batch and set(out) == set(batch),
        torch.equal(out["x"], x4[:, :, a:b]),
        torch.equal(out["y"], x5[:, :, :, a:b]),
        out["static"] is x3 and out["meta"] is meta and out["name"] == "era5",
        torch.equal(alt, x5[:, :, c:d]),
        torch.equal(old_5d, alt) and torch.equal(old_4d, x4[..., e:f]),
        batch["x"] is x4 and batch["y"] is x5,  # the input dict is untouched
    )


def test_shard_batch_shards_4d_and_5d_tensors_and_leaves_the_rest():
    for flags in run_on_ranks(_batch_worker, 2):
        assert all(flags), flags


def _domain_one_worker(rank, world):
    mgr = DomainParallelManager(world, 1)  # pure data parallelism: domain size 1
    x = torch.randn(2, 3, 5, 4)
    batch = {"x": x}
    return (
        shard_tensor(x, -2, mgr) is x,
        gather_tensor(x, -2, mgr) is x,
        shard_batch(batch, manager=mgr)["x"] is x,
        mgr.domain_world_size,
        mgr.dp_world_size,
        mgr.domain_group is None,
    )


def test_domain_size_one_and_no_manager_are_identities():
    for res in run_on_ranks(_domain_one_worker, 2):
        assert res == (True, True, True, 1, 2, True)
    previous = get_domain_parallel_manager()
    set_domain_parallel_manager(None)
    try:
        x = torch.randn(1, 2, 3, 4)
        assert shard_tensor(x) is x and gather_tensor(x) is x
        assert shard_batch({"x": x})["x"] is x
    finally:
        set_domain_parallel_manager(previous)


def _manager_worker(rank, world):
    mgr = DomainParallelManager(world, 2)
    return {
        "domain_rank": mgr.domain_rank,
        "domain_world_size": mgr.domain_world_size,
        "dp_rank": mgr.dp_rank,
        "dp_world_size": mgr.dp_world_size,
        "domain_ranks": mgr.domain_ranks,
        "domain_group_ranks": dist.get_process_group_ranks(mgr.domain_group),
        "dp_group_ranks": dist.get_process_group_ranks(mgr.data_parallel_group),
        "neighbors": mgr.neighbor_ranks(),
        "first": mgr.is_first_domain_rank,
        "last": mgr.is_last_domain_rank,
    }


def test_manager_on_4_ranks_domain_2_dp_2():
    results = run_on_ranks(_manager_worker, 4)
    for g, res in enumerate(results):
        base = g - g % 2
        assert res["domain_rank"] == g % 2 and res["domain_world_size"] == 2
        assert res["dp_rank"] == g // 2 and res["dp_world_size"] == 2
        assert res["domain_ranks"] == res["domain_group_ranks"] == [base, base + 1]
        assert res["dp_group_ranks"] == [g % 2, g % 2 + 2]
        assert res["first"] == (g % 2 == 0) and res["last"] == (g % 2 == 1)
        assert res["neighbors"] == ((None, base + 1) if g % 2 == 0 else (base, None))


def _manager_4_domain_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    return mgr.neighbor_ranks(), mgr.is_first_domain_rank, mgr.is_last_domain_rank


def test_manager_neighbours_in_the_middle_of_a_4_rank_domain():
    assert run_on_ranks(_manager_4_domain_worker, 4) == [
        ((None, 1), True, False),
        ((0, 2), False, False),
        ((1, 3), False, False),
        ((2, None), False, True),
    ]


def test_manager_rejects_bad_sizes():
    with pytest.raises(ValueError, match="domain_parallel_size"):
        DomainParallelManager(4, 0)
    with pytest.raises(ValueError, match="not divisible"):
        DomainParallelManager(4, 3)


def _mesh_worker(rank, world):
    from credit_parallel.layout.mesh import build_device_mesh

    mesh, sub = build_device_mesh({"data": "fsdp2", "tensor": 2, "domain": 2}, device="cpu")
    mgr = DomainParallelManager.from_device_mesh(mesh)
    return {
        "mesh_domain": dist.get_process_group_ranks(sub["domain"].get_group()),
        "mesh_dp": dist.get_process_group_ranks(sub["dp"].get_group()),
        "domain_ranks": mgr.domain_ranks,
        "domain_group": dist.get_process_group_ranks(mgr.domain_group),
        "dp_group": dist.get_process_group_ranks(mgr.data_parallel_group),
        "domain_rank": mgr.domain_rank,
        "dp_rank": mgr.dp_rank,
        "neighbors": mgr.neighbor_ranks(),
    }


def test_manager_from_device_mesh_agrees_with_the_mesh_when_tensor_parallel_is_on():
    results = run_on_ranks(_mesh_worker, 8, timeout=180)
    for g, res in enumerate(results):
        # layout (dp, tp, domain), domain innermost: g = dp*4 + tp*2 + domain
        assert res["domain_ranks"] == res["domain_group"] == res["mesh_domain"]
        assert res["dp_group"] == res["mesh_dp"]
        assert res["domain_ranks"] == [g - g % 2, g - g % 2 + 1]
        assert res["dp_group"] == [g % 4, g % 4 + 4]
        assert res["domain_rank"] == g % 2 and res["dp_rank"] == g // 4
        prev, nxt = res["neighbors"]
        assert (prev, nxt) == ((None, g + 1) if g % 2 == 0 else (g - 1, None))


def _process_wide_worker(rank, world):
    set_domain_parallel_manager(None)
    assert get_domain_parallel_manager() is None
    mgr = initialize_domain_parallel(world, world)
    assert get_domain_parallel_manager() is mgr
    # layers and sharding without manager= use the process-wide one
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 7, 4)
    y = gather_tensor(DomainParallelConv2d(conv)(shard_tensor(x)))
    return float((y - conv(x)).abs().max())


def test_initialize_domain_parallel_sets_the_process_wide_manager():
    assert max(run_on_ranks(_process_wide_worker, 2)) <= 1e-12


def _cache_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.Conv2d(4, 2, 3)
    )
    inputs = {
        h: torch.randn(1, 2, h, 6, generator=torch.Generator().manual_seed(h)) for h in (9, 10)
    }
    ref = {h: model(x) for h, x in inputs.items()}
    par = convert_to_domain_parallel(nn.Sequential(*[m for m in model]), mgr)
    gathers = []
    original = mgr._gather_length

    def counting(owner, local_length):
        gathers.append(type(owner).__name__)
        return original(owner, local_length)

    mgr._gather_length = counting
    errors, per_forward = [], []
    # alternate H=9 and H=10: on rank 0 both have 5 local rows
    for h in (9, 10, 9, 10, 10, 9):
        before = len(gathers)
        y_local = par(shard_tensor(inputs[h], -2, mgr))
        per_forward.append(len(gathers) - before)
        errors.append(float((gather_tensor(y_local, -2, mgr) - ref[h]).abs().max()))
    return errors, per_forward, shard_range(9, world, rank)[1] - shard_range(9, world, rank)[0]


def test_height_cache_needs_no_collective_in_steady_state_and_never_confuses_h9_h10():
    for rank, (errors, per_forward, local9) in enumerate(run_on_ranks(_cache_worker, 2)):
        assert max(errors) <= 1e-12
        # first forward of each height: one height all_gather per layer; then none
        assert per_forward == [3, 3, 0, 0, 0, 0], per_forward
        if rank == 0:
            assert local9 == 5  # the ambiguous case: same local height for H=9 and H=10


def _gather_same_token_worker(rank, world):
    """gather_tensor handed tensors of different global heights under ONE registered token
    (e.g. the outputs of two models, or of two layers): each must come back whole."""
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    full = {h: torch.randn(1, 2, h, 3, generator=torch.Generator().manual_seed(h)) for h in (9, 10)}
    mgr.begin_forward(("one token for everything",))
    ok = []
    for h in (9, 10, 9, 10):
        a, b = shard_range(h, world, rank)
        ok.append(torch.equal(gather_tensor(full[h][:, :, a:b], -2, mgr), full[h]))
    mgr.begin_forward(("one token for everything",))  # the same token again, other order
    for h in (10, 9):
        a, b = shard_range(h, world, rank)
        ok.append(torch.equal(gather_tensor(full[h][:, :, a:b], -2, mgr), full[h]))
    return ok


def test_gather_tensor_is_not_fooled_by_a_repeated_token():
    for ok in run_on_ranks(_gather_same_token_worker, 2):
        assert all(ok), ok


def test_shard_batch_refuses_a_dim_under_both_its_new_and_its_deprecated_name():
    with pytest.raises(TypeError, match="shard_dim_5d= only"):
        shard_batch({}, shard_dim_5d=3, spatial_dims_5d=3)
