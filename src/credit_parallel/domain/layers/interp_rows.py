"""Index arithmetic of interpolation along the sharded dim, exactly as the kernels compute it.

Each rank of a domain-parallel interpolation needs to know which input rows its output rows read
and with which weights.  ``rows.interp_source_rows`` holds PyTorch's portable arithmetic;
:func:`kernel_traits` finds, by running a device's kernels once on tiny probes, where a build
departs from it (fused multiply-add, float32 floor of float64 coordinates, special cases for
unchanged or doubled sizes), and :func:`interp_row_plan` turns the result into every rank's
window and blend weights.  No processes; the probes are the only tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F

from ..rows import interp_source_rows, shard_range

__all__ = [
    "InterpRowPlan",
    "KernelTraits",
    "interp_output_size",
    "interp_row_plan",
    "interp_source_rows_exact",
    "kernel_probe_weights",
    "kernel_traits",
    "weight_matrix",
]

_MODES = ("nearest", "bilinear")


# --------------------------------------------------------------------------- pure arithmetic
def _pair(value, name: str, kind):
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(
                f"DomainParallelInterpolate: {name} must be a single value or an (H, W) pair for "
                f"4-D inputs, got {value!r}"
            )
        return tuple(kind(v) for v in value)
    return kind(value), kind(value)


def interp_output_size(
    in_hw: tuple[int, int], size, scale_factor, recompute_scale_factor=None
) -> tuple[tuple[int, int], tuple]:
    """Global output (H, W) and the scales the kernel receives, exactly as ``F.interpolate``
    derives them for a 4-D input of spatial size ``in_hw``.

    Returns ``((out_h, out_w), (scale_h, scale_w))``; a scale is None when the kernel computes
    it from the sizes (``size=`` given, or ``recompute_scale_factor=True``).
    """
    if size is not None:
        out = _pair(size, "size", int)
        scales = (None, None)
    else:
        factors = _pair(scale_factor, "scale_factor", float)
        out = tuple(math.floor(float(n) * f) for n, f in zip(in_hw, factors))
        scales = (None, None) if recompute_scale_factor else factors
    if min(out) < 1:
        raise ValueError(
            f"DomainParallelInterpolate: input of spatial size {tuple(in_hw)} with size={size!r}, "
            f"scale_factor={scale_factor!r} gives an empty output {out}"
        )
    return out, scales


@dataclass(frozen=True)
class KernelTraits:
    """How a device's ``F.interpolate`` kernels compute source indices, where builds differ.

    * ``fused_source_index``: bilinear (align_corners=False) rounds ``scale * (dst + 0.5) - 0.5``
      once (a fused multiply-add: FMA CPU builds, CUDA) instead of twice.  In float32 the two
      differ by up to an ulp of the coordinate: a weight error of ~6e-5 at 700 rows, far above
      the 1e-5 tolerance.
    * ``index_floor_in_float32``: the float64 bilinear kernel takes the source index as
      ``floorf`` of the coordinate, i.e. rounds it to float32 first (the CPU kernels): a
      coordinate just below an integer gets that integer and a clipped weight of 0.
    * ``linear_equal_dim_identity`` / ``nearest_equal_dim_identity``: a dim whose size does not
      change is copied even when a scale factor other than 1 is given (7 rows x 1.1) while the
      other dim changes (the CPU kernels); otherwise only a wholly unchanged shape is copied.
    * ``nearest_doubling_shift``: nearest with ``out == 2 * in`` uses ``dst >> 1`` whatever the
      scale factor (the CPU kernel) instead of ``floor(dst * scale)``.

    The defaults are the arithmetic of ``rows.interp_source_rows``; :func:`kernel_traits` finds
    a device's traits by running its kernels on tiny probes.
    """

    fused_source_index: bool = False
    index_floor_in_float32: bool = False
    linear_equal_dim_identity: bool = False
    nearest_equal_dim_identity: bool = True
    nearest_doubling_shift: bool = False


_ROWS_ARITHMETIC = KernelTraits()


def _linear_source_rows(
    in_len: int,
    out_len: int,
    out_start: int,
    out_stop: int,
    *,
    align_corners,
    scale_factor,
    double: bool,
    traits: KernelTraits,
):
    """Bilinear source rows ``(idx0, idx1, lambda1)`` under ``traits``.  A fused float32
    coordinate is exact in float64 (a 24-bit scale times a short integer + 0.5), a fused float64
    one is evaluated with rationals; either is then rounded once, as the instruction does."""
    ft = np.float64 if double else np.float32
    dst = np.arange(out_start, out_stop, dtype=np.int64)
    if align_corners:
        scale = ft(in_len - 1) / ft(out_len - 1) if out_len > 1 else ft(0)
        real = scale * dst.astype(ft)
    else:
        if scale_factor is not None and scale_factor > 0:
            scale = ft(1.0 / scale_factor)
        else:
            scale = ft(in_len) / ft(out_len)
        if not traits.fused_source_index:
            real = scale * (dst.astype(ft) + ft(0.5)) - ft(0.5)
        elif double:
            exact = Fraction(float(scale))
            real = np.array(
                [float(exact * (2 * int(d) + 1) / 2 - Fraction(1, 2)) for d in dst],
                dtype=np.float64,
            )
        else:
            real = (np.float64(scale) * (dst.astype(np.float64) + 0.5) - 0.5).astype(np.float32)
        real = np.maximum(real, ft(0))
    floor_of = real.astype(np.float32) if double and traits.index_floor_in_float32 else real
    idx0 = np.minimum(np.floor(floor_of).astype(np.int64), in_len - 1)
    lam1 = np.clip(real - idx0.astype(ft), ft(0), ft(1))
    idx1 = idx0 + (idx0 < in_len - 1).astype(np.int64)
    return idx0, idx1, lam1.astype(np.float64)


def interp_source_rows_exact(
    mode: str,
    in_len: int,
    out_len: int,
    out_start: int,
    out_stop: int,
    *,
    align_corners,
    scale_factor,
    double: bool,
    traits: KernelTraits = _ROWS_ARITHMETIC,
    shape_unchanged: bool = False,
):
    """Source indices along one dim of output positions ``[out_start, out_stop)``, exactly as a
    kernel with ``traits`` computes them (with the default traits: exactly
    :func:`rows.interp_source_rows`, which it calls wherever a kernel agrees with it).

    Returns ``(idx,)`` (a copy, or nearest) or ``(idx0, idx1, lambda1)`` as
    ``interp_source_rows`` does.  ``shape_unchanged``: the whole spatial shape is unchanged
    (every kernel then copies the input).
    """
    dst = np.arange(out_start, out_stop, dtype=np.int64)
    if in_len == out_len:
        if mode == "nearest":
            identity = traits.nearest_equal_dim_identity
        else:
            identity = traits.linear_equal_dim_identity or bool(align_corners)
        if shape_unchanged or identity:
            return (dst,)
    rows_kw = dict(align_corners=align_corners, scale_factor=scale_factor, double=double)
    if mode == "nearest":
        if out_len == 2 * in_len and traits.nearest_doubling_shift:
            return (dst >> 1,)
        if in_len == out_len:  # rows.py copies here; this kernel applies the scale factor
            scale = np.float32(1.0 / scale_factor) if scale_factor else np.float32(1.0)
            src = np.floor(dst.astype(np.float32) * scale).astype(np.int64)
            return (np.minimum(src, in_len - 1),)
        return interp_source_rows(mode, in_len, out_len, out_start, out_stop, **rows_kw)
    if mode not in ("bilinear", "linear"):
        raise ValueError(f"unsupported interpolation mode {mode!r} (supported: {_MODES})")
    if not (traits.fused_source_index or (double and traits.index_floor_in_float32)):
        return interp_source_rows(mode, in_len, out_len, out_start, out_stop, **rows_kw)
    return _linear_source_rows(in_len, out_len, out_start, out_stop, traits=traits, **rows_kw)


def weight_matrix(src, in_len: int, out_len: int, double: bool) -> np.ndarray:
    """``M[c, o]``: the weight of input position c in output position o (float64 array holding
    values of the kernel's precision), from the result of :func:`interp_source_rows_exact`."""
    ft = np.float64 if double else np.float32
    m = np.zeros((in_len, out_len), dtype=ft)
    cols = np.arange(out_len)
    if len(src) == 1:
        m[src[0], cols] = 1
        return m.astype(np.float64)
    idx0, idx1, lam1 = src
    lam1 = lam1.astype(ft)
    m[idx0, cols] = ft(1) - lam1
    m[idx1, cols] += lam1  # each (row, col) once per statement: cols are distinct
    return m.astype(np.float64)


def kernel_probe_weights(
    mode,
    in_len,
    size=None,
    scale_factor=None,
    align_corners=None,
    *,
    dtype=torch.float64,
    device="cpu",
) -> np.ndarray:
    """The weights ``F.interpolate`` on ``device`` gives along H, read off a one-hot input
    (channel c is row c's indicator) of width 1, interpolated with ``size``/``scale_factor``
    (pairs, so the width may change too; output column 0 always reads input column 0 alone)."""
    probe = torch.eye(in_len, dtype=dtype, device=device).view(1, in_len, in_len, 1)
    with torch.no_grad():
        out = F.interpolate(
            probe, size=size, scale_factor=scale_factor, mode=mode, align_corners=align_corners
        )
    return out[0, :, :, 0].double().cpu().numpy()


_TRAITS_CACHE: dict = {}


def kernel_traits(device, dtype) -> KernelTraits:
    """The :class:`KernelTraits` of ``device``'s kernels for ``dtype`` (float32 or float64),
    found by running each kernel once on a probe whose result tells the candidates apart.
    Cached per (device type, dtype); all ranks of a domain group run the same kind of device."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key in _TRAITS_CACHE:
        return _TRAITS_CACHE[key]
    double = dtype == torch.float64

    def better(mode, in_len, out_len, probe_kw, field, traits, align_corners=None):
        got = kernel_probe_weights(
            mode, in_len, align_corners=align_corners, dtype=dtype, device=device, **probe_kw
        )
        mismatch = {}
        for value in (False, True):
            cand = KernelTraits(**{**traits.__dict__, field: value})
            src = interp_source_rows_exact(
                mode,
                in_len,
                out_len,
                0,
                out_len,
                align_corners=align_corners,
                scale_factor=probe_kw.get("scale_factor", (None,))[0],
                double=double,
                traits=cand,
            )
            mismatch[value] = np.abs(weight_matrix(src, in_len, out_len, double) - got).max()
        return KernelTraits(**{**traits.__dict__, field: bool(mismatch[True] < mismatch[False])})

    t = KernelTraits()
    # probe sizes on which the two candidates of each trait give different weights
    if double:
        t = better("bilinear", 14, 24, {"size": (24, 1)}, "index_floor_in_float32", t, True)
    in_len, out_len = (9, 17) if double else (17, 33)
    t = better("bilinear", in_len, out_len, {"size": (out_len, 1)}, "fused_source_index", t, False)
    t = better(
        "bilinear", 7, 7, {"scale_factor": (1.1, 2.0)}, "linear_equal_dim_identity", t, False
    )
    t = better("nearest", 12, 12, {"scale_factor": (1.05, 2.0)}, "nearest_equal_dim_identity", t)
    t = better("nearest", 5, 10, {"scale_factor": (2.1, 1.0)}, "nearest_doubling_shift", t)
    _TRAITS_CACHE[key] = t
    return t


@dataclass(frozen=True)
class InterpRowPlan:
    """How every rank resamples rows: ``windows[r]`` are the global input rows rank r gathers
    (sorted, each needed row once); ``pos0[r]``/``pos1[r]`` index that window for each output
    row the rank owns, blended with weights ``w0[r]``/``w1[r]`` (a copy or nearest: ``pos1``
    and the weights are None)."""

    windows: tuple
    pos0: tuple
    pos1: tuple | None
    w0: tuple | None
    w1: tuple | None


def interp_row_plan(
    mode: str,
    in_len: int,
    out_len: int,
    n: int,
    *,
    align_corners,
    scale_factor,
    double: bool,
    traits: KernelTraits = KernelTraits(),
    shape_unchanged: bool = False,
) -> InterpRowPlan:
    """The resampling plan of all ``n`` ranks along one dim of ``in_len`` positions (pure)."""
    ft = np.float64 if double else np.float32
    windows, pos0, pos1, w0, w1 = [], [], [], [], []
    for r in range(n):
        o0, o1 = shard_range(out_len, n, r)
        src = interp_source_rows_exact(
            mode,
            in_len,
            out_len,
            o0,
            o1,
            align_corners=align_corners,
            scale_factor=scale_factor,
            double=double,
            traits=traits,
            shape_unchanged=shape_unchanged,
        )
        needed = np.unique(np.concatenate(src[:2]))
        windows.append(tuple(int(v) for v in needed))
        pos0.append(np.searchsorted(needed, src[0]))
        if len(src) == 1:
            continue
        pos1.append(np.searchsorted(needed, src[1]))
        lam1 = src[2].astype(ft)  # exact: computed in ft
        # the kernel's weight of the first row is 1 - lambda1 in its own precision
        w0.append((ft(1) - lam1).astype(np.float64))
        w1.append(lam1.astype(np.float64))
    if not pos1:
        return InterpRowPlan(tuple(windows), tuple(pos0), None, None, None)
    return InterpRowPlan(tuple(windows), tuple(pos0), tuple(pos1), tuple(w0), tuple(w1))
