"""Pure geometry of (transposed) convolutions along the sharded dim: no processes, no tensors.

:class:`ConvGeometry` holds a conv's kernel, stride, dilation, resolved padding and boundary rule;
:func:`conv_windows` / :func:`conv_transpose_windows` give, for every domain rank, the global
input rows its owned output rows read (the ``input_windows`` of the layers in ``conv.py``);
:func:`overlap_split` says which of a rank's output rows read only its own rows (they can be
computed straight from the shard while halo rows travel) and which read the window's edges;
:class:`ConvOp` is the local op along the other dims (their padding, then the plain conv).
Everything is cached on its (hashable, immutable) arguments: the shape algebra of a call is
computed once per geometry and height.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn.functional as F
from torch import nn

from ..rows import (
    ceil_div,
    conv_output_length,
    conv_transpose_input_range,
    conv_transpose_output_length,
    conv_window,
    edge_source_row,
    pure_cached,
    same_padding,
    shard_range,
)

__all__ = [
    "ConvGeometry",
    "ConvOp",
    "OverlapSplit",
    "conv_needs_domain_wrapper",
    "conv_rows",
    "conv_transpose_windows",
    "conv_windows",
    "overlap_split",
]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class ConvGeometry:
    """Everything about a conv along all spatial dims, with padding resolved to (before, after)."""

    transposed: bool
    kernel: tuple
    stride: tuple
    dilation: tuple
    pads: tuple  # ((before, after), ...) per spatial dim
    output_padding: tuple
    groups: int
    edge_mode: str  # boundary rule along the sharded dim
    other_mode: str  # padding mode of the other spatial dims

    @classmethod
    def of(cls, conv: nn.Module) -> ConvGeometry:
        nd = len(conv.kernel_size)
        transposed = isinstance(conv, nn.modules.conv._ConvTransposeNd)
        if isinstance(conv.padding, str):
            if conv.padding == "valid":
                pads = tuple((0, 0) for _ in range(nd))
            else:  # "same"
                pads = tuple(same_padding(k, d) for k, d in zip(conv.kernel_size, conv.dilation))
        else:
            pads = tuple((p, p) for p in conv.padding)
        mode = conv.padding_mode
        return cls(
            transposed,
            tuple(conv.kernel_size),
            tuple(conv.stride),
            tuple(conv.dilation),
            pads,
            tuple(getattr(conv, "output_padding", (0,) * nd)),
            conv.groups,
            mode,
            mode,
        )

    def output_length(self, length: int, i: int) -> int:
        if self.transposed:
            return conv_transpose_output_length(
                length,
                self.kernel[i],
                self.stride[i],
                self.pads[i][0],
                self.output_padding[i],
                self.dilation[i],
            )
        return conv_output_length(
            length, self.kernel[i], self.stride[i], *self.pads[i], self.dilation[i]
        )

    def is_row_local(self, i: int) -> bool:
        """True when output row r is computed from input row r alone (no exchange needed)."""
        return (
            self.kernel[i] == 1
            and self.stride[i] == 1
            and self.pads[i] == (0, 0)
            and self.output_padding[i] == 0
        )


def conv_needs_domain_wrapper(conv: nn.Module, spatial_index: int) -> bool:
    return not ConvGeometry.of(conv).is_row_local(spatial_index)


@pure_cached(maxsize=4096)
def conv_windows(geo: ConvGeometry, i: int, length: int, n: int) -> tuple:
    """``(windows, output length)`` of a (non-transposed) conv along spatial dim ``i`` of a global
    ``length``: ``windows[r]`` are the input rows (or FILL, by the boundary rule) of rank r's
    output rows.  A rank that owns no output row has an empty window."""
    out_len = geo.output_length(length, i)
    windows = tuple(conv_rows(geo, i, length, *shard_range(out_len, n, r)) for r in range(n))
    return windows, out_len


def conv_rows(geo: ConvGeometry, i: int, length: int, o0: int, o1: int) -> tuple:
    """The input rows (or FILL, by the boundary rule) that output rows ``[o0, o1)`` of a
    (non-transposed) conv read along spatial dim ``i`` of a global ``length``; empty for an
    empty range.  (Any range: the halo chains of ``halo_chain.py`` ask for wider ones than a
    rank owns.)"""
    if o0 >= o1:
        return ()
    lo, hi = conv_window(
        o0,
        o1,
        kernel=geo.kernel[i],
        stride=geo.stride[i],
        dilation=geo.dilation[i],
        pad_before=geo.pads[i][0],
    )
    return tuple(edge_source_row(p, length, geo.edge_mode) for p in range(lo, hi))


@pure_cached(maxsize=4096)
def conv_transpose_windows(geo: ConvGeometry, i: int, length: int, n: int) -> tuple:
    """``(windows, output length)`` of a transposed conv: ``windows[r]`` are the input rows that
    write into rank r's output rows (empty when none does: those outputs are just the bias)."""
    out_len = geo.output_length(length, i)
    windows = []
    for r in range(n):
        o0, o1 = shard_range(out_len, n, r)
        if o0 == o1:
            windows.append(())
            continue
        lo, hi = conv_transpose_input_range(
            o0,
            o1,
            length,
            kernel=geo.kernel[i],
            stride=geo.stride[i],
            padding=geo.pads[i][0],
            dilation=geo.dilation[i],
        )
        windows.append(tuple(range(lo, hi)))
    return tuple(windows), out_len


