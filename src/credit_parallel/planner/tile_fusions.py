"""The exchange fusions of lat x lon tiles in the planner's tile plans (``tiles.py``): what
the converter fuses on tiles (``domain/fusion.py`` with ``tiles=True``) counted as it runs.

* A padding layer and the conv after it: the pad exchanges nothing, the conv exchanges the
  PAD'S input once with the row and column maps of the two composed
  (``conv_tiles.fused_tile_windows``).
* A GroupNorm (and an elementwise activation) before a conv: the norm's statistics collective
  is gone (``stats_with_exchange``); the conv's first pass with peers (the rows, or the columns
  at P = 1) carries them to every other rank of the P x Q group, forward and backward
  (``stats_pass``: one message to each, one call even where no halo row moves).  The halo
  bytes are the unfused conv's (the statistics are not halo bytes, as ``record_exchange_stats``
  counts them).
"""

from __future__ import annotations

import dataclasses

from ..domain.layers.conv_tiles import fused_pad_key, fused_tile_windows
from ..domain.tiles_convert import tile_fusions
from .tiles import TileLayerPlan, tile_layer_plan

__all__ = ["fuse_tile_plans"]

_EXCHANGE_FIELDS = (
    "band_rows", "rows_sent", "rows_received", "row_peers_sent", "row_peers_received",
    "cols_sent", "cols_received", "col_peers_sent", "col_peers_received",
)  # fmt: skip


def fuse_tile_plans(model, trace, layers: list[TileLayerPlan], shape, double: bool = False):
    """``layers`` (``tiles.tile_layer_plans`` of ``trace``, the trace of the meta ``model``)
    with the exchange fusions the converter makes on a ``shape`` = (P, Q) domain."""
    decided = {path: replacement for path, _, replacement, *_ in trace.calls}
    pairs, triples = tile_fusions(model, decided)
    pad_of = {id(conv): pad for pad, conv in pairs}
    fused_pads = {id(pad) for pad, _ in pairs}
    linked_norms = {id(norm) for norm, _, _ in triples}
    linked_convs = {id(conv) for _, _, conv in triples}
    stats_pass = "rows" if shape[0] > 1 else "cols"
    tops = [lay.path for lay in layers if lay.strips_sent]  # run on strips: no tile fusion
    out = []
    for lay, (_, _, layer, in_shape, out_shape, _) in zip(layers, trace.calls):
        if any(lay.path == top or lay.path.startswith(top + ".") for top in tops):
            out.append(lay)
        elif id(layer) in fused_pads:
            out.append(dataclasses.replace(lay, **{key: () for key in _EXCHANGE_FIELDS}))
        elif id(layer) in pad_of:
            out.append(_fused_conv(lay, layer, pad_of[id(layer)], in_shape, out_shape, shape))
        elif id(layer) in linked_convs:
            out.append(dataclasses.replace(lay, stats_pass=stats_pass))
        elif id(layer) in linked_norms:
            out.append(dataclasses.replace(lay, stats_with_exchange=True))
        else:
            out.append(lay)
    return out


def _fused_conv(lay, conv, pad, in_shape, out_shape, shape) -> TileLayerPlan:
    """The plan of ``conv`` exchanging the input of ``pad`` for both."""
    left, right, top, bottom = pad.padding
    pad_in = list(in_shape)
    pad_in[-2] -= top + bottom
    pad_in[-1] -= left + right
    key = fused_pad_key(pad)

    def windows(height, width, tile_shape, double=False):
        geo, i_h, nd = conv.geometry, conv.spatial_index, conv.nd
        return fused_tile_windows(key, geo, i_h, nd, height, width, tuple(tile_shape))

    return tile_layer_plan(lay.path, conv, tuple(pad_in), out_shape, shape, windows=windows)
