"""Halo/compute overlap of the domain-parallel convolutions, and fused (batched) exchanges.

* ``overlap_split`` (pure): for many geometries, convolving the top window, the interior shard
  rows and the bottom window separately and concatenating gives bitwise the conv of the whole
  window (single process, no ranks);
* overlap on vs off on 2 and 3 gloo ranks: forward, input gradient and every parameter gradient
  are equal to rounding (bitwise only on CPUs whose conv kernels do not depend on the row split) for the Conv2d matrix of ``test_domain_conv.py`` (float64 and float32),
  Conv3d, the periodic conv, and a conv/GroupNorm/SiLU stack; the overlapped path really ran;
* a shard too thin for an interior row falls back to the plain path silently and stays exact;
* ``exchange_rows_batched`` / ``HaloExchange.forward_many``: several tensors in ONE batched call
  per direction, one message per peer, results equal to separate ``exchange_rows`` calls;
* the overlapped conv saves no more for backward than the plain one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.halo import HaloExchange, exchange_rows, exchange_rows_batched
from credit_parallel.domain.exchange.traffic import exchange_stats, record_exchange_stats
from credit_parallel.domain.layers.conv import DomainParallelConv2d, _DomainParallelConvNd
from credit_parallel.domain.layers.conv_geometry import ConvGeometry, conv_windows, overlap_split
from credit_parallel.domain.layers.split_conv import overlap_enabled, set_model_overlap
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import FILL, conv_window, edge_source_row, shard_range
from credit_parallel.models import PeriodicConv2d
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks
from helpers import parity_matrix_worker
from test_domain_conv import CONV2D

__all__: list[str] = []


# --------------------------------------------------------------------------- pure split
def _conv_rows_split_invariant(dtype) -> bool:
    """Whether this machine's CPU conv kernel gives an output row the same bits whichever other
    rows one call computes (true for oneDNN float32 here; float64 runs im2col + BLAS GEMM, whose
    blocking depends on the number of rows, e.g. on AMD EPYC with MKL: 3.6e-15 differences).
    The overlapped path relies on it for BITWISE equality; where it does not hold, overlap on and
    off are still equal to rounding, which is what the tests then assert."""
    gen = torch.Generator().manual_seed(0)
    for conv, nd, stride in (
        (F.conv2d, 2, 1),
        (F.conv2d, 2, 2),
        (F.conv3d, 3, 1),
        (F.conv3d, 3, 2),
    ):
        x = torch.randn(2, 4, *([4] * (nd - 2)), 15, 6, generator=gen, dtype=dtype)
        w = torch.randn(5, 4, *([3] * nd), generator=gen, dtype=dtype)
        full = conv(x, w, stride=stride)
        for out_cut in range(1, full.shape[-2]):
            top = conv(x[..., : (out_cut - 1) * stride + 3, :], w, stride=stride)
            bottom = conv(x[..., out_cut * stride :, :], w, stride=stride)
            if not torch.equal(full, torch.cat([top, bottom], -2)):
                return False
    return True


def _rounding(dtype) -> float:
    """Largest relative difference (max|a-b| / max|b|) overlap may make where the kernel is not
    split-invariant: rounding, the SPEC's float32 tolerance for float32."""
    return 1e-12 if dtype == torch.float64 else 1e-5


def _split_cases():
    for kw in (
        dict(kernel_size=3, padding=1),
        dict(kernel_size=5, padding=2),
        dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=4, stride=2, padding=1),
        dict(kernel_size=3, padding=2, dilation=2),
        dict(kernel_size=3, stride=2, padding=3, dilation=3),
        dict(kernel_size=2, stride=2),
        dict(kernel_size=3, padding=1, padding_mode="reflect"),
        dict(kernel_size=4, padding="same"),
    ):
        for length in (13, 16, 19):
            for n in (2, 3, 4):
                yield kw, length, n


