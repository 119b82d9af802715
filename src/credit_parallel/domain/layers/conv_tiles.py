"""(Transposed) convolutions on the tiles of a two-dimensional (lat x lon) domain (SPEC §3b).

The 1-D machinery along each axis in turn: the window of input rows a rank's owned output rows
read (``conv_geometry.conv_windows`` / ``conv_transpose_windows``, boundary rule included) is
planned along H over the latitude ranks and along W over the longitude ranks
(``rows.plan_exchange``), and exchanged along H first, then along W OF THE H-EXTENDED tensor
(``exchange.exchange_planned`` on the manager's axis views).  The ranks of one latitude band
share their row window, so the second exchange carries the halo rows' columns too: the corners
arrive in two hops, with no diagonal message.  The boundary rules are index maps (or a fill), so
padding H then W equals padding W then H: the window equals the padded global input's, and the
plain op (no padding along H and W) gives exactly the owned outputs.

Longitude wraps across the longitude ranks under ``padding_mode="circular"`` and for
``PeriodicConv2d``; with Q = 2 the west and the east neighbour are one rank, and its columns
arrive in ONE message placed by global column (``plan_exchange``), so the two halos cannot swap;
with Q = 1 the wrap is local.  Per (H, W, P, Q, tile) the plans and the op are made once
(:class:`TileConvCall`) and replayed: a forward is two batched exchanges of at most one message
per peer each (at most 4 messages when the halos fit in the neighbouring tiles), each element
sent once (``exchange/halo.py``), the backward the same in reverse (autograd: the exact
adjoint).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..exchange.halo import (
    TilePlan,
    exchange_tile,
    exchange_tile_columns,
    expand_rows,
    tile_plan,
)
from ..exchange.windows import assemble_window
from ..manager import tiles_unsupported
from ..rows import compose_windows, pure_cached, shard_range
from .conv_geometry import ConvOp, conv_transpose_windows, conv_windows
from .padding import checked_pad_windows

__all__ = [
    "TileConvCall",
    "fused_pad_key",
    "fused_tile_windows",
    "tile_conv_call",
    "tile_conv_forward",
    "tile_conv_windows",
]

_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class TileConvCall:
    """This rank's part of one conv call on a tile: the exchange plans along H (latitude ranks)
    and W (longitude ranks; ``exchange/halo.py``), the local op, the owned output ranges and the
    first input row / column of the windows (None: an empty window)."""

    plan: TilePlan
    op: ConvOp | None
    out_h: tuple[int, int]
    out_w: tuple[int, int]
    first_h: int | None
    first_w: int | None


def tile_conv_windows(layer, height: int, width: int, shape) -> tuple[tuple, tuple]:
    """(row windows of every latitude rank, column windows of every longitude rank) of
    ``layer`` for a global ``height`` x ``width`` input on a ``shape`` = (P, Q) domain: what
    :func:`tile_conv_call` exchanges (the planner asks this too)."""
    return _windows(layer.geometry, layer.spatial_index, layer.nd, height, width, tuple(shape))


def _windows(geo, i_h: int, nd: int, height: int, width: int, shape) -> tuple[tuple, tuple]:
    i_w = nd - 1
    windows_of = conv_transpose_windows if geo.transposed else conv_windows
    # along W the rule is that of the conv's other dims (circular: longitude wraps)
    geo_w = replace(geo, edge_mode=geo.other_mode)
    return windows_of(geo, i_h, height, shape[0])[0], windows_of(geo_w, i_w, width, shape[1])[0]


def fused_pad_key(pad) -> tuple | None:
    """The geometry of a padding layer fused into a conv (``fusion.py``): hashable, or None."""
    if pad is None:
        return None
    return (tuple(pad.padding), pad.mode, f"{type(pad.wrapped).__name__}{tuple(pad.padding)}")


def fused_tile_windows(pad_key, geo, i_h: int, nd: int, height: int, width: int, shape):
    """(row windows, column windows) over the pad's ``height`` x ``width`` input of a padding
    layer (``pad_key``: its padding, mode and name) followed by the conv of ``geo``: the row
    maps of the two composed along each axis (``rows.compose_windows``), so ONE tile exchange
    of the pad's input gives the conv's window."""
    (left, right, top, bottom), mode, what = pad_key
    p, q = shape
    pad_rows = checked_pad_windows(height, p, top, bottom, mode, what)
    pad_cols = checked_pad_windows(width, q, left, right, mode, what)
    padded_h, padded_w = height + top + bottom, width + left + right
    rows, cols = _windows(geo, i_h, nd, padded_h, padded_w, shape)
    return compose_windows(pad_rows, padded_h, rows), compose_windows(pad_cols, padded_w, cols)


def tile_conv_call(layer, height: int, width: int, shape, coords) -> TileConvCall:
    """The :class:`TileConvCall` of ``layer`` (a ``_DomainParallelConvNd``) for a global
    ``height`` x ``width`` input on the tile ``coords`` of a ``shape`` domain: planned once per
    argument set, then a dict lookup (under ``torch.compile``: a constant of the graph, made
    while Dynamo traces, nothing written on the layer).  With a fused pad (``fusion.py``) the
    input is the pad's and the windows are the composed ones."""
    pad_key = fused_pad_key(layer.options.fused_pad)
    args = (layer.geometry, layer.spatial_index, layer.nd, height, width, tuple(shape))
    args += (tuple(coords), pad_key)
    if torch.compiler.is_compiling():
        return _plan_call.__wrapped__(*args)  # no lru_cache wrapper traced
    key = (height, width, tuple(shape), tuple(coords), pad_key)
    calls = layer.__dict__.setdefault("_tile_calls", {})
    call = calls.get(key)
    if call is None:
        call = _plan_call(*args)
        if len(calls) > 64:
            calls.clear()
        calls[key] = call
    return call


