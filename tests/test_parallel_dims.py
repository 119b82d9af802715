"""ParallelDims owns the layout: degrees, checks, rank layout, "trivial", and every mesh.

The domain manager is built from that mesh only (no second set of process groups), its
data-parallel group is a real group also at dp = 1, and ``parallelize`` never replaces the
process-wide manager that ``initialize_domain_parallel`` set.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

from credit_parallel import (
    DomainParallelManager,
    ParallelDims,
    get_domain_manager,
    get_domain_parallel_manager,
    initialize_domain_parallel,
    parallelize,
)
from credit_parallel.domain.manager import set_domain_parallel_manager
from credit_parallel.layout.config import DP_DOMAIN
from credit_parallel.testing import fake_process_group, run_on_ranks


@pytest.mark.parametrize(
    "block, world, trivial, changes_model",
    [
        ({"data": "none"}, 1, True, False),
        ({"data": "none"}, 8, False, False),  # a ("dp",) mesh of 8, the model left alone
        ({"data": "fsdp2"}, 1, False, True),
        ({"data": "none", "domain": 2}, 2, False, True),
        ({"data": "ddp", "tensor": 1}, 4, False, True),
    ],
)
def test_trivial_and_model_changing_layouts(block, world, trivial, changes_model):
    dims = ParallelDims.from_block(block, world)
    assert dims.is_trivial is trivial
    assert dims.parallelizes_model is changes_model
    assert dims.is_trivial == (dims.mesh_axes == ())


def test_coords_follow_the_row_major_dp_tp_domain_layout():
    dims = ParallelDims.from_block({"data": "fsdp2", "tensor": 2, "domain": 3}, 12)
    for g in range(12):
        assert dims.coords(g) == {"dp": g // 6, "tp": (g // 3) % 2, "domain": g % 3}
    assert dims.rank_layout.shape == (2, 2, 3)
    assert dims.fsdp_over_domain and not ParallelDims("ddp", 1, 3, 12).fsdp_over_domain


def test_from_conf_takes_the_world_size_of_the_process_group_or_one():
    conf = {"trainer": {"parallelism": {"data": "none"}}}
    assert ParallelDims.from_conf(conf).world_size == 1
    with pytest.raises(RuntimeError, match="process group"):
        ParallelDims.from_conf({"trainer": {"parallelism": {"domain": 2}}})
    with fake_process_group(3, 8):
        dims = ParallelDims.from_conf({"trainer": {"parallelism": {"tensor": 2, "domain": 2}}})
        assert (dims.world_size, dims.dp) == (8, 2)


def test_ddp_with_tensor_parallel_is_unsupported_by_name():
    with pytest.raises(ValueError, match="ddp.*tensor > 1.*fsdp2"):
        ParallelDims("ddp", 2, 1, 4).check_supported()
    ParallelDims("fsdp2", 2, 1, 4).check_supported()


def test_fake_512_ranks_flattened_dp_domain_axis_groups_the_right_ranks():
    dp, tp, domain = 16, 4, 8
    for rank in (0, 37, 511):
        with fake_process_group(rank, 512):
            meshes = ParallelDims("fsdp2", tp, domain, 512).build_mesh("cpu")
            flat = meshes.fsdp_mesh
            assert flat.mesh_dim_names == (DP_DOMAIN,) and flat.size() == dp * domain
            coords = ParallelDims("fsdp2", tp, domain, 512).coords(rank)
            expected = [
                d * tp * domain + coords["tp"] * domain + c
                for d in range(dp)
                for c in range(domain)
            ]
            assert dist.get_process_group_ranks(flat.get_group()) == expected


def _manager_worker(rank, world, block):
    meshes = ParallelDims.from_block(block).build_mesh("cpu")
    calls = []
    real_new_group = dist.new_group

    def counting_new_group(*args, **kwargs):
        calls.append(args)
        return real_new_group(*args, **kwargs)

    dist.new_group = counting_new_group
    try:
        mgr = DomainParallelManager.from_device_mesh(meshes.mesh)
    finally:
        dist.new_group = real_new_group
    return {
        "new_group_calls": len(calls),
        "dp_group": dist.get_process_group_ranks(mgr.data_parallel_group),
        "domain_group": dist.get_process_group_ranks(mgr.domain_group),
        "mesh_domain": dist.get_process_group_ranks(meshes.axis("domain").get_group()),
        "dp": (mgr.dp_rank, mgr.dp_world_size),
    }


@pytest.mark.parametrize("block", [{"data": "none", "domain": 2}, {"data": "fsdp2", "domain": 2}])
def test_manager_from_mesh_makes_no_new_groups_and_dp_of_one_is_a_group_of_this_rank(block):
    for rank, res in enumerate(run_on_ranks(_manager_worker, 2, block)):
        assert res["new_group_calls"] == 0
        assert res["dp_group"] == [rank] and res["dp"] == (0, 1)
        assert res["domain_group"] == res["mesh_domain"] == [0, 1]


def _process_wide_worker(rank, world):
    set_domain_parallel_manager(None)
    mine = initialize_domain_parallel(world, world)
    model = parallelize(
        nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)),
        {"trainer": {"parallelism": {"data": "none", "domain": 2}}},
    )
    kept = get_domain_parallel_manager() is mine
    attached = get_domain_manager(model)
    set_domain_parallel_manager(None)
    return kept, attached is not None and attached is not mine


def test_parallelize_never_replaces_the_process_wide_manager():
    assert run_on_ranks(_process_wide_worker, 2) == [(True, True)] * 2