def test_overlap_split_pieces_reassemble_the_window_conv_bitwise():
    """Top window + interior shard rows + bottom window == the whole window, for every rank
    (bitwise where this machine's conv kernel is split-invariant, else to rounding)."""
    bitwise = _conv_rows_split_invariant(torch.float64)
    checked = 0
    for kw, length, n in _split_cases():
        conv = nn.Conv2d(3, 4, **kw).double()
        geo = ConvGeometry.of(conv)
        x = torch.randn(
            1, 3, length, 6, generator=torch.Generator().manual_seed(length), dtype=torch.float64
        )
        out_len = geo.output_length(length, 0)
        for r in range(n):
            split = overlap_split(geo, 0, length, n, r)
            o0, o1 = shard_range(out_len, n, r)
            s, e = shard_range(length, n, r)
            lo, hi = conv_window(
                o0,
                o1,
                kernel=geo.kernel[0],
                stride=geo.stride[0],
                dilation=geo.dilation[0],
                pad_before=geo.pads[0][0],
            )
            rows = [edge_source_row(p, length, geo.edge_mode) for p in range(lo, hi)]
            window = torch.stack(
                [x[:, :, g] if g != FILL else torch.zeros_like(x[:, :, 0]) for g in rows], 2
            )

            def run(t, conv=conv, geo=geo):
                t = F.pad(t, (geo.pads[1][0], geo.pads[1][1], 0, 0))
                return F.conv2d(t, conv.weight, conv.bias, geo.stride, 0, geo.dilation)

            if split is None:
                # no interior: some output row of this rank reads outside the shard
                continue
            assert split.top_rows + split.interior_rows + split.bottom_rows == o1 - o0
            parts = []
            if split.top_rows:
                parts.append(run(window[:, :, : split.top_stop]))
            local = x[:, :, s:e]
            parts.append(run(local[:, :, split.interior_start : split.interior_stop]))
            if split.bottom_rows:
                parts.append(run(window[:, :, split.bottom_start :]))
            pieces, whole = torch.cat(parts, 2), run(window)
            if bitwise:
                assert torch.equal(pieces, whole), (kw, length, n, r)
            else:
                assert float((pieces - whole).detach().abs().max()) <= _rounding(torch.float64)
            checked += 1
    assert checked > 150


def test_overlap_split_is_none_for_thin_shards_and_transposed_convs():
    geo = ConvGeometry.of(nn.Conv2d(1, 1, 5, padding=2))
    # 5 rows over 4 ranks: shards of 2,1,1,1 rows cannot hold a 5-row kernel reach
    assert [overlap_split(geo, 0, 5, 4, r) for r in range(4)] == [None] * 4
    assert overlap_split(ConvGeometry.of(nn.ConvTranspose2d(1, 1, 3)), 0, 16, 2, 0) is None
    split = overlap_split(ConvGeometry.of(nn.Conv2d(1, 1, 3, padding=1)), 0, 16, 2, 0)
    # rank 0 of 2 owns rows [0, 8): row 0 reads the pole row -1, row 7 reads row 8
    assert (split.top_rows, split.interior_rows, split.bottom_rows) == (1, 6, 1)
    assert (split.interior_start, split.interior_stop) == (0, 8)


def test_overlap_is_a_layer_option_default_off_and_set_per_model():
    layer = DomainParallelConv2d(nn.Conv2d(1, 1, 3))
    assert layer.overlap is None  # the default rule: off on CPU (slower on the 2-core machine)
    assert not overlap_enabled(None, torch.device("cpu"))
    assert overlap_enabled(None, torch.device("cuda", 0))  # the transfer runs beside kernels
    assert overlap_enabled(True, torch.device("cpu")) and not overlap_enabled(False, None)
    model = nn.Sequential(layer, nn.SiLU(), DomainParallelConv2d(nn.Conv2d(1, 1, 3), overlap=False))
    assert set_model_overlap(model, True) == 2
    assert model[0].overlap is True and model[2].overlap is True
    assert set_model_overlap(model, None) == 2 and model[2].overlap is None
    with pytest.raises(TypeError, match="True, False or None"):
        set_model_overlap(model, "yes")
    with pytest.raises(TypeError, match="True, False or None"):
        DomainParallelConv2d(nn.Conv2d(1, 1, 3), overlap=1)


