"""The only place that sends and receives rows between domain ranks.

One exchange path.  :func:`exchange_rows_batched` turns the local shards of one or more tensors
into the windows of global rows the layers need (own rows, rows of other ranks, fill rows beyond
the globe) in ONE batched P2P call (``batch_isend_irecv``) per direction, one message per peer;
its backward sends every window's gradient rows back to their owners, again in one call, and
accumulates them.  :func:`exchange_rows` is that path with one tensor.  Because every rank derives
the same :class:`~credit_parallel.domain.rows.RankExchangePlan` for all ranks from the global
height, both ends of every message agree on its size without talking, halos wider than a
neighbour's shard simply come from further ranks, and exactly the rows needed are sent.

The two halves of the path are public for layers with their own backward (the split
convolution of ``domain/layers/split_conv.py``): :func:`post_rows` posts the forward messages and returns a
:class:`PendingExchange` at once, :func:`assemble_window` builds any range of the window from the
shard and the received rows, and :func:`post_gradient_return` posts the gradient return.  The
autograd path is built from the same pieces, so the messages, the arithmetic and the order in
which gradient rows are accumulated are the same whichever way a layer calls it.

:func:`~credit_parallel.domain.rows.compose_windows` (pure, in ``rows.py``) fuses two
back-to-back row maps into one window, so one exchange replaces two (``fusion.py``).

Statistics are opt-in (``exchange/traffic.py``): inside ``with record_exchange_stats() as stats:`` this
rank's calls, messages, bytes and seconds blocked are counted; outside, nothing is counted or
timed.  ``side_stream=True`` packs and posts on the device's exchange stream (``exchange/streams.py``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ...launch import wait_all
from ..manager import require_manager, resolve_manager
from ..rows import compose_windows, edge_source_row, plan_exchange, shard_range
from .ops import EAGER_IMPLS, exchange_traced
from .streams import comm_stream_for
from .traffic import ExchangeStats, active_recorder, exchange_stats, record_exchange_stats

__all__ = [
    "ExchangeStats",
    "HaloExchange",
    "PendingExchange",
    "assemble_window",
    "compose_windows",
    "exchange_rows",
    "exchange_planned",
    "exchange_rows_batched",
    "exchange_stats",
    "halo_gradient_buffers",
    "halo_window",
    "post_gradient_return",
    "post_halo_gradients",
    "post_rows",
    "record_exchange_stats",
    "scatter_window_grad",
]


def _flat_tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for item in obj for t in _flat_tensors(item)]


class PendingExchange:
    """A posted batched exchange; :meth:`wait` completes it (once) and returns its result."""

    def __init__(
        self,
        works: list,
        direction: str,
        result,
        finish=None,
        keep=(),
        posted_s=0.0,
        stream=None,
        group=None,
    ):
        self._works = works
        self._group = group  # the waits are bounded by its timeout (launch.wait_all)
        self._stream = stream  # a CommStream the exchange was posted on, or None
        self._keep = keep  # send buffers stay alive until the exchange completes
        self._direction = direction
        self._result = result
        self._finish = finish
        self._done = False
        stats = active_recorder()
        if stats is not None:
            stats.seconds[direction] += posted_s

    def _keep_tensors(self) -> list:
        return [t for _, t in self._keep]

    def posted_on(self, stream) -> PendingExchange:
        """Mark this exchange as posted on ``stream`` (a
        :class:`~credit_parallel.domain.exchange.streams.CommStream`): :meth:`wait` joins it and hands the
        result over to the compute stream.  Returns self."""
        self._stream = stream
        return self

    def then(self, fn) -> PendingExchange:
        """Apply ``fn`` to the result once it is complete (after any earlier ``finish``);
        returns self.  Must be called before :meth:`wait`."""
        if self._done:
            raise RuntimeError("PendingExchange.then: the exchange is already complete")
        first = self._finish
        self._finish = fn if first is None else (lambda result: fn(first(result)))
        return self

    def wait(self):
        if not self._done:
            stats = active_recorder()
            t0 = time.perf_counter() if stats is not None else 0.0
            wait_all(self._works, self._group)
            if self._stream is not None:
                self._stream.join()
                self._stream.handoff(_flat_tensors(self._result))
            if stats is not None:
                stats.seconds[self._direction] += time.perf_counter() - t0
            self._done = True
            self._works, self._keep = [], ()
            if self._finish is not None:
                self._result = self._finish(self._result)
                self._finish = None
        return self._result


def _add_returned_rows(grad_x: torch.Tensor, plan, dim: int, views: dict, peers) -> torch.Tensor:
    """Add to ``grad_x`` (in place) the gradients other ranks computed for the rows this rank
    sent them (``plan.sends``), read in order from the received ``views`` per peer."""
    for q, runs in plan.sends:
        back, off = views[peers[q]].pop(0), 0
        for s, c in runs:
            grad_x.narrow(dim, s, c).add_(back.narrow(dim, off, c))
            off += c
    return grad_x


def _post(sends: list, recvs: list, group, direction: str, overlapped: bool):
    """Post one batched call: ``sends``/``recvs`` are lists of (global peer rank, tensor).
    Returns (works, seconds spent posting)."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for peer, t in recvs]
    if not ops:
        return [], 0.0
    stats = active_recorder()
    t0 = time.perf_counter() if stats is not None else 0.0
    works = dist.batch_isend_irecv(ops)
    if stats is None:
        return works, 0.0
    stats.p2p_calls += 1
    stats.overlapped_calls += int(overlapped)
    stats.messages += len(sends)
    nbytes = sum(t.numel() * t.element_size() for _, t in sends)
    stats.bytes_sent += nbytes
    stats.by_direction[direction] += nbytes
    return works, time.perf_counter() - t0


