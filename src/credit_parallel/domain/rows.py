"""Row-range algebra of domain parallelism: pure functions, no torch.distributed.

Everything here is integer arithmetic on GLOBAL row indices along the sharded dim (latitude):

* the balanced shard layout (``torch.tensor_split``): which rows each domain rank owns (a dim
  shorter than the number of ranks leaves the last ranks empty: they own no row, still take part
  in every exchange, and their windows are empty or made of other ranks' rows);
* for each layer family, which input rows the output rows of a rank need.  A needed row outside
  the globe is mapped by the layer's boundary rule (:func:`edge_source_row`) to a real row or to
  :data:`FILL` (a row of zeros / the pad constant);
* from the windows every rank needs, the exchange plan: what each rank sends to and receives from
  each peer (:func:`plan_exchange`).  Both sides of every message compute the same plan from the
  same arguments, so no sizes are ever negotiated at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "FILL",
    "RankExchangePlan",
    "compose_windows",
    "conv_output_length",
    "conv_transpose_output_length",
    "conv_window",
    "ceil_div",
    "conv_transpose_input_range",
    "edge_source_row",
    "interp_source_rows",
    "plan_exchange",
    "pure_cached",
    "row_owner",
    "same_padding",
    "shard_range",
    "shard_sizes",
    "shard_start",
]


def pure_cached(maxsize: int):
    """``lru_cache`` for a pure function of the row arithmetic (ints, tuples, frozen geometry)
    that Dynamo runs for real while it traces, its result a constant of the graph
    (``assume_constant_result``): a compiled forward neither traces the arithmetic (numpy
    included) nor breaks its graph on it, and needs no eager call to fill a cache first."""

    def wrap(fn):
        return lru_cache(maxsize=maxsize)(torch._dynamo.assume_constant_result(fn))

    return wrap


FILL = -1  # a window row that is not a row of the tensor: zeros (or the pad constant)


# --------------------------------------------------------------------------- shard layout
def shard_sizes(length: int, n: int) -> tuple[int, ...]:
    """Rows owned by each of ``n`` ranks for a dim of ``length``: ``torch.tensor_split`` sizes."""
    q, r = divmod(length, n)
    return tuple(q + (1 if i < r else 0) for i in range(n))


def shard_start(length: int, n: int, rank: int) -> int:
    q, r = divmod(length, n)
    return rank * q + min(rank, r)


def shard_range(length: int, n: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the rows owned by ``rank``."""
    start = shard_start(length, n, rank)
    return start, start + length // n + (1 if rank < length % n else 0)


def row_owner(length: int, n: int, row: int) -> int:
    """The rank owning global ``row`` (0 <= row < length)."""
    q, r = divmod(length, n)
    big = r * (q + 1)  # rows held by the first r (larger) ranks
    if row < big:
        return row // (q + 1)
    return r + (row - big) // q


# --------------------------------------------------------------------------- boundary rules
def edge_source_row(p: int, length: int, mode: str) -> int:
    """Map a padded row coordinate ``p`` (may lie outside [0, length)) to the row it reads.

    ``zeros``/``constant`` give :data:`FILL` outside the globe; ``reflect`` mirrors about the
    edge row (row -1 reads row 1), ``replicate`` repeats the edge row, ``circular`` wraps.
    """
    if 0 <= p < length:
        return p
    if mode in ("zeros", "constant"):
        return FILL
    if mode == "replicate":
        return 0 if p < 0 else length - 1
    if mode == "circular":
        return p % length
    if mode == "reflect":
        q = -p if p < 0 else 2 * (length - 1) - p
        if not 0 <= q < length:
            raise ValueError(
                f"reflect padding of {max(-p, p - length + 1)} rows needs a dim longer than the "
                f"padding, but the global dim has {length} rows"
            )
        return q
    raise ValueError(f"unknown padding mode {mode!r}")


# --------------------------------------------------------------------------- convolution
def same_padding(kernel: int, dilation: int) -> tuple[int, int]:
    """PyTorch's padding="same": total d*(k-1), the extra row (if odd) at the end."""
    total = dilation * (kernel - 1)
    return total // 2, total - total // 2


def conv_output_length(
    length: int, kernel: int, stride: int, pad_before: int, pad_after: int, dilation: int
) -> int:
    return (length + pad_before + pad_after - dilation * (kernel - 1) - 1) // stride + 1


