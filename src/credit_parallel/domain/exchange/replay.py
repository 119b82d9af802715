"""The messages of one exchange, planned once per (plans, shapes, peers, group) and replayed.

What a batched row exchange does on the host is the same at every call of a layer with the
same input shape: which peer gets which runs of which tensor, how large each receive buffer is
and how it is cut into per-tensor views, which gradient rows go back to whom.  A
:class:`ForwardMessages` / :class:`BackwardMessages` holds all of it, built the first time a
(plans, dims, shapes, peers, group) combination is seen (:func:`forward_messages`,
:func:`backward_messages`); a call then only slices, allocates the receive buffers (fresh per
call: autograd may keep them), posts and waits.  The posts reuse one ``P2POp`` per message
(its tensor rebound per call) and the group's wait bound is looked up once (:class:`Link`).
The layout of every message is that of ``p2p.py``'s generic path, so both ends agree whichever
path either takes.  Pure bookkeeping plus the one ``batch_isend_irecv`` per call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...layout.launch import _point_to_point_timeout
from .windows import _rows, shape_numel

__all__ = ["BackwardMessages", "ForwardMessages", "Link", "backward_messages", "forward_messages"]

_PLACEHOLDER = torch.empty(0)
_CACHE: dict = {}
_CACHE_LIMIT = 512


class Link:
    """A process group as the exchange posts on it: its P2P wait bound, read once."""

    __slots__ = ("group", "timeout")

    def __init__(self, group):
        self.group = group
        self.timeout = _point_to_point_timeout(group)

    def wait(self, works) -> None:
        """Wait for ``works`` within the group's timeout (as ``launch.wait_all`` does)."""
        timeout = self.timeout
        for work in works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)


