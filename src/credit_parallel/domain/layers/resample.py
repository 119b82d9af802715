"""Domain-parallel resampling: interpolation (nearest, bilinear) and PixelShuffle/PixelUnshuffle.

These layers change the global height, and (SPEC §3) their output is again in the balanced
layout of its own global height.  Each rank therefore works out which output rows it owns, which
input rows those rows read (with the index arithmetic of the kernels themselves, see below),
assembles exactly those input rows with one :func:`~credit_parallel.domain.exchange.halo.exchange_rows`,
and computes its rows locally.

Interpolation is separable for both supported modes: each rank gathers the source rows it needs,
resamples the (unsharded) width and then its rows with index_select and the kernel's weights.
Indices and weights are those of the input's device: ``rows.interp_source_rows`` holds PyTorch's
arithmetic, and :func:`kernel_traits` finds, by running the device's kernels once on tiny probes,
where a build departs from it (fused multiply-add, float32 floor of float64 coordinates,
special cases for unchanged or doubled sizes).
The result equals ``F.interpolate`` on the unsharded tensor to rounding.  The index arithmetic
is in ``interp_rows.py``, PixelShuffle/PixelUnshuffle in ``pixel_shuffle.py``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ..exchange.halo import exchange_rows
from ..manager import resolve_manager
from ..options import OptionsMixin
from ..rows import pure_cached
from .interp_rows import (  # noqa: F401 - re-exported names
    _MODES,
    InterpRowPlan,
    KernelTraits,
    _pair,
    interp_output_size,
    interp_row_plan,
    interp_source_rows_exact,
    kernel_probe_weights,
    kernel_traits,
    weight_matrix,
)
from .pixel_shuffle import (
    DomainParallelPixelShuffle,
    DomainParallelPixelUnshuffle,
    pixel_shuffle_windows,
    pixel_unshuffle_windows,
)

# the interpolation arithmetic and the pixel (un)shuffle layers live in their own modules;
# their names stay importable from here
__all__ = [
    "DomainParallelInterpolate",
    "DomainParallelPixelShuffle",
    "DomainParallelPixelUnshuffle",
    "InterpRowPlan",
    "KernelTraits",
    "interp_output_size",
    "interp_row_plan",
    "interp_source_rows_exact",
    "kernel_probe_weights",
    "kernel_traits",
    "pixel_shuffle_windows",
    "pixel_unshuffle_windows",
    "weight_matrix",
]


def _resample_dim(t: torch.Tensor, dim: int, pos0, pos1, w0, w1) -> torch.Tensor:
    """Gather (and blend) positions along ``dim``: out = w0 * t[pos0] + w1 * t[pos1]."""
    if pos1 is None:
        return t.index_select(dim, pos0)
    return t.index_select(dim, pos0) * w0 + t.index_select(dim, pos1) * w1


@pure_cached(maxsize=256)
def _interp_plans(mode: str, align_corners, key) -> tuple[InterpRowPlan, InterpRowPlan]:
    """(row plan over the domain ranks, column plan) of one interpolation geometry; shared by
    all layers (a layer built per call, as in ``unpad_shard_interp``, plans only once)."""
    (in_h, in_w), (out_h, out_w), (scale_h, scale_w), n, double, traits = key
    kw = dict(
        align_corners=align_corners,
        double=double,
        traits=traits,
        shape_unchanged=(in_h, in_w) == (out_h, out_w),
    )
    rows = interp_row_plan(mode, in_h, out_h, n, scale_factor=scale_h, **kw)
    cols = interp_row_plan(mode, in_w, out_w, 1, scale_factor=scale_w, **kw)
    return rows, cols


@pure_cached(maxsize=256)
def _tile_interp_plans(mode: str, align_corners, key) -> tuple[InterpRowPlan, InterpRowPlan]:
    """(row plan over the P latitude ranks, column plan over the Q longitude ranks) of one
    interpolation geometry on lat x lon tiles."""
    (in_h, in_w), (out_h, out_w), (scale_h, scale_w), (p, q), double, traits = key
    kw = dict(
        align_corners=align_corners,
        double=double,
        traits=traits,
        shape_unchanged=(in_h, in_w) == (out_h, out_w),
    )
    rows = interp_row_plan(mode, in_h, out_h, p, scale_factor=scale_h, **kw)
    cols = interp_row_plan(mode, in_w, out_w, q, scale_factor=scale_w, **kw)
    return rows, cols


def _plan_tensors(plan: InterpRowPlan, r: int, shape, device, dtype, *, base=None) -> tuple:
    """Rank ``r``'s positions (into its gathered window; with ``base``, the window's global
    indices, into the whole axis) and weights (shaped ``shape``)."""

    def index(pos):
        pos = pos if base is None else base[pos]
        return torch.as_tensor(pos, dtype=torch.long, device=device)

    if plan.pos1 is None:
        return index(plan.pos0[r]), None, None, None
    return (
        index(plan.pos0[r]),
        index(plan.pos1[r]),
        torch.as_tensor(plan.w0[r], dtype=dtype, device=device).view(shape),
        torch.as_tensor(plan.w1[r], dtype=dtype, device=device).view(shape),
    )


# --------------------------------------------------------------------------- interpolation
class DomainParallelInterpolate(OptionsMixin, nn.Module):
    """``F.interpolate`` of a latitude-sharded B,C,H,W tensor, exact and in the balanced layout.

    ``size`` is the GLOBAL output size ``(H, W)`` (or an int), as it would be passed to
    ``F.interpolate`` on the unsharded tensor; or give ``scale_factor`` (float or pair) instead
    (``recompute_scale_factor`` as in ``F.interpolate``).  Modes ``nearest`` and ``bilinear``
    (``align_corners`` False/True; None means False), up- and down-sampling, any sizes.  No
    parameters.  Indices and weights follow the kernels of the input's device
    (:func:`kernel_traits`), so the result equals ``F.interpolate`` there to rounding.
    """

    _domain_parallel = True
    domain_form = "halo"
    domain_kind = "interpolate"
    tile_exact = True  # exact on lat x lon tiles too (_forward_tile)
    windows_depend_on_precision = True  # input_windows(..., double=) (domain/geometry.py)

    def __init__(
        self,
        size=None,
        mode: str = "bilinear",
        shard_dim: int = -2,
        align_corners: bool | None = None,
        *,
        scale_factor=None,
        manager=None,
        recompute_scale_factor: bool | None = None,
    ):
        super().__init__()
        if mode not in _MODES:
            raise ValueError(
                f"DomainParallelInterpolate: mode {mode!r} is not supported under domain "
                f"parallelism (supported: {', '.join(_MODES)}); use one of those or keep the "
                "layer out of the domain-parallel model"
            )
        if (size is None) == (scale_factor is None):
            raise ValueError(
                "DomainParallelInterpolate: give exactly one of size= (the GLOBAL output size) "
                f"and scale_factor=, got size={size!r}, scale_factor={scale_factor!r}"
            )
        if mode == "nearest" and align_corners is not None:
            raise ValueError(
                "DomainParallelInterpolate: align_corners can only be set with mode='bilinear' "
                f"(got mode='nearest', align_corners={align_corners!r})"
            )
        if recompute_scale_factor and size is not None:
            raise ValueError(
                "DomainParallelInterpolate: recompute_scale_factor is not meaningful with an "
                "explicit size"
            )
        # validate the shapes of size / scale_factor now, not at the first forward
        if size is not None:
            _pair(size, "size", int)
        else:
            _pair(scale_factor, "scale_factor", float)
        self.size = tuple(size) if isinstance(size, (list, tuple)) else size
        self.scale_factor = (
            tuple(float(v) for v in scale_factor)
            if isinstance(scale_factor, (list, tuple))
            else (float(scale_factor) if scale_factor is not None else None)
        )
        self.mode = mode
        self.align_corners = bool(align_corners) if mode == "bilinear" else None
        self.recompute_scale_factor = recompute_scale_factor
        self.shard_dim = shard_dim
        self.manager = manager
        # per (geometry key, rank, device, dtype): this rank's index and weight tensors
        self._index_tensors: dict = {}

    # ---- geometry (domain/geometry.py)
    def output_height(self, input_height: int) -> int:
        if self.size is not None:
            out_h = _pair(self.size, "size", int)[0]
        else:
            out_h = math.floor(
                float(input_height) * _pair(self.scale_factor, "scale_factor", float)[0]
            )
        if out_h < 1:
            raise ValueError(
                f"DomainParallelInterpolate: an input of {input_height} rows with "
                f"size={self.size!r}, scale_factor={self.scale_factor!r} gives no output row"
            )
        return out_h

    def input_windows(self, input_height: int, n: int, *, double: bool = False) -> tuple:
        """The rows each rank gathers, with the portable kernel arithmetic (``double``: that of
        float64 inputs); a device's kernels may differ in a last index (``kernel_traits``)."""
        out_h = self.output_height(input_height)
        scale_h = None
        if self.size is None and not self.recompute_scale_factor:
            scale_h = _pair(self.scale_factor, "scale_factor", float)[0]
        plan = interp_row_plan(
            self.mode,
            input_height,
            out_h,
            n,
            align_corners=self.align_corners,
            scale_factor=scale_h,
            double=double,
        )
        return plan.windows

    def tile_windows(self, height: int, width: int, shape, *, double: bool = False) -> tuple:
        """(row windows over the P latitude ranks, column windows over the Q longitude ranks)
        of a ``height`` x ``width`` input on a ``shape`` = (P, Q) domain, with the portable
        kernel arithmetic (:meth:`input_windows`; :meth:`_forward_tile` exchanges these)."""
        out_hw, scales = interp_output_size(
            (height, width), self.size, self.scale_factor, self.recompute_scale_factor
        )
        key = ((height, width), out_hw, scales, tuple(shape), double, KernelTraits())
        rows, cols = _tile_interp_plans(self.mode, self.align_corners, key)
        return rows.windows, cols.windows

    def _plans(self, key):
        return _interp_plans(self.mode, self.align_corners, key)

    def _tensors(self, key, rank: int, device, dtype):
        """This rank's row positions/weights (shaped to broadcast over W) and the column
        positions/weights, as tensors on ``device``."""
        cache = self._index_tensors
        tkey = (key, rank, str(device), dtype)
        hit = cache.get(tkey)
        if hit is None:
            rows, cols = self._plans(key)

            # rows index the gathered window; columns index the whole (unsharded) width
            whole = np.asarray(cols.windows[0], dtype=np.int64)
            hit = (
                _plan_tensors(rows, rank, (-1, 1), device, dtype),
                _plan_tensors(cols, 0, (-1,), device, dtype, base=whole),
            )
            if len(cache) > 64:
                cache.clear()
            cache[tkey] = hit
        return hit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(
                f"DomainParallelInterpolate(mode={self.mode!r}): only 4-D B,C,H,W inputs sharded "
                f"along dim -2 are supported, got a {x.dim()}-D tensor of shape {tuple(x.shape)}"
            )
        if self.shard_dim % 4 != 2:
            raise ValueError(
                f"DomainParallelInterpolate(mode={self.mode!r}): shard_dim={self.shard_dim} is "
                "not the height (dim -2) of a 4-D B,C,H,W input; only latitude sharding is supported"
            )
        mgr = resolve_manager(self.manager, "DomainParallelInterpolate")
        if getattr(mgr, "is_tiled", False):  # a lat x lon tile (SPEC §3b)
            return self._forward_tile(x, mgr)
        n = mgr.domain_world_size
        in_hw = (mgr.global_length(self, x.shape[2]), x.shape[3])
        # the kernels compute indices and weights in float64 for float64, else in float32
        compute_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        if torch.compiler.is_compiling():  # the same geometry, computed at trace time
            spec = (self.size, self.mode, self.align_corners, self.scale_factor)
            spec += (self.recompute_scale_factor,)
            windows, rows, cols = _geometry_at_trace(
                spec, in_hw, n, mgr.domain_rank, x.device, x.dtype, compute_dtype
            )
        else:
            windows, rows, cols = self._geometry(in_hw, n, mgr.domain_rank, x, compute_dtype)
        window = exchange_rows(x, windows, in_hw[0], 2, mgr).to(compute_dtype)
        # width first, then rows: the association of the 2-D kernels' h0*(w0*x00 + w1*x01) + ...
        y = _resample_dim(window, 3, *cols)
        y = _resample_dim(y, 2, *rows)
        return y.to(x.dtype)

    def _forward_tile(self, x: torch.Tensor, mgr) -> torch.Tensor:
        """On a lat x lon tile: the source rows of the owned output rows over the latitude
        ranks, then the source columns of the owned output columns over the longitude ranks
        (the same plan, ``interp_row_plan``, along W), resampled width first, then rows, with
        the kernel's indices and weights: the arithmetic of :meth:`forward`."""
        in_hw = (mgr.global_height(self, x.shape[2]), mgr.global_width(self, x.shape[3]))
        compute_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        tile = (tuple(mgr.domain_shape), tuple(mgr.domain_coords))
        if torch.compiler.is_compiling():  # the same geometry, computed at trace time
            spec = (self.size, self.mode, self.align_corners, self.scale_factor)
            spec += (self.recompute_scale_factor,)
            geometry = _tile_geometry_at_trace(spec, in_hw, tile, x.device, x.dtype, compute_dtype)
        else:
            geometry = self._tile_geometry(in_hw, tile, x, compute_dtype)
        row_windows, col_windows, rows, cols = geometry
        window = exchange_rows(x, row_windows, in_hw[0], 2, mgr.lat)
        window = exchange_rows(window, col_windows, in_hw[1], 3, mgr.lon).to(compute_dtype)
        y = _resample_dim(window, 3, *cols)
        y = _resample_dim(y, 2, *rows)
        return y.to(x.dtype)

    def _tile_geometry(self, in_hw, tile, x, compute_dtype):
        """(row windows, column windows, this tile's row and column positions / weights) on
        the tile ``tile`` = ((P, Q), (lat, lon))."""
        shape, coords = tile
        out_hw, scales = interp_output_size(
            in_hw, self.size, self.scale_factor, self.recompute_scale_factor
        )
        traits = kernel_traits(x.device, compute_dtype)
        key = (in_hw, out_hw, scales, shape, x.dtype == torch.float64, traits)
        plans = _tile_interp_plans(self.mode, self.align_corners, key)
        tkey = ("tile", key, coords, str(x.device), compute_dtype)
        hit = self._index_tensors.get(tkey)
        if hit is None:
            shapes = ((-1, 1), (-1,))
            hit = tuple(
                _plan_tensors(plan, coord, shape, x.device, compute_dtype)
                for plan, coord, shape in zip(plans, coords, shapes)
            )
            if len(self._index_tensors) > 64:
                self._index_tensors.clear()
            self._index_tensors[tkey] = hit
        return plans[0].windows, plans[1].windows, hit[0], hit[1]

    def _geometry(self, in_hw, n: int, rank: int, x, compute_dtype):
        """(row windows, this rank's row positions/weights, the column positions/weights)."""
        out_hw, scales = interp_output_size(
            in_hw, self.size, self.scale_factor, self.recompute_scale_factor
        )
        traits = kernel_traits(x.device, compute_dtype)
        key = (in_hw, out_hw, scales, n, x.dtype == torch.float64, traits)
        row_plan, _ = self._plans(key)
        rows, cols = self._tensors(key, rank, x.device, compute_dtype)
        return row_plan.windows, rows, cols

    def extra_repr(self) -> str:
        what = f"size={self.size}" if self.size is not None else f"scale_factor={self.scale_factor}"
        ac = f", align_corners={self.align_corners}" if self.mode == "bilinear" else ""
        return f"{what}, mode={self.mode!r}{ac}, shard_dim={self.shard_dim}"


