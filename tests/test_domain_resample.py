"""Domain-parallel resampling (interpolation, PixelShuffle/Unshuffle, unpad_shard_interp) against
the single-process computation: forward and input gradient, 1-4 domain ranks, even and uneven
heights, up- and down-sampling, odd sizes; plus pure checks that the source-row arithmetic
reproduces ``F.interpolate`` index for index."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from credit_parallel.domain.layers.resample import (
    DomainParallelInterpolate,
    DomainParallelPixelShuffle,
    DomainParallelPixelUnshuffle,
    KernelTraits,
    interp_output_size,
    interp_row_plan,
    interp_source_rows_exact,
    kernel_probe_weights,
    kernel_traits,
    weight_matrix,
)
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import interp_source_rows
from credit_parallel.domain.sharding import gather_tensor, shard_tensor, unpad_shard_interp
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks

# --------------------------------------------------------------------------- pure index checks
# (in_len, out_len or None, scale_factor or None)
_INDEX_CASES = [
    (9, 17, None),
    (17, 33, None),
    (12, 24, None),
    (13, 6, None),
    (19, 7, None),
    (7, 7, None),
    (1, 5, None),
    (5, 1, None),
    (30, 11, None),
    (11, 30, None),
    (12, None, 2.0),
    (13, None, 0.5),
    (17, None, 1.7),
    (19, None, 0.3),
    (10, None, 3.0),
    (9, None, 0.77),
    (23, None, 2.5),
    (6, None, 1.0 / 3.0),
    (40, None, 0.1),
]
# nearest with out == 2 * in but a scale factor other than 2: the CPU kernel uses dst >> 1
_DOUBLING_CASES = [(5, None, 2.1), (4, None, 2.2), (6, None, 2.05)]
# the size does not change but the scale factor is not 1: the CPU kernels copy that dim
_UNCHANGED_CASES = [(7, None, 1.1), (12, None, 1.05), (19, None, 1.04)]
_MODES = [("nearest", None), ("bilinear", False), ("bilinear", True)]


def _check_source_rows(fn, cases, modes, *, exact_weights, width_changes=True, **extra):
    """Compare ``fn``'s source rows and weights with the CPU kernel's for every case, in float32
    and float64.  With ``exact_weights`` the same rows carry weight (index agreement is exact)
    and the weights are bitwise equal wherever the two source rows differ; without, weights
    agree to an ulp of the source coordinate (and a tie may move such a weight to a neighbour).
    ``width_changes``: the probe's width goes 1 -> 2, so only H can stay unchanged."""
    w_out = 2 if width_changes else 1
    for in_len, out_len, sf in cases:
        for mode, ac in modes:
            for dtype in (torch.float32, torch.float64):
                probe = (
                    {"size": (out_len, w_out)}
                    if sf is None
                    else {"scale_factor": (sf, float(w_out))}
                )
                ref = kernel_probe_weights(mode, in_len, align_corners=ac, dtype=dtype, **probe)
                n_out = ref.shape[1]
                double = dtype == torch.float64
                kw = {k: v(dtype) for k, v in extra.items()}
                if "shape_unchanged" in kw:
                    kw["shape_unchanged"] = n_out == in_len and w_out == 1
                src = fn(
                    mode,
                    in_len,
                    n_out,
                    0,
                    n_out,
                    align_corners=ac,
                    scale_factor=sf,
                    double=double,
                    **kw,
                )
                mine = weight_matrix(src, in_len, n_out, double)
                what = f"{mode} ac={ac} {in_len}->{n_out} sf={sf} {dtype} w_out={w_out}"
                eps = float(torch.finfo(dtype).eps)
                tol = 2 * eps if exact_weights else 2 * eps * in_len
                floor = 0.0 if exact_weights else tol
                np.testing.assert_array_equal(ref > floor, mine > floor, err_msg=what)
                np.testing.assert_allclose(mine, ref, rtol=0, atol=tol, err_msg=what)
                if exact_weights and len(src) == 3:
                    distinct = src[0] != src[1]
                    rows, cols = src[0][distinct], np.arange(n_out)[distinct]
                    np.testing.assert_array_equal(mine[rows, cols], ref[rows, cols], err_msg=what)