def _frozen(value):
    """``value`` as a hashable key: lists (shapes from the traced operators) become tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _cached(kind: str, plans: tuple, key: tuple, build):
    """The object ``build()`` for ``(kind, ids of plans, key)``, built once; the plans are held
    by the entry so that their ids stay theirs while it lives."""
    full = (kind, tuple(map(id, plans)), key)
    hit = _CACHE.get(full)
    if hit is None:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        hit = _CACHE[full] = (plans, build())
    return hit[1]


def _receive_layout(shapes_by_peer: dict) -> tuple:
    """Per peer (sorted): (peer, total numel, ((offset, numel, shape), ...) in request order)."""
    out = []
    for peer in sorted(shapes_by_peer):
        off, views = 0, []
        for shape in shapes_by_peer[peer]:
            size = shape_numel(shape)
            views.append((off, size, tuple(shape)))
            off += size
        out.append((peer, off, tuple(views)))
    return tuple(out)


def batches_p2p(pg, device: torch.device) -> bool:
    """Whether the exchange posts through one ``dist.batch_isend_irecv`` on ``pg`` (a backend
    that coalesces point-to-point calls: NCCL) rather than the group's own send / recv
    (gloo)."""
    return type(pg) is not dist.ProcessGroup or pg._get_backend(device).supports_coalescing


class _Posts:
    """The posts of one exchange's messages (sends, then receives) and the receive buffers'
    layout.  On a backend that batches point-to-point calls (NCCL), one ``P2POp`` per message,
    its tensor rebound per call, through ``dist.batch_isend_irecv``; on one that does not
    (gloo), where ``batch_isend_irecv`` posts each message in turn, the process group's own
    ``send`` / ``recv`` with the group ranks looked up once (no per-call checks)."""

    def __init__(self, send_peers, recv_layout, group, device: torch.device):
        self.link = _link(group)
        self.recv_layout = recv_layout
        pg = group if group is not None else dist.group.WORLD
        self.direct = None
        if batches_p2p(pg, device):
            self.ops = [dist.P2POp(dist.isend, _PLACEHOLDER, p, group) for p in send_peers]
            self.ops += [dist.P2POp(dist.irecv, _PLACEHOLDER, p, group) for p, _, _ in recv_layout]
        else:
            to = [(pg.send, dist.get_group_rank(pg, p)) for p in send_peers]
            to += [(pg.recv, dist.get_group_rank(pg, p)) for p, _, _ in recv_layout]
            self.direct = to

    def post(self, send_tensors, ref: torch.Tensor):
        """Post ``send_tensors`` (one flat tensor per send peer, in order) and fresh receive
        buffers like ``ref``; returns (works, sends, receives as (peer, flat), views per peer)."""
        recvs, views = [], []
        for peer, numel, layout in self.recv_layout:
            if len(layout) == 1:  # one tensor's rows from this peer: received in its shape
                flat = ref.new_empty(layout[0][2])
                views.append([flat])
            else:
                flat = ref.new_empty(numel)
                views.append([flat.narrow(0, off, n).view(shape) for off, n, shape in layout])
            recvs.append((peer, flat))
        tensors = [*send_tensors, *(flat for _, flat in recvs)]
        if not tensors:
            return [], [], recvs, views
        if self.direct is not None:
            works = [
                call([torch.view_as_real(t) if t.is_complex() else t], rank, 0)
                for (call, rank), t in zip(self.direct, tensors)
            ]
            return works, tensors[: len(send_tensors)], recvs, views
        ops = self.ops
        for op, t in zip(ops, tensors):
            op.tensor = t
        try:
            works = dist.batch_isend_irecv(ops)
        finally:
            for op in ops:
                op.tensor = _PLACEHOLDER
        return works, tensors[: len(send_tensors)], recvs, views


_LINKS: dict = {}


def _link(group) -> Link:
    hit = _LINKS.get(id(group))
    if hit is None or hit.group is not group:
        hit = _LINKS[id(group)] = Link(group)
    return hit


def _flat(parts: list) -> torch.Tensor:
    """One contiguous message of ``parts``, flattened and concatenated (one part is sent in its
    own shape: a message is its bytes)."""
    if len(parts) == 1:
        return parts[0].contiguous()
    return torch.cat([p.reshape(-1) for p in parts])


class ForwardMessages:
    """The forward messages of ``specs`` (``(plan, dim, fill)``) for shards of ``shapes``."""

    def __init__(self, specs, shapes, peers, group, device):
        sends: dict = {}
        shapes_by_peer: dict = {}
        slots: dict = {}
        for k, ((plan, dim, _), shape) in enumerate(zip(specs, shapes)):
            for q, runs in plan.sends:
                sends.setdefault(peers[q], []).append((k, dim, tuple(runs)))
            for slot, (q, c) in enumerate(plan.recvs):
                shapes_by_peer.setdefault(peers[q], []).append(_shape_at(shape, dim, c))
                slots.setdefault(peers[q], []).append((k, slot))
        self.sends = tuple((peer, tuple(sends[peer])) for peer in sorted(sends))
        layout = _receive_layout(shapes_by_peer)
        where = {}
        for i, (peer, _, _) in enumerate(layout):
            for j, (k, slot) in enumerate(slots[peer]):
                where[k, slot] = (i, j)
        self.gather = tuple(
            tuple(where[k, slot] for slot in range(len(plan.recvs)))
            for k, (plan, _, _) in enumerate(specs)
        )
        self.posts = _Posts([peer for peer, _ in self.sends], layout, group, device)

    def post(self, xs):
        """Post; returns (works, kept tensors, received views per spec)."""
        send_tensors = []
        for _, parts in self.sends:
            pieces = []
            for k, dim, runs in parts:
                x = xs[k]
                if len(runs) == 1:
                    pieces.append(x.narrow(dim, runs[0][0], runs[0][1]))
                else:
                    pieces.append(torch.cat([x.narrow(dim, s, c) for s, c in runs], dim))
            send_tensors.append(_flat(pieces))
        works, sends, recvs, views = self.posts.post(send_tensors, xs[0])
        per_spec = [[views[i][j] for i, j in g] for g in self.gather]
        return works, (*sends, *(flat for _, flat in recvs)), per_spec


def _shape_at(shape, dim: int, rows: int) -> list[int]:
    """``shape`` with ``rows`` along ``dim``."""
    out = list(shape)
    out[dim] = rows
    return out


def _own_tiling(plan, rows: int):
    """Window positions ``((position, count), ...)`` of the own segments in local row order when
    they cover the shard's ``rows`` exactly once (every row's gradient is one window row's),
    else None."""
    pieces, pos = [], 0
    for seg in plan.segments:
        if seg[0] == "own":
            pieces.append((seg[1], pos, seg[-1]))
        pos += seg[-1]
    pieces.sort()
    local = 0
    for start, _, count in pieces:
        if start != local:
            return None
        local += count
    if local != rows or not pieces:
        return None
    return tuple((p, c) for _, p, c in pieces)


def _recv_pieces(plan):
    """Per ``plan.recvs`` entry, the window position of the ONE segment holding all its rows,
    or None when some entry is read by several or partial segments."""
    found: dict = {}
    pos = 0
    for seg in plan.segments:
        if seg[0] == "recv":
            if seg[1] in found or seg[2] != 0 or seg[3] != plan.recvs[seg[1]][1]:
                return None
            found[seg[1]] = pos
        pos += seg[-1]
    if len(found) != len(plan.recvs):
        return None
    return tuple(found[i] for i in range(len(plan.recvs)))


class BackwardMessages:
    """The gradient return of ``specs`` for shards of ``shapes``: the gradients of the received
    rows back to their owners, those of the sent rows received and added."""

    def __init__(self, specs, shapes, peers, group, device):
        sends: dict = {}
        shapes_by_peer: dict = {}
        slots: dict = {}
        for k, ((plan, dim, _), shape) in enumerate(zip(specs, shapes)):
            for slot, (q, _) in enumerate(plan.recvs):
                sends.setdefault(peers[q], []).append((k, slot))
            for q, runs in plan.sends:
                rows = sum(c for _, c in runs)
                shapes_by_peer.setdefault(peers[q], []).append(_shape_at(shape, dim, rows))
                slots.setdefault(peers[q], []).append(tuple(runs))
        self.sends = tuple(tuple(sends[peer]) for peer in sorted(sends))
        layout = _receive_layout(shapes_by_peer)
        index = {peer: i for i, (peer, _, _) in enumerate(layout)}
        taken: dict = {}
        returns = []
        for plan, dim, _ in specs:  # the order of p2p._add_returned_rows
            adds = []
            for q, runs in plan.sends:
                i = index[peers[q]]
                j = taken[i] = taken.get(i, -1) + 1
                off = 0
                for s, c in runs:
                    adds.append((i, j, s, off, c))
                    off += c
            returns.append((dim, tuple(adds)))
        self.returns = tuple(returns)
        self.own = tuple(
            _own_tiling(plan, shape[dim]) for (plan, dim, _), shape in zip(specs, shapes)
        )
        self.recv_at = tuple(_recv_pieces(plan) for plan, _, _ in specs)
        self.posts = _Posts(sorted(sends), layout, group, device)

    def split(self, k: int, grad: torch.Tensor, plan, dim: int, x_shape):
        """``(grad_x, grad_recv)`` of spec ``k``'s window gradient, or None (the generic
        split): own rows gathered (a fresh tensor), received rows as views of ``grad``."""
        own, recv_at = self.own[k], self.recv_at[k]
        if own is None or recv_at is None:
            return None
        parts = [grad.narrow(dim, p, c) for p, c in own]
        if len(parts) == 1:
            grad_x = parts[0].clone(memory_format=torch.contiguous_format)
        else:
            grad_x = torch.cat(parts, dim)
        grad_recv = [grad.narrow(dim, p, c) for p, (_, c) in zip(recv_at, plan.recvs)]
        return grad_x, grad_recv

    def post(self, grad_recvs, ref: torch.Tensor):
        """Post the received rows' gradients (``grad_recvs[k]``: per spec, one per
        ``plan.recvs`` entry); returns (works, kept tensors, views per peer)."""
        send_tensors = [_flat([grad_recvs[k][slot] for k, slot in parts]) for parts in self.sends]
        works, sends, recvs, views = self.posts.post(send_tensors, ref)
        return works, (*sends, *(flat for _, flat in recvs)), views

    def add_returned(self, grad_xs, views) -> None:
        """Add, in place, what the peers returned for the rows this rank sent them."""
        for (dim, adds), grad_x in zip(self.returns, grad_xs):
            for i, j, s, off, c in adds:
                _rows(grad_x, dim, s, c).add_(_rows(views[i][j], dim, off, c))


def forward_messages(specs, shapes, peers, group, device) -> ForwardMessages:
    """The :class:`ForwardMessages` of ``specs`` for shards of ``shapes`` on ``device``, built
    once per (plans, dims, shapes, peers, group, device)."""
    plans = tuple(p for p, _, _ in specs)
    key = (tuple(d for _, d, _ in specs), _frozen(shapes), _frozen(peers), id(group), device)
    build = lambda: ForwardMessages(specs, shapes, peers, group, device)  # noqa: E731
    return _cached("forward", plans, key, build)


def backward_messages(specs, shapes, peers, group, device) -> BackwardMessages:
    """The :class:`BackwardMessages` of ``specs`` for shards of ``shapes`` on ``device``,
    built once per (plans, dims, shapes, peers, group, device)."""
    plans = tuple(p for p, _, _ in specs)
    key = (tuple(d for _, d, _ in specs), _frozen(shapes), _frozen(peers), id(group), device)
    build = lambda: BackwardMessages(specs, shapes, peers, group, device)  # noqa: E731
    return _cached("backward", plans, key, build)
