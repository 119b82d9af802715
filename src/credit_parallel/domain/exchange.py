"""The only place that sends and receives rows between domain ranks.

:func:`exchange_rows` turns a rank's local shard into the window of global rows a layer needs
(its own rows, rows of other ranks, fill rows beyond the globe) in ONE batched P2P call
(``batch_isend_irecv``) carrying both directions.  Its backward sends the window's gradient
rows back to their owners, again in one batched call, and accumulates them.  Because every rank
derives the same :class:`~credit_parallel.domain.rows.RankExchangePlan` for all ranks from the
global height, both ends of every message agree on its size without talking, halos wider than a
neighbour's shard simply come from further ranks, and exactly the rows needed are sent.

Two further forms keep the number of messages down and let layers hide the transfer:

* :func:`exchange_rows_batched` exchanges several tensors that are needed at the same point (each
  with its own windows, dim and fill value) in ONE batched call per direction, one message per
  peer (the rows of all tensors for a peer travel as one flat buffer);
* :func:`compose_windows` fuses two back-to-back row maps on the same tensor (a padding layer
  followed by a convolution) into one, so one exchange replaces two;
* the split-phase pieces :func:`post_rows` / :func:`assemble_window` (forward) and
  :func:`post_gradient_return` (backward) post an exchange, return at once, and complete it in
  :meth:`PendingExchange.wait`, so a layer can compute what needs no halo while the rows are in
  flight (``domain/conv.py`` does this for convolutions).  The arithmetic, the message sizes and
  the order in which gradient rows are accumulated are those of :func:`exchange_rows`, so the
  results are bitwise the same.

:data:`exchange_stats` counts the calls, messages and bytes this rank sends, and the seconds it
spends blocked in the exchange (posting plus waiting; the time a layer computes while rows are in
flight is not counted), which is what the benchmarks read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .manager import resolve_manager
from .rows import FILL, check_min_rows, plan_exchange, row_owner, shard_range, shard_start

__all__ = [
    "ExchangeStats",
    "HaloExchange",
    "PendingExchange",
    "assemble_window",
    "compose_windows",
    "exchange_rows",
    "exchange_rows_batched",
    "exchange_stats",
    "halo_window",
    "post_gradient_return",
    "post_rows",
]


def _directions(value):
    return {"forward": value, "backward": value}


@dataclass
class ExchangeStats:
    """Counters of domain P2P traffic on this rank (read by the benchmarks).

    ``p2p_calls``: ``batch_isend_irecv`` calls; ``messages``: sends; ``bytes_sent`` (also split
    ``by_direction``); ``seconds``: time blocked in exchanges by direction (posting + waiting);
    ``overlapped_calls``: calls whose wait was deferred behind computation.
    """

    p2p_calls: int = 0
    messages: int = 0
    bytes_sent: int = 0
    by_direction: dict = field(default_factory=lambda: _directions(0))
    seconds: dict = field(default_factory=lambda: _directions(0.0))
    overlapped_calls: int = 0

    def reset(self) -> None:
        self.p2p_calls = self.messages = self.bytes_sent = self.overlapped_calls = 0
        self.by_direction = _directions(0)
        self.seconds = _directions(0.0)


exchange_stats = ExchangeStats()


class PendingExchange:
    """A posted batched exchange; :meth:`wait` completes it (once) and returns its result."""

    def __init__(
        self, works: list, direction: str, result, finish=None, posted_s: float = 0.0, keep=()
    ):
        self._works = works
        self._keep = keep  # send buffers stay alive until the exchange completes
        self._direction = direction
        self._result = result
        self._finish = finish
        self._done = False
        exchange_stats.seconds[direction] += posted_s

    def wait(self):
        if not self._done:
            t0 = time.perf_counter()
            for work in self._works:
                work.wait()
            exchange_stats.seconds[self._direction] += time.perf_counter() - t0
            self._done = True
            self._works, self._keep = [], ()
            if self._finish is not None:
                self._result = self._finish(self._result)
                self._finish = None
        return self._result


def _post(sends: list, recvs: list, group, direction: str, *, overlapped: bool = False):
    """Post one batched call: ``sends``/``recvs`` are lists of (global peer rank, tensor).
    Returns (works, seconds spent posting)."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for peer, t in recvs]
    if not ops:
        return [], 0.0
    t0 = time.perf_counter()
    works = dist.batch_isend_irecv(ops)
    posted = time.perf_counter() - t0
    exchange_stats.p2p_calls += 1
    exchange_stats.overlapped_calls += int(overlapped)
    exchange_stats.messages += len(sends)
    nbytes = sum(t.numel() * t.element_size() for _, t in sends)
    exchange_stats.bytes_sent += nbytes
    exchange_stats.by_direction[direction] += nbytes
    return works, posted


