"""Row layouts of attention under latitude sharding: pure integer arithmetic, no processes.

An attention whose rows only mix inside known groups (windows that tile H, strided long-distance
groups, shifted windows) is made exact by re-laying its input rows out so that every rank holds
whole groups, running the unmodified module there, and sending every output row back to the
rank that owns it in the balanced layout.  A layout is, per domain rank, the tuple of GLOBAL rows
that rank holds while the module runs, in the order the module must see them; over all ranks
it is a permutation of ``range(height)`` (every row held exactly once), which is what makes the
return trip the exact inverse of the first exchange.

Sequence-parallel attention splits heads instead of rows: :func:`head_split` says which heads
each rank computes on all positions.
"""

from __future__ import annotations

from ..rows import pure_cached, shard_range

__all__ = [
    "check_permutation",
    "head_split",
    "shifted_window_layout",
    "strided_group_layout",
    "window_layout",
]


def _check_divides(height: int, rows: int, what: str) -> int:
    if rows < 1 or height % rows:
        raise ValueError(
            f"{what}: a height of {height} rows is not a multiple of {rows} (the module itself "
            "would fail on the whole globe)"
        )
    return height // rows


@pure_cached(maxsize=256)  # every forward asks again; the answer is pure
def window_layout(height: int, n: int, window_rows: int) -> tuple[tuple[int, ...], ...]:
    """Windows ``[j*w, (j+1)*w)`` tile H; rank r holds the balanced share of whole windows.

    When the balanced row shards already end on window boundaries this is the balanced layout
    itself and no row moves."""
    count = _check_divides(height, window_rows, "windowed attention")
    out = []
    for r in range(n):
        first, stop = shard_range(count, n, r)
        out.append(tuple(range(first * window_rows, stop * window_rows)))
    return tuple(out)


@pure_cached(maxsize=256)  # every forward asks again; the answer is pure
def shifted_window_layout(
    height: int, n: int, window_rows: int, shift_rows: int
) -> tuple[tuple[int, ...], ...]:
    """Windows of the tensor rolled by ``-shift_rows`` over H (Swin's cyclic shift): window j
    holds global rows ``(j*w + shift + i) % H``.  The roll becomes part of the row exchange."""
    return tuple(
        tuple((g + shift_rows) % height for g in rows)
        for rows in window_layout(height, n, window_rows)
    )


@pure_cached(maxsize=256)  # every forward asks again; the answer is pure
def strided_group_layout(height: int, n: int, group_rows: int) -> tuple[tuple[int, ...], ...]:
    """CREDIT's long-distance attention (``rearrange "(l1 h)"`` with ``l1 = group_rows``): group
    ``j`` is rows ``j, j + H/k, j + 2H/k, ...``.  Rank r holds the balanced share of whole groups
    ``[a, b)`` laid out as ``(l1 h')`` with ``h' = b - a``, so that the unmodified module's own
    rearrange finds exactly those groups on the local tensor."""
    stride = _check_divides(height, group_rows, "long-distance attention")
    out = []
    for r in range(n):
        a, b = shard_range(stride, n, r)
        out.append(tuple(l1 * stride + j for l1 in range(group_rows) for j in range(a, b)))
    return tuple(out)


def check_permutation(layout: tuple, height: int) -> None:
    """A layout must hold every global row exactly once (its return trip is then its inverse)."""
    rows = sorted(g for rank_rows in layout for g in rank_rows)
    if rows != list(range(height)):
        raise ValueError(
            f"attention row layout is not a permutation of the {height} rows: {layout!r}"
        )


def head_split(heads: int, n: int) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` of the heads each of ``n`` ranks computes (balanced; with fewer heads
    than ranks the last ranks compute none, and still take part in the all-to-all)."""
    return tuple(shard_range(heads, n, r) for r in range(n))