def test_rows_interp_source_rows_reproduces_f_interpolate_nearest_and_align_corners():
    cases = _INDEX_CASES + _UNCHANGED_CASES
    modes = [("nearest", None), ("bilinear", True)]
    _check_source_rows(interp_source_rows, cases, modes, exact_weights=True)


def test_rows_interp_source_rows_bilinear_agrees_with_f_interpolate_to_an_ulp():
    # align_corners=False: rows.py rounds scale * (dst + 0.5) before subtracting 0.5; an FMA
    # build rounds once, so a weight may be off by an ulp of the source coordinate
    _check_source_rows(interp_source_rows, _INDEX_CASES, [("bilinear", False)], exact_weights=False)


def _cpu_traits(dtype):
    return kernel_traits("cpu", dtype)


def test_interp_source_rows_exact_reproduces_f_interpolate_bitwise():
    cases = _INDEX_CASES + _DOUBLING_CASES + _UNCHANGED_CASES
    for width_changes in (True, False):
        _check_source_rows(
            interp_source_rows_exact,
            cases,
            _MODES,
            exact_weights=True,
            width_changes=width_changes,
            traits=_cpu_traits,
            shape_unchanged=lambda dtype: None,  # filled in per case
        )


def test_interp_source_rows_exact_on_a_quarter_degree_grid():
    # 721 -> 1440 rows: where the rounding of the source coordinate matters most in float32
    _check_source_rows(
        interp_source_rows_exact,
        [(721, 1440, None), (181, None, 2.0), (640, 1279, None), (1440, 721, None)],
        [("bilinear", False), ("bilinear", True)],
        exact_weights=True,
        traits=_cpu_traits,
    )


def test_kernel_traits_of_the_cpu_kernels():
    for dtype in (torch.float32, torch.float64):
        traits = kernel_traits("cpu", dtype)
        assert traits.nearest_doubling_shift and traits.nearest_equal_dim_identity
        assert traits.linear_equal_dim_identity
        assert kernel_traits(torch.device("cpu"), dtype) is traits  # cached
    assert kernel_traits("cpu", torch.float64).index_floor_in_float32
    # each trait's probe really tells its two candidates apart
    for field, mode, (in_len, out_len, sf, ac), double in [
        ("nearest_doubling_shift", "nearest", (5, 10, 2.1, None), False),
        ("nearest_equal_dim_identity", "nearest", (12, 12, 1.05, None), False),
        ("linear_equal_dim_identity", "bilinear", (7, 7, 1.1, False), False),
        ("fused_source_index", "bilinear", (17, 33, None, False), False),
        ("fused_source_index", "bilinear", (9, 17, None, False), True),
        ("index_floor_in_float32", "bilinear", (14, 24, None, True), True),
    ]:
        got = []
        for value in (False, True):
            src = interp_source_rows_exact(
                mode,
                in_len,
                out_len,
                0,
                out_len,
                align_corners=ac,
                scale_factor=sf,
                double=double,
                traits=KernelTraits(**{field: value}),
            )
            got.append(weight_matrix(src, in_len, out_len, double))
        assert not np.array_equal(*got), field


