import pytest
import torch
import torch.distributed as dist

from credit_parallel import build_device_mesh, data_parallel_coords, dp_world_size
from credit_parallel.testing import RankFailure, fake_process_group, run_on_ranks


def _expected_coords(g, tp, domain):
    return {"dp": g // (tp * domain), "tp": (g // domain) % tp, "domain": g % domain}


def _mesh_worker(rank, world, block):
    mesh, subs = build_device_mesh(block, device="cpu")
    out = {
        "shape": tuple(mesh.shape),
        "names": tuple(mesh.mesh_dim_names),
        "groups": {},
        "sums": {},
    }
    for name, sub in subs.items():
        ranks = dist.get_process_group_ranks(sub.get_group())
        out["groups"][name] = ranks
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub.get_group())
        out["sums"][name] = t.item()
    out["dp"] = data_parallel_coords({"trainer": {"parallelism": block}})
    return out


def _check_groups(results, tp, domain):
    world = len(results)
    for g, res in enumerate(results):
        mine = _expected_coords(g, tp, domain)
        for name, ranks in res["groups"].items():
            # the group along `name`: every rank that shares my other coordinates
            expect = [
                h
                for h in range(world)
                if all(
                    _expected_coords(h, tp, domain)[k] == v for k, v in mine.items() if k != name
                )
            ]
            assert ranks == expect, (g, name)
            assert res["sums"][name] == float(sum(expect))
        dp = world // (tp * domain)
        assert res["dp"] == (mine["dp"], dp)


@pytest.mark.parametrize(
    "world, block, shape, names",
    [
        (8, {"data": "fsdp2", "tensor": 1, "domain": 1}, (8,), ("dp",)),
        (8, {"data": "fsdp2", "tensor": 2, "domain": 1}, (4, 2), ("dp", "tp")),
        (8, {"data": "fsdp2", "tensor": 2, "domain": 2}, (2, 2, 2), ("dp", "tp", "domain")),
        (4, {"data": "none", "tensor": 2, "domain": 2}, (2, 2), ("tp", "domain")),
        (4, {"data": "ddp", "tensor": 1, "domain": 2}, (2, 2), ("dp", "domain")),
    ],
)
def test_build_device_mesh_on_gloo_ranks(world, block, shape, names):
    results = run_on_ranks(_mesh_worker, world, block, timeout=120)
    for res in results:
        assert res["shape"] == shape and res["names"] == names
        assert set(res["groups"]) == {n for n, s in zip(names, shape) if s > 1}
    _check_groups(results, block["tensor"], block["domain"])


def test_single_rank_nothing_active_returns_none():
    def worker(rank, world):
        return build_device_mesh({"data": "none", "tensor": 1, "domain": 1}, device="cpu")

    assert run_on_ranks(worker, 1) == [(None, {})]
    # ...and it needs no process group at all
    assert build_device_mesh({"data": "none"}) == (None, {})


def test_data_none_on_8_ranks_gets_a_dp_mesh_of_size_8_not_none():
    def worker(rank, world):
        mesh, subs = build_device_mesh({"data": "none", "tensor": 1, "domain": 1}, device="cpu")
        ranks = dist.get_process_group_ranks(subs["dp"].get_group())
        return tuple(mesh.shape), tuple(mesh.mesh_dim_names), sorted(subs), ranks

    assert run_on_ranks(worker, 8, timeout=120) == [((8,), ("dp",), ["dp"], list(range(8)))] * 8


def test_single_rank_fsdp2_gets_dp_mesh_of_size_one():
    def worker(rank, world):
        mesh, subs = build_device_mesh({"data": "fsdp2"}, device="cpu")
        return tuple(mesh.shape), tuple(mesh.mesh_dim_names), subs

    assert run_on_ranks(worker, 1) == [((1,), ("dp",), {})]


def test_indivisible_world_raises_value_error_on_every_rank():
    def worker(rank, world):
        build_device_mesh({"data": "ddp", "tensor": 4, "domain": 1}, device="cpu")

    with pytest.raises(RankFailure) as err:
        run_on_ranks(worker, 6)
    assert str(err.value).count("\nValueError: world size 6") == 6
    assert "not divisible" in str(err.value)


def test_mesh_without_process_group_is_a_clear_runtime_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_device_mesh({"data": "fsdp2", "tensor": 2})


def test_data_parallel_coords_without_distributed():
    assert data_parallel_coords({"trainer": {"parallelism": {"data": "fsdp2", "tensor": 2}}}) == (
        0,
        1,
    )
    with pytest.raises(ValueError):
        data_parallel_coords({"trainer": {}})


def test_dp_world_size():
    assert dp_world_size({"data": "fsdp2", "tensor": 2, "domain": 2}, 8) == 2
    assert dp_world_size({"tensor": "2"}, 4) == 2
    for bad_world in (6, 2, 0):
        with pytest.raises(ValueError):
            dp_world_size({"tensor": 4}, bad_world)
    with pytest.raises(ValueError, match="data"):
        dp_world_size({"data": "x"}, 4)


@pytest.mark.parametrize("world, tp, domain", [(64, 4, 4), (512, 8, 8), (512, 2, 16)])
def test_layout_at_large_world_sizes_with_fake_process_group(world, tp, domain):
    for rank in (0, 1, world // 2 + 3, world - 1):
        with fake_process_group(rank, world):
            block = {"data": "fsdp2", "tensor": tp, "domain": domain}
            mesh, subs = build_device_mesh(block, device="cpu")
            exp = _expected_coords(rank, tp, domain)
            assert tuple(mesh.get_coordinate()) == (exp["dp"], exp["tp"], exp["domain"])
            dom = dist.get_process_group_ranks(subs["domain"].get_group())
            assert dom == list(range(rank - exp["domain"], rank - exp["domain"] + domain))
            tpr = dist.get_process_group_ranks(subs["tp"].get_group())
            assert tpr == [exp["dp"] * tp * domain + t * domain + exp["domain"] for t in range(tp)]
            assert data_parallel_coords({"trainer": {"parallelism": block}}) == (
                exp["dp"],
                world // (tp * domain),
            )
