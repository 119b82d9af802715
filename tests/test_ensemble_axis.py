"""The ensemble axis of the layout (SPEC §1-§2): ``trainer.parallelism.ensemble: E``.

World = dp x E x tensor x domain, row-major over (dp, ensemble, tp, domain); E = 1 leaves
every layout unchanged; FSDP2 shards over dp x ensemble x domain.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from credit_parallel import ParallelDims, parse_parallelism_conf
from credit_parallel.layout.config import DP_DOMAIN, ENSEMBLE
from credit_parallel.layout.mesh import data_parallel_coords, dp_world_size
from credit_parallel.testing import fake_process_group


def _conf(**block):
    return {"trainer": {"parallelism": block}}


def test_ensemble_key_is_parsed_only_above_one():
    assert "ensemble" not in parse_parallelism_conf(_conf(data="fsdp2", ensemble=1))
    assert parse_parallelism_conf(_conf(data="fsdp2", ensemble="2"))["ensemble"] == 2


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "two"])
def test_bad_ensemble_degree_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match=r"trainer\.parallelism\.ensemble"):
        parse_parallelism_conf(_conf(data="fsdp2", ensemble=bad))


@pytest.mark.parametrize("ens, tp, domain, world", [(2, 1, 2, 8), (3, 2, 1, 12), (2, 1, 3, 6)])
def test_rank_layout_is_dp_ensemble_tp_domain_row_major(ens, tp, domain, world):
    dims = ParallelDims("fsdp2", tp, domain, world, ens)
    assert dims.dp == world // (ens * tp * domain)
    assert dims.rank_layout.dim_names == ("dp", ENSEMBLE, "tp", "domain")
    for g in range(world):
        expected = {
            "dp": g // (ens * tp * domain),
            ENSEMBLE: (g // (tp * domain)) % ens,
            "tp": (g // domain) % tp,
            "domain": g % domain,
        }
        assert dims.coords(g) == expected
    assert (
        dp_world_size({"data": "fsdp2", "ensemble": ens, "tensor": tp, "domain": domain}, world)
        == dims.dp
    )


def test_ensemble_one_leaves_the_layout_unchanged():
    a, b = ParallelDims("fsdp2", 1, 2, 8), ParallelDims("fsdp2", 1, 2, 8, 1)
    assert a == b and a.rank_layout.dim_names == ("dp", "tp", "domain")
    assert "ensemble" not in a.coords(5) and a.ensemble_coord(5) == 0


def test_world_not_divisible_and_ddp_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"ensemble\*tensor\*domain = 2\*1\*2 = 4"):
        ParallelDims("fsdp2", 1, 2, 6, 2)
    problems = ParallelDims.problems("ddp", 1, 2, 8, 2)
    assert (
        len(problems) == 1 and "trainer.parallelism.ensemble = 2 needs data: fsdp2" in problems[0]
    )
    with pytest.raises(ValueError, match="trainer.parallelism.ensemble"):
        ParallelDims("ddp", 1, 1, 4, 2).check_supported()


@pytest.mark.parametrize("domain", [2, {"lat": 2, "lon": 2}])
def test_fake_mesh_has_the_ensemble_axis_and_fsdp_spans_dp_ensemble_domain(domain):
    ens, world = 2, 16
    for rank in (0, 5, 13):
        with fake_process_group(rank, world):
            dims = ParallelDims("fsdp2", 1, domain, world, ens)
            meshes = dims.build_mesh("cpu")
            names = meshes.mesh.mesh_dim_names
            assert names[:2] == ("dp", ENSEMBLE)
            ens_group = dist.get_process_group_ranks(meshes.submeshes[ENSEMBLE].get_group())
            inner = dims.domain  # tp = 1: ranks of one member group are `domain` apart
            base = rank - dims.ensemble_coord(rank) * inner
            assert ens_group == [base + e * inner for e in range(ens)]
            flat = meshes.fsdp_mesh
            assert flat.mesh_dim_names == (DP_DOMAIN,) and flat.size() == world
            assert dims.fsdp_group_size == world and dims.fsdp_over_domain
            conf = _conf(data="fsdp2", ensemble=ens, domain=domain)
            # the sampler contract: ranks differing only in ensemble / domain share a batch
            assert data_parallel_coords(conf) == (rank // (ens * inner), world // (ens * inner))


def test_fsdp_over_the_ensemble_axis_without_domain():
    with fake_process_group(3, 4):
        meshes = ParallelDims("fsdp2", 1, 1, 4, 2).build_mesh("cpu")
        assert meshes.mesh.mesh_dim_names == ("dp", ENSEMBLE)
        assert dist.get_process_group_ranks(meshes.fsdp_mesh.get_group()) == [0, 1, 2, 3]