def _shape_with(x: torch.Tensor, dim: int, rows: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = rows
    return shape


def _numel(shape) -> int:
    n = 1
    for v in shape:
        n *= v
    return n


def _send_buffers(x: torch.Tensor, plan, dim: int) -> list[torch.Tensor]:
    """One contiguous buffer per peer in ``plan.sends``: the runs of own rows it needs."""
    out = []
    for _, runs in plan.sends:
        parts = [x.narrow(dim, s, c) for s, c in runs]
        buf = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        out.append(buf.contiguous())
    return out


def _flat_messages(buffers_by_peer: dict) -> list:
    """(peer, one flat buffer) per peer, the peer's buffers concatenated in request order."""
    out = []
    for peer in sorted(buffers_by_peer):
        parts = [b.reshape(-1) for b in buffers_by_peer[peer]]
        out.append((peer, parts[0] if len(parts) == 1 else torch.cat(parts)))
    return out


def _receive_buffers(ref: torch.Tensor, shapes_by_peer: dict):
    """One flat receive buffer per peer and, per peer, its views in request order."""
    flat = {
        p: ref.new_empty(sum(_numel(s) for s in shapes)) for p, shapes in shapes_by_peer.items()
    }
    views = {}
    for peer, shapes in shapes_by_peer.items():
        off, parts = 0, []
        for shape in shapes:
            size = _numel(shape)
            parts.append(flat[peer].narrow(0, off, size).view(shape))
            off += size
        views[peer] = parts
    return sorted(flat.items()), views


def _post_forward(xs, specs, peers, group, overlapped: bool, stream=None) -> PendingExchange:
    """Post the forward messages of every ``(plan, dim, fill)`` spec for its shard in ``xs``;
    ``wait()`` gives, per spec, the received buffers (one per ``plan.recvs`` entry).
    ``stream``: a :class:`~credit_parallel.domain.exchange.streams.CommStream` to pack and post on."""
    if stream is not None and stream.active:
        with stream.posting():
            pending = _post_forward(xs, specs, peers, group, overlapped)
        stream.keep([*xs, *pending._keep_tensors()])
        return pending.posted_on(stream)
    send_parts: dict = {}
    recv_shapes: dict = {}
    for (plan, dim, _), x in zip(specs, xs):
        for (q, _), buf in zip(plan.sends, _send_buffers(x, plan, dim)):
            send_parts.setdefault(peers[q], []).append(buf)
        for q, c in plan.recvs:
            recv_shapes.setdefault(peers[q], []).append(_shape_with(x, dim, c))
    recvs, views = _receive_buffers(xs[0], recv_shapes)
    sends = _flat_messages(send_parts)
    works, posted = _post(sends, recvs, group, "forward", overlapped)
    per_spec = [[views[peers[q]].pop(0) for q, _ in plan.recvs] for plan, _, _ in specs]
    keep = (*sends, *recvs)
    return PendingExchange(works, "forward", per_spec, keep=keep, posted_s=posted, group=group)


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


def _post_backward(
    grads, specs, peers, group, x_shapes, overlapped: bool, stream=None
) -> PendingExchange:
    """Backward of :func:`_post_forward`: every window gradient goes back to the owners of its
    rows.  Own-row gradients accumulate at once; ``wait()`` adds the gradients other ranks
    return for the rows this rank sent and gives the shard gradients, per spec."""
    if stream is not None and stream.active:
        with stream.posting():
            pending = _post_backward(grads, specs, peers, group, x_shapes, overlapped)
        stream.keep([*grads, *pending._keep_tensors(), *pending._result])
        return pending.posted_on(stream)
    grad_xs, send_parts, back_shapes = [], {}, {}
    for (plan, dim, _), grad, shape in zip(specs, grads, x_shapes):
        grad_x, grad_recv = _split_window_grad(grad, plan, dim, shape)
        # the gradient of every row we received goes back to its owner
        for (q, _), g in zip(plan.recvs, grad_recv):
            send_parts.setdefault(peers[q], []).append(g)
        for q, runs in plan.sends:
            rows = sum(c for _, c in runs)
            back_shapes.setdefault(peers[q], []).append(_shape_with(grad, dim, rows))
        grad_xs.append(grad_x)
    recvs, views = _receive_buffers(grads[0], back_shapes)
    sends = _flat_messages(send_parts)
    works, posted = _post(sends, recvs, group, "backward", overlapped)

    def finish(grad_xs):
        for (plan, dim, _), grad_x in zip(specs, grad_xs):
            _add_returned_rows(grad_x, plan, dim, views, peers)
        return grad_xs

    keep = (*sends, *recvs)
    return PendingExchange(
        works, "backward", grad_xs, finish, keep=keep, posted_s=posted, group=group
    )


def post_rows(x: torch.Tensor, plan, dim: int, peers, group, *, overlapped: bool = True):
    """Post the forward exchange of ``plan`` (this rank's :class:`RankExchangePlan`) for the local
    shard ``x``; returns a :class:`PendingExchange` whose ``wait()`` gives the received buffers
    (one per ``plan.recvs`` entry).  Not differentiable: for layers with their own backward."""
    pending = _post_forward([x], [(plan, dim, 0.0)], peers, group, overlapped)
    return pending.then(lambda per_spec: per_spec[0])


def post_gradient_return(
    grad: torch.Tensor, plan, dim: int, peers, group, x_shape, *, overlapped: bool = True
):
    """Backward of :func:`post_rows`: ``wait()`` gives the gradient of the local shard (shape
    ``x_shape``) from the gradient ``grad`` of this rank's window."""
    pending = _post_backward([grad], [(plan, dim, 0.0)], peers, group, [x_shape], overlapped)
    return pending.then(lambda grad_xs: grad_xs[0])


def _range_segments(plan, start: int, stop: int, skip: tuple[int, int] = (0, 0)):
    """The plan's segments cut to window positions ``[start, stop)`` minus ``skip``: yields
    ``(kind, where, position, count)`` with ``where`` the local row ("own"), ``(recv index,
    offset)`` ("recv") or None ("fill"), and ``position`` the window position of the piece."""
    ranges = ((start, stop),)
    if skip[1] > skip[0]:
        ranges = ((start, min(stop, skip[0])), (max(start, skip[1]), stop))
    pos = 0
    for seg in plan.segments:
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


def _window_pieces(x, recv_bufs, plan, dim, fill_value, start, stop, skip=(0, 0)) -> list:
    pieces, pos = [], start
    for kind, where, a, c in _range_segments(plan, start, stop, skip):
        if a > pos:  # skipped positions: zeros
            pieces.append(x.new_zeros(_shape_with(x, dim, a - pos)))
        if kind == "own":
            pieces.append(x.narrow(dim, where, c))
        elif kind == "recv":
            pieces.append(recv_bufs[where[0]].narrow(dim, where[1], c))
        else:
            pieces.append(x.new_full(_shape_with(x, dim, c), fill_value))
        pos = a + c
    if pos < stop:
        pieces.append(x.new_zeros(_shape_with(x, dim, stop - pos)))
    return pieces


def scatter_window_grad(grad, start: int, plan, dim: int, grad_x, grad_recv, skip=(0, 0)):
    """Accumulate the gradient ``grad`` of window positions ``[start, start + rows)`` (minus the
    positions ``skip``) into the shard gradient ``grad_x`` (own rows) and the per-peer buffers
    ``grad_recv`` (received rows, one per ``plan.recvs`` entry; either may be None: not
    accumulated now); fill rows are dropped."""
    stop = start + grad.shape[dim]
    for kind, where, a, c in _range_segments(plan, start, stop, skip):
        g = grad.narrow(dim, a - start, c)
        if kind == "own" and grad_x is not None:
            grad_x.narrow(dim, where, c).add_(g)
        elif kind == "recv" and grad_recv is not None:
            grad_recv[where[0]].narrow(dim, where[1], c).add_(g)


def halo_gradient_buffers(like: torch.Tensor, plan, dim: int) -> list[torch.Tensor]:
    """Zeroed gradient buffers of the rows ``plan`` receives (one per ``plan.recvs`` entry)."""
    return [like.new_zeros(_shape_with(like, dim, c)) for _, c in plan.recvs]


def post_halo_gradients(grad_recv, plan, dim: int, peers, group, like, *, overlapped=True):
    """Send the gradients ``grad_recv`` of the received rows back to their owners; ``wait()``
    gives a function adding, into a shard gradient, what other ranks return for the rows this
    rank sent them.  For layers that split their window gradient (``layers/split_conv.py``)."""
    back_shapes = {}
    for q, runs in plan.sends:
        back_shapes.setdefault(peers[q], []).append(_shape_with(like, dim, sum(c for _, c in runs)))
    send_parts = {}
    for (q, _), g in zip(plan.recvs, grad_recv):
        send_parts.setdefault(peers[q], []).append(g)
    recvs, views = _receive_buffers(like, back_shapes)
    sends = _flat_messages(send_parts)
    works, posted = _post(sends, recvs, group, "backward", overlapped)

    def add_returned(grad_x):
        return _add_returned_rows(grad_x, plan, dim, views, peers)

    return PendingExchange(
        works, "backward", add_returned, keep=(*sends, *recvs), posted_s=posted, group=group
    )


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


def _windows_now(xs, specs, peers, group) -> list[torch.Tensor]:
    """The windows of :func:`exchange_planned`, not differentiable (the traced operator's body)."""
    received = _post_forward(xs, specs, peers, group, False).wait()
    return [assemble_window(x, r, p, d, f) for (p, d, f), x, r in zip(specs, xs, received)]


def _window_grads_now(grads, specs, peers, group, x_shapes) -> list[torch.Tensor]:
    """The shard gradients of :func:`_windows_now` from its window gradients ``grads``."""
    return list(_post_backward(grads, specs, peers, group, x_shapes, False).wait())


EAGER_IMPLS.update(exchange_rows=_windows_now, exchange_rows_backward=_window_grads_now)


class _ExchangeRows(torch.autograd.Function):
    """Forward: every tensor's window in one batched call (one message per peer).  Backward: all
    gradient rows back to their owners in one batched call.  ``specs[k] = (plan, dim, fill)``."""

    @staticmethod
    def forward(ctx, specs, peers, group, stream, *xs):
        received = _post_forward(xs, specs, peers, group, False, stream).wait()
        outs = []
        for (plan, dim, fill), x, recv_bufs in zip(specs, xs, received):
            window = assemble_window(x, recv_bufs, plan, dim, fill)
            # an output of a Function must not alias its input (a window of own rows only)
            aliased = window.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            outs.append(window.clone() if aliased else window)
        ctx.specs, ctx.peers, ctx.group, ctx.stream = specs, peers, group, stream
        ctx.x_shapes = [x.shape for x in xs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        pending = _post_backward(
            grads, ctx.specs, ctx.peers, ctx.group, ctx.x_shapes, False, ctx.stream
        )
        return (None, None, None, None, *pending.wait())


def exchange_rows_batched(requests, manager, *, side_stream: bool = False) -> list[torch.Tensor]:
    """Assemble the windows of several tensors needed at the same point, in ONE batched call per
    direction.  Differentiable.

    ``requests``: a sequence of ``(x, windows, length, dim)`` or ``(x, windows, length, dim,
    fill_value)``, identical in number and order on every rank: ``x`` is the local shard of a
    dim of ``length`` rows; ``windows[r]`` (a tuple of global rows or FILL) is the window rank r
    assembles, every rank's being given so that each rank knows what to send.  All tensors must
    share dtype and device (their rows to a peer travel as one flat message).  Returns the
    windows, in order.  ``side_stream``: pack and post on the device's exchange stream
    (``exchange/streams.py``; nothing changes on CPU).
    """
    requests = list(requests)
    if not requests:
        return []
    require_manager(manager, "exchange_rows_batched")
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
    return exchange_planned(xs, specs, manager, side_stream=side_stream)


def exchange_planned(xs, specs, manager, *, side_stream: bool = False) -> list[torch.Tensor]:
    """:func:`exchange_rows_batched` with this rank's plans already made: ``specs[k] = (plan,
    dim, fill_value)`` for the shard ``xs[k]`` (``plan`` this rank's
    :class:`~credit_parallel.domain.rows.RankExchangePlan`, ``dim`` non-negative), for layers
    that cache their per-call geometry.  Differentiable."""
    require_manager(manager, "exchange_planned")
    if all(not p.sends and not p.recvs for p, _, _ in specs):
        # nothing to move on any rank's side with us: own and fill rows only (a view if it can)
        return [assemble_window(x, [], p, d, f) for x, (p, d, f) in zip(xs, specs)]
    if torch.compiler.is_compiling():  # one traced operator (ops.py)
        return exchange_traced(xs, specs, manager.domain_group)
    stream = comm_stream_for(xs[0].device) if side_stream else None
    return list(
        _ExchangeRows.apply(tuple(specs), manager.domain_ranks, manager.domain_group, stream, *xs)
    )


def exchange_rows(
    x: torch.Tensor,
    windows: tuple,
    length: int,
    dim: int,
    manager,
    fill_value: float = 0.0,
    *,
    side_stream: bool = False,
) -> torch.Tensor:
    """:func:`exchange_rows_batched` of one tensor: this rank's window (``windows[domain_rank]``)
    of the local shard ``x`` of a dim of ``length`` rows.  Differentiable."""
    request = [(x, windows, length, dim, fill_value)]
    return exchange_rows_batched(request, manager, side_stream=side_stream)[0]


def halo_window(
    length: int, n: int, rank: int, before: int, after: int, mode: str = "zeros"
) -> tuple:
    """Rows ``[start-before, stop+after)`` of a rank's shard, mapped by the boundary ``mode``."""
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

    domain_form = "halo"
    domain_kind = "halo_exchange"

    def __init__(self, halo_width, dim: int = -2, manager=None, *, mode: str = "zeros"):
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

    # ---- geometry (domain/geometry.py)
    def output_height(self, input_height: int) -> int:
        """The rows it serves are its input's: each rank's output is its window, not a new
        balanced tensor."""
        return input_height

    def input_windows(self, input_height: int, n: int) -> tuple:
        return tuple(
            halo_window(input_height, n, r, self.halo_before, self.halo_after, self.mode)
            for r in range(n)
        )

    def _request(self, mgr, x: torch.Tensor):
        dim = self.dim % x.dim()
        length = mgr.global_length(self, x.shape[dim])
        return x, self.input_windows(length, mgr.domain_world_size), length, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mgr = resolve_manager(self.manager, "HaloExchange")
        return exchange_rows(*self._request(mgr, x), mgr)

    def forward_many(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`forward` of each tensor (same dtype and device), all in ONE batched call."""
        mgr = resolve_manager(self.manager, "HaloExchange")
        return exchange_rows_batched([self._request(mgr, x) for x in tensors], mgr)

    @staticmethod
    def trim(x: torch.Tensor, halo_before: int, halo_after: int, dim: int = -2) -> torch.Tensor:
        """Drop ``halo_before`` leading and ``halo_after`` trailing rows along ``dim``."""
        size = x.shape[dim]
        if halo_before < 0 or halo_after < 0 or halo_before + halo_after > size:
            raise ValueError(f"cannot trim {halo_before}+{halo_after} rows from a dim of {size}")
        return x.narrow(dim, halo_before, size - halo_before - halo_after)

    def extra_repr(self) -> str:
        return f"halo_width={self.halo_width}, dim={self.dim}, mode={self.mode!r}"
