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
* Sibling 2-D convs called on one tile: the first call exchanges the union of their windows
  (``shared_input.tile_union_windows``), the others nothing, by the run-time rule
  (``shared_input.sharing_step``).
"""

from __future__ import annotations

import dataclasses

from ..domain.exchange.shared_input import sharing_step, tile_union_windows
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
    pairs, groups, triples = tile_fusions(model, decided)
    shared = _shared_calls(trace, groups, shape)
    pad_of = {id(conv): pad for pad, conv in pairs}
    fused_pads = {id(pad) for pad, _ in pairs}
    linked_norms = {id(norm) for norm, _, _ in triples}
    linked_convs = {id(conv) for _, _, conv in triples}
    stats_pass = "rows" if shape[0] > 1 else "cols"
    tops = [lay.path for lay in layers if lay.strips_sent]  # run on strips: no tile fusion
    out = []
    for index, (lay, call) in enumerate(zip(layers, trace.calls)):
        _, _, layer, in_shape, out_shape, _ = call
        if any(lay.path == top or lay.path.startswith(top + ".") for top in tops):
            out.append(lay)
        elif id(layer) in fused_pads:
            out.append(dataclasses.replace(lay, **{key: () for key in _EXCHANGE_FIELDS}))
        elif id(layer) in pad_of:
            out.append(
                _fused_conv(lay, layer, pad_of[id(layer)], in_shape, out_shape, shape, double)
            )
        elif index in shared:
            out.append(_with_windows(lay, layer, shared[index], in_shape, out_shape, shape, double))
        elif id(layer) in linked_convs:
            out.append(dataclasses.replace(lay, stats_pass=stats_pass))
        elif id(layer) in linked_norms:
            out.append(dataclasses.replace(lay, stats_with_exchange=True))
        else:
            out.append(lay)
    return out


def _shared_calls(trace, groups, shape) -> dict:
    """``{call index: (row windows, column windows) or None}`` of the calls of sibling convs:
    the union windows where the run-time rule (``shared_input.sharing_step``) exchanges, None
    where the call takes its window from a sibling's exchange."""
    group_of = {id(layer): g for g in map(tuple, groups) for layer in g}
    out, served_by, inactive = {}, {}, set()
    for index, (_, _, layer, in_shape, _, x) in enumerate(trace.calls):
        group = group_of.get(id(layer))
        if group is None or id(group) in inactive:
            continue
        entry = served_by.get(id(group))  # (input, siblings served) of the last exchange
        member = group.index(layer)
        same = entry is not None and entry[0] is x
        exchanges, active = sharing_step(None if entry is None else entry[1], member, same)
        if not exchanges:
            entry[1].add(member)
            out[index] = None
            if len(entry[1]) == len(group):
                served_by[id(group)] = None  # all served: the next call exchanges afresh
            continue
        if not active:
            inactive.add(id(group))  # a stack, not siblings: every later call alone
        geometries = tuple(m.geometry for m in group)
        height, width = in_shape[-2], in_shape[-1]
        rows, cols, _ = tile_union_windows(
            geometries, layer.spatial_index, layer.nd, height, width, shape
        )
        out[index] = (rows, cols)
        served_by[id(group)] = (x, {member})
    return out


def _with_windows(lay, conv, windows, in_shape, out_shape, shape, double) -> TileLayerPlan:
    """The plan of a sibling conv's call: the union windows' exchange, or none."""
    if windows is None:
        return dataclasses.replace(lay, **{key: () for key in _EXCHANGE_FIELDS})
    union = lambda height, width, tile_shape, double=False: windows  # noqa: E731
    plan = tile_layer_plan(lay.path, conv, tuple(in_shape), out_shape, shape, double, union)
    return dataclasses.replace(plan, input_grad=lay.input_grad)


def _fused_conv(lay, conv, pad, in_shape, out_shape, shape, double) -> TileLayerPlan:
    """The plan of ``conv`` exchanging the input of ``pad`` for both."""
    left, right, top, bottom = pad.padding
    pad_in = list(in_shape)
    pad_in[-2] -= top + bottom
    pad_in[-1] -= left + right
    key = fused_pad_key(pad)

    def windows(height, width, tile_shape, double=False):
        geo, i_h, nd = conv.geometry, conv.spatial_index, conv.nd
        return fused_tile_windows(key, geo, i_h, nd, height, width, tuple(tile_shape))

    plan = tile_layer_plan(lay.path, conv, tuple(pad_in), out_shape, shape, double, windows)
    return dataclasses.replace(plan, input_grad=lay.input_grad)
