"""DomainParallelGroupNorm against nn.GroupNorm on one process: forward, input gradient and
parameter gradients, for 2-4 domain ranks, even and uneven heights, 4-D and 5-D inputs; plus the
collective count, numerical stability at a large mean, and the conv-stack benchmark smoke run."""

import copy
import importlib.util
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from credit_parallel.domain.layers.norm import (
    DomainParallelGroupNorm,
    group_norm_input_grad_coefficients,
    local_group_moments,
    merge_group_moments,
)
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.domain.sharding import gather_tensor
from credit_parallel.layout import small_collectives
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks

CHANNELS = 8


def _group_norm(groups, affine, dtype=torch.float64):
    def build():
        norm = nn.GroupNorm(groups, CHANNELS, affine=affine).to(dtype)
        if affine:  # non-trivial weights, so that their gradients mean something
            with torch.no_grad():
                norm.weight.normal_()
                norm.bias.normal_()
        return norm

    return build


def _input(shape, offset, seed=5, dtype=torch.float64):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x * 3 + offset).to(dtype)


def _parity_cases_worker(rank, world, heights):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    results = {}
    for h in heights:
        for ndim in (4, 5):
            shape = (2, CHANNELS, h, 6) if ndim == 4 else (2, CHANNELS, 3, h, 5)
            # a mean far from zero (nn.GroupNorm's own float64 weight gradient, computed as
            # sum(dy * x) - mean * sum(dy), loses ~1e-10 beyond an offset of 1e4)
            x = _input(shape, offset=1.0e3)
            for groups in (1, 2, 4):
                for affine in (True, False):
                    errs = domain_parity_errors(_group_norm(groups, affine), x, mgr)
                    results[(h, ndim, groups, affine)] = errs
                    assert_parity(errs)
    return results


@pytest.mark.parametrize("world, heights", [(2, (12, 13)), (3, (12, 17)), (4, (12, 19))])
def test_group_norm_groups_1_2_4_affine_4d_5d_matches_single_process(world, heights):
    results = run_on_ranks(_parity_cases_worker, world, heights)
    cases = results[0]
    assert len(cases) == len(heights) * 2 * 3 * 2
    for errs in cases.values():
        # forward, the exact input gradient and (affine) both parameter gradients were compared
        assert "output" in errs and "input_grad" in errs
    assert all("param:weight" in e and "param:bias" in e for k, e in cases.items() if k[3])