@pure_cached(maxsize=1024)
def _plan_call(
    geo, i_h: int, nd: int, height: int, width: int, shape, coords, pad_key=None
) -> TileConvCall:
    i_w = nd - 1
    (lat, lon), (p, q) = coords, shape
    if pad_key is None:
        rows, cols = _windows(geo, i_h, nd, height, width, shape)
        out_h = shard_range(geo.output_length(height, i_h), p, lat)
        out_w = shard_range(geo.output_length(width, i_w), q, lon)
    else:
        rows, cols = fused_tile_windows(pad_key, geo, i_h, nd, height, width, shape)
        (left, right, top, bottom) = pad_key[0]
        out_h = shard_range(geo.output_length(height + top + bottom, i_h), p, lat)
        out_w = shard_range(geo.output_length(width + left + right, i_w), q, lon)
    first_h = rows[lat][0] if rows[lat] else None  # the first input row / column of the window
    first_w = cols[lon][0] if cols[lon] else None
    plan = tile_plan(height, width, shape, coords, rows, cols)
    op = None
    if not geo.transposed:  # the op pads the dims that are not split (T of a Conv3d) only
        pads = tuple((0, 0) if j == i_w else p for j, p in enumerate(geo.pads))
        op = ConvOp.of(replace(geo, pads=pads), i_h)
        if op.pad_flat is not None and not any(op.pad_flat):  # nothing left to pad
            op = replace(op, pad_flat=None, pad_mode="constant")
    return TileConvCall(plan, op, out_h, out_w, first_h, first_w)


def _check_supported(layer) -> None:
    if layer.spatial_index == layer.nd - 1:
        raise ValueError(
            f"{type(layer).__name__}: on a lat x lon tile the sharded dim (latitude) cannot be "
            "the last dim (longitude)"
        )
    options = layer.options
    if options.fused_pad is not None and (layer.geometry.transposed or layer.nd != 2):
        raise ValueError(tiles_unsupported(layer, options.module_path) + " (option fused_pad)")
    if options.shared_input is not None and (layer.geometry.transposed or layer.nd != 2):
        raise ValueError(tiles_unsupported(layer, options.module_path) + " (option shared_input)")
    if layer.side_stream:
        raise ValueError(tiles_unsupported(layer, options.module_path) + " (option side_stream)")