# --------------------------------------------------------------------------- on vs off, ranks
def _set_overlap(model: nn.Module, enabled: bool) -> None:
    for m in model.modules():
        if isinstance(m, _DomainParallelConvNd):
            m.configure(overlap=enabled)


def _on_off(mgr, build, shape, dtype, seed):
    """(bitwise equal?, max relative diff, overlapped calls) of overlap on vs off for one case."""
    torch.manual_seed(seed)
    ref = build().to(dtype)
    models = {}
    for enabled in (True, False):
        m = convert_to_domain_parallel(copy.deepcopy(ref), mgr)
        _set_overlap(m, enabled)
        models[enabled] = m
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    n, r = mgr.domain_world_size, mgr.domain_rank
    a, b = shard_range(shape[-2], n, r)
    with torch.no_grad():
        out_shape = ref(x).shape
    grad_out = torch.randn(out_shape, generator=gen, dtype=dtype)
    oa, ob = shard_range(out_shape[-2], n, r)
    results = {}
    for enabled, m in models.items():
        mgr.begin_forward(("overlap-test", seed, enabled))
        xl = x[..., a:b, :].clone().requires_grad_()
        with record_exchange_stats():
            y = m(xl)
            (y * grad_out[..., oa:ob, :]).sum().backward()
        tensors = [y.detach(), xl.grad] + [p.grad for p in m.parameters()]
        results[enabled] = (tensors, exchange_stats.overlapped_calls)
    equal, diff = True, 0.0
    for t_on, t_off in zip(results[True][0], results[False][0]):
        equal = equal and torch.equal(t_on, t_off)
        scale = max(float(t_off.double().abs().max()), 1e-30)
        diff = max(diff, float((t_on.double() - t_off.double()).abs().max()) / scale)
    return equal, diff, results[True][1], results[False][1]


def _conv_cases():
    out = []
    for i, (name, kw) in enumerate(CONV2D):
        for h in (16, (13, 17, 19)[i % 3]):
            out.append((f"conv2d_{name}_h{h}", lambda kw=kw: nn.Conv2d(4, 6, **kw), (2, 4, h, 9)))
    for h in (13, 16):
        out.append((f"conv3d_k3p1_h{h}", lambda: nn.Conv3d(3, 4, 3, padding=1), (1, 3, 4, h, 6)))
        out.append(
            (
                f"conv3d_k3s2p1_h{h}",
                lambda: nn.Conv3d(3, 4, 3, stride=2, padding=1),
                (1, 3, 4, h, 6),
            )
        )
    for k, p in ((3, 1), (5, 2)):
        for h in (16, 13):
            out.append(
                (
                    f"periodic_k{k}_h{h}",
                    lambda k=k, p=p: PeriodicConv2d(4, 6, k, padding=p),
                    (2, 4, h, 8),
                )
            )
    out.append(
        (
            "spectral_conv2d_h13",
            lambda: nn.utils.spectral_norm(nn.Conv2d(4, 6, 3, padding=1)),
            (2, 4, 13, 6),
        )
    )
    out.append(("conv_stack_h19", _stack, (1, 8, 19, 10)))
    return out


def _stack() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.SiLU(),
        PeriodicConv2d(8, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.SiLU(),
        nn.Conv2d(8, 4, 3, stride=2, padding=1),
    )


def _on_off_worker(rank, world, dtype):
    mgr = DomainParallelManager(world, world)
    results = {}
    for i, (name, build, shape) in enumerate(_conv_cases()):
        results[name] = _on_off(mgr, build, shape, dtype, i)
    return results


