"""Differentiable collectives over the domain group (the only domain code, besides
``exchange/halo.py``, that communicates).

* :func:`all_gather_rows` — uneven all-gather along a dim; backward = all-reduce of the full
  gradient, then each rank keeps its rows (so each rank gets the sum over ranks of the
  gradients computed for its rows).
* :func:`scatter_rows` — keep this rank's rows of a replicated tensor; backward = all-gather.
* :func:`all_gather_stacked` — stack one equally shaped tensor per rank (norm statistics);
  backward = all-reduce of the stacked gradient, each rank keeps its slot;
* :func:`all_reduce_sum` — plain in-place sum over the domain group (inside a backward).

Under ``torch.compile`` the first two are the traced operators ``credit_parallel::gather_rows``
/ ``scatter_rows`` of :mod:`.ops` (the same communication).  The last two carry a few hundred bytes: they go through :mod:`credit_parallel.layout.small_collectives`
(point to point on small gloo groups, where gloo's collectives cost several times the latency).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...layout.compat import all_gather_single
from ...layout.small_collectives import gather_small, sum_small_
from ..rows import shard_range, shard_sizes
from .ops import EAGER_IMPLS, gather_rows_traced, scatter_rows_traced

__all__ = ["all_gather_rows", "all_gather_stacked", "all_reduce_sum", "scatter_rows"]


def _gather_padded(x: torch.Tensor, dim: int, sizes, group) -> torch.Tensor:
    n = len(sizes)
    biggest = max(sizes)
    if x.shape[dim] < biggest:
        pad_shape = list(x.shape)
        pad_shape[dim] = biggest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((n * biggest, *x.shape[1:]))
    all_gather_single(out, x, group=group)
    parts = [out.narrow(0, r * biggest, s) for r, s in enumerate(sizes)]
    return torch.cat(parts, 0).movedim(0, dim)


EAGER_IMPLS["gather_rows"] = _gather_padded


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, length, rank, group):
        n = dist.get_world_size(group)
        ctx.dim, ctx.length, ctx.rank, ctx.group, ctx.n = dim, length, rank, group, n
        return _gather_padded(x, dim, shard_sizes(length, n), group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start, stop = shard_range(ctx.length, ctx.n, ctx.rank)
        return grad.narrow(ctx.dim, start, stop - start).contiguous(), None, None, None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, group):
        n = dist.get_world_size(group)
        length = x.shape[dim]
        ctx.dim, ctx.length, ctx.group = dim, length, group
        start, stop = shard_range(length, n, rank)
        return x.narrow(dim, start, stop - start).clone()

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        return (
            _gather_padded(grad.contiguous(), ctx.dim, shard_sizes(ctx.length, n), ctx.group),
            None,
            None,
            None,
        )


class _AllGatherStacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rank, group):
        ctx.rank, ctx.group = rank, group
        return gather_small(x, group)  # point to point where that is faster (small_collectives)

    @staticmethod
    def backward(ctx, grad):
        grad = sum_small_(grad.contiguous(), ctx.group)
        return grad[ctx.rank], None, None


def all_gather_rows(x: torch.Tensor, dim: int, length: int, manager) -> torch.Tensor:
    if torch.compiler.is_compiling():  # one traced operator (domain/exchange/ops.py)
        sizes = shard_sizes(length, manager.domain_world_size)
        return gather_rows_traced(x, dim, sizes, manager.domain_group)
    return _AllGatherRows.apply(x, dim, length, manager.domain_rank, manager.domain_group)


def scatter_rows(x: torch.Tensor, dim: int, manager) -> torch.Tensor:
    if torch.compiler.is_compiling():  # one traced operator (domain/exchange/ops.py)
        sizes = shard_sizes(x.shape[dim], manager.domain_world_size)
        return scatter_rows_traced(x, dim, sizes, manager.domain_rank, manager.domain_group)
    return _ScatterRows.apply(x, dim, manager.domain_rank, manager.domain_group)


def all_gather_stacked(x: torch.Tensor, manager) -> torch.Tensor:
    return _AllGatherStacked.apply(x, manager.domain_rank, manager.domain_group)


def all_reduce_sum(x: torch.Tensor, manager) -> torch.Tensor:
    """Sum ``x`` over the domain group in place and return it (not differentiable: for use
    inside an autograd Function's backward, e.g. the GroupNorm gradient statistics)."""
    return sum_small_(x, manager.domain_group)