def _p2p(sends: list, recvs: list, group, direction: str) -> None:
    """One batched call, completed before returning."""
    works, posted = _post(sends, recvs, group, direction)
    PendingExchange(works, direction, None, posted_s=posted).wait()


def _shape_with(x: torch.Tensor, dim: int, rows: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = rows
    return shape


def _send_buffers(x: torch.Tensor, plan, dim: int) -> list[torch.Tensor]:
    """One contiguous buffer per peer in ``plan.sends``: the runs of own rows it needs."""
    out = []
    for _, runs in plan.sends:
        parts = [x.narrow(dim, s, c) for s, c in runs]
        buf = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        out.append(buf.contiguous())
    return out


def post_rows(x: torch.Tensor, plan, dim: int, peers, group, *, overlapped: bool = True):
    """Post the forward exchange of ``plan`` (this rank's :class:`RankExchangePlan`) for the local
    shard ``x``; returns a :class:`PendingExchange` whose ``wait()`` gives the received buffers
    (one per ``plan.recvs`` entry).  Not differentiable: for layers with their own backward."""
    sends = [(peers[q], buf) for (q, _), buf in zip(plan.sends, _send_buffers(x, plan, dim))]
    recv_bufs = [x.new_empty(_shape_with(x, dim, c)) for _, c in plan.recvs]
    works, posted = _post(
        sends,
        [(peers[q], b) for (q, _), b in zip(plan.recvs, recv_bufs)],
        group,
        "forward",
        overlapped=overlapped,
    )
    return PendingExchange(works, "forward", recv_bufs, posted_s=posted, keep=sends)


def _window_pieces(x, recv_bufs, plan, dim, fill_value, start, stop) -> list[torch.Tensor]:
    pieces, pos = [], 0
    for seg in plan.segments:
        count = seg[-1]
        a, b = max(start, pos), min(stop, pos + count)
        if a < b:
            off, c = a - pos, b - a
            if seg[0] == "own":
                pieces.append(x.narrow(dim, seg[1] + off, c))
            elif seg[0] == "recv":
                pieces.append(recv_bufs[seg[1]].narrow(dim, seg[2] + off, c))
            else:
                pieces.append(x.new_full(_shape_with(x, dim, c), fill_value))
        pos += count
    return pieces


def assemble_window(
    x: torch.Tensor,
    recv_bufs: list,
    plan,
    dim: int,
    fill_value: float = 0.0,
    start: int = 0,
    stop: int | None = None,
) -> torch.Tensor:
    """Positions ``[start, stop)`` of this rank's window, from its own rows ``x``, the buffers
    received by :func:`post_rows` and fill rows (a view of ``x`` when only own rows are asked)."""
    stop = plan.window_rows if stop is None else stop
    pieces = _window_pieces(x, recv_bufs, plan, dim, fill_value, start, stop)
    if not pieces:
        return x.new_empty(_shape_with(x, dim, 0))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _split_window_grad(grad: torch.Tensor, plan, dim: int, x_shape):
    """Split a window's gradient by the plan's segments: own rows accumulate into the local
    shard's gradient, received rows into one buffer per peer (fill rows are dropped)."""
    grad_x = grad.new_zeros(x_shape)
    grad_recv = [grad.new_zeros(_shape_with(grad, dim, c)) for _, c in plan.recvs]
    pos = 0
    for seg in plan.segments:
        count = seg[-1]
        g = grad.narrow(dim, pos, count)
        if seg[0] == "own":
            grad_x.narrow(dim, seg[1], count).add_(g)
        elif seg[0] == "recv":
            grad_recv[seg[1]].narrow(dim, seg[2], count).add_(g)
        pos += count
    return grad_x, grad_recv


def post_gradient_return(
    grad: torch.Tensor, plan, dim: int, peers, group, x_shape, *, overlapped: bool = True
):
    """Backward of the exchange: the gradient of this rank's window ``grad`` goes back to the
    owners of its rows.  Own-row gradients are accumulated at once, the gradients of received
    rows are posted to their owners; ``wait()`` adds the gradients other ranks return for the
    rows this rank sent and gives the gradient of the local shard (shape ``x_shape``)."""
    grad_x, grad_recv = _split_window_grad(grad, plan, dim, x_shape)
    # the gradient of every row we received goes back to its owner; we receive the
    # gradients of the rows we sent
    back = [
        grad.new_empty(_shape_with(grad, dim, sum(c for _, c in runs))) for _, runs in plan.sends
    ]
    works, posted = _post(
        [(peers[q], g) for (q, _), g in zip(plan.recvs, grad_recv)],
        [(peers[q], b) for (q, _), b in zip(plan.sends, back)],
        group,
        "backward",
        overlapped=overlapped,
    )

    def finish(grad_x):
        for (_, runs), b in zip(plan.sends, back):
            off = 0
            for s, c in runs:
                grad_x.narrow(dim, s, c).add_(b.narrow(dim, off, c))
                off += c
        return grad_x

    return PendingExchange(works, "backward", grad_x, finish, posted_s=posted, keep=grad_recv)


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, dim, peers, group, fill_value):
        recv_bufs = post_rows(x, plan, dim, peers, group, overlapped=False).wait()
        pieces = _window_pieces(x, recv_bufs, plan, dim, fill_value, 0, plan.window_rows)
        ctx.plan, ctx.dim, ctx.peers, ctx.group = plan, dim, peers, group
        ctx.x_shape = x.shape
        if not pieces:  # an empty window (a rank whose outputs read no input) still sends
            return x.new_empty(_shape_with(x, dim, 0))
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim)

    @staticmethod
    def backward(ctx, grad):
        pending = post_gradient_return(
            grad, ctx.plan, ctx.dim, ctx.peers, ctx.group, ctx.x_shape, overlapped=False
        )
        return pending.wait(), None, None, None, None, None


