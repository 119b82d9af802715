"""Sums and gathers of SMALL tensors over small gloo groups, point to point.

GroupNorm statistics (a few hundred bytes, twice per layer and step) and the gradient buckets of
small models are latency-bound.  On the 2-core benchmark machine gloo's ``all_reduce`` of 64
bytes over two ranks takes 1.4 ms and its ``all_gather`` 0.7 ms, while one batched send/receive
pair takes 0.26 ms; from about 1 MiB up its ring all-reduce is the faster one
(docs/performance.md, "small collectives").  So, on gloo only, and only where it pays
(:func:`point_to_point_pays`), every rank sends its tensor to every other rank in ONE
``batch_isend_irecv`` and sums the parts locally in rank order, which also gives every rank
bitwise the same sum.  NCCL keeps its own collectives (latency-optimised on the GPU).

Such a call is still, by meaning, an all-gather or an all-reduce: inside
``with record_small_collectives() as counts:`` each one taken point to point is counted under
that kind (the benchmark adds them to the collectives it counts, to compare with the planner's).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .compat import all_gather_single
from .launch import wait_all

__all__ = [
    "P2P_MAX_BYTES",
    "P2P_MAX_RANKS",
    "gather_small",
    "point_to_point_pays",
    "record_small_collectives",
    "sum_small_",
]

# below ~1 MiB per rank two gloo ranks exchange-and-add faster than gloo's all-reduce; each
# rank sends its tensor to every peer, so the traffic per rank grows with the group
P2P_MAX_BYTES = 1 << 18
P2P_MAX_RANKS = 8


def point_to_point_pays(nbytes: int, world: int, backend: str) -> bool:
    """Whether a sum or gather of ``nbytes`` per rank over ``world`` ranks of ``backend`` goes
    point to point (pure arithmetic; the rule of this module)."""
    return (
        backend == "gloo" and 1 < world <= P2P_MAX_RANKS and nbytes * (world - 1) <= P2P_MAX_BYTES
    )


def _pays(x: torch.Tensor, group) -> bool:
    return point_to_point_pays(
        x.numel() * x.element_size(), dist.get_world_size(group), str(dist.get_backend(group))
    )


_recording: list[collections.Counter] = []  # active recorders; empty: nothing is counted


@contextlib.contextmanager
def record_small_collectives() -> Iterator[collections.Counter]:
    """Count, inside the block, the all-gathers and all-reduces taken point to point."""
    counts: collections.Counter = collections.Counter()
    _recording.append(counts)
    try:
        yield counts
    finally:
        _recording.remove(counts)


def _exchange_all(x: torch.Tensor, group, kind: str) -> list[torch.Tensor]:
    """Every rank's ``x`` in group-rank order (this rank's own slot is ``x`` itself)."""
    group = dist.group.WORLD if group is None else group
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    x = x.contiguous()
    parts, ops = [], []
    for q, peer in enumerate(ranks):
        if q == me:
            parts.append(x)
            continue
        buf = torch.empty_like(x)
        parts.append(buf)
        ops.append(dist.P2POp(dist.isend, x, peer, group))
        ops.append(dist.P2POp(dist.irecv, buf, peer, group))
    wait_all(dist.batch_isend_irecv(ops), group)
    for counts in _recording:
        counts[kind] += 1
    return parts


def gather_small(x: torch.Tensor, group) -> torch.Tensor:
    """``torch.stack`` of every rank's ``x`` (same shape on every rank), in group-rank order."""
    if _pays(x, group):
        return torch.stack(_exchange_all(x, group, "all_gather"))
    world = dist.get_world_size(group)
    out = x.new_empty((world, *x.shape))
    all_gather_single(out, x.reshape(1, *x.shape).contiguous(), group=group)
    return out


def sum_small_(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ``group`` (None: the default group) in place, as ``dist.all_reduce``
    does, and return it."""
    if not _pays(x, group):
        dist.all_reduce(x, group=group)
        return x
    parts = _exchange_all(x, group, "all_reduce")
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    x.copy_(total)
    return x
