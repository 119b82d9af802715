"""Point to point: the messages of a row exchange posted in one batched call per direction.

Every rank derives the same :class:`~credit_parallel.domain.rows.RankExchangePlan` for all ranks
from the global height, so both ends of every message agree on its size without talking.
:func:`post_rows` posts the forward messages of one tensor and returns a :class:`PendingExchange`
at once; :func:`post_gradient_return` / :func:`post_halo_gradients` post the gradient rows back to
their owners.  Every wait goes through ``launch.wait_all`` (bounded by the group's timeout on
gloo); statistics are opt-in (``traffic.py``); ``stream`` packs and posts on the device's
exchange stream (``streams.py``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ...layout.launch import wait_all
from .traffic import active_recorder
from .windows import shape_numel, shape_with

__all__ = [
    "PendingExchange",
    "post_backward",
    "post_forward",
    "post_gradient_return",
    "post_halo_gradients",
    "post_messages",
    "post_rows",
    "send_buffers",
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


def post_messages(sends: list, recvs: list, group, direction: str, overlapped: bool):
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


def send_buffers(x: torch.Tensor, plan, dim: int) -> list[torch.Tensor]:
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
        p: ref.new_empty(sum(shape_numel(s) for s in shapes))
        for p, shapes in shapes_by_peer.items()
    }
    views = {}
    for peer, shapes in shapes_by_peer.items():
        off, parts = 0, []
        for shape in shapes:
            size = shape_numel(shape)
            parts.append(flat[peer].narrow(0, off, size).view(shape))
            off += size
        views[peer] = parts
    return sorted(flat.items()), views


def post_forward(xs, specs, peers, group, overlapped: bool, stream=None) -> PendingExchange:
    """Post the forward messages of every ``(plan, dim, fill)`` spec for its shard in ``xs``;
    ``wait()`` gives, per spec, the received buffers (one per ``plan.recvs`` entry).
    ``stream``: a :class:`~credit_parallel.domain.exchange.streams.CommStream` to pack and post on."""
    if stream is not None and stream.active:
        with stream.posting():
            pending = post_forward(xs, specs, peers, group, overlapped)
        stream.keep([*xs, *pending._keep_tensors()])
        return pending.posted_on(stream)
    send_parts: dict = {}
    recv_shapes: dict = {}
    for (plan, dim, _), x in zip(specs, xs):
        for (q, _), buf in zip(plan.sends, send_buffers(x, plan, dim)):
            send_parts.setdefault(peers[q], []).append(buf)
        for q, c in plan.recvs:
            recv_shapes.setdefault(peers[q], []).append(shape_with(x, dim, c))
    recvs, views = _receive_buffers(xs[0], recv_shapes)
    sends = _flat_messages(send_parts)
    works, posted = post_messages(sends, recvs, group, "forward", overlapped)
    per_spec = [[views[peers[q]].pop(0) for q, _ in plan.recvs] for plan, _, _ in specs]
    keep = (*sends, *recvs)
    return PendingExchange(works, "forward", per_spec, keep=keep, posted_s=posted, group=group)


def _split_window_grad(grad: torch.Tensor, plan, dim: int, x_shape):
    """Split a window's gradient by the plan's segments: own rows accumulate into the local
    shard's gradient, received rows into one buffer per peer (fill rows are dropped)."""
    grad_x = grad.new_zeros(x_shape)
    grad_recv = [grad.new_zeros(shape_with(grad, dim, c)) for _, c in plan.recvs]
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


def post_backward(
    grads, specs, peers, group, x_shapes, overlapped: bool, stream=None
) -> PendingExchange:
    """Backward of :func:`post_forward`: every window gradient goes back to the owners of its
    rows.  Own-row gradients accumulate at once; ``wait()`` adds the gradients other ranks
    return for the rows this rank sent and gives the shard gradients, per spec."""
    if stream is not None and stream.active:
        with stream.posting():
            pending = post_backward(grads, specs, peers, group, x_shapes, overlapped)
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
            back_shapes.setdefault(peers[q], []).append(shape_with(grad, dim, rows))
        grad_xs.append(grad_x)
    recvs, views = _receive_buffers(grads[0], back_shapes)
    sends = _flat_messages(send_parts)
    works, posted = post_messages(sends, recvs, group, "backward", overlapped)

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
    pending = post_forward([x], [(plan, dim, 0.0)], peers, group, overlapped)
    return pending.then(lambda per_spec: per_spec[0])


def post_gradient_return(
    grad: torch.Tensor, plan, dim: int, peers, group, x_shape, *, overlapped: bool = True
):
    """Backward of :func:`post_rows`: ``wait()`` gives the gradient of the local shard (shape
    ``x_shape``) from the gradient ``grad`` of this rank's window."""
    pending = post_backward([grad], [(plan, dim, 0.0)], peers, group, [x_shape], overlapped)
    return pending.then(lambda grad_xs: grad_xs[0])


def post_halo_gradients(grad_recv, plan, dim: int, peers, group, like, *, overlapped=True):
    """Send the gradients ``grad_recv`` of the received rows back to their owners; ``wait()``
    gives a function adding, into a shard gradient, what other ranks return for the rows this
    rank sent them.  For layers that split their window gradient (``layers/split_conv.py``)."""
    back_shapes = {}
    for q, runs in plan.sends:
        back_shapes.setdefault(peers[q], []).append(shape_with(like, dim, sum(c for _, c in runs)))
    send_parts = {}
    for (q, _), g in zip(plan.recvs, grad_recv):
        send_parts.setdefault(peers[q], []).append(g)
    recvs, views = _receive_buffers(like, back_shapes)
    sends = _flat_messages(send_parts)
    works, posted = post_messages(sends, recvs, group, "backward", overlapped)

    def add_returned(grad_x):
        return _add_returned_rows(grad_x, plan, dim, views, peers)

    return PendingExchange(
        works, "backward", add_returned, keep=(*sends, *recvs), posted_s=posted, group=group
    )
