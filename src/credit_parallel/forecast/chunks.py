"""Which rank writes which chunk of the forecast store, and the neighbour exchange that hands it
the rows it writes but does not hold.

The domain ranks hold balanced row ranges (``domain.rows.shard_range``: 721 rows over 4 ranks are
181/180/180/180), so no chunk length but 1 fits every split of an uneven grid into whole chunks.
Instead the chunks are whole row blocks of :func:`chunk_length` rows, each written by ONE rank:
the rank holding its first row (its owner).  A chunk straddling two ranks gets its rows held by
the next rank through a small exchange before the write, as a halo: every rank sends the head of
its rows (up to its first chunk boundary) to the owner of the chunk they fall in, and appends
what it receives to the rows it owns.  No chunk has one row, no chunk has two writers, and no
write reads a chunk back.

On a latitude x longitude domain (SPEC §3b) the same is done per axis: the columns first (along
each row of tiles), then the rows (along each column of tiles, with the columns each rank now
owns), so a chunk straddling four tiles reaches its owner's corner in two steps, as a halo's
corners do.

:func:`chunk_length` and :func:`axis_plan` are pure arithmetic (``tests/test_forecast_chunks.py``
checks them exhaustively); :func:`exchange` is the one place that communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ROW_CHUNKS", "AxisPart", "axis_plan", "chunk_length", "exchange", "row_chunk_length"]

# at least this many row chunks over the globe (docs/forecast.md "Writing": tensorstore encodes
# the chunks of a step in parallel; a quarter globe of 17 levels at 0.25 degrees is 18 MB)
ROW_CHUNKS = 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def chunk_length(length: int, parts: int, max_rows: int | None = None) -> int:
    """Rows (or columns) per chunk for ``length`` rows split over ``parts`` balanced ranks.

    About one chunk per rank (``ceil(length / parts)``), or each rank's share split evenly into
    chunks of at most ``max_rows`` rows; if that leaves a last chunk of one row, the next
    shorter chunk that does not (every rank then holds a whole chunk's rows or more, so a chunk
    straddles at most two ranks: the exchange is between neighbours), else (tiny grids) the next
    longer one (``length`` 7 over 3: 4 + 3, not 3 + 3 + 1).  At least 2 rows per chunk
    (``length`` >= 2)."""
    if length < 1 or parts < 1:
        raise ValueError(f"chunk_length: length and parts must be >= 1, got {length}, {parts}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"chunk_length: max_rows must be >= 1, got {max_rows}")
    if length == 1:
        return 1
    size = _ceil_div(length, parts)
    if max_rows is not None and max_rows < size:
        size = _ceil_div(size, _ceil_div(size, max_rows))
    size = max(size, 2)
    for candidate in (*range(size, 1, -1), *range(size + 1, length + 1)):
        if length % candidate != 1:
            return candidate
    return length  # not reached: length % length == 0


def row_chunk_length(height: int, parts: int) -> int:
    """The store's latitude chunk: one per rank, at most ``1 / ROW_CHUNKS`` of the globe."""
    return chunk_length(height, parts, max_rows=_ceil_div(height, ROW_CHUNKS))


@dataclass(frozen=True)
class AxisPart:
    """One rank's share along one axis: ``held`` the rows it computed, ``owned`` the rows of the
    chunks it writes (whole chunks; empty ``(s, s)`` when it owns none), ``send`` ``(rank,
    (start, stop))`` the head of its rows that another rank writes (or None), ``receive`` the
    ``(rank, (start, stop))`` it gets, in row order (``owned`` = its rows from the first chunk
    boundary on, then these)."""

    held: tuple[int, int]
    owned: tuple[int, int]
    send: tuple[int, tuple[int, int]] | None
    receive: tuple[tuple[int, tuple[int, int]], ...]


def axis_plan(length: int, ranges: Sequence[tuple[int, int]], chunk: int) -> list[AxisPart]:
    """Every rank's :class:`AxisPart` for ``ranges`` (``[start, stop)`` per rank, contiguous and
    in order, empty ones allowed) of ``length`` rows in chunks of ``chunk`` rows."""
    ranges = [(int(a), int(b)) for a, b in ranges]
    if chunk < 1:
        raise ValueError(f"axis_plan: chunk must be >= 1, got {chunk}")
    position = 0
    for a, b in ranges:
        if a != position or b < a:
            raise ValueError(f"axis_plan: ranges {ranges} are not contiguous from 0")
        position = b
    if position != length:
        raise ValueError(f"axis_plan: ranges {ranges} do not cover {length} rows")

    def holder(row: int) -> int:
        return next(r for r, (a, b) in enumerate(ranges) if a <= row < b)

    owned, sends = [], []
    for a, b in ranges:
        first = _ceil_div(a, chunk) * chunk  # the first chunk boundary at or after a
        if first < b:
            owned.append((first, min(length, _ceil_div(b, chunk) * chunk)))
        else:
            owned.append((b, b))
        head = (a, min(b, first))
        sends.append((holder((a // chunk) * chunk), head) if head[0] < head[1] else None)
    parts = []
    for r, (a, b) in enumerate(ranges):
        receive = tuple((src, s[1]) for src, s in enumerate(sends) if s and s[0] == r)
        parts.append(AxisPart((a, b), owned[r], sends[r], receive))
    return parts


def exchange(x: torch.Tensor, part: AxisPart, dim: int, peer: Callable[[int], int]) -> torch.Tensor:
    """``x`` (this rank's ``held`` rows along ``dim``) -> its ``owned`` rows: the head of its rows
    sent to their chunk's owner, the rows it owns but does not hold received from their holders
    (``peer(i)``: the global rank of the i-th rank along this axis).  Every rank of the axis
    calls it (one ``batch_isend_irecv``); with nothing to send or receive it only slices."""
    import torch.distributed as dist

    dim = dim % x.dim()
    a, b = part.held
    start = min(max(part.owned[0], a), b)
    keep = x.narrow(dim, start - a, b - start)
    ops, received = [], []
    if part.send is not None:
        dst, (s0, s1) = part.send
        ops.append(dist.P2POp(dist.isend, x.narrow(dim, s0 - a, s1 - s0).contiguous(), peer(dst)))
    for src, (s0, s1) in part.receive:
        shape = list(x.shape)
        shape[dim] = s1 - s0
        buffer = torch.empty(shape, dtype=x.dtype, device=x.device)
        ops.append(dist.P2POp(dist.irecv, buffer, peer(src)))
        received.append(buffer)
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return torch.cat([keep, *received], dim=dim) if received else keep