def test_interp_source_rows_exact_with_default_traits_is_rows_arithmetic():
    for in_len, out_len, sf in _INDEX_CASES + _DOUBLING_CASES + _UNCHANGED_CASES:
        n_out = out_len or int(in_len * sf)
        for mode, ac in _MODES:
            for double in (False, True):
                kw = dict(align_corners=ac, scale_factor=sf, double=double)
                for o0, o1 in ((0, n_out), (n_out // 2, n_out)):
                    mine = interp_source_rows_exact(mode, in_len, n_out, o0, o1, **kw)
                    ref = interp_source_rows(mode, in_len, n_out, o0, o1, **kw)
                    np.testing.assert_array_equal(
                        weight_matrix(mine, in_len, o1 - o0, double),
                        weight_matrix(ref, in_len, o1 - o0, double),
                    )


def test_interp_row_plan_windows_cover_exactly_the_needed_rows():
    # 4 ranks, 19 rows upsampled x2 bilinear: every window is sorted, contiguous here, and each
    # rank's positions land inside it; together the ranks produce every output row once
    plan = interp_row_plan(
        "bilinear", 19, 38, 4, align_corners=False, scale_factor=2.0, double=True
    )
    assert sum(len(p) for p in plan.pos0) == 38
    for window, p0, p1 in zip(plan.windows, plan.pos0, plan.pos1):
        assert list(window) == sorted(set(window))
        used = set(np.asarray(window)[p0]) | set(np.asarray(window)[p1])
        assert used == set(window)
    # strong nearest downsampling sends only the rows actually read, not the span between
    plan = interp_row_plan("nearest", 40, 5, 2, align_corners=None, scale_factor=None, double=True)
    assert plan.windows == ((0, 8, 16), (24, 32))


@pytest.mark.parametrize(
    "in_hw, size, sf, recompute",
    [
        ((9, 20), (17, 40), None, None),
        ((13, 10), 7, None, None),
        ((13, 10), None, 2, None),
        ((13, 11), None, 0.5, None),
        ((17, 10), None, (1.7, 0.6), None),
        ((17, 10), None, (1.7, 0.6), True),
        ((19, 7), None, 1 / 3, None),
    ],
)
def test_interp_output_size_matches_f_interpolate(in_hw, size, sf, recompute):
    x = torch.zeros(1, 1, *in_hw)
    ref = F.interpolate(x, size=size, scale_factor=sf, recompute_scale_factor=recompute)
    (oh, ow), scales = interp_output_size(in_hw, size, sf, recompute)
    assert (oh, ow) == tuple(ref.shape[-2:])
    if size is not None or recompute:
        assert scales == (None, None)


def test_interpolate_constructor_errors_name_the_problem():
    with pytest.raises(ValueError, match="exactly one of size"):
        DomainParallelInterpolate()
    with pytest.raises(ValueError, match="exactly one of size"):
        DomainParallelInterpolate(size=4, scale_factor=2.0)
    with pytest.raises(ValueError, match="mode 'bicubic' is not supported"):
        DomainParallelInterpolate(size=4, mode="bicubic")
    with pytest.raises(ValueError, match="align_corners"):
        DomainParallelInterpolate(size=4, mode="nearest", align_corners=True)
    with pytest.raises(ValueError, match=r"\(H, W\) pair"):
        DomainParallelInterpolate(size=(4, 5, 6))
    with pytest.raises(TypeError, match="nn.PixelShuffle"):
        DomainParallelPixelShuffle(nn.PixelUnshuffle(2))
    with pytest.raises(TypeError, match="nn.PixelUnshuffle"):
        DomainParallelPixelUnshuffle(nn.PixelShuffle(2))


# --------------------------------------------------------------------------- multi-rank parity
class _Interp(nn.Module):
    """Reference: plain F.interpolate with fixed arguments."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.interpolate(x, **self.kw)


def _as_domain_interp(module, mgr):
    return DomainParallelInterpolate(**module.kw, manager=mgr)


def _interp_cases(h, w):
    """(name, F.interpolate kwargs) for an input of h x w."""
    cases = []
    for ac in (False, True):
        cases += [
            (f"bilinear_x2_ac{ac}", dict(scale_factor=2.0, mode="bilinear", align_corners=ac)),
            (f"bilinear_x0.5_ac{ac}", dict(scale_factor=0.5, mode="bilinear", align_corners=ac)),
            (
                f"bilinear_odd_up_ac{ac}",
                dict(size=(2 * h + 3, 2 * w - 1), mode="bilinear", align_corners=ac),
            ),
            (
                f"bilinear_size_down_ac{ac}",
                dict(size=(h // 2 + 1, w // 2), mode="bilinear", align_corners=ac),
            ),
            (
                f"bilinear_sf1.7x0.6_ac{ac}",
                dict(scale_factor=(1.7, 0.6), mode="bilinear", align_corners=ac),
            ),
        ]
    cases += [
        ("bilinear_x3", dict(scale_factor=3.0, mode="bilinear")),
        (
            "bilinear_recompute",
            dict(scale_factor=1.3, mode="bilinear", recompute_scale_factor=True),
        ),
        ("nearest_x2", dict(scale_factor=2.0, mode="nearest")),
        ("nearest_x2.1", dict(scale_factor=2.1, mode="nearest")),
        ("nearest_x0.5", dict(scale_factor=0.5, mode="nearest")),
        ("nearest_odd_up", dict(size=(2 * h + 1, w + 3), mode="nearest")),
        ("nearest_size_down", dict(size=(max(h // 3, 4), w - 3), mode="nearest")),
        ("nearest_sf0.37", dict(scale_factor=(0.37, 1.6), mode="nearest")),
        # heights < 20: H keeps its size under a scale factor of 1.05 (the CPU kernels copy it)
        ("bilinear_sf1.05x2", dict(scale_factor=(1.05, 2.0), mode="bilinear")),
        ("nearest_sf1.05x2", dict(scale_factor=(1.05, 2.0), mode="nearest")),
        ("bilinear_same_size", dict(size=(h, w), mode="bilinear")),
    ]
    return cases


def _interp_worker(rank, world, heights, dtype, extra):
    torch.set_default_dtype(dtype)
    mgr = DomainParallelManager(world, world)
    errors = {}
    gen = torch.Generator().manual_seed(7)
    for h in heights:
        w = 10
        x = torch.randn(2, 3, h, w, generator=gen, dtype=dtype)
        cases = _interp_cases(h, w) + [(name, kw) for hh, name, kw in extra if hh == h]
        for name, kw in cases:
            (out_h, _), _ = interp_output_size(
                (h, w), kw.get("size"), kw.get("scale_factor"), kw.get("recompute_scale_factor")
            )
            if out_h < world:  # cannot be sharded; the error is tested separately
                continue
            errs = domain_parity_errors(
                lambda kw=kw: _Interp(**kw), x, mgr, convert=_as_domain_interp
            )
            for key, err in errs.items():
                errors[f"h{h}/{name}/{key}"] = err
    # the converter's nn.Upsample rule builds the same layer
    x = torch.randn(1, 2, heights[0], 6, generator=gen, dtype=dtype)
    for kw in (dict(scale_factor=2, mode="bilinear"), dict(size=(heights[0] + 3, 5))):
        errs = domain_parity_errors(lambda kw=kw: nn.Upsample(**kw), x, mgr)
        for key, err in errs.items():
            errors[f"upsample{kw}/{key}"] = err
    return errors


_EXTRA = [
    (9, "bilinear_9_to_17x40", dict(size=(17, 40), mode="bilinear")),
    (9, "bilinear_9_to_17x40_ac", dict(size=(17, 40), mode="bilinear", align_corners=True)),
    (17, "bilinear_17_to_33", dict(size=33, mode="bilinear")),
    (17, "nearest_17_to_33", dict(size=33, mode="nearest")),
]


def _check(errors, dtype=torch.float64):
    assert errors, "no parity cases ran"
    assert_parity(errors, dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_interpolate_matches_single_process_float64(world):
    heights = {1: [9, 13, 17], 2: [9, 12, 13, 17], 3: [9, 13, 17, 19], 4: [9, 12, 17, 19]}[world]
    results = run_on_ranks(_interp_worker, world, heights, torch.float64, _EXTRA)
    for errors in results:
        _check(errors)
    # every rank reports the same (globally reduced) errors
    assert all(r == results[0] for r in results)


def test_interpolate_float32_spot_check_domain3():
    (errors, *_) = run_on_ranks(_interp_worker, 3, [13], torch.float32, [])
    _check(errors, torch.float32)


def _large_grid_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    gen = torch.Generator().manual_seed(5)
    errors = {}
    cases = [
        (721, dict(size=(1440, 7), mode="bilinear")),
        (721, dict(scale_factor=2.0, mode="bilinear", align_corners=True)),
        (640, dict(size=(1279, 5), mode="bilinear")),
        (181, dict(scale_factor=1.7, mode="bilinear")),
        (1440, dict(size=(721, 3), mode="bilinear")),
        (721, dict(scale_factor=(2.0, 1.5), mode="nearest")),
        # float64: a coordinate 2e-5 below an integer, which the CPU kernel floors in float32
        (1470, dict(scale_factor=(2.4534929753907373, 1.0), mode="bilinear")),
    ]
    for dtype in (torch.float32, torch.float64):
        for h, kw in cases:
            x = torch.randn(1, 2, h, 4, generator=gen, dtype=dtype)
            errs = domain_parity_errors(
                lambda kw=kw: _Interp(**kw), x, mgr, convert=_as_domain_interp
            )
            errors[dtype] = {
                **errors.get(dtype, {}),
                **{f"h{h}/{kw}/{k}": v for k, v in errs.items()},
            }
    return errors


def test_interpolate_on_large_grids_matches_the_kernel_rounding_domain2():
    # at ~700 rows one rounding more or less of the float32 source coordinate moves a weight
    # by ~6e-5 (and float64 indices taken with floorf move whole rows): the kernel's arithmetic
    # must be followed exactly, so float32 is held to 1e-6 here, float64 to 1e-10
    (errors, _) = run_on_ranks(_large_grid_worker, 2)
    assert_parity(errors[torch.float64], torch.float64)
    assert_parity(errors[torch.float32], torch.float32, rel_out=1e-6, rel_param=1e-6)


def _too_few_rows_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    layer = DomainParallelInterpolate(scale_factor=0.25, manager=mgr)
    x = torch.randn(1, 1, 12, 4)
    mgr.begin_forward(("too_few", tuple(x.shape)))
    y = layer(shard_tensor(x, -2, mgr))  # 12 -> 3 rows over 4 ranks: rank 3 empty
    full = gather_tensor(y, -2, mgr)
    with pytest.raises(ValueError, match="only 4-D"):
        layer(torch.zeros(1, 1, 2, 3, 4))
    ref = torch.nn.functional.interpolate(x, scale_factor=0.25, mode="bilinear")
    return y.shape[-2], float((full - ref).abs().max())


def test_interpolate_output_shorter_than_domain_leaves_the_last_rank_empty_and_is_exact():
    results = run_on_ranks(_too_few_rows_worker, 4)
    assert [rows for rows, _ in results] == [1, 1, 1, 0]
    assert all(err <= 1e-12 for _, err in results)


# --------------------------------------------------------------------------- pixel (un)shuffle
def _shuffle_worker(rank, world, shuffle_heights, unshuffle_heights):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    gen = torch.Generator().manual_seed(3)
    errors = {}
    for r in (2, 3):
        for h in shuffle_heights:
            x = torch.randn(2, 2 * r * r, h, 5, generator=gen)
            errs = domain_parity_errors(lambda r=r: nn.PixelShuffle(r), x, mgr)
            errors.update({f"shuffle r{r} h{h}/{k}": v for k, v in errs.items()})
        for h in unshuffle_heights[r]:
            if h // r < world:
                continue
            x = torch.randn(2, 3, h, 6 * r, generator=gen)
            errs = domain_parity_errors(lambda r=r: nn.PixelUnshuffle(r), x, mgr)
            errors.update({f"unshuffle r{r} h{h}/{k}": v for k, v in errs.items()})
    # a 5-D input (..., C, H, W) works too: height is dim -2
    x = torch.randn(2, 3, 8, 7, 4, generator=gen)
    errs = domain_parity_errors(lambda: nn.PixelShuffle(2), x, mgr)
    errors.update({f"shuffle 5d/{k}": v for k, v in errs.items()})
    return errors


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pixel_shuffle_and_unshuffle_match_single_process(world):
    unshuffle_heights = {2: [8, 12, 14, 18, 22], 3: [9, 12, 15, 21, 27]}
    results = run_on_ranks(_shuffle_worker, world, [4, 12, 13, 17, 19], unshuffle_heights)
    for errors in results:
        _check(errors)


def _unshuffle_indivisible_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    layer = DomainParallelPixelUnshuffle(nn.PixelUnshuffle(2), manager=mgr)
    x = torch.randn(1, 1, 13, 4)
    mgr.begin_forward(("indivisible", tuple(x.shape)))
    with pytest.raises(ValueError, match="global height 13 is not divisible by 2"):
        layer(shard_tensor(x, -2, mgr))
    return True


def test_pixel_unshuffle_indivisible_height_raises_on_every_rank():
    assert run_on_ranks(_unshuffle_indivisible_worker, 2) == [True, True]


def test_pixel_shuffle_wrappers_keep_state_dict_keys():
    shuffle = nn.PixelShuffle(2)
    assert DomainParallelPixelShuffle(shuffle).state_dict().keys() == shuffle.state_dict().keys()
    assert DomainParallelInterpolate(size=4).state_dict() == {}


# --------------------------------------------------------------------------- unpad_shard_interp
_PAD = {"pad_lat": (2, 3), "pad_lon": (1, 1)}


class _Unpad(nn.Module):
    """Reference (manager None): strip the padding of the global tensor and interpolate; the
    domain copy (manager set) calls unpad_shard_interp on its shard."""

    def __init__(self, image_h, image_w):
        super().__init__()
        self.image_h, self.image_w, self.manager = image_h, image_w, None

    def forward(self, y):
        if self.manager is not None:
            return unpad_shard_interp(y, _PAD, self.manager, self.image_h, self.image_w)
        h, w = y.shape[-2:]
        y = y[..., 2 : h - 3, 1 : w - 1]
        if tuple(y.shape[-2:]) != (self.image_h, self.image_w):
            y = F.interpolate(y, size=(self.image_h, self.image_w), mode="bilinear")
        return y


def _with_manager(module, mgr):
    module.manager = mgr
    return module


def _unpad_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    gen = torch.Generator().manual_seed(11)
    errors = {}
    # (padded global H, W, image_h, image_w): plain strip on uneven grids, then strip + resize
    for hp, wp, ih, iw in [(17, 12, 12, 10), (19, 9, 14, 7), (18, 12, 9, 15), (16, 10, 17, 8)]:
        y = torch.randn(2, 3, hp, wp, generator=gen)
        errs = domain_parity_errors(
            lambda ih=ih, iw=iw: _Unpad(ih, iw), y, mgr, convert=_with_manager
        )
        errors.update({f"{hp}x{wp}->{ih}x{iw}/{k}": v for k, v in errs.items()})
        # the result is exactly the balanced shard of the un-padded global output
        mgr.begin_forward(("unpad", tuple(y.shape)))
        local = unpad_shard_interp(shard_tensor(y, -2, mgr), _PAD, mgr, ih, iw)
        ref = _Unpad(ih, iw)(y)
        if (ih, iw) == (hp - 5, wp - 2):  # no resize: bitwise the shard of the stripped tensor
            assert torch.equal(local, shard_tensor(ref, -2, mgr, register=False))
        assert gather_tensor(local, -2, mgr).shape == ref.shape
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_unpad_shard_interp_matches_stripping_the_gathered_tensor(world):
    for errors in run_on_ranks(_unpad_worker, world):
        _check(errors)


def test_unpad_shard_interp_without_domain_interpolates_to_the_image_size():
    from credit_parallel import unpad_shard_interp

    y = torch.randn(1, 2, 12, 20, dtype=torch.float64)
    out = unpad_shard_interp(y, {"pad_lat": (1, 1), "pad_lon": (2, 2)}, None, 7, 9)
    ref = torch.nn.functional.interpolate(y[..., 1:11, 2:18], size=(7, 9), mode="bilinear")
    assert torch.equal(out, ref)
