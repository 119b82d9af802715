"""Small sums and gathers go point to point on small gloo groups: same numbers as the gloo
collectives (every rank bitwise the same sum), the collective path beyond the threshold."""

from __future__ import annotations

import importlib.util
import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from credit_parallel.layout import small_collectives
from credit_parallel.layout.small_collectives import gather_small, point_to_point_pays, sum_small_
from credit_parallel.parallel.collectives import allreduce_grads
from credit_parallel.testing import run_on_ranks


def test_point_to_point_rule_small_tensors_small_gloo_groups_only():
    limit = small_collectives.P2P_MAX_BYTES
    assert point_to_point_pays(64, 2, "gloo")
    assert point_to_point_pays(limit, 2, "gloo")
    assert not point_to_point_pays(limit + 1, 2, "gloo")
    assert point_to_point_pays(limit // 3, 4, "gloo")  # each rank sends to 3 peers
    assert not point_to_point_pays(limit // 3 + 1, 4, "gloo")
    assert not point_to_point_pays(8, small_collectives.P2P_MAX_RANKS + 1, "gloo")
    assert not point_to_point_pays(64, 2, "nccl")
    assert not point_to_point_pays(64, 1, "gloo")


def _value(rank: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64) * 10**rank


def _worker(rank, world, numel, force_collective):
    if force_collective:
        small_collectives.P2P_MAX_BYTES = 0
    shape = (3, numel // 3)
    expected_sum = _value(0, shape).clone()
    for q in range(1, world):
        expected_sum.add_(_value(q, shape))  # rank order, as the point-to-point sum adds
    out = {}
    gathered = gather_small(_value(rank, shape), None)
    out["gather"] = torch.equal(gathered, torch.stack([_value(q, shape) for q in range(world)]))
    total = sum_small_(_value(rank, shape), None)
    out["sum_err"] = (total - expected_sum).abs().max().item()
    out["sum_bits"] = total
    # a non-contiguous tensor is summed in place, its layout kept
    t = _value(rank, (shape[1], 3)).t()
    sum_small_(t, None)
    want = sum(_value(q, (shape[1], 3)).t() for q in range(world))
    out["noncontig_err"] = (t - want).abs().max().item()
    out["noncontig_layout"] = t.stride() == (1, 3)
    # a sub-group of the last two ranks: peers are translated to global ranks
    sub = dist.new_group([world - 2, world - 1])
    if rank >= world - 2:
        part = sum_small_(_value(rank, shape), sub)
        out["sub_err"] = (part - _value(world - 2, shape) - _value(world - 1, shape)).abs().max()
    # gradient buckets
    grads = [_value(rank, (4, 5)), _value(rank, (7,))]
    allreduce_grads(grads, None, op="sum")
    want = [sum(_value(q, g.shape) for q in range(world)) for g in grads]
    out["grads_err"] = max((g - w).abs().max().item() for g, w in zip(grads, want))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("numel, force_collective", [(12, False), (3 * 2**14, False), (12, True)])
def test_small_sum_and_gather_equal_the_collectives(world, numel, force_collective):
    results = run_on_ranks(_worker, world, numel, force_collective)
    for r in results:
        assert r["gather"]
        assert r["sum_err"] <= 1e-12 * 10 ** (world - 1)
        assert r["noncontig_err"] <= 1e-12 * 10 ** (world - 1) and r["noncontig_layout"]
        assert r["grads_err"] <= 1e-12 * 10 ** (world - 1)
    for r in results[-2:]:
        assert r["sub_err"] <= 1e-12 * 10 ** (world - 1)
    if not force_collective:
        # the point-to-point sum adds in rank order on every rank: bitwise one result
        for r in results[1:]:
            assert torch.equal(r["sum_bits"], results[0]["sum_bits"])


def _count_worker(rank, world, numel):
    calls = []
    original_p2p, original_ar = dist.batch_isend_irecv, dist.all_reduce
    dist.batch_isend_irecv = lambda ops: calls.append("p2p") or original_p2p(ops)
    dist.all_reduce = lambda *a, **k: calls.append("all_reduce") or original_ar(*a, **k)
    try:
        with small_collectives.record_small_collectives() as counts:
            sum_small_(torch.ones(numel), None)
            gather_small(torch.ones(3), None)
    finally:
        dist.batch_isend_irecv, dist.all_reduce = original_p2p, original_ar
    return calls, dict(counts)


def test_small_tensor_is_one_batch_of_point_to_point_large_one_all_reduce():
    small = small_collectives.P2P_MAX_BYTES // 4
    both = {"all_reduce": 1, "all_gather": 1}  # counted by meaning, whatever the transport
    assert run_on_ranks(_count_worker, 2, small) == [(["p2p", "p2p"], both)] * 2
    assert (
        run_on_ranks(_count_worker, 2, small + 1)
        == [(["all_reduce", "p2p"], {"all_gather": 1})] * 2
    )


def test_collective_latency_benchmark_tiny_run_times_every_variant_and_size():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "collective_latency.py"
    spec = importlib.util.spec_from_file_location("collective_latency", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with redirect_stdout(io.StringIO()) as out:
        times = bench.main(["--world", "2", "--sizes", "64,4096", "--calls", "3", "--warmup", "1"])
    names = {name for name, _ in times}
    assert names == {
        "gloo all_reduce", "gloo all_gather", "send/recv all peers", "sum_small_", "gather_small"
    }  # fmt: skip
    assert {size for _, size in times} == {64, 4096}
    assert all(t > 0 for t in times.values())
    assert "bytes per rank" in out.getvalue()