def _float32_worker(rank, world, h):
    mgr = DomainParallelManager(world, world)
    build = _group_norm(2, True, torch.float32)
    x = _input((2, CHANNELS, h, 10), offset=10.0, dtype=torch.float32)
    assert_parity(domain_parity_errors(build, x, mgr), torch.float32)
    # At a mean of 1000 nn.GroupNorm's own float32 weight gradient is off by ~8e-5 (it forms
    # sum(dy * x) - mean * sum(dy)), so there the float64 computation on the same float32 input
    # is the reference, and the bounds are float32 rounding, ten times below the contract's.
    x = _input((2, CHANNELS, h, 10), offset=1000.0, dtype=torch.float32)
    torch.manual_seed(0)
    norm = build()
    ref = copy.deepcopy(norm).double()
    x64 = x.double().requires_grad_()
    y64 = ref(x64)
    grad_y = torch.randn(y64.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (y64 * grad_y).sum().backward()
    layer = DomainParallelGroupNorm(norm, manager=mgr)
    a, b = shard_range(h, world, rank)
    x_local = x[:, :, a:b].clone().requires_grad_()
    y = layer(x_local)
    (y * grad_y[:, :, a:b].float()).sum().backward()
    assert y.dtype == torch.float32
    pairs = {
        "output": (gather_tensor(y.detach(), -2, mgr), y64.detach()),
        "input_grad": (gather_tensor(x_local.grad, -2, mgr), x64.grad),
    }
    for name in ("weight", "bias"):
        grad = getattr(norm, name).grad.clone()
        dist.all_reduce(grad, group=mgr.domain_group)
        pairs[f"param:{name}"] = (grad, getattr(ref, name).grad)
    return {k: float((a.double() - b).abs().max() / b.abs().max()) for k, (a, b) in pairs.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_group_norm_float32_h13_matches_single_process_and_is_stable_at_mean_1000(world):
    for rel in run_on_ranks(_float32_worker, world, 13):
        assert rel["output"] <= 1e-6 and rel["input_grad"] <= 1e-6, rel
        assert rel["param:weight"] <= 1e-5 and rel["param:bias"] <= 1e-5, rel


def _count_collectives_worker(rank, world, point_to_point):
    torch.set_default_dtype(torch.float64)
    if not point_to_point:  # the collective path, as on NCCL or large groups
        small_collectives.P2P_MAX_BYTES = 0
    mgr = DomainParallelManager(world, world)
    calls = {}
    names = ("all_gather_single", "all_gather", "all_gather_into_tensor", "all_reduce")
    names += ("broadcast", "reduce_scatter_tensor", "batch_isend_irecv", "send", "recv")
    # torch < 2.13 has no all_gather_single (credit_parallel.compat uses all_gather_into_tensor)
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return call

    torch.manual_seed(0)
    layer = DomainParallelGroupNorm(nn.GroupNorm(4, CHANNELS), manager=mgr)
    x = _input((2, CHANNELS, 7, 6), offset=0.0, seed=rank).requires_grad_()
    try:
        for name in originals:
            setattr(dist, name, counting(name))
        y = layer(x)
        forward = dict(calls)
        calls.clear()
        y.square().sum().backward()
        backward = dict(calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return forward, backward


def test_group_norm_forward_is_one_all_gather_backward_one_all_reduce():
    for forward, backward in run_on_ranks(_count_collectives_worker, 2, False):
        gather = (
            "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        )
        assert forward == {gather: 1}
        assert backward == {"all_reduce": 1}


def test_group_norm_on_two_gloo_ranks_is_one_batch_of_point_to_point_per_direction():
    for forward, backward in run_on_ranks(_count_collectives_worker, 2, True):
        assert forward == {"batch_isend_irecv": 1}
        assert backward == {"batch_isend_irecv": 1}


def _collective_path_parity_worker(rank, world):
    small_collectives.P2P_MAX_BYTES = 0
    return _parity_cases_worker(rank, world, (13,))


@pytest.mark.parametrize("world", [2, 3])
def test_group_norm_matches_single_process_through_the_gloo_collectives_too(world):
    cases = run_on_ranks(_collective_path_parity_worker, world)[0]
    assert len(cases) == 2 * 3 * 2


def _domain1_worker(rank, world):
    mgr = DomainParallelManager(world, 1)
    norm = nn.GroupNorm(2, CHANNELS)
    with torch.no_grad():
        norm.weight.normal_()
    layer = DomainParallelGroupNorm(copy.deepcopy(norm), manager=mgr)
    x = _input((2, CHANNELS, 5, 6), offset=1.0, dtype=torch.float32)
    return torch.equal(layer(x), norm(x))


def test_group_norm_domain_size_1_is_the_group_norm():
    assert run_on_ranks(_domain1_worker, 1) == [True]


def _bf16_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, CHANNELS)
    layer = DomainParallelGroupNorm(copy.deepcopy(norm).bfloat16(), manager=mgr)
    x = _input((2, CHANNELS, 9, 6), offset=4.0, dtype=torch.bfloat16)
    a, b = shard_range(9, world, rank)
    y = layer(x[:, :, a:b])
    full = gather_tensor(y, -2, mgr)
    ref = norm(x.float())
    return y.dtype, float((full.float() - ref).abs().max())


def test_group_norm_bf16_input_gives_bf16_output():
    for dtype, err in run_on_ranks(_bf16_worker, 2):
        assert dtype == torch.bfloat16
        assert err <= 0.05  # bf16 output rounding only (values of a few units)


def _bf16_backward_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, CHANNELS)
    layer = DomainParallelGroupNorm(copy.deepcopy(norm).bfloat16(), manager=mgr)
    x = _input((2, CHANNELS, 9, 6), offset=4.0, dtype=torch.bfloat16)
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    a, b = shard_range(9, world, rank)
    x_local = x[:, :, a:b].clone().requires_grad_()
    layer(x_local).backward(grad_y[:, :, a:b].bfloat16())
    x_ref = x.float().requires_grad_()
    norm(x_ref).backward(grad_y)
    grad = gather_tensor(x_local.grad, -2, mgr)
    err = float((grad.float() - x_ref.grad).abs().max() / x_ref.grad.abs().max())
    return x_local.grad.dtype, err


def test_group_norm_bf16_backward_gives_bf16_input_grad_close_to_float32():
    for dtype, err in run_on_ranks(_bf16_backward_worker, 2):
        assert dtype == torch.bfloat16
        assert err <= 0.02  # bf16 rounding of the input, the output gradient and the result


def test_group_norm_keeps_state_dict_keys_and_properties():
    norm = nn.GroupNorm(4, CHANNELS, eps=1e-3)
    layer = DomainParallelGroupNorm(norm)
    assert list(layer.state_dict()) == list(norm.state_dict()) == ["weight", "bias"]
    assert layer.weight is norm.weight
    assert (layer.num_groups, layer.num_channels, layer.eps, layer.affine) == (4, 8, 1e-3, True)
    with pytest.raises(TypeError, match="GroupNorm"):
        DomainParallelGroupNorm(nn.LayerNorm(8))


def _rows_of_rank_worker(rank, world, h, dtype):
    """Compare this rank's own output rows and gradient rows with the single-process ones
    directly (no gather), so that a rank with zero rows is checked too."""
    mgr = DomainParallelManager(world, world)
    torch.manual_seed(0)
    norm = _group_norm(2, True, dtype)()
    ref = copy.deepcopy(norm)
    x = _input((2, CHANNELS, h, 6), offset=50.0, dtype=dtype)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    grad_y = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    (y_ref * grad_y).sum().backward()
    a, b = shard_range(h, world, rank)
    x_local = x[:, :, a:b].clone().requires_grad_()
    layer = DomainParallelGroupNorm(norm, manager=mgr)
    y = layer(x_local)
    (y * grad_y[:, :, a:b]).sum().backward()

    def max_abs(t):
        return float(t.detach().abs().amax()) if t.numel() else 0.0

    errs = {
        "rows": b - a,
        "output": max_abs(y - y_ref[:, :, a:b]),
        "input_grad": max_abs(x_local.grad - x_ref.grad[:, :, a:b]),
        "finite": bool(torch.isfinite(y).all() and torch.isfinite(x_local.grad).all()),
    }
    for name in ("weight", "bias"):
        grad = getattr(norm, name).grad.clone()
        dist.all_reduce(grad, group=mgr.domain_group)
        errs[name] = float((grad - getattr(ref, name).grad).abs().max())
    return errs


def test_group_norm_h2_domain3_rank_with_zero_rows_matches_single_process_float64():
    results = run_on_ranks(_rows_of_rank_worker, 3, 2, torch.float64)
    assert [r["rows"] for r in results] == [1, 1, 0]
    for r in results:
        assert r["finite"]
        for key in ("output", "input_grad", "weight", "bias"):
            assert r[key] <= 1e-10, (key, r)


def test_group_norm_h5_domain4_float32_matches_single_process_rows_of_each_rank():
    results = run_on_ranks(_rows_of_rank_worker, 4, 5, torch.float32)
    assert [r["rows"] for r in results] == [2, 1, 1, 1]
    for r in results:
        # outputs/input gradients are O(1..10); the SPEC's float32 bounds are relative 1e-5
        assert r["output"] <= 2e-5 and r["input_grad"] <= 1e-5, r
        assert r["weight"] <= 1e-3 and r["bias"] <= 1e-3, r


def test_local_moments_of_uneven_and_empty_pieces_merge_to_the_global_moments():
    x = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x = x * 2 + 1.0e4
    pieces = torch.tensor_split(x, (9, 9, 31), dim=-1)  # sizes 9, 0, 22, 9: one empty
    stats = []
    for p in pieces:
        centred = p - p.mean(-1, keepdim=True) if p.shape[-1] else p
        hi = p.mean(-1) if p.shape[-1] else torch.zeros(p.shape[:-1], dtype=p.dtype)
        stats.append(local_group_moments(centred, hi, torch.float64))
    stats = torch.stack(stats)
    assert stats[1, 0].eq(0).all() and torch.isfinite(stats).all()
    mean, m2 = merge_group_moments(stats[:, 0], stats[:, 1], stats[:, 2])
    var, ref_mean = torch.var_mean(x, dim=-1, correction=0)
    assert torch.allclose(mean, ref_mean, rtol=0, atol=1e-10)
    assert torch.allclose(m2 / 40, var, rtol=1e-12, atol=0)


def test_chan_merge_of_split_moments_is_stable_at_a_mean_of_1e6():
    spread = torch.randn(3, 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = spread + 1.0e6  # x - 1e6 is exact, so the spread gives the exact moments
    parts = torch.tensor_split(x, (7, 25), dim=1)
    counts = torch.tensor([[p.shape[1]] * 3 for p in parts], dtype=torch.float64)
    means = torch.stack([p.mean(1) for p in parts])
    m2s = torch.stack([((p - p.mean(1, keepdim=True)) ** 2).sum(1) for p in parts])
    mean, m2 = merge_group_moments(counts, means, m2s)
    var, spread_mean = torch.var_mean(x - 1.0e6, dim=1, correction=0)
    assert torch.allclose(mean - 1.0e6, spread_mean, rtol=0, atol=1e-9)
    assert torch.allclose(m2 / 40, var, rtol=1e-9, atol=0)
    # the sum-of-squares merge the formula replaces is off by ~1e-4 here
    squares = torch.stack([(p**2).sum(1) for p in parts]).sum(0)
    naive_var = squares / 40 - (x.sum(1) / 40) ** 2
    assert not torch.allclose(naive_var, var, rtol=1e-9, atol=0)


# ---------------------------------------------------------------- the conv-stack benchmark
def _load_benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "domain_conv_stack.py"
    spec = importlib.util.spec_from_file_location("domain_conv_stack", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_conv_stack_benchmark_tiny_run_sends_exactly_the_minimum_halo():
    bench = _load_benchmark()
    out = io.StringIO()
    argv = ["--channels", "8", "--height", "16", "--width", "32", "--blocks", "2"]
    with redirect_stdout(out):
        bench.main(argv + ["--steps", "1", "--warmup", "0"])
    text = out.getvalue()
    for direction, convs in (("forward", 2), ("backward", 1)):
        match = re.search(rf"halo bytes/step {direction}\s*\|\s*(\d+)\s*\|\s*(\d+)", text)
        assert match, text
        measured, minimum = int(match.group(1)), int(match.group(2))
        # convs x 1 interior boundary x 2 directions x 1 row x 8 channels x 32 x 4 bytes; the
        # first conv's input (the model's) needs no gradient: 1 conv returns gradients
        assert measured == minimum == convs * 2 * 8 * 32 * 4
    assert re.search(r"P2P calls per exchange\s*\|\s*1\.00", text), text


def _load_script(name):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_groupnorm_speed_benchmark_tiny_run_times_all_four_variants():
    bench = _load_script("groupnorm_speed")
    argv = ["--channels", "8", "--groups", "2", "--height", "8", "--width", "8"]
    argv += ["--steps", "1", "--warmup", "0", "--rounds", "1"]
    with redirect_stdout(io.StringIO()) as out:
        result = bench.main(argv)
    assert set(result) == {"native_full", "native_shard", "ours_1rank", "ours_domain"}
    for r in result.values():
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["cpu_ms"] > 0
    assert "DomainParallelGroupNorm, domain ranks" in out.getvalue()


def _autocast_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, CHANNELS)
    layer = DomainParallelGroupNorm(copy.deepcopy(norm), manager=mgr)
    x = _input((2, CHANNELS, 9, 6), offset=2.0, dtype=torch.bfloat16)
    a, b = shard_range(9, world, rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x[:, :, a:b])
        ref = norm(x)
    full = gather_tensor(y, -2, mgr)
    return y.dtype, ref.dtype, float((full.float() - ref.float()).abs().max())


def test_group_norm_under_cpu_autocast_keeps_the_dtype_nn_group_norm_gives():
    for dtype, ref_dtype, err in run_on_ranks(_autocast_worker, 2):
        assert dtype == ref_dtype == torch.bfloat16  # CPU autocast leaves group_norm in bf16
        assert err <= 0.05  # bf16 output rounding only (values of a few units)


@pytest.mark.parametrize("affine", [True, False])
def test_input_grad_coefficients_give_the_autograd_group_norm_gradient_one_process(affine):
    gen = torch.Generator().manual_seed(11)
    b, g, cg, length = 2, 3, 2, 20
    x = torch.randn(b, g * cg, length, generator=gen, dtype=torch.float64) * 2 + 7
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    weight = torch.randn(g * cg, generator=gen, dtype=torch.float64) if affine else None
    xr = x.clone().requires_grad_()
    torch.nn.functional.group_norm(xr, g, weight, None, 1e-5).backward(dy)
    grouped = x.view(b, g, cg * length)
    hi = grouped.mean(-1) + 0.25  # any centring close to the mean
    t = grouped - hi.unsqueeze(-1)
    var, mean = torch.var_mean(grouped, dim=-1, correction=0)
    rstd = torch.rsqrt(var + 1e-5)
    offset = mean - hi
    w = weight.view(g, cg) if affine else torch.ones(g, cg, dtype=torch.float64)
    dyg = dy.view(b, g, cg, length) * w.unsqueeze(-1)
    sum_g = dyg.sum((-1, -2))
    sum_g_centred = (dyg * (t.view(b, g, cg, length) - offset[..., None, None])).sum((-1, -2))
    count = torch.full_like(rstd, cg * length)
    alpha, beta, c = group_norm_input_grad_coefficients(
        rstd, offset, sum_g, sum_g_centred, count, weight.view(g, cg) if affine else None
    )
    dx = (
        dy.view(b, g, cg, length) * alpha.unsqueeze(-1)
        + t.view(b, g, cg, length) * beta[..., None, None]
        + c[..., None, None]
    )
    assert torch.allclose(dx.reshape(x.shape), xr.grad, rtol=0, atol=1e-12)
