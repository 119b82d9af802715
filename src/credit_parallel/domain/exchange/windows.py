"""Windows: the global rows a layer reads, assembled from the shard and the received rows.

Pure tensor bookkeeping, no communication: :func:`assemble_window` builds any range of a window
(own rows, rows of other ranks, fill rows beyond the globe, edge rows of reflect / replicate),
:func:`scatter_window_grad` sends each row of a window's gradient back to where it came from
(the shard, or the buffer returned to its owner), :func:`halo_gradient_buffers` allocates those
buffers.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = [
    "assemble_window",
    "halo_gradient_buffers",
    "reads_only_fill",
    "scatter_window_grad",
    "shape_numel",
    "shape_with",
]


def shape_with(x: torch.Tensor, dim: int, rows: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = rows
    return shape


def shape_numel(shape) -> int:
    n = 1
    for v in shape:
        n *= v
    return n


def _range_segments(segments, start: int, stop: int, skip: tuple[int, int] = (0, 0)):
    """A plan's ``segments`` cut to window positions ``[start, stop)`` minus ``skip``: yields
    ``(kind, where, position, count)`` with ``where`` the local row ("own"), ``(recv index,
    offset)`` ("recv") or None ("fill"), and ``position`` the window position of the piece."""
    ranges = ((start, stop),)
    if skip[1] > skip[0]:
        ranges = ((start, min(stop, skip[0])), (max(start, skip[1]), stop))
    pos = 0
    for seg in segments:
        count = seg[-1]
        for lo, hi in ranges:
            a, b = max(lo, pos), min(hi, pos + count)
            if a < b:
                off = a - pos
                if seg[0] == "own":
                    yield "own", seg[1] + off, a, b - a
                elif seg[0] == "recv":
                    yield "recv", (seg[1], seg[2] + off), a, b - a
                else:
                    yield "fill", None, a, b - a
        pos += count


_SEGMENTS: OrderedDict = OrderedDict()  # least recently used first
_SEGMENTS_LIMIT = 1024


def _rows(t: torch.Tensor, dim: int, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start + count)`` of ``t`` along ``dim``: ``t`` itself when that is all of
    it (one operation fewer per piece), else a view."""
    if start == 0 and count == t.shape[dim]:
        return t
    return t.narrow(dim, start, count)


@torch._dynamo.assume_constant_result
def _cut(segments: tuple, start: int, stop: int, skip) -> tuple:
    """:func:`_range_segments` as a tuple, computed once per (segments, range, skip): the same
    plan is cut the same way at every call of a layer.  Run for real while Dynamo traces (its
    result a constant of the graph; its arguments plain tuples and ints), so the cache is never
    written from traced code and compiled and eager layers cut their windows alike.  At the
    size limit the least recently used cut goes (an entry holds its segments, so that their id
    stays theirs)."""
    key = (id(segments), start, stop, skip[0], skip[1])
    hit = _SEGMENTS.get(key)
    if hit is None:
        hit = _SEGMENTS[key] = (segments, tuple(_range_segments(segments, start, stop, skip)))
        if len(_SEGMENTS) > _SEGMENTS_LIMIT:
            _SEGMENTS.popitem(last=False)
    else:
        _SEGMENTS.move_to_end(key)
    return hit[1]


def _segments(plan, start: int, stop: int, skip) -> tuple:
    """The pieces of ``plan``'s window positions ``[start, stop)`` minus ``skip`` (:func:`_cut`)."""
    return _cut(plan.segments, start, stop, (skip[0], skip[1]))


def _window_pieces(x, recv_bufs, plan, dim, fill_value, start, stop, skip=(0, 0)) -> list:
    pieces, pos = [], start
    for kind, where, a, c in _segments(plan, start, stop, skip):
        if a > pos:  # skipped positions: zeros
            pieces.append(x.new_zeros(shape_with(x, dim, a - pos)))
        if kind == "own":
            pieces.append(x.narrow(dim, where, c))
        elif kind == "recv":
            pieces.append(_rows(recv_bufs[where[0]], dim, where[1], c))
        else:
            pieces.append(x.new_full(shape_with(x, dim, c), fill_value))
        pos = a + c
    if pos < stop:
        pieces.append(x.new_zeros(shape_with(x, dim, stop - pos)))
    return pieces


def scatter_window_grad(grad, start: int, plan, dim: int, grad_x, grad_recv, skip=(0, 0)):
    """Accumulate the gradient ``grad`` of window positions ``[start, start + rows)`` (minus the
    positions ``skip``) into the shard gradient ``grad_x`` (own rows) and the per-peer buffers
    ``grad_recv`` (received rows, one per ``plan.recvs`` entry; either may be None: not
    accumulated now); fill rows are dropped."""
    stop = start + grad.shape[dim]
    for kind, where, a, c in _segments(plan, start, stop, skip):
        if kind == "own" and grad_x is not None:
            _rows(grad_x, dim, where, c).add_(_rows(grad, dim, a - start, c))
        elif kind == "recv" and grad_recv is not None:
            _rows(grad_recv[where[0]], dim, where[1], c).add_(_rows(grad, dim, a - start, c))


def reads_only_fill(plan, start: int, stop: int, skip: tuple[int, int] = (0, 0)) -> bool:
    """Whether window positions ``[start, stop)`` minus ``skip`` hold only fill rows (rows
    beyond the globe that no rank owns)."""
    return all(kind == "fill" for kind, _, _, _ in _segments(plan, start, stop, skip))


def halo_gradient_buffers(like: torch.Tensor, plan, dim: int) -> list[torch.Tensor]:
    """Zeroed gradient buffers of the rows ``plan`` receives (one per ``plan.recvs`` entry)."""
    return [like.new_zeros(shape_with(like, dim, c)) for _, c in plan.recvs]


def assemble_window(
    x: torch.Tensor,
    recv_bufs: list,
    plan,
    dim: int,
    fill_value: float = 0.0,
    start: int = 0,
    stop: int | None = None,
    skip: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """Positions ``[start, stop)`` of this rank's window, from its own rows ``x``, the buffers
    received by :func:`post_rows` and fill rows (a view of ``x`` when only own rows are asked);
    positions in ``skip`` (a range) are zeros."""
    stop = plan.window_rows if stop is None else stop
    pieces = _window_pieces(x, recv_bufs, plan, dim, fill_value, start, stop, skip)
    if not pieces:  # an empty window, still a view of x (attached to its graph)
        return x.narrow(dim, 0, 0)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
