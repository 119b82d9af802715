"""One halo exchange for several convolutions called on the SAME tensor.

The branches of a cross-scale embedding (CREDIT's CrossEmbed) or an inception block apply
several convolutions to one input.  Grouped with :func:`share_input_exchange` (the converter does
it automatically for sibling convolutions declared on a module, see ``convert.py``), the first of
them called on a tensor exchanges the UNION of their windows and the others take their rows from
it.  A layer called on another tensor (or twice on the same one) simply exchanges again, so the
results never depend on the pairing; they equal the unshared layers' to rounding (gradient rows
are summed before they travel).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import replace

from ..layers.conv_geometry import ConvGeometry
from ..rows import conv_window, edge_source_row, pure_cached, shard_range
from .halo import exchange_rows, exchange_tile, tile_plan

__all__ = [
    "SharedInputExchange",
    "share_input_exchange",
    "sharing_step",
    "tile_union_windows",
    "union_windows",
]


def sharing_step(served, index: int, same_tensor: bool, unchanged: bool = True):
    """The rule of a shared exchange for one call of sibling ``index``: ``(exchanges,
    stays_active)``.  ``served``: the siblings already served from the last exchanged input
    (None: nothing pending); ``same_tensor``: the call's input is that input; ``unchanged``: it
    was not modified in place since (same version, same height).  A call exchanges unless a
    sibling not yet served is called on the unchanged same input; a group whose previous input
    served only the layer that exchanged it, called on another tensor, is a stack, not
    siblings: it stops sharing.  Pure: the run time (:class:`SharedInputExchange`) and the
    planner (``planner/layer_calls.py``) both follow it."""
    if served is None:
        return True, True
    if same_tensor and unchanged and index not in served:
        return False, True
    return True, same_tensor or len(served) != 1


@pure_cached(maxsize=1024)
def union_windows(geometries: tuple, i: int, length: int, n: int, rank: int) -> tuple:
    """``(windows, offsets)`` of convolutions ``geometries`` (same boundary rule) sharing one
    input of ``length`` rows along spatial dim ``i``: ``windows[r]`` is the union window of rank
    r; ``offsets[m]`` = (start, count) of conv m's own window inside ``rank``'s union window."""
    lo = [[0] * len(geometries) for _ in range(n)]
    hi = [[0] * len(geometries) for _ in range(n)]
    for m, geo in enumerate(geometries):
        out_len = geo.output_length(length, i)
        for r in range(n):
            o0, o1 = shard_range(out_len, n, r)
            if o0 == o1:  # no output rows: an empty window at the shard start
                start = shard_range(length, n, r)[0]
                lo[r][m] = hi[r][m] = start
                continue
            lo[r][m], hi[r][m] = conv_window(
                o0,
                o1,
                kernel=geo.kernel[i],
                stride=geo.stride[i],
                dilation=geo.dilation[i],
                pad_before=geo.pads[i][0],
            )
    mode = geometries[0].edge_mode
    windows = tuple(
        tuple(edge_source_row(p, length, mode) for p in range(min(lo[r]), max(hi[r])))
        for r in range(n)
    )
    offsets = tuple(
        (lo[rank][m] - min(lo[rank]), hi[rank][m] - lo[rank][m]) for m in range(len(geometries))
    )
    return windows, offsets


class SharedInputExchange:
    """The exchange shared by a group of convolutions (see the module docstring)."""

    def __init__(self, layers):
        self.layers = tuple(layers)
        self._entry = None  # (weakref to the input, its version, length, window, served ids)
        # False once the layers were seen called on different tensors (a stack applied one
        # after the other, not branches): they then exchange alone.  Every rank sees the same
        # sequence of calls, so every rank switches at the same call.
        self.active = True

    # a copied or pickled model must not carry (or fail on) the window of a forward in flight
    def __deepcopy__(self, memo):
        new = SharedInputExchange(())
        new.active = self.active
        memo[id(self)] = new  # the layers refer back to this group
        new.layers = copy.deepcopy(self.layers, memo)
        return new

    def __getstate__(self):
        return {"layers": self.layers, "_entry": None, "active": self.active}

    def window_for(self, layer, x, length: int, n: int, dim: int, mgr):
        geometries = tuple(m.geometry for m in self.layers)
        windows, offsets = union_windows(
            geometries, layer.spatial_index, length, n, mgr.domain_rank
        )
        index = self.layers.index(layer)
        entry = self._entry
        same = entry is not None and entry[0]() is x
        unchanged = entry is not None and entry[1] == x._version and entry[2] == length
        fresh, self.active = sharing_step(
            None if entry is None else entry[4], index, same, unchanged
        )
        if fresh:
            # every rank sees the same sequence of calls, so all ranks exchange together
            window = exchange_rows(x, windows, length, dim, mgr)
            entry = self._entry = (weakref.ref(x), x._version, length, window, set())
        entry[4].add(index)
        window = entry[3]
        if len(entry[4]) == len(self.layers):
            self._entry = None  # all served: do not keep the window alive
        start, count = offsets[index]
        return window.narrow(dim, start, count)

    def tile_window_for(self, layer, x, height: int, width: int, dims: tuple, mgr):
        """On a lat x lon tile (SPEC §3b): the window of ``layer`` cut from ONE tile exchange
        of the union windows of the group along H and along W (``exchange/halo.py``), shared
        by the siblings called on the same tile ``x`` (the same rule as :meth:`window_for`)."""
        geometries = tuple(m.geometry for m in self.layers)
        shape, coords = tuple(mgr.domain_shape), tuple(mgr.domain_coords)
        rows, cols, offsets = tile_union_windows(
            geometries, layer.spatial_index, layer.nd, height, width, shape
        )
        index = self.layers.index(layer)
        entry, size = self._entry, (height, width)
        same = entry is not None and entry[0]() is x
        unchanged = entry is not None and entry[1] == x._version and entry[2] == size
        fresh, self.active = sharing_step(
            None if entry is None else entry[4], index, same, unchanged
        )
        if fresh:  # every rank sees the same sequence of calls: all exchange together
            plan = tile_plan(height, width, shape, coords, rows, cols)
            window = exchange_tile(x, plan, dims, mgr)
            entry = self._entry = (weakref.ref(x), x._version, size, window, set())
        entry[4].add(index)
        window = entry[3]
        if len(entry[4]) == len(self.layers):
            self._entry = None
        (h0, hn), (w0, wn) = offsets(coords)[index]
        return window.narrow(dims[0], h0, hn).narrow(dims[1], w0, wn)


def tile_union_windows(geometries: tuple, i_h: int, nd: int, height: int, width: int, shape):
    """``(rows, cols, offsets)`` of convolutions sharing one input on lat x lon tiles of
    ``shape`` = (P, Q) (rank-independent parts: every rank's union windows along H and along W,
    the longitude one by the convs' ``other_mode``) and a function ``offsets(coords)`` giving,
    per conv, ``((start, count) along H, (start, count) along W)`` inside the union window."""
    p, q = shape
    geos_w = tuple(replace(g, edge_mode=g.other_mode) for g in geometries)
    rows = union_windows(geometries, i_h, height, p, 0)[0]
    cols = union_windows(geos_w, nd - 1, width, q, 0)[0]

    def offsets(coords):
        lat, lon = coords
        along_h = union_windows(geometries, i_h, height, p, lat)[1]
        along_w = union_windows(geos_w, nd - 1, width, q, lon)[1]
        return tuple(zip(along_h, along_w))

    return rows, cols, offsets


def share_input_exchange(*layers) -> None:
    """Let domain-parallel convolutions that are called on the SAME tensor one after the other
    fetch their halo rows in ONE exchange instead of one each (see the module docstring).
    Every layer must be a non-transposed domain-parallel conv (``geometry`` a
    :class:`ConvGeometry`) with the same shard dim, boundary rule and manager.  These layers do
    not overlap (the exchange is shared, not hidden)."""
    if len(layers) < 2:
        raise ValueError("share_input_exchange needs at least two layers")
    first = layers[0]
    for layer in layers:
        geo = getattr(layer, "geometry", None)
        if (
            not isinstance(geo, ConvGeometry)
            or geo.transposed
            or not hasattr(layer, "shared_input")
        ):
            raise TypeError(
                "share_input_exchange takes domain-parallel (non-transposed) convolutions, got "
                f"{type(layer).__name__}"
            )
        same = (
            layer.shard_dim % (layer.nd + 2) == first.shard_dim % (first.nd + 2)
            and layer.nd == first.nd
            and geo.edge_mode == first.geometry.edge_mode
            and layer.manager is first.manager
        )
        if not same:
            raise ValueError(
                "share_input_exchange: all layers need the same shard dim, dimensionality, "
                f"boundary rule and manager; {layer!r} differs from {first!r}"
            )
    group = SharedInputExchange(layers)
    for layer in layers:
        layer.configure(shared_input=group)