def conv_window(
    out_start: int, out_stop: int, *, kernel: int, stride: int, dilation: int, pad_before: int
) -> tuple[int, int]:
    """Input rows ``[lo, hi)`` (global coordinates, may leave the globe) read by output rows
    ``[out_start, out_stop)`` of a convolution; a conv with no padding over exactly these rows
    produces exactly those output rows."""
    lo = out_start * stride - pad_before
    hi = (out_stop - 1) * stride + dilation * (kernel - 1) + 1 - pad_before
    return lo, hi


def conv_transpose_output_length(
    length: int, kernel: int, stride: int, padding: int, output_padding: int, dilation: int
) -> int:
    return (length - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def conv_transpose_input_range(
    out_start: int,
    out_stop: int,
    length: int,
    *,
    kernel: int,
    stride: int,
    padding: int,
    dilation: int,
) -> tuple[int, int]:
    """Input rows ``[lo, hi)`` contributing to output rows ``[out_start, out_stop)`` of a
    transposed convolution (input row i writes positions ``i*s + j*d - padding``, j < kernel).

    Exact at both ends: ``lo`` and ``hi - 1`` really write into the range.  (The hull
    ``[ceil((out_start + padding - d*(k-1)) / s), (out_stop - 1 + padding) // s + 1)`` is not:
    with dilation > stride the taps of an end row can jump over a short output range.)  An
    empty range (``lo == hi``) means no input reaches these outputs (they are just the bias).
    """
    lo, hi = length, 0
    for j in range(kernel):
        # rows i with out_start <= i*s + j*d - padding < out_stop
        first = max(ceil_div(out_start + padding - j * dilation, stride), 0)
        last = min((out_stop - 1 + padding - j * dilation) // stride, length - 1)
        if first <= last:
            lo, hi = min(lo, first), max(hi, last + 1)
    return (lo, hi) if lo < hi else (0, 0)


# --------------------------------------------------------------------------- interpolation
def interp_source_rows(
    mode: str,
    in_len: int,
    out_len: int,
    out_start: int,
    out_stop: int,
    *,
    align_corners: bool | None,
    scale_factor: float | None,
    double: bool,
):
    """Source rows of output rows ``[out_start, out_stop)`` as PyTorch's CPU kernels compute them.

    ``nearest``: returns ``(idx,)``.  ``bilinear``/``linear``: returns ``(idx0, idx1, lambda1)``
    with output = (1-lambda1)*x[idx0] + lambda1*x[idx1].  The arithmetic is done in the kernels'
    precision (float32 for float32 inputs, float64 for float64).  This is the portable reference
    arithmetic; where a device's kernels round differently (fused multiply-add, float32 floor in
    the float64 kernel, nearest ``dst >> 1`` doubling, copying an unchanged dim),
    ``resample.interp_source_rows_exact`` applies the differences it measured on that device.
    """
    ft = np.float64 if double else np.float32
    dst = np.arange(out_start, out_stop, dtype=np.int64)
    if mode == "nearest":
        # nearest always computes its scale in float32
        if out_len == in_len:
            return (dst,)
        if scale_factor is not None and scale_factor > 0:
            scale = np.float32(1.0 / scale_factor)
        else:
            scale = np.float32(in_len) / np.float32(out_len)
        src = np.floor(dst.astype(np.float32) * scale).astype(np.int64)
        return (np.minimum(src, in_len - 1),)
    if mode in ("bilinear", "linear"):
        if align_corners:
            scale = ft(in_len - 1) / ft(out_len - 1) if out_len > 1 else ft(0)
            real = scale * dst.astype(ft)
        else:
            if scale_factor is not None and scale_factor > 0:
                scale = ft(1.0 / scale_factor)
            else:
                scale = ft(in_len) / ft(out_len)
            real = scale * (dst.astype(ft) + ft(0.5)) - ft(0.5)
            real = np.maximum(real, ft(0))
        idx0 = np.minimum(np.floor(real).astype(np.int64), in_len - 1)
        lam1 = np.clip(real - idx0.astype(ft), ft(0), ft(1))
        idx1 = idx0 + (idx0 < in_len - 1).astype(np.int64)
        return idx0, idx1, lam1.astype(np.float64)
    raise ValueError(f"unsupported interpolation mode {mode!r} (supported: nearest, bilinear)")


# --------------------------------------------------------------------------- exchange plans
@dataclass(frozen=True)
class RankExchangePlan:
    """What one rank does in one exchange.

    ``sends``: ``((peer, ((local_start, count), ...)), ...)`` runs of OWN rows each peer needs,
    sorted by global row.  ``recvs``: ``((peer, count), ...)``: rows arriving from each peer, in
    the peer's sorted global-row order.  ``segments``: how the window is assembled, in order:
    ``("own", local_start, count)``, ``("recv", peer_index, offset, count)`` (index into
    ``recvs``) or ``("fill", 0, count)``.
    """

    sends: tuple
    recvs: tuple
    segments: tuple
    window_rows: int

    @property
    def rows_sent(self) -> int:
        return sum(c for _, runs in self.sends for _, c in runs)

    @property
    def rows_received(self) -> int:
        return sum(c for _, c in self.recvs)


def _runs(rows):
    """Compress sorted ints into (start, count) runs of consecutive values."""
    out = []
    for r in rows:
        if out and out[-1][0] + out[-1][1] == r:
            out[-1][1] += 1
        else:
            out.append([r, 1])
    return tuple((s, c) for s, c in out)


@pure_cached(maxsize=4096)
def plan_exchange(length: int, n: int, windows: tuple) -> tuple[RankExchangePlan, ...]:
    """Exchange plans of all ``n`` ranks, given the window (a tuple of global rows or FILL)
    that each rank must assemble from a dim of ``length`` rows in the balanced layout."""
    if len(windows) != n:
        raise ValueError(f"need one window per rank ({n}), got {len(windows)}")
    ranges = [shard_range(length, n, r) for r in range(n)]
    # needed[r][q] = sorted global rows rank r needs from peer q != r
    needed = []
    for r, window in enumerate(windows):
        by_peer: dict[int, set] = {}
        for g in window:
            if g == FILL:
                continue
            if not 0 <= g < length:
                raise ValueError(f"window row {g} outside [0, {length})")
            q = row_owner(length, n, g)
            if q != r:
                by_peer.setdefault(q, set()).add(g)
        needed.append({q: sorted(rows) for q, rows in sorted(by_peer.items())})
    plans = []
    for r in range(n):
        start = ranges[r][0]
        sends = []
        for q in range(n):
            if q != r and r in needed[q]:
                sends.append((q, _runs([g - start for g in needed[q][r]])))
        recvs = tuple((q, len(rows)) for q, rows in needed[r].items())
        position = {}  # global row -> (peer index, offset in that peer's message)
        for pi, rows in enumerate(needed[r].values()):
            for off, g in enumerate(rows):
                position[g] = (pi, off)
        segments = []
        for g in windows[r]:
            if g == FILL:
                seg = ("fill", 0, 1)
            elif ranges[r][0] <= g < ranges[r][1]:
                seg = ("own", g - start, 1)
            else:
                pi, off = position[g]
                seg = ("recv", pi, off, 1)
            last = segments[-1] if segments else None
            # merge with the previous segment when it continues it
            if last is not None and last[0] == seg[0] == "fill":
                segments[-1] = ("fill", 0, last[2] + 1)
            elif last is not None and last[0] == seg[0] == "own" and last[1] + last[2] == seg[1]:
                segments[-1] = ("own", last[1], last[2] + 1)
            elif (
                last is not None
                and last[0] == seg[0] == "recv"
                and last[1] == seg[1]
                and last[2] + last[3] == seg[2]
            ):
                segments[-1] = ("recv", last[1], last[2], last[3] + 1)
            else:
                segments.append(seg)
        plans.append(RankExchangePlan(tuple(sends), recvs, tuple(segments), len(windows[r])))
    return tuple(plans)


def ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def compose_windows(first: tuple, first_length: int, second: tuple) -> tuple:
    """Fuse two back-to-back row maps into one, so two exchanges become one.

    ``first[r]``: the rows (of a tensor A, or FILL) that make up rank r's shard of a tensor B in
    the balanced layout of ``first_length`` rows (e.g. a padding layer's windows);
    ``second[r]``: the rows of B (or FILL) rank r needs next (e.g. a convolution's windows).
    Returns, per rank, the rows of A (or FILL) the second layer needs: one
    :func:`exchange_rows` of A with these windows yields exactly the window two exchanges would
    assemble, as long as both layers fill with the same value (zeros).
    """
    n = len(first)
    if len(second) != n:
        raise ValueError(f"compose_windows: {len(first)} and {len(second)} windows (one per rank)")
    if tuple(len(w) for w in first) != tuple(
        shard_range(first_length, n, r)[1] - shard_range(first_length, n, r)[0] for r in range(n)
    ):
        raise ValueError(
            f"compose_windows: the first windows are not the balanced layout of {first_length} "
            f"rows over {n} ranks"
        )
    out = []
    for window in second:
        rows = []
        for g in window:
            if g == FILL:
                rows.append(FILL)
                continue
            q = row_owner(first_length, n, g)
            rows.append(first[q][g - shard_range(first_length, n, q)[0]])
        out.append(tuple(rows))
    return tuple(out)