@pytest.mark.parametrize(
    "world,dtype", [(2, torch.float64), (3, torch.float64), (2, torch.float32), (3, torch.float32)]
)
def test_overlap_on_equals_overlap_off_to_rounding(world, dtype):
    # Bitwise equality needs kernels whose bits do not depend on how rows are split over calls
    # (forward) or on which gradients one backward call computes: true on the machine this was
    # first built on, not on every CPU (AMD EPYC with MKL/oneDNN here differs in the last bits
    # for Conv3d and strided convs).  What must hold everywhere: equal to rounding.
    results = run_on_ranks(_on_off_worker, world, dtype)
    unequal = [
        (rank, name, diff)
        for rank, per_rank in enumerate(results)
        for name, (_, diff, _, _) in per_rank.items()
        if diff > _rounding(dtype)
    ]
    assert not unequal, (
        f"overlap changed results beyond rounding ({_rounding(dtype)}) "
        f"(rank, case, max relative diff): {unequal}"
    )
    for per_rank in results:
        # the plain path never overlaps; the overlapped path ran in most cases on every rank
        assert all(off == 0 for _, _, _, off in per_rank.values())
        overlapped = sum(1 for _, _, on, _ in per_rank.values() if on > 0)
        assert overlapped >= 0.8 * len(per_rank), overlapped


def _path_results(mgr, build, shape, dtype, seed):
    """Forward, input and parameter gradients for each (split_halo, overlap) of one case."""
    torch.manual_seed(seed)
    ref = build().to(dtype)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    n, r = mgr.domain_world_size, mgr.domain_rank
    a, b = shard_range(shape[-2], n, r)
    with torch.no_grad():
        out_shape = ref(x).shape
    grad_out = torch.randn(out_shape, generator=gen, dtype=dtype)
    oa, ob = shard_range(out_shape[-2], n, r)
    results = {}
    for split, late in ((False, False), (True, False), (True, True)):
        m = convert_to_domain_parallel(copy.deepcopy(ref), mgr)
        for layer in m.modules():
            if isinstance(layer, _DomainParallelConvNd):
                layer.configure(split_halo=split, overlap=late)
        mgr.begin_forward(("path-test", seed, split, late))
        xl = x[..., a:b, :].clone().requires_grad_()
        y = m(xl)
        (y * grad_out[..., oa:ob, :]).sum().backward()
        results[split, late] = [y.detach(), xl.grad] + [p.grad for p in m.parameters()]
    return results


def _paths_worker(rank, world, dtype):
    mgr = DomainParallelManager(world, world)
    out = {}
    for i, (name, build, shape) in enumerate(_conv_cases()):
        res = _path_results(mgr, build, shape, dtype, i)
        late_equal = all(torch.equal(a, b) for a, b in zip(res[True, True], res[True, False]))
        diff = 0.0
        for t_split, t_window in zip(res[True, False], res[False, False]):
            scale = max(float(t_window.double().abs().max()), 1e-30)
            diff = max(diff, float((t_split.double() - t_window.double()).abs().max()) / scale)
        out[name] = (late_equal, diff)
    return out


@pytest.mark.parametrize("world,dtype", [(2, torch.float64), (3, torch.float32)])
def test_split_conv_equals_the_window_path_to_rounding_and_overlap_changes_no_bit(world, dtype):
    for per_rank in run_on_ranks(_paths_worker, world, dtype):
        for name, (late_equal, diff) in per_rank.items():
            # overlap only moves the wait: the same calls on the same operands
            assert late_equal, name
            assert diff <= _rounding(dtype), (name, diff)


def _convert_overlapped(model, mgr):
    model = convert_to_domain_parallel(model, mgr)
    set_model_overlap(model, True)
    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_overlapped_convs_match_the_single_process(dtype):
    cases = [(name, b, shape, _convert_overlapped) for name, b, shape in _conv_cases()[::3]]
    for per_rank in run_on_ranks(parity_matrix_worker, 3, cases, dtype):
        for name, errs in per_rank.items():
            try:
                assert_parity(errs, dtype)
            except AssertionError as err:
                raise AssertionError(f"{name}: {err}") from None


