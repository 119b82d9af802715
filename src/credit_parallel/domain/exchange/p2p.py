"""Point to point: the messages of a row exchange posted in one batched call per direction.

Every rank derives the same :class:`~credit_parallel.domain.rows.RankExchangePlan` for all ranks
from the global height, so both ends of every message agree on its size without talking.
:func:`post_rows` posts the forward messages of one tensor and returns a :class:`PendingExchange`
at once; :func:`post_gradient_return` / :func:`post_halo_gradients` post the gradient rows back to
their owners.  Every wait is bounded by the group's timeout on gloo (``launch.wait_all``, or
the replay's ``Link``, which reads that timeout once); statistics are opt-in (``traffic.py``); ``stream`` packs and posts on the device's
exchange stream (``streams.py``).  The messages of one (plans, shapes, peers, group) are
planned once and replayed (``replay.py``): a call slices, allocates its receive buffers, posts
and waits, nothing else.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ...layout.launch import wait_all
from .replay import backward_messages, forward_messages
from .traffic import active_recorder
from .windows import shape_with

__all__ = [
    "PendingExchange",
    "exchange_gradients",
    "exchange_windows",
    "post_backward",
    "post_forward",
    "post_gradient_return",
    "post_halo_gradients",
    "post_messages",
    "post_rows",
    "receive_halo_gradients",
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
        link=None,
    ):
        self._works = works
        self._group = group  # the waits are bounded by its timeout (launch.wait_all)
        self._link = link  # or by the replay's Link of the group (its timeout read once)
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
        # tensors, or (peer, tensor) pairs (post_messages' callers)
        return [t if isinstance(t, torch.Tensor) else t[1] for t in self._keep]

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
            if self._link is not None:
                self._link.wait(self._works)
            else:
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
    _count(stats, [t for _, t in sends], direction, overlapped)
    return works, time.perf_counter() - t0


def _count(stats, sends: list, direction: str, overlapped: bool) -> None:
    """Note one batched call sending the tensors ``sends`` in the traffic statistics."""
    stats.p2p_calls += 1
    stats.overlapped_calls += int(overlapped)
    stats.messages += len(sends)
    nbytes = sum(t.numel() * t.element_size() for t in sends)
    stats.bytes_sent += nbytes
    stats.by_direction[direction] += nbytes


def _replayed(post, args, direction: str, overlapped: bool, n_sends):
    """``post(*args)`` (a replayed exchange's post: works first, then its kept tensors, the
    first ``n_sends`` of them sent), counted and timed when statistics are on; returns its
    result and the seconds spent posting."""
    stats = active_recorder()
    if stats is None:
        return post(*args), 0.0
    t0 = time.perf_counter()
    out = post(*args)
    seconds = time.perf_counter() - t0
    if out[0]:
        _count(stats, list(out[1][:n_sends]), direction, overlapped)
    return out, seconds


def exchange_windows(program, xs) -> list[torch.Tensor]:
    """The windows of ``program`` (a ``replay.ForwardMessages``) for the shards ``xs``: the
    receives posted, the sends sliced and posted, waited for and the windows assembled, all at
    once (the exchange's own forward: no :class:`PendingExchange`)."""
    stats = active_recorder()
    if stats is None:
        works, keep, received = program.post(xs)
        program.posts.link.wait(works)
        return program.assemble(xs, received)
    t0 = time.perf_counter()
    works, keep, received = program.post(xs)
    if works:
        _count(stats, list(keep[: program.posts.n_sends]), "forward", False)
    program.posts.link.wait(works)
    stats.seconds["forward"] += time.perf_counter() - t0
    return program.assemble(xs, received)


def exchange_gradients(program, grads) -> list[torch.Tensor] | None:
    """The shard gradients of :func:`exchange_windows` from the window gradients ``grads``, all
    at once, where every shard row is one window row's and every received run one window
    piece (``BackwardMessages.tiled``); else None (:func:`post_backward` does it)."""
    back = program.backward
    if not back.tiled:
        return None
    stats = active_recorder()
    t0 = time.perf_counter() if stats is not None else 0.0
    works, keep, views, grad_xs = back.post_tiled(grads)
    if stats is not None and works:
        _count(stats, list(keep[: back.posts.n_sends]), "backward", False)
    back.posts.link.wait(works)
    if stats is not None:
        stats.seconds["backward"] += time.perf_counter() - t0
    back.add_returned(grad_xs, views)
    return grad_xs


def send_buffers(x: torch.Tensor, plan, dim: int) -> list[torch.Tensor]:
    """One contiguous buffer per peer in ``plan.sends``: the runs of own rows it needs."""
    out = []
    for _, runs in plan.sends:
        parts = [x.narrow(dim, s, c) for s, c in runs]
        buf = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        out.append(buf.contiguous())
    return out


def post_forward(xs, specs, peers, group, overlapped: bool, stream=None) -> PendingExchange:
    """Post the forward messages of every ``(plan, dim, fill)`` spec for its shard in ``xs``;
    ``wait()`` gives, per spec, the received buffers (one per ``plan.recvs`` entry).
    ``stream``: a :class:`~credit_parallel.domain.exchange.streams.CommStream` to pack and post on."""
    if stream is not None and stream.active:
        with stream.posting():
            pending = post_forward(xs, specs, peers, group, overlapped)
        stream.keep([*xs, *pending._keep_tensors()])
        return pending.posted_on(stream)
    program = forward_messages(specs, [x.shape for x in xs], peers, group, xs[0].device)
    (works, keep, per_spec), posted = _replayed(
        program.post, (xs,), "forward", overlapped, len(program.sends)
    )
    return PendingExchange(
        works, "forward", per_spec, keep=keep, posted_s=posted, link=program.posts.link
    )


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
    grads, specs, peers, group, x_shapes, overlapped: bool, stream=None, program=None
) -> PendingExchange:
    """Backward of :func:`post_forward`: every window gradient goes back to the owners of its
    rows.  Own-row gradients accumulate at once; ``wait()`` adds the gradients other ranks
    return for the rows this rank sent and gives the shard gradients, per spec.  ``program``:
    the ``replay.BackwardMessages`` of these specs when the caller holds it."""
    if stream is not None and stream.active:
        with stream.posting():
            pending = post_backward(grads, specs, peers, group, x_shapes, overlapped, None, program)
        stream.keep([*grads, *pending._keep_tensors(), *pending._result])
        return pending.posted_on(stream)
    if program is None:
        program = backward_messages(specs, x_shapes, peers, group, grads[0].device)
    grad_xs, grad_recvs = [], []
    for k, ((plan, dim, _), grad, shape) in enumerate(zip(specs, grads, x_shapes)):
        split = program.split(k, grad, plan, dim, shape)
        grad_x, grad_recv = (
            split if split is not None else _split_window_grad(grad, plan, dim, shape)
        )
        grad_xs.append(grad_x)
        grad_recvs.append(grad_recv)
    (works, keep, views), posted = _replayed(
        program.post, (grad_recvs, grads[0]), "backward", overlapped, len(program.sends)
    )

    def finish(grad_xs):
        program.add_returned(grad_xs, views)
        return grad_xs

    return PendingExchange(
        works, "backward", grad_xs, finish, keep=keep, posted_s=posted, link=program.posts.link
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


def receive_halo_gradients(plan, dim: int, peers, group, like):
    """Post now, before the computation that makes this rank's own halo gradients, the
    receives of what the other ranks will return for the rows this rank sent them (gloo; a
    batching backend posts them with the sends); give the result to
    :func:`post_halo_gradients` (``received=``)."""
    program = backward_messages([(plan, dim, 0.0)], [like.shape], peers, group, like.device)
    return program.posts.receive(like)


def post_halo_gradients(
    grad_recv, plan, dim: int, peers, group, like, *, overlapped=True, received=None
):
    """Send the gradients ``grad_recv`` of the received rows back to their owners; ``wait()``
    gives a function adding, into a shard gradient, what other ranks return for the rows this
    rank sent them.  For layers that split their window gradient (``layers/split_conv.py``).
    ``received``: :func:`receive_halo_gradients`' result when the receives are posted."""
    program = backward_messages([(plan, dim, 0.0)], [like.shape], peers, group, like.device)
    (works, keep, views), posted = _replayed(
        program.post, ([grad_recv], like, received), "backward", overlapped, len(program.sends)
    )

    def add_returned(grad_x):
        program.add_returned([grad_x], views)
        return grad_x

    return PendingExchange(
        works, "backward", add_returned, keep=keep, posted_s=posted, link=program.posts.link
    )