def _local_window(x: torch.Tensor, plan, dim: int, fill_value: float) -> torch.Tensor:
    """The window of a rank that neither sends nor receives: own rows and fill rows only."""
    pieces = _window_pieces(x, [], plan, dim, fill_value, 0, plan.window_rows)
    if not pieces:  # an empty window
        return x.narrow(dim, 0, 0)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def exchange_rows(
    x: torch.Tensor, windows: tuple, length: int, dim: int, manager, fill_value: float = 0.0
) -> torch.Tensor:
    """Assemble this rank's window (``windows[domain_rank]``, a tuple of global rows or FILL)
    from the local shard ``x`` of a dim of ``length`` rows; ``windows`` holds every rank's window
    so that each rank knows what to send.  Differentiable."""
    n = manager.domain_world_size
    plans = plan_exchange(length, n, windows)
    plan = plans[manager.domain_rank]
    dim = dim % x.dim()
    if not plan.sends and not plan.recvs:
        return _local_window(x, plan, dim, fill_value)
    return _ExchangeRows.apply(x, plan, dim, manager.domain_ranks, manager.domain_group, fill_value)


# --------------------------------------------------------------------------- several tensors
def _flat_messages(buffers_by_peer: dict) -> list:
    """(peer, one flat buffer) per peer, the peer's buffers concatenated in request order."""
    out = []
    for peer in sorted(buffers_by_peer):
        parts = [b.reshape(-1) for b in buffers_by_peer[peer]]
        out.append((peer, parts[0] if len(parts) == 1 else torch.cat(parts)))
    return out