@dataclass(frozen=True)
class OverlapSplit:
    """How one rank's output rows of a convolution split around its shard (sharded dim only).

    Output rows ``[0, top_rows)`` (of this rank's outputs) read window positions
    ``[0, top_stop)``; the next ``interior_rows`` read only own rows, local rows
    ``[interior_start, interior_stop)`` of the shard; the last ``bottom_rows`` read window
    positions ``[bottom_start, window_rows)``.
    """

    top_rows: int
    top_stop: int
    interior_rows: int
    interior_start: int
    interior_stop: int
    bottom_rows: int
    bottom_start: int


@pure_cached(maxsize=4096)
def overlap_split(geo: ConvGeometry, i: int, length: int, n: int, rank: int):
    """The :class:`OverlapSplit` of ``rank`` for a (non-transposed) conv ``geo`` along spatial
    dim ``i`` of a global ``length``, or None when the rank has no interior output row (its
    shard is thinner than the kernel's reach, or it owns no output)."""
    if geo.transposed:
        return None
    k, st, d, pb = geo.kernel[i], geo.stride[i], geo.dilation[i], geo.pads[i][0]
    span = d * (k - 1) + 1
    out_len = geo.output_length(length, i)
    o0, o1 = shard_range(out_len, n, rank)
    s, e = shard_range(length, n, rank)
    # output row o reads padded rows [o*st - pb, o*st - pb + span): interior when inside [s, e)
    i0 = max(o0, ceil_div(s + pb, st))
    i1 = min(o1, (e + pb - span) // st + 1)
    if i1 <= i0:
        return None
    top_stop = (i0 - 1 - o0) * st + span if i0 > o0 else 0
    return OverlapSplit(
        top_rows=i0 - o0,
        top_stop=top_stop,
        interior_rows=i1 - i0,
        interior_start=i0 * st - pb - s,
        interior_stop=(i1 - 1) * st - pb + span - s,
        bottom_rows=o1 - i1,
        bottom_start=(i1 - o0) * st,
    )


@dataclass(frozen=True)
class ConvOp:
    """The local op of a conv along the non-sharded dims: optional ``F.pad`` then the conv."""

    nd: int
    stride: tuple
    padding: tuple  # the conv's own padding (zeros, symmetric) of every dim, 0 on the sharded
    dilation: tuple
    groups: int
    pad_flat: tuple | None  # F.pad argument when the other dims are padded explicitly
    pad_mode: str

    @classmethod
    def of(cls, geo: ConvGeometry, i: int) -> ConvOp:
        """The op of ``geo`` sharded along spatial dim ``i`` (no padding along it)."""
        nd = len(geo.kernel)
        # padding of the other spatial dims exactly as the wrapped conv would do it
        pads = [p if j != i else (0, 0) for j, p in enumerate(geo.pads)]
        if geo.other_mode == "zeros" and all(a == b for a, b in pads):
            return cls(
                nd,
                geo.stride,
                tuple(a for a, _ in pads),
                geo.dilation,
                geo.groups,
                None,
                "constant",
            )
        flat = []
        for a, b in reversed(pads):
            flat += [a, b]
        mode = "constant" if geo.other_mode == "zeros" else geo.other_mode
        return cls(nd, geo.stride, (0,) * nd, geo.dilation, geo.groups, tuple(flat), mode)

    def with_row_padding(self, i: int, pad: int) -> ConvOp:
        """This op with the conv's own zero padding ``pad`` along spatial dim ``i``."""
        padding = tuple(pad if j == i else p for j, p in enumerate(self.padding))
        return replace(self, padding=padding)

    def input_of(self, window):
        if self.pad_flat is None:
            return window
        return F.pad(window, list(self.pad_flat), mode=self.pad_mode)

    def __call__(self, window, weight, bias):
        inp = self.input_of(window)
        return _CONV[self.nd](
            inp, weight, bias, self.stride, self.padding, self.dilation, self.groups
        )