def _layer_of(spec) -> DomainParallelInterpolate:
    """A layer of ``spec`` (size, mode, align_corners, scale_factor, recompute_scale_factor)."""
    size, mode, align_corners, scale_factor, recompute = spec
    return DomainParallelInterpolate(
        size=size,
        mode=mode,
        align_corners=align_corners,
        scale_factor=scale_factor,
        recompute_scale_factor=recompute,
    )


@torch._dynamo.assume_constant_result
def _geometry_at_trace(spec, in_hw, n: int, rank: int, device, dtype, compute_dtype):
    """:meth:`DomainParallelInterpolate._geometry` for a layer of ``spec`` (size, mode,
    align_corners, scale_factor, recompute_scale_factor), run for real while Dynamo traces: the
    kernel probe, the row plan and the index tensors are constants of the compiled graph."""
    probe = torch.empty(0, dtype=dtype, device=device)
    return _layer_of(spec)._geometry(in_hw, n, rank, probe, compute_dtype)


@torch._dynamo.assume_constant_result
def _tile_geometry_at_trace(spec, in_hw, tile, device, dtype, compute_dtype):
    """:meth:`DomainParallelInterpolate._tile_geometry` for a layer of ``spec``, run for real
    while Dynamo traces (as :func:`_geometry_at_trace`): constants of the compiled graph."""
    probe = torch.empty(0, dtype=dtype, device=device)
    return _layer_of(spec)._tile_geometry(in_hw, tile, probe, compute_dtype)
