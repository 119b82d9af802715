"""The row exchange as ONE functional collective: a neighbour-only ``all_to_all_single``.

Selectable (:func:`exchange_path`, :func:`set_exchange_path`): ``"p2p"`` (the default, one
batched point-to-point call per direction, ``p2p.py``) or ``"all_to_all"``.  Under
``"all_to_all"`` :func:`exchange_planned <credit_parallel.domain.exchange.halo.exchange_planned>`
packs every tensor's rows for each peer into one flat buffer, in the group's rank order (a rank
that is no peer gets 0 elements), and calls
``torch.distributed._functional_collectives.all_to_all_single_autograd``: a collective the
compiler sees as such (Dynamo traces functional collectives into the graph, Inductor may reorder
them), with its own autograd formula (the backward is the reverse all-to-all, which returns every
window's gradient rows to their owners; autograd adds them to the own rows' gradient).  The
windows are assembled from the received rows by the same plans
(:class:`~credit_parallel.domain.rows.RankExchangePlan` segments) as the P2P path: the same
values, the same gradients (the additions may come in another order: equal to rounding).

Every rank of the domain group takes part in each call (a collective), also one that moves
nothing; on gloo an all-to-all costs more than the P2P pair it replaces (measured:
``benchmarks/exchange_host.py``).  Layers with their own P2P halves (the split conv's
boundary strips, the norm + conv link) keep them.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

__all__ = ["EXCHANGE_PATHS", "all_to_all_windows", "exchange_path", "set_exchange_path"]

EXCHANGE_PATHS = ("p2p", "all_to_all")
_path = ["p2p"]


def set_exchange_path(path: str) -> str:
    """Select the exchange path of every later exchange (``"p2p"`` or ``"all_to_all"``); returns
    the previous one.  Every rank must select the same path."""
    if path not in EXCHANGE_PATHS:
        raise ValueError(f"exchange path must be one of {EXCHANGE_PATHS}, got {path!r}")
    previous, _path[0] = _path[0], path
    return previous


@contextlib.contextmanager
def exchange_path(path: str):
    """The exchange path inside the block (:func:`set_exchange_path`), restored after it."""
    previous = set_exchange_path(path)
    try:
        yield
    finally:
        set_exchange_path(previous)


def current_exchange_path() -> str:
    return _path[0]


def _rows(x: torch.Tensor, dim: int, runs) -> list[torch.Tensor]:
    return [x.narrow(dim, s, c) for s, c in runs]


def all_to_all_windows(xs, specs, manager) -> list[torch.Tensor]:
    """The windows of ``xs`` (``specs[k] = (plan, dim, fill)``, as ``exchange_planned``) through
    one neighbour-only ``all_to_all_single`` over the domain group.  Differentiable."""
    group, peers = manager.domain_group, manager.domain_ranks
    n = len(peers)
    slot = [dist.get_group_rank(group, peers[q]) for q in range(n)]  # domain index -> group rank
    flat = [x.movedim(dim, 0) for x, (_, dim, _) in zip(xs, specs)]  # rows first
    row = [math.prod(f.shape[1:]) for f in flat]
    send_parts: list[list] = [[] for _ in range(n)]
    recv_counts = [0] * n
    for k, (f, (plan, _, _)) in enumerate(zip(flat, specs)):
        for peer, runs in plan.sends:
            send_parts[slot[peer]] += [r.reshape(-1) for r in _rows(f, 0, runs)]
        for peer, count in plan.recvs:
            recv_counts[slot[peer]] += count * row[k]
    in_splits = [sum(p.numel() for p in parts) for parts in send_parts]
    # an empty slice of every input in the buffer: the collective is in the autograd graph on
    # every rank (its backward is a collective too), also where this rank sends nothing
    pieces = [f.narrow(0, 0, 0).reshape(-1) for f in flat]
    buffer = torch.cat(pieces + [p for parts in send_parts for p in parts])
    received = funcol.all_to_all_single_autograd(buffer, recv_counts, in_splits, group)
    received = funcol.wait_tensor(received) if isinstance(received, torch.Tensor) else received
    # this rank's slice of each peer's message, per tensor, in the order the peer packed it
    offsets = [sum(recv_counts[:g]) for g in range(n)]
    windows = []
    for k, (f, (plan, dim, fill)) in enumerate(zip(flat, specs)):
        got = []
        for peer, count in plan.recvs:
            size = count * row[k]
            start = offsets[slot[peer]]
            got.append(received.narrow(0, start, size).view(count, *f.shape[1:]))
            offsets[slot[peer]] += size
        # an empty slice of the collective's output in every window: every rank's backward
        # then takes part in the reverse all-to-all, also one whose window received nothing
        parts = [received.narrow(0, 0, 0).view(0, *f.shape[1:])]
        for seg in plan.segments:
            if seg[0] == "own":
                parts.append(f.narrow(0, seg[1], seg[2]))
            elif seg[0] == "recv":
                parts.append(got[seg[1]].narrow(0, seg[2], seg[3]))
            else:
                parts.append(f.new_full((seg[2], *f.shape[1:]), fill))
        window = torch.cat(parts)
        windows.append(window.movedim(0, dim))
    return windows