def _thin_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    with record_exchange_stats() as stats:
        x = torch.randn(2, 3, 5, 6, generator=torch.Generator().manual_seed(1))
        build = lambda: nn.Conv2d(3, 4, 5, padding=2)  # noqa: E731
        errs = domain_parity_errors(build, x, mgr, convert=_convert_overlapped)
    overlapped = stats.overlapped_calls
    calls = stats.p2p_calls
    assert_parity(errs)
    equal, _, _, _ = _on_off(
        mgr, lambda: nn.Conv2d(3, 4, 5, padding=2), (2, 3, 5, 6), torch.float64, 2
    )
    return overlapped, calls, equal


def test_shard_too_thin_for_an_interior_falls_back_to_the_plain_path():
    # 5 rows over 4 ranks (2,1,1,1) with a 5-row kernel: no rank has an interior output row
    for overlapped, calls, equal in run_on_ranks(_thin_worker, 4):
        assert overlapped == 0 and calls >= 2 and equal


# --------------------------------------------------------------------------- memory
def _saved_bytes(fn) -> int:
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _memory_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    conv = nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(1, 8, 32, 16)
    a, b = shard_range(32, world, rank)
    out = {}
    for split, enabled in ((True, True), (True, False), (False, False)):
        layer = DomainParallelConv2d(copy.deepcopy(conv), manager=mgr, overlap=enabled)
        layer.configure(split_halo=split)
        xl = x[:, :, a:b].clone().requires_grad_()
        # the input is also kept by another consumer (a residual), as inside a network
        out[split, enabled] = _saved_bytes(lambda layer=layer, xl=xl: (layer(xl) * xl).sum())
    return out


def test_split_conv_saves_no_copy_of_the_window_with_overlap_on_and_off():
    for out in run_on_ranks(_memory_worker, 2):
        # window path: the input plus a copy of it with the halo; split: the input plus halo rows
        row = 8 * 16 * 4
        assert out[True, True] <= out[False, False] - 14 * row, out
        assert out[True, False] <= out[False, False] - 14 * row, out


# --------------------------------------------------------------------------- batched exchange
def _batched_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    gen = torch.Generator().manual_seed(11)
    requests, grads = [], []
    specs = [  # (global shape, dim, windows builder, fill)
        ((2, 3, 13, 5), 2, lambda h: _halo(h, world, 2, 1, "zeros"), 0.0),
        ((4, 11, 3), 1, lambda h: _halo(h, world, 1, 3, "circular"), 0.0),
        ((1, 2, 3, 9, 4), 3, lambda h: _halo(h, world, 1, 1, "zeros"), 1.5),
    ]
    globals_, locals_ = [], []
    for shape, dim, windows_of, fill in specs:
        x = torch.randn(shape, generator=gen)
        h = shape[dim]
        windows = windows_of(h)
        a, b = shard_range(h, world, rank)
        globals_.append(x)
        locals_.append(x.narrow(dim, a, b - a))
        requests.append((windows, h, dim, fill))
        out_shape = list(shape)
        out_shape[dim] = len(windows[rank])
        grads.append(torch.randn(out_shape, generator=gen))
    # separately
    sep_x = [t.clone().requires_grad_() for t in locals_]
    with record_exchange_stats() as stats:
        sep = [
            exchange_rows(x, w, h, d, mgr, fill_value=f) for x, (w, h, d, f) in zip(sep_x, requests)
        ]
        sum((y * g).sum() for y, g in zip(sep, grads)).backward()
    sep_calls = stats.p2p_calls
    # batched
    bat_x = [t.clone().requires_grad_() for t in locals_]
    with record_exchange_stats():
        bat = exchange_rows_batched(
            [(x, w, h, d, f) for x, (w, h, d, f) in zip(bat_x, requests)], mgr
        )
        sum((y * g).sum() for y, g in zip(bat, grads)).backward()
    equal = all(torch.equal(a, b) for a, b in zip(sep, bat))
    equal = equal and all(torch.equal(a.grad, b.grad) for a, b in zip(sep_x, bat_x))
    batched = (exchange_stats.p2p_calls, exchange_stats.messages)
    # HaloExchange.forward_many on two tensors of one dim
    halo = HaloExchange(2, manager=mgr, mode="reflect")
    t1, t2 = (torch.randn(2, 3, 12, 4, generator=gen) for _ in range(2))
    a, b = shard_range(12, world, rank)
    with record_exchange_stats() as stats:
        many = halo.forward_many(t1[:, :, a:b], t2[:, :, a:b])
    many_calls = stats.p2p_calls
    single = [halo(t1[:, :, a:b]), halo(t2[:, :, a:b])]
    equal = equal and all(torch.equal(m, s) for m, s in zip(many, single))
    return equal, sep_calls, batched, many_calls