def tile_conv_forward(layer, x: torch.Tensor, weight, bias, manager) -> torch.Tensor:
    """The forward of ``layer`` on this rank's tile ``x`` (rows along ``layer.shard_dim``,
    columns along the last dim) under the tiled ``manager``."""
    _check_supported(layer)
    dim_h, dim_w = layer.spatial_index + 2, layer.nd + 1
    height = manager.global_height(layer, x.shape[dim_h])
    width = manager.global_width(layer, x.shape[dim_w])
    call = tile_conv_call(layer, height, width, manager.domain_shape, manager.domain_coords)
    # along H, then along W of the H-extended tensor (the corners come with it)
    pad = layer.options.fused_pad  # a pad fused into this conv: its fill (fusion.py)
    fill = 0.0 if pad is None else pad.value
    window = _linked_window(layer, x, call, (dim_h, dim_w), manager)
    shared = layer.options.shared_input  # siblings on one tile: one exchange (fusion.py)
    if window is None and shared is not None and shared.active:
        if not torch.compiler.is_compiling():
            window = shared.tile_window_for(layer, x, height, width, (dim_h, dim_w), manager)
    if window is None:
        window = exchange_tile(x, call.plan, (dim_h, dim_w), manager, fill)
    rows, cols = call.out_h[1] - call.out_h[0], call.out_w[1] - call.out_w[0]
    if layer.geometry.transposed:
        if call.first_h is None or call.first_w is None or rows == 0 or cols == 0:
            return _bias_only(layer, x, window, weight, bias, rows, cols)
        return _transposed(layer, window, weight, bias, call)
    if rows == 0 or cols == 0:  # a tile that owns no output (its windows are empty)
        return _bias_only(layer, x, window, weight, bias, rows, cols)
    return _run_op(call.op, window, weight, bias)


def _linked_window(layer, x, call: TileConvCall, dims, manager):
    """The window when the GroupNorm before this conv sent its rows with its statistics
    (``norm_halo.NormConvLink``): those rows assembled, then the columns; else None."""
    link = layer.options.fused_norm
    if link is None or torch.compiler.is_compiling():
        return None
    halos = link.take_halos(x)
    if halos is None:
        return None
    if link.tile_axis == "rows":
        rows = assemble_window(x, halos, call.plan.rows, dims[0], 0.0)
        return exchange_tile_columns(rows, call.plan, dims, manager)
    # P = 1: the rows are the tile's own (assembled locally), the columns came with the norm
    rows = assemble_window(x, [], call.plan.rows, dims[0], 0.0)
    window = assemble_window(rows, halos, call.plan.cols, dims[1], 0.0)
    return expand_rows(window, call.plan, dims[0])


def _run_op(op: ConvOp, window, weight, bias) -> torch.Tensor:
    """``op(window, weight, bias)``, written out: under ``torch.compile`` ``op`` is a constant
    of the graph (a plan made at trace time), read field by field, not called."""
    if op.pad_flat is not None:
        window = F.pad(window, list(op.pad_flat), mode=op.pad_mode)
    conv = (F.conv1d, F.conv2d, F.conv3d)[op.nd - 1]
    return conv(window, weight, bias, op.stride, op.padding, op.dilation, op.groups)


def _bias_only(layer, x, window, weight, bias, rows: int, cols: int) -> torch.Tensor:
    """Outputs no input reaches (or none at all): the bias, attached to the graph of the window
    and the weight so that the exchanges' backward runs on this rank too."""
    geo, i_h, i_w = layer.geometry, layer.spatial_index, layer.nd - 1
    channels = weight.shape[1] * geo.groups if geo.transposed else weight.shape[0]
    shape = [x.shape[0], channels]
    for j in range(layer.nd):
        size = {i_h: rows, i_w: cols}.get(j)
        shape.append(size if size is not None else geo.output_length(x.shape[j + 2], j))
    y = (window.sum() + weight.sum()) * 0.0 + x.new_zeros(shape)
    if bias is not None:
        y = y + bias.view(1, -1, *([1] * layer.nd))
    return y


def _transposed(layer, window, weight, bias, call: TileConvCall) -> torch.Tensor:
    """A transposed conv of the window, cropped to the owned outputs along H and W (positions
    no input reaches are zeros, then the bias)."""
    geo, nd = layer.geometry, layer.nd
    split = {layer.spatial_index: (call.out_h, call.first_h), nd - 1: (call.out_w, call.first_w)}
    pads = tuple(0 if j in split else p[0] for j, p in enumerate(geo.pads))
    out_pad = tuple(0 if j in split else p for j, p in enumerate(geo.output_padding))
    y = _CONVT[nd](window, weight, None, geo.stride, pads, out_pad, geo.groups, geo.dilation)
    for j, ((o0, o1), first_input) in split.items():
        dim = j + 2
        first = o0 + geo.pads[j][0] - first_input * geo.stride[j]
        last = o1 + geo.pads[j][0] - first_input * geo.stride[j]
        before, after = max(0, -first), max(0, last - y.shape[dim])
        if before or after:  # outputs no input reaches (output_padding, gaps)
            flat = [0, 0] * (nd - 1 - j) + [before, after]
            y = F.pad(y, flat)
            first, last = first + before, last + before
        y = y.narrow(dim, first, last - first)
    if bias is not None:
        y = y + bias.view(1, -1, *([1] * nd))
    return y