def _split_flat(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    views, off = [], 0
    for shape in shapes:
        numel = 1
        for v in shape:
            numel *= v
        views.append(flat.narrow(0, off, numel).view(shape))
        off += numel
    return views


class _ExchangeRowsBatched(torch.autograd.Function):
    """Forward: every tensor's window in one batched call (one message per peer).  Backward: all
    gradient rows back to their owners in one batched call.  ``specs[k] = (plan, dim, fill)``."""

    @staticmethod
    def forward(ctx, specs, peers, group, *xs):
        send_parts: dict = {}
        recv_shapes: dict = {}
        for (plan, dim, _), x in zip(specs, xs):
            for (q, _), buf in zip(plan.sends, _send_buffers(x, plan, dim)):
                send_parts.setdefault(peers[q], []).append(buf)
            for q, c in plan.recvs:
                recv_shapes.setdefault(peers[q], []).append(_shape_with(x, dim, c))
        ref = xs[0]
        recv_flat = {
            p: ref.new_empty(sum(_numel(s) for s in shapes)) for p, shapes in recv_shapes.items()
        }
        _p2p(_flat_messages(send_parts), sorted(recv_flat.items()), group, "forward")
        views = {p: _split_flat(recv_flat[p], recv_shapes[p]) for p in recv_flat}
        outs = []
        for (plan, dim, fill), x in zip(specs, xs):
            recv_bufs = [views[peers[q]].pop(0) for q, _ in plan.recvs]
            pieces = _window_pieces(x, recv_bufs, plan, dim, fill, 0, plan.window_rows)
            if not pieces:
                outs.append(x.new_empty(_shape_with(x, dim, 0)))
            else:
                outs.append(pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim))
        ctx.specs, ctx.peers, ctx.group = specs, peers, group
        ctx.x_shapes = [x.shape for x in xs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        specs, peers = ctx.specs, ctx.peers
        grad_xs, send_parts, back_shapes = [], {}, {}
        for (plan, dim, _), grad, shape in zip(specs, grads, ctx.x_shapes):
            grad_x, grad_recv = _split_window_grad(grad, plan, dim, shape)
            for (q, _), g in zip(plan.recvs, grad_recv):
                send_parts.setdefault(peers[q], []).append(g)
            for q, runs in plan.sends:
                rows = sum(c for _, c in runs)
                back_shapes.setdefault(peers[q], []).append(_shape_with(grad, dim, rows))
            grad_xs.append(grad_x)
        ref = grads[0]
        back_flat = {
            p: ref.new_empty(sum(_numel(s) for s in shapes)) for p, shapes in back_shapes.items()
        }
        _p2p(_flat_messages(send_parts), sorted(back_flat.items()), ctx.group, "backward")
        views = {p: _split_flat(back_flat[p], back_shapes[p]) for p in back_flat}
        for (plan, dim, _), grad_x in zip(specs, grad_xs):
            for q, runs in plan.sends:
                b = views[peers[q]].pop(0)
                off = 0
                for s, c in runs:
                    grad_x.narrow(dim, s, c).add_(b.narrow(dim, off, c))
                    off += c
        return (None, None, None, *grad_xs)


def _numel(shape) -> int:
    n = 1
    for v in shape:
        n *= v
    return n


def exchange_rows_batched(requests, manager) -> list[torch.Tensor]:
    """Several :func:`exchange_rows` at the same point in ONE batched call per direction.

    ``requests``: a sequence of ``(x, windows, length, dim)`` or ``(x, windows, length, dim,
    fill_value)``, identical in number and order on every rank.  All tensors must share dtype and
    device (their rows to a peer travel as one flat message).  Returns the windows, in order;
    each is exactly what :func:`exchange_rows` returns for that request.  Differentiable.
    """
    requests = list(requests)
    if not requests:
        return []
    n, rank = manager.domain_world_size, manager.domain_rank
    specs, xs = [], []
    for index, request in enumerate(requests):
        if len(request) not in (4, 5):
            raise ValueError(
                f"exchange_rows_batched: request {index} must be (x, windows, length, dim"
                f"[, fill_value]), got {len(request)} items"
            )
        x, windows, length, dim = request[:4]
        fill = float(request[4]) if len(request) == 5 else 0.0
        if x.dtype != requests[0][0].dtype or x.device != requests[0][0].device:
            raise ValueError(
                f"exchange_rows_batched: request {index} is {x.dtype} on {x.device} but request 0 "
                f"is {requests[0][0].dtype} on {requests[0][0].device}; batch tensors of one "
                "dtype and device together (or call exchange_rows per tensor)"
            )
        plan = plan_exchange(length, n, windows)[rank]
        specs.append((plan, dim % x.dim(), fill))
        xs.append(x)
    if all(not p.sends and not p.recvs for p, _, _ in specs):
        return [_local_window(x, p, d, f) for x, (p, d, f) in zip(xs, specs)]
    outs = _ExchangeRowsBatched.apply(tuple(specs), manager.domain_ranks, manager.domain_group, *xs)
    return list(outs)


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
    if first_length < n or tuple(len(w) for w in first) != tuple(
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
            rows.append(first[q][g - shard_start(first_length, n, q)])
        out.append(tuple(rows))
    return tuple(out)


def halo_window(
    length: int, n: int, rank: int, before: int, after: int, mode: str = "zeros"
) -> tuple:
    """Rows ``[start-before, stop+after)`` of a rank's shard, mapped by the boundary ``mode``."""
    from .rows import edge_source_row

    start, stop = shard_range(length, n, rank)
    return tuple(edge_source_row(p, length, mode) for p in range(start - before, stop + after))


class HaloExchange(nn.Module):
    """Pad the local shard with ``halo_width`` rows from each neighbour along ``dim``.

    Beyond the global edges the halo is zeros (``mode="zeros"``) or follows ``mode``
    ("reflect", "replicate", "circular" — circular wraps around the ring of domain ranks).  A halo
    wider than a neighbour's shard is served from the ranks beyond it.  Differentiable: backward
    returns halo gradients to their owners.  ``halo_width`` may be an int or (before, after).
    :meth:`forward_many` pads several tensors in one batched call per direction.
    """

    def __init__(self, halo_width, dim: int = -2, manager=None, mode: str = "zeros"):
        super().__init__()
        if isinstance(halo_width, int):
            halo_width = (halo_width, halo_width)
        before, after = (int(v) for v in halo_width)
        if before < 0 or after < 0:
            raise ValueError(f"halo_width must be >= 0, got {halo_width}")
        if mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(
                f"HaloExchange mode must be zeros/reflect/replicate/circular, got {mode!r}"
            )
        self.halo_before, self.halo_after = before, after
        self.halo_width = before if before == after else (before, after)
        self.dim = dim
        self.mode = mode
        self.manager = manager

    def _windows(self, mgr, x: torch.Tensor):
        n = mgr.domain_world_size
        dim = self.dim % x.dim()
        length = mgr.global_length(self, x.shape[dim])
        check_min_rows(length, n, "HaloExchange")
        windows = tuple(
            halo_window(length, n, r, self.halo_before, self.halo_after, self.mode)
            for r in range(n)
        )
        return windows, length, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mgr = resolve_manager(self.manager, "HaloExchange")
        windows, length, dim = self._windows(mgr, x)
        return exchange_rows(x, windows, length, dim, mgr)

    def forward_many(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`forward` of each tensor (same dtype and device), all in ONE batched call."""
        mgr = resolve_manager(self.manager, "HaloExchange")
        requests = [(x, *self._windows(mgr, x)) for x in tensors]
        return exchange_rows_batched(requests, mgr)

    @staticmethod
    def trim(x: torch.Tensor, halo_before: int, halo_after: int, dim: int = -2) -> torch.Tensor:
        """Drop ``halo_before`` leading and ``halo_after`` trailing rows along ``dim``."""
        size = x.shape[dim]
        if halo_before < 0 or halo_after < 0 or halo_before + halo_after > size:
            raise ValueError(f"cannot trim {halo_before}+{halo_after} rows from a dim of {size}")
        return x.narrow(dim, halo_before, size - halo_before - halo_after)

    def extra_repr(self) -> str:
        return f"halo_width={self.halo_width}, dim={self.dim}, mode={self.mode!r}"
