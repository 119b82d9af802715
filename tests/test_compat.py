"""torch >= 2.11: the compatibility paths, run on this torch by simulating the older API surface.

torch 2.11 has no ``dist.all_gather_single`` (only ``all_gather_into_tensor``), refuses
``F.batch_norm(..., eps=0)`` and cannot redistribute a DTensor to a one-axis ``_StridedShard``.
Each rank here removes / replaces exactly those three (:func:`_as_torch_2_11`) and then runs
exactness checks against single-process references: the domain GroupNorm at uneven rows, the
row gathers, and a fused tensor-parallel projection alone and under FSDP2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from credit_parallel.layout import compat
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks

__all__: list[str] = []


def _as_torch_2_11(gather: bool = True):
    """Make this (forked) rank's torch look like 2.11 where the project touches it.

    ``gather=False`` keeps ``dist.all_gather_single``: this torch's own FSDP2 calls it (2.11's
    FSDP2 calls its own older name), so a run through FSDP2 simulates the other two only."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if gather and hasattr(dist, "all_gather_single"):
        delattr(dist, "all_gather_single")
    real_bn, real_redistribute = F.batch_norm, DTensor.redistribute

    def batch_norm(*args, **kwargs):
        eps = kwargs.get("eps", args[7] if len(args) > 7 else 1e-5)
        if not eps > 0:
            raise RuntimeError("batch_norm eps must be positive")
        return real_bn(*args, **kwargs)

    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        if placements is not None and any(isinstance(p, _StridedShard) for p in placements):
            raise RuntimeError(
                f"use_strided_shard_as_shard_order is True, but placements: {tuple(placements)} "
                "is unable to be interpreted"
            )
        return real_redistribute(self, device_mesh, placements, **kwargs)

    F.batch_norm = batch_norm
    DTensor.redistribute = redistribute
    compat.STRIDED_SHARD_REDISTRIBUTE = False


def test_simulation_removes_what_2_11_lacks():
    def worker(rank, world):
        _as_torch_2_11()
        x = torch.ones(1, 2, 3)
        with pytest.raises(RuntimeError, match="eps must be positive"):
            F.batch_norm(x, torch.zeros(2), torch.ones(2), None, None, False, 0.0, 0.0)
        return hasattr(dist, "all_gather_single")

    assert run_on_ranks(worker, 1) == [False]


def _gather_worker(rank, world):
    from credit_parallel.domain.exchange.collectives import all_gather_rows
    from credit_parallel.domain.manager import DomainParallelManager
    from credit_parallel.domain.rows import shard_range
    from credit_parallel.layout.small_collectives import gather_small

    _as_torch_2_11()
    mgr = DomainParallelManager(world, world)
    mine = torch.full((2, 3), float(rank))
    stacked = gather_small(mine, None)
    start, stop = shard_range(5, world, rank)  # uneven rows: 5 over 2 ranks
    rows = torch.arange(start, stop, dtype=torch.float64).reshape(1, stop - start, 1)
    full = all_gather_rows(rows, 1, 5, mgr)
    return stacked, full


def test_gathers_use_all_gather_into_tensor_where_all_gather_single_is_missing():
    for stacked, full in run_on_ranks(_gather_worker, 2):
        assert torch.equal(stacked, torch.stack([torch.zeros(2, 3), torch.ones(2, 3)]))
        assert full.flatten().tolist() == [0, 1, 2, 3, 4]


def _group_norm_worker(rank, world, heights):
    from credit_parallel.domain.manager import DomainParallelManager

    _as_torch_2_11()
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = []
    for h in heights:
        gen = torch.Generator().manual_seed(h)
        x = torch.randn(2, 8, h, 6, generator=gen) + 10.0

        def build():
            torch.manual_seed(0)
            m = torch.nn.GroupNorm(2, 8)
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-1, 1)
            return m

        errs = domain_parity_errors(build, x, mgr)
        assert_parity(errs)
        out.append(errs)
    return out


