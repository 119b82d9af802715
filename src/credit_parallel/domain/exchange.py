"""The only place that sends and receives rows between domain ranks.

:func:`exchange_rows` turns a rank's local shard into the window of global rows a layer needs
(its own rows, rows of other ranks, fill rows beyond the globe) in ONE batched P2P call
(``batch_isend_irecv``) carrying both directions.  Its backward sends the window's gradient
rows back to their owners, again in one batched call, and accumulates them.  Because every rank
derives the same :class:`~credit_parallel.domain.rows.RankExchangePlan` for all ranks from the
global height, both ends of every message agree on its size without talking, halos wider than a
neighbour's shard simply come from further ranks, and exactly the rows needed are sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .manager import resolve_manager
from .rows import check_min_rows, plan_exchange, shard_range

__all__ = ["ExchangeStats", "HaloExchange", "exchange_rows", "exchange_stats", "halo_window"]


@dataclass
class ExchangeStats:
    """Counters of domain P2P traffic on this rank (read by the benchmarks)."""

    p2p_calls: int = 0  # batch_isend_irecv calls
    messages: int = 0  # individual sends
    bytes_sent: int = 0
    by_direction: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})

    def reset(self) -> None:
        self.p2p_calls = self.messages = self.bytes_sent = 0
        self.by_direction = {"forward": 0, "backward": 0}


exchange_stats = ExchangeStats()


def _p2p(sends: list, recvs: list, group, direction: str) -> None:
    """One batched call: ``sends``/``recvs`` are lists of (global peer rank, tensor)."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for peer, t in recvs]
    if not ops:
        return
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    exchange_stats.p2p_calls += 1
    exchange_stats.messages += len(sends)
    nbytes = sum(t.numel() * t.element_size() for _, t in sends)
    exchange_stats.bytes_sent += nbytes
    exchange_stats.by_direction[direction] += nbytes


def _shape_with(x: torch.Tensor, dim: int, rows: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = rows
    return shape


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, dim, peers, group, fill_value):
        sends = []
        for q, runs in plan.sends:
            parts = [x.narrow(dim, s, c) for s, c in runs]
            buf = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
            sends.append((peers[q], buf.contiguous()))
        recv_bufs = [x.new_empty(_shape_with(x, dim, c)) for _, c in plan.recvs]
        _p2p(sends, [(peers[q], b) for (q, _), b in zip(plan.recvs, recv_bufs)], group, "forward")
        pieces = []
        for seg in plan.segments:
            kind = seg[0]
            if kind == "own":
                pieces.append(x.narrow(dim, seg[1], seg[2]))
            elif kind == "recv":
                pieces.append(recv_bufs[seg[1]].narrow(dim, seg[2], seg[3]))
            else:
                pieces.append(x.new_full(_shape_with(x, dim, seg[2]), fill_value))
        ctx.plan, ctx.dim, ctx.peers, ctx.group = plan, dim, peers, group
        ctx.x_shape = x.shape
        if not pieces:  # an empty window (a rank whose outputs read no input) still sends
            return x.new_empty(_shape_with(x, dim, 0))
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim)

    @staticmethod
    def backward(ctx, grad):
        plan, dim, peers = ctx.plan, ctx.dim, ctx.peers
        grad_x = grad.new_zeros(ctx.x_shape)
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
        # the gradient of every row we received goes back to its owner; we receive the
        # gradients of the rows we sent
        back = [
            grad.new_empty(_shape_with(grad, dim, sum(c for _, c in runs)))
            for _, runs in plan.sends
        ]
        _p2p(
            [(peers[q], g) for (q, _), g in zip(plan.recvs, grad_recv)],
            [(peers[q], b) for (q, _), b in zip(plan.sends, back)],
            ctx.group,
            "backward",
        )
        for (_, runs), b in zip(plan.sends, back):
            off = 0
            for s, c in runs:
                grad_x.narrow(dim, s, c).add_(b.narrow(dim, off, c))
                off += c
        return grad_x, None, None, None, None, None


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
        # nothing to send or receive on this rank: own rows and fill rows only
        pieces = []
        for seg in plan.segments:
            if seg[0] == "own":
                pieces.append(x.narrow(dim, seg[1], seg[2]))
            else:
                pieces.append(x.new_full(_shape_with(x, dim, seg[2]), fill_value))
        if not pieces:  # an empty window
            return x.narrow(dim, 0, 0)
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces, dim)
    return _ExchangeRows.apply(x, plan, dim, manager.domain_ranks, manager.domain_group, fill_value)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mgr = resolve_manager(self.manager, "HaloExchange")
        n = mgr.domain_world_size
        dim = self.dim % x.dim()
        length = mgr.global_length(self, x.shape[dim])
        check_min_rows(length, n, "HaloExchange")
        windows = tuple(
            halo_window(length, n, r, self.halo_before, self.halo_after, self.mode)
            for r in range(n)
        )
        return exchange_rows(x, windows, length, dim, mgr)

    @staticmethod
    def trim(x: torch.Tensor, halo_before: int, halo_after: int, dim: int = -2) -> torch.Tensor:
        """Drop ``halo_before`` leading and ``halo_after`` trailing rows along ``dim``."""
        size = x.shape[dim]
        if halo_before < 0 or halo_after < 0 or halo_before + halo_after > size:
            raise ValueError(f"cannot trim {halo_before}+{halo_after} rows from a dim of {size}")
        return x.narrow(dim, halo_before, size - halo_before - halo_after)

    def extra_repr(self) -> str:
        return f"halo_width={self.halo_width}, dim={self.dim}, mode={self.mode!r}"
