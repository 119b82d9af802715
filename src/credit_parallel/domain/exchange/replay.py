"""The messages of one exchange, planned once per (plans, shapes, peers, group) and replayed.

What a batched row exchange does on the host is the same at every call of a layer with the
same input shape: which peer gets which runs of which tensor, how large each receive buffer is
and how it is cut into per-tensor views, how each window is put together from the shard, the
received rows and fill rows, which gradient rows go back to whom.  A :class:`ForwardMessages`
/ :class:`BackwardMessages` holds all of it, built the first time a (plans, dims, fills,
shapes, peers, group, device) combination is seen (:func:`forward_messages`,
:func:`backward_messages`; the forward's own backward is built with it, :attr:`ForwardMessages.
backward`); a call then only allocates its receive buffers (fresh per call: autograd may keep
them), posts the receives, slices and posts the sends, waits and assembles.  On a backend
that batches point-to-point calls (NCCL) one ``batch_isend_irecv`` of reused ``P2POp``s; on
gloo each message posted on the group directly (:class:`Link` reads the group's wait bound
once).  The layout of every message is that of ``p2p.py``'s generic path, so both ends agree
whichever path either takes.  The programs are kept in a bounded cache, least recently used
evicted first.  Pure bookkeeping plus the posts.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

import torch
import torch.distributed as dist

from ...layout.launch import _point_to_point_timeout
from .windows import _rows, shape_numel

__all__ = ["BackwardMessages", "ForwardMessages", "Link", "backward_messages", "forward_messages"]

_PLACEHOLDER = torch.empty(0)
_CACHE: OrderedDict = OrderedDict()  # least recently used first
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


def _shapes_key(shapes) -> tuple:
    """``shapes`` as a hashable key (lists from the traced operators become tuples)."""
    return tuple(s if isinstance(s, tuple) else tuple(s) for s in shapes)


def _fill_key(fill):
    """``fill`` in a cache key by its bits: a NaN never equals another NaN (every call would
    build anew), and 0.0 / -0.0 compare equal but fill differently."""
    return struct.pack("d", fill) if isinstance(fill, float) else fill


def _cached(kind: type, specs, shapes, peers, group, device):
    """``kind(specs, shapes, peers, group, device)``, built once per (kind, plans, dims, fills,
    shapes, peers, group, device) (the plans by their ids: the entry holds them, so that their
    ids stay theirs while it lives); at the size limit the least recently used entry goes."""
    if len(specs) == 1:  # the common case, without the generators
        (p, d, f), shape = specs[0], shapes[0]
        ids = ((id(p), d, _fill_key(f)),)
        shapes_key = (shape if isinstance(shape, tuple) else tuple(shape),)
    else:
        ids = tuple((id(p), d, _fill_key(f)) for p, d, f in specs)
        shapes_key = _shapes_key(shapes)
    key = (kind.__name__, ids, shapes_key, tuple(peers), id(group), device)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = (
            tuple(p for p, _, _ in specs),
            kind(specs, shapes, peers, group, device),
        )
        if len(_CACHE) > _CACHE_LIMIT:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
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


def _wire(t: torch.Tensor) -> list:
    """``t`` as gloo takes it (a complex tensor as its real view)."""
    return [torch.view_as_real(t) if t.is_complex() else t]


class _Posts:
    """The posts of one exchange's messages (receives, then sends) and the receive buffers'
    layout.  On a backend that batches point-to-point calls (NCCL), one ``P2POp`` per message,
    its tensor rebound per call, through ``dist.batch_isend_irecv``; on one that does not
    (gloo), where ``batch_isend_irecv`` posts each message in turn, the process group's own
    ``send`` / ``recv`` with the group ranks looked up once (no per-call checks)."""

    def __init__(self, send_peers, recv_layout, group, device: torch.device):
        self.link = _link(group)
        self.recv_layout = recv_layout
        self.n_sends = len(send_peers)
        pg = group if group is not None else dist.group.WORLD
        self.direct = None
        if batches_p2p(pg, device):
            self.ops = [dist.P2POp(dist.isend, _PLACEHOLDER, p, group) for p in send_peers]
            self.ops += [dist.P2POp(dist.irecv, _PLACEHOLDER, p, group) for p, _, _ in recv_layout]
        else:
            self.direct = (
                [(pg.recv, dist.get_group_rank(pg, p)) for p, _, _ in recv_layout],
                [(pg.send, dist.get_group_rank(pg, p)) for p in send_peers],
            )

    def _buffers(self, ref: torch.Tensor):
        """Fresh receive buffers like ``ref``: (one flat tensor per peer, views per peer)."""
        recvs, views = [], []
        for _, numel, layout in self.recv_layout:
            if len(layout) == 1:  # one tensor's rows from this peer: received in its shape
                flat = ref.new_empty(layout[0][2])
                views.append([flat])
            else:
                flat = ref.new_empty(numel)
                views.append([flat.narrow(0, off, n).view(shape) for off, n, shape in layout])
            recvs.append(flat)
        return recvs, views

    def receive(self, ref: torch.Tensor):
        """Fresh receive buffers like ``ref``, posted now where each message is posted alone
        (gloo; a batching backend posts them with the sends): (works, buffers, views per
        peer)."""
        recvs, views = self._buffers(ref)
        if self.direct is None:
            return [], recvs, views
        works = [call(_wire(t), rank, 0) for (call, rank), t in zip(self.direct[0], recvs)]
        return works, recvs, views

    def post(self, pack, ref: torch.Tensor, received=None):
        """Post the receives (fresh buffers like ``ref``; or ``received``, what :meth:`receive`
        posted earlier), then the sends ``pack()`` gives (one flat tensor per send peer, in
        order; packed after the receives are posted); returns (works, sends, receive buffers,
        views per peer)."""
        works, recvs, views = self.receive(ref) if received is None else received
        sends = pack()
        if self.direct is not None:
            to_send = self.direct[1]
            works = [*works, *(call(_wire(t), rank, 0) for (call, rank), t in zip(to_send, sends))]
            return works, sends, recvs, views
        if not sends and not recvs:
            return [], sends, recvs, views
        ops = self.ops
        for op, t in zip(ops, (*sends, *recvs)):
            op.tensor = t
        try:
            works = dist.batch_isend_irecv(ops)
        finally:
            for op in ops:
                op.tensor = _PLACEHOLDER
        return works, sends, recvs, views


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


def _shape_at(shape, dim: int, rows: int) -> list[int]:
    """``shape`` with ``rows`` along ``dim``."""
    out = list(shape)
    out[dim] = rows
    return out


def _assembly(plan, dim: int, shape) -> tuple:
    """How a window of ``plan`` is put together from a shard of ``shape``: per segment
    ``(0, local start, count, whole shard)`` (own rows), ``(1, recv index, offset, count)``
    (received) or ``(2, fill shape)``."""
    pieces = []
    for seg in plan.segments:
        if seg[0] == "own":
            pieces.append((0, seg[1], seg[2], seg[1] == 0 and seg[2] == shape[dim]))
        elif seg[0] == "recv":
            whole = seg[2] == 0 and seg[3] == plan.recvs[seg[1]][1]
            pieces.append((1, seg[1], seg[2], seg[3], whole))
        else:
            pieces.append((2, tuple(_shape_at(shape, dim, seg[2]))))
    return tuple(pieces)


class ForwardMessages:
    """The forward messages of ``specs`` (``(plan, dim, fill)``) for shards of ``shapes``, and
    how each window is assembled from them."""

    def __init__(self, specs, shapes, peers, group, device):
        self.specs, self.shapes, self.peers, self.group = specs, shapes, peers, group
        self.device = device
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
        self.moves = bool(sends or layout)  # this rank sends or receives something
        where = {}
        for i, (peer, _, _) in enumerate(layout):
            for j, (k, slot) in enumerate(slots[peer]):
                where[k, slot] = (i, j)
        self.gather = tuple(
            tuple(where[k, slot] for slot in range(len(plan.recvs)))
            for k, (plan, _, _) in enumerate(specs)
        )
        self.pieces = tuple(_assembly(p, d, s) for (p, d, _), s in zip(specs, shapes))
        self.posts = _Posts([peer for peer, _ in self.sends], layout, group, device)
        self._backward = None

    @property
    def backward(self) -> BackwardMessages:
        """The gradient return of these messages (built at its first use)."""
        if self._backward is None:
            self._backward = BackwardMessages(
                self.specs, self.shapes, self.peers, self.group, self.device
            )
        return self._backward

    def _pack(self, xs) -> list:
        out = []
        for _, parts in self.sends:
            if len(parts) == 1 and len(parts[0][2]) == 1:  # one run of one tensor: one copy
                k, dim, ((s, c),) = parts[0]
                x = xs[k]
                out.append(x.contiguous() if c == x.shape[dim] else x.narrow_copy(dim, s, c))
                continue
            pieces = []
            for k, dim, runs in parts:
                x = xs[k]
                if len(runs) == 1:
                    pieces.append(_rows(x, dim, runs[0][0], runs[0][1]))
                else:
                    pieces.append(torch.cat([x.narrow(dim, s, c) for s, c in runs], dim))
            out.append(_flat(pieces))
        return out

    def post(self, xs):
        """Post; returns (works, kept tensors, received views per spec)."""
        works, sends, recvs, views = self.posts.post(lambda: self._pack(xs), xs[0])
        per_spec = [[views[i][j] for i, j in g] for g in self.gather]
        return works, (*sends, *recvs), per_spec

    def assemble(self, xs, received) -> list[torch.Tensor]:
        """Every spec's window from its shard in ``xs`` and its received buffers (``post``'s
        third result): own tensors, never views of a shard (the outputs of the exchange)."""
        out = []
        for (_, dim, fill), x, recv, pieces in zip(self.specs, xs, received, self.pieces):
            parts = []
            for piece in pieces:
                kind = piece[0]
                if kind == 0:
                    parts.append(x if piece[3] else x.narrow(dim, piece[1], piece[2]))
                elif kind == 1:
                    buf = recv[piece[1]]
                    parts.append(buf if piece[4] else buf.narrow(dim, piece[2], piece[3]))
                else:
                    parts.append(x.new_full(piece[1], fill))
            if len(parts) > 1:
                out.append(torch.cat(parts, dim))
            elif not parts:  # an empty window
                out.append(x.new_empty(_shape_at(x.shape, dim, 0)))
            else:  # one piece: a shard's rows are copied (an output must not alias an input)
                out.append(parts[0].clone() if pieces[0][0] == 0 else parts[0])
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
        self.dims = tuple(d for _, d, _ in specs)
        self.own = tuple(
            _own_tiling(plan, shape[dim]) for (plan, dim, _), shape in zip(specs, shapes)
        )
        self.recv_at = tuple(_recv_pieces(plan) for plan, _, _ in specs)
        # every shard row one window row's and every received run one window piece's: the
        # own rows are gathered and the received rows' gradients sliced (no zeros + add)
        self.tiled = all(o is not None for o in self.own) and None not in self.recv_at
        self.send_at = (
            tuple(
                tuple(
                    (k, self.dims[k], self.recv_at[k][slot], specs[k][0].recvs[slot][1])
                    for k, slot in parts
                )
                for parts in self.sends
            )
            if self.tiled
            else None
        )
        self.posts = _Posts(sorted(sends), layout, group, device)

    def split(self, k: int, grad: torch.Tensor, plan, dim: int, x_shape):
        """``(grad_x, grad_recv)`` of spec ``k``'s window gradient, or None (the generic
        split): own rows gathered (a fresh tensor), received rows as views of ``grad``."""
        own, recv_at = self.own[k], self.recv_at[k]
        if own is None or recv_at is None:
            return None
        grad_recv = [grad.narrow(dim, p, c) for p, (_, c) in zip(recv_at, plan.recvs)]
        return self._own_grad(k, grad), grad_recv

    def _own_grad(self, k: int, grad: torch.Tensor) -> torch.Tensor:
        dim, own = self.dims[k], self.own[k]
        if len(own) == 1:
            return grad.narrow_copy(dim, own[0][0], own[0][1])
        return torch.cat([grad.narrow(dim, p, c) for p, c in own], dim)

    def post(self, grad_recvs, ref: torch.Tensor, received=None):
        """Post the received rows' gradients (``grad_recvs[k]``: per spec, one per
        ``plan.recvs`` entry; ``received``: the receives ``posts.receive`` posted before);
        returns (works, kept tensors, views per peer)."""

        def pack():
            return [_flat([grad_recvs[k][slot] for k, slot in parts]) for parts in self.sends]

        works, sends, recvs, views = self.posts.post(pack, ref, received)
        return works, (*sends, *recvs), views

    def post_tiled(self, grads):
        """With :attr:`tiled`: the shard gradients' own rows gathered from the window
        gradients ``grads``, the received rows' gradients posted (sliced straight from
        ``grads``); returns (works, kept tensors, views per peer, shard gradients)."""
        grad_xs = [self._own_grad(k, g) for k, g in enumerate(grads)]

        def pack():
            out = []
            for parts in self.send_at:
                if len(parts) == 1:
                    k, dim, p, c = parts[0]
                    out.append(grads[k].narrow_copy(dim, p, c))
                else:
                    out.append(
                        torch.cat([grads[k].narrow(d, p, c).reshape(-1) for k, d, p, c in parts])
                    )
            return out

        works, sends, recvs, views = self.posts.post(pack, grads[0])
        return works, (*sends, *recvs), views, grad_xs

    def add_returned(self, grad_xs, views) -> None:
        """Add, in place, what the peers returned for the rows this rank sent them."""
        for (dim, adds), grad_x in zip(self.returns, grad_xs):
            for i, j, s, off, c in adds:
                _rows(grad_x, dim, s, c).add_(_rows(views[i][j], dim, off, c))


def forward_messages(specs, shapes, peers, group, device) -> ForwardMessages:
    """The :class:`ForwardMessages` of ``specs`` for shards of ``shapes`` on ``device``, built
    once per (plans, dims, fills, shapes, peers, group, device)."""
    return _cached(ForwardMessages, specs, shapes, peers, group, device)


def backward_messages(specs, shapes, peers, group, device) -> BackwardMessages:
    """The :class:`BackwardMessages` of ``specs`` for shards of ``shapes`` on ``device``,
    built once per (plans, dims, fills, shapes, peers, group, device)."""
    return _cached(BackwardMessages, specs, shapes, peers, group, device)