def _halo(h, n, before, after, mode):
    from credit_parallel.domain.exchange.halo import halo_window

    return tuple(halo_window(h, n, r, before, after, mode) for r in range(n))


@pytest.mark.parametrize("world", [3, 4])
def test_batched_exchange_is_one_call_per_direction_and_equals_separate_calls(world):
    for rank, (equal, sep_calls, (calls, messages), many_calls) in enumerate(
        run_on_ranks(_batched_worker, world)
    ):
        assert equal, rank
        assert sep_calls == 6 and calls == 2 and many_calls == 1, (sep_calls, calls, many_calls)
        # one message per peer and direction (a circular halo reaches at most 3 peers here)
        assert messages <= 2 * min(world - 1, 3), messages


def test_batched_exchange_rejects_mixed_dtypes_and_bad_requests():
    class _Mgr:
        domain_world_size, domain_rank = 2, 0

    w = ((0, 1), (0, 1))
    with pytest.raises(ValueError, match="request 1 is torch.float32"):
        exchange_rows_batched(
            [(torch.zeros(1, 1, dtype=torch.float64), w, 2, 0), (torch.zeros(1, 1), w, 2, 0)],
            _Mgr(),
        )
    with pytest.raises(ValueError, match="request 0 must be"):
        exchange_rows_batched([(torch.zeros(1, 1), w)], _Mgr())
    assert exchange_rows_batched([], _Mgr()) == []