@pytest.mark.parametrize("world, heights", [(2, (12, 13)), (3, (17,))])
def test_domain_group_norm_exact_without_the_eps_0_batch_norm(world, heights):
    for per_height in run_on_ranks(_group_norm_worker, world, heights):
        for errs in per_height:
            assert {"output", "input_grad", "param:weight", "param:bias"} <= set(errs)
            assert max(err for err, _ in errs.values()) <= 1e-10, errs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_affine_per_channel_is_one_rounded_multiply_add(dtype):
    """``t * scale + shift`` per channel with at most the two roundings of a multiply and an
    add (what the eps=0 batch norm it replaces did), against float64 arithmetic."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(3, 5, 40, generator=gen, dtype=torch.float64).to(dtype)
    scale = torch.randn(3, 5, generator=gen, dtype=torch.float64).to(dtype)
    shift = torch.randn(3, 5, generator=gen, dtype=torch.float64).to(dtype)
    out = compat.affine_per_channel(t, scale, shift)
    assert out.shape == t.shape and out.dtype == dtype
    product = t.double() * scale.double().unsqueeze(-1)
    exact = product + shift.double().unsqueeze(-1)
    ulp = torch.finfo(dtype).eps
    bound = ulp * (product.abs() + exact.abs())  # one rounding of each operation
    assert ((out.double() - exact).abs() <= bound).all()
    # channel blocks of several rows (the GroupNorm backward's (B, G, Cg) coefficients)
    t4 = t.reshape(3, 5, 4, 10)
    assert torch.equal(compat.affine_per_channel(t4, scale, shift), out.view(3, 5, 4, 10))
    assert compat.affine_per_channel(t[:, :, :0], scale, shift).shape == (3, 5, 0)


def _tp_worker(rank, world, old_api, case, layout, dtype):
    import test_tensor_parallel as ttp

    if old_api:
        _as_torch_2_11(gather=layout != "fsdp2")
    if layout == "fsdp2":
        return ttp._fsdp2_worker(rank, world, case)
    return ttp._parity_worker(rank, world, case, layout, dtype)


@pytest.mark.parametrize("old_api", [True, False])
def test_fused_projection_regroup_is_exact_on_both_paths(old_api):
    import test_tensor_parallel as ttp

    results = run_on_ranks(_tp_worker, 2, old_api, "fused_qkv_attention", "tp2", torch.float64)
    ttp._check_parity(results, 1e-10, 1e-10)


def test_fused_projection_under_fsdp2_over_tp_is_exact_with_the_old_api():
    results = run_on_ranks(_tp_worker, 4, True, "fused_qkv_attention", "fsdp2", torch.float64)
    for out_err, input_err, errors, _, tp_params in results:
        assert out_err <= 1e-10 and input_err <= 1e-10 and tp_params
        assert max(errors.values()) <= 1e-10, errors


def test_simulated_redistribute_refuses_the_strided_layout():
    """The simulation is faithful: with the old path the strided redistribute is not reached,
    and reaching it raises the 2.11 error (so the exactness tests above would have failed)."""

    def worker(rank, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        _as_torch_2_11()
        mesh = init_device_mesh("cpu", (world,))
        w = distribute_tensor(torch.arange(12.0).reshape(12, 1), mesh, [Shard(0)])
        compat.STRIDED_SHARD_REDISTRIBUTE = True
        try:
            compat.regroup_parts(w, 3)
        except RuntimeError as exc:
            refused = "unable to be interpreted" in str(exc)
        compat.STRIDED_SHARD_REDISTRIBUTE = False
        return refused, compat.regroup_parts(w, 3).flatten().tolist()

    results = run_on_ranks(worker, 2)
    assert results[0] == (True, [0.0, 1.0, 4.0, 5.0, 8.0, 9.0])
    assert results[1] == (True, [2.0, 3.0, 6.0, 7.0, 10.0, 11.0])