# --------------------------------------------------------------------------- shared input
class _CrossScale(nn.Module):
    """Branches with different kernels and one stride on the same input (CrossFormer-style)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(3, 4, k, stride=2, padding=(k - 2) // 2) for k in (2, 4, 6)
        )

    def forward(self, x):
        return torch.cat([conv(x) for conv in self.convs], dim=1)


def _unfused_convert(model, mgr):
    return convert_to_domain_parallel(model, mgr, fuse_exchanges=False)


def _shared_convert(model, mgr):
    from credit_parallel.domain.exchange.shared_input import share_input_exchange

    _unfused_convert(model, mgr)
    share_input_exchange(*model.convs)
    return model


def _shared_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = {}
    for h in (16, 20):
        x = torch.randn(2, 3, h, 8, generator=torch.Generator().manual_seed(h))
        with record_exchange_stats() as stats:
            errs = domain_parity_errors(_CrossScale, x, mgr, convert=_shared_convert)
        assert_parity(errs)
        shared_calls = stats.p2p_calls
        with record_exchange_stats() as stats:
            domain_parity_errors(_CrossScale, x, mgr, convert=_unfused_convert)
        out[h] = (shared_calls, stats.p2p_calls)
    # the same layers called on two different tensors exchange for each (never mis-paired)
    model = _shared_convert(_CrossScale(), mgr)
    a, b = shard_range(16, world, rank)
    t1, t2 = torch.randn(1, 3, 16, 8), torch.randn(1, 3, 16, 8)
    ys = [conv(t) for conv, t in zip(model.convs, (t1[:, :, a:b], t2[:, :, a:b], t1[:, :, a:b]))]
    ref_model = _unfused_convert(copy.deepcopy(_CrossScale()), mgr)
    ref_model.load_state_dict(model.state_dict())
    refs = [
        conv(t) for conv, t in zip(ref_model.convs, (t1[:, :, a:b], t2[:, :, a:b], t1[:, :, a:b]))
    ]
    # to rounding: a layer whose sharing switched off convolves around the halo (split path),
    # the reference too; a mis-paired window would differ by O(1)
    out["mixed_equal"] = all(float((y - r).abs().max()) <= 1e-12 for y, r in zip(ys, refs))
    return out


def test_convs_sharing_an_input_exchange_once_and_stay_exact():
    for out in run_on_ranks(_shared_worker, 3):
        for h in (16, 20):
            shared, separate = out[h]
            # gather_tensor in the parity check adds no P2P.  Separately each branch that needs
            # rows exchanges (the k2 s2 branch not on every rank); shared: 1 call each way
            assert shared == 2 and separate >= 4, out[h]
        assert out["mixed_equal"]


def test_share_input_exchange_rejects_mismatched_layers():
    from credit_parallel.domain.exchange.shared_input import share_input_exchange
    from credit_parallel.domain.layers.conv import DomainParallelConvTranspose2d

    a = DomainParallelConv2d(nn.Conv2d(2, 2, 3, padding=1))
    b = DomainParallelConv2d(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match="boundary rule"):
        share_input_exchange(a, b)
    with pytest.raises(TypeError, match="non-transposed"):
        share_input_exchange(a, DomainParallelConvTranspose2d(nn.ConvTranspose2d(2, 2, 2, 2)))
    with pytest.raises(ValueError, match="at least two"):
        share_input_exchange(a)


# --------------------------------------------------------------------------- with FSDP2
def _fsdp_worker(rank, world):
    from credit_parallel.models import UNet
    from credit_parallel.parallel.composition import get_domain_manager, parallelize

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, 17, 16, generator=gen)
    g = torch.randn(2, 4, 17, 16, generator=gen)
    a, b = shard_range(17, world, rank)
    results = {}
    for enabled in (True, False):
        torch.manual_seed(0)
        model = UNet(4, 4, 17, 16, base_channels=8, channel_mults=(1, 2), norm_groups=2)
        parallelism = {"data": "fsdp2", "tensor": 1, "domain": world}
        conf = {"trainer": {"parallelism": parallelism, "activation_checkpoint": True}}
        model = parallelize(model, conf)
        set_model_overlap(model, enabled)
        mgr = get_domain_manager(model)
        mgr.begin_forward(("fsdp-overlap", enabled))
        xl = x[:, :, a:b].clone().requires_grad_()
        with record_exchange_stats() as stats:
            (model(xl) * g[:, :, a:b]).sum().backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        results[enabled] = ([xl.grad, *grads], stats.overlapped_calls)
    equal = all(torch.equal(p, q) for p, q in zip(results[True][0], results[False][0]))
    return equal, results[True][1], results[False][1]


def test_overlap_under_fsdp2_with_activation_checkpointing_is_bitwise_unchanged():
    for equal, overlapped_on, overlapped_off in run_on_ranks(_fsdp_worker, 2):
        assert equal and overlapped_on > 0 and overlapped_off == 0


# --------------------------------------------------------------------------- composed windows
def _compose_worker(rank, world):
    from credit_parallel.domain.layers.padding import pad_windows
    from credit_parallel.domain.rows import compose_windows

    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = []
    for h, mode in ((13, "reflect"), (16, "replicate"), (11, "circular")):
        pads = pad_windows(h, world, 2, 1, mode)  # a padding layer: H -> H + 3
        geo = ConvGeometry.of(nn.Conv2d(2, 2, 3))  # then a "valid" 3x3 conv
        conv, _ = conv_windows(geo, 0, h + 3, world)
        fused = compose_windows(pads, h + 3, conv)
        x = torch.randn(2, 2, h, 5, generator=torch.Generator().manual_seed(h))
        g = torch.randn(2, 2, len(conv[rank]), 5, generator=torch.Generator().manual_seed(1))
        a, b = shard_range(h, world, rank)
        xs = [x[:, :, a:b].clone().requires_grad_() for _ in range(2)]
        with record_exchange_stats():
            two = exchange_rows(exchange_rows(xs[0], pads, h, 2, mgr), conv, h + 3, 2, mgr)
            (two * g).sum().backward()
        calls_two = exchange_stats.p2p_calls
        with record_exchange_stats():
            one = exchange_rows(xs[1], fused, h, 2, mgr)
            (one * g).sum().backward()
        out.append(
            (
                torch.equal(one, two),
                float((xs[0].grad - xs[1].grad).abs().max()),
                calls_two,
                exchange_stats.p2p_calls,
            )
        )
    return out


def test_composed_windows_turn_pad_then_conv_into_one_exchange():
    results = run_on_ranks(_compose_worker, 3)
    for case in range(3):
        per_case = [per_rank[case] for per_rank in results]
        for equal, grad_err, calls_two, calls_one in per_case:
            assert equal and grad_err <= 1e-12
            # at most one exchange each way; a rank may sit out an exchange with nothing to move
            assert calls_one <= 2 and calls_two >= calls_one
        assert sum(c[2] for c in per_case) > sum(c[3] for c in per_case)


def test_compose_windows_checks_its_arguments():
    from credit_parallel.domain.rows import compose_windows

    with pytest.raises(ValueError, match="one per rank"):
        compose_windows(((0,), (1,)), 2, ((0,),))
    with pytest.raises(ValueError, match="balanced layout"):
        compose_windows(((0, 1), (2,)), 4, ((0,), (1,)))
    assert compose_windows(((5, FILL), (7,)), 3, ((FILL, 2, 0), (1,))) == ((FILL, 7, 5), (FILL,))


def test_shared_layers_survive_deepcopy_and_pickling_mid_forward():
    import io

    from credit_parallel.domain.exchange.shared_input import share_input_exchange

    model = _CrossScale()
    for i, conv in enumerate(model.convs):
        model.convs[i] = DomainParallelConv2d(conv)
    share_input_exchange(*model.convs)
    group = model.convs[0].shared_input
    window = torch.ones(2, requires_grad=True) * 2  # a non-leaf, as a window in flight is
    group._entry = (None, 0, 4, window, {0})
    copied = copy.deepcopy(model)
    new_group = copied.convs[0].shared_input
    assert new_group is copied.convs[2].shared_input and new_group._entry is None
    assert new_group.layers == tuple(copied.convs)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.convs[1].shared_input._entry is None


# --------------------------------------------------------------------------- path choice
def test_default_path_is_split_except_for_explicitly_padded_convs_and_the_side_stream():
    from credit_parallel.domain.layers.conv import DomainParallelPeriodicConv2d

    plain = DomainParallelConv2d(nn.Conv2d(2, 2, 3, padding=1))
    periodic = DomainParallelPeriodicConv2d(PeriodicConv2d(2, 2, 3, padding=1))
    assert plain._splits and not periodic._splits  # periodic: the window path by default
    periodic.configure(overlap=False)  # an explicit overlap choice is a choice of the split form
    assert periodic._splits
    periodic.configure(split_halo=False)
    assert not periodic._splits
    plain.configure(side_stream=True)  # the side stream posts through the window path
    assert not plain._splits


def test_halo_paths_benchmark_sets_every_domain_conv():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "halo_paths.py"
    spec = importlib.util.spec_from_file_location("halo_paths_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    model = nn.Sequential(
        DomainParallelConv2d(nn.Conv2d(2, 2, 3, padding=1)), nn.SiLU(), nn.Conv2d(2, 2, 1)
    )
    assert module.set_halo_path(model, *module.VARIANTS["window"]) == 1
    assert model[0].split_halo is False and model[0].overlap is False
    assert module.set_halo_path(model, *module.VARIANTS["default"]) == 1
    assert model[0].split_halo is None and model[0].overlap is None
