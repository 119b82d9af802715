"""The domain layers' communication as operators ``torch.compile`` traces (``credit_parallel::``).

In eager mode the layers call ``exchange/halo.py``, ``exchange/collectives.py`` and the attention
all-to-all through autograd Functions that post point-to-point messages; Dynamo cannot trace
those (a graph break at every layer).  Under ``torch.compile`` (``torch.compiler.is_compiling()``
at the call site) the same communication goes through the custom operators of this module
instead, so that a converted block compiles to ONE graph:

* ``credit_parallel::exchange_rows`` / ``exchange_rows_backward`` — the batched row exchange
  (forward: windows from the shards; backward: window gradients back to their owners), built on
  the very functions of the eager path (``p2p.post_forward`` / ``post_backward``);
* ``credit_parallel::gather_small`` / ``sum_small`` — the norm statistics (stack of every rank's
  tensor; its backward: the sum over ranks, each rank keeping its slot);
* ``credit_parallel::all_to_all`` — the attention re-layout (its backward: the reverse
  all-to-all);
* ``credit_parallel::gather_rows`` / ``reduce_rows`` / ``scatter_rows`` — rows gathered from
  every rank (the nonlocal gather policy; backward: the sum over ranks, each keeping its rows)
  and a replicated tensor's own rows kept (backward: the gather).

Custom operators take tensors and plain values only: a row plan travels as a flat list of ints
(:func:`encode_plan`), a process group by its ``group_name`` (resolved as the functional
collectives resolve it).  Every operator has a fake (meta) implementation that gives the output
shapes from those ints alone, and a registered autograd formula.  The eager path stays the
default: these operators are only taken while compiling.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
from torch.distributed.distributed_c10d import _resolve_process_group

from ...layout.small_collectives import gather_small, sum_small_
from ..rows import RankExchangePlan

__all__ = [
    "EAGER_IMPLS",
    "all_to_all_traced",
    "decode_plans",
    "encode_plan",
    "exchange_traced",
    "gather_rows_traced",
    "gather_stacked_traced",
    "group_name",
    "return_rows_traced",
    "scatter_rows_traced",
]

# The eager communication each operator runs, registered by the module that owns it (exchange.py,
# attention/sequence.py), which import this one: ``name -> function``.
EAGER_IMPLS: dict = {}

_KIND = {"own": 0, "recv": 1, "fill": 2}
_NAME = {v: k for k, v in _KIND.items()}


# ----------------------------------------------------------------------------- plan encoding
def encode_plan(plan: RankExchangePlan) -> list[int]:
    """``plan`` as a flat list of ints (the form a custom operator accepts):
    ``[window_rows, len(sends), (peer, len(runs), start, count, ...)..., len(recvs),
    (peer, count)..., len(segments), (kind, a, b, count)...]``."""
    out = [plan.window_rows, len(plan.sends)]
    for peer, runs in plan.sends:
        out += [peer, len(runs)]
        for s, c in runs:
            out += [s, c]
    out.append(len(plan.recvs))
    for peer, c in plan.recvs:
        out += [peer, c]
    out.append(len(plan.segments))
    for seg in plan.segments:
        if seg[0] == "recv":
            out += [1, seg[1], seg[2], seg[3]]
        else:
            out += [_KIND[seg[0]], seg[1], 0, seg[2]]
    return out


@functools.lru_cache(maxsize=1024)
def decode_plans(code: tuple) -> tuple[RankExchangePlan, ...]:
    """The plans :func:`encode_plan` encoded, concatenated in ``code``."""
    plans, i = [], 0
    while i < len(code):
        rows, ns = code[i], code[i + 1]
        i += 2
        sends = []
        for _ in range(ns):
            peer, nr = code[i], code[i + 1]
            i += 2
            sends.append((peer, tuple((code[i + 2 * k], code[i + 2 * k + 1]) for k in range(nr))))
            i += 2 * nr
        nrecv = code[i]
        i += 1
        recvs = tuple((code[i + 2 * k], code[i + 2 * k + 1]) for k in range(nrecv))
        i += 2 * nrecv
        nseg = code[i]
        i += 1
        segments = []
        for k in range(nseg):
            kind, a, b, c = code[i + 4 * k : i + 4 * k + 4]
            name = _NAME[kind]
            segments.append((name, a, b, c) if name == "recv" else (name, a, c))
        i += 4 * nseg
        plans.append(RankExchangePlan(tuple(sends), recvs, tuple(segments), rows))
    return tuple(plans)


def group_name(group) -> str:
    """The name under which ``group`` is resolved inside an operator."""
    return (dist.group.WORLD if group is None else group).group_name


def _peers(name: str) -> tuple[dist.ProcessGroup, list[int]]:
    group = _resolve_process_group(name)
    return group, dist.get_process_group_ranks(group)


def _owned(t: torch.Tensor, inputs=()) -> torch.Tensor:
    """``t`` as an operator output: its own contiguous memory (the fake implementations promise
    contiguous outputs, and an output must not be a view of an input or of another output)."""
    ptr = t.untyped_storage().data_ptr()
    aliased = any(ptr == x.untyped_storage().data_ptr() for x in inputs)
    if t._base is None and t.is_contiguous() and not aliased:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _shape_with(shape, dim: int, rows: int) -> list[int]:
    out = list(shape)
    out[dim] = rows
    return out


# ----------------------------------------------------------------------------- row exchange
@torch.library.custom_op("credit_parallel::exchange_rows", mutates_args=())
def _exchange_rows(
    xs: list[torch.Tensor], plans: list[int], dims: list[int], fills: list[float], group: str
) -> list[torch.Tensor]:
    pg, peers = _peers(group)
    specs = [(p, d, f) for p, d, f in zip(decode_plans(tuple(plans)), dims, fills)]
    windows = EAGER_IMPLS["exchange_rows"](list(xs), specs, peers, pg)
    return [_owned(w, xs) for w in windows]


@_exchange_rows.register_fake
def _(xs, plans, dims, fills, group):
    specs = decode_plans(tuple(plans))
    return [x.new_empty(_shape_with(x.shape, d, p.window_rows)) for x, p, d in zip(xs, specs, dims)]


@torch.library.custom_op("credit_parallel::exchange_rows_backward", mutates_args=())
def _exchange_rows_backward(
    grads: list[torch.Tensor], plans: list[int], dims: list[int], rows: list[int], group: str
) -> list[torch.Tensor]:
    pg, peers = _peers(group)
    specs = [(p, d, 0.0) for p, d in zip(decode_plans(tuple(plans)), dims)]
    shapes = [_shape_with(g.shape, d, r) for g, d, r in zip(grads, dims, rows)]
    grads = [g.contiguous() for g in grads]
    return [
        _owned(g, grads)
        for g in EAGER_IMPLS["exchange_rows_backward"](grads, specs, peers, pg, shapes)
    ]


@_exchange_rows_backward.register_fake
def _(grads, plans, dims, rows, group):
    return [g.new_empty(_shape_with(g.shape, d, r)) for g, d, r in zip(grads, dims, rows)]


def _exchange_setup(ctx, inputs, output):
    xs, plans, dims, _, group = inputs
    ctx.plans, ctx.dims, ctx.group = plans, dims, group
    ctx.rows = [x.shape[d] for x, d in zip(xs, dims)]
    ctx.like = [(o.shape, o.dtype, o.device) for o in output]


def _exchange_backward(ctx, grads):
    grads = [
        torch.zeros(s, dtype=t, device=dev) if g is None else g
        for g, (s, t, dev) in zip(grads, ctx.like)
    ]
    back = torch.ops.credit_parallel.exchange_rows_backward(
        grads, ctx.plans, ctx.dims, ctx.rows, ctx.group
    )
    return list(back), None, None, None, None


torch.library.register_autograd(
    "credit_parallel::exchange_rows", _exchange_backward, setup_context=_exchange_setup
)


def exchange_traced(xs, specs, group) -> list[torch.Tensor]:
    """:func:`~credit_parallel.domain.exchange.halo.exchange_planned` as one traced operator:
    ``specs[k] = (plan, dim, fill_value)`` for the shard ``xs[k]``."""
    code: list[int] = []
    for plan, _, _ in specs:
        code += encode_plan(plan)
    dims = [int(d) for _, d, _ in specs]
    fills = [float(f) for _, _, f in specs]
    return list(
        torch.ops.credit_parallel.exchange_rows(list(xs), code, dims, fills, group_name(group))
    )


@torch.library.custom_op("credit_parallel::return_rows", mutates_args=())
def _return_rows(y: torch.Tensor, plan: list[int], dim: int, rows: int, group: str) -> torch.Tensor:
    return _exchange_rows_backward([y], plan, [dim], [rows], group)[0]


@_return_rows.register_fake
def _(y, plan, dim, rows, group):
    return y.new_empty(_shape_with(y.shape, dim, rows))


def _return_setup(ctx, inputs, output):
    _, ctx.plan, ctx.dim, _, ctx.group = inputs


def _return_backward(ctx, grad):
    window = torch.ops.credit_parallel.exchange_rows(
        [grad.contiguous()], ctx.plan, [ctx.dim], [0.0], ctx.group
    )[0]
    return window, None, None, None, None


torch.library.register_autograd(
    "credit_parallel::return_rows", _return_backward, setup_context=_return_setup
)


def return_rows_traced(y, plan, dim: int, rows: int, group) -> torch.Tensor:
    """The rows of a permutation layout back to their owners (``attention/relayout.py``'s
    ``return_rows``; the transpose of the exchange) as one traced operator; ``rows``: this
    rank's balanced shard height."""
    return torch.ops.credit_parallel.return_rows(
        y, encode_plan(plan), int(dim), int(rows), group_name(group)
    )


# ----------------------------------------------------------------------------- small statistics
@torch.library.custom_op("credit_parallel::gather_small", mutates_args=())
def _gather_small(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return _owned(gather_small(x.contiguous(), _resolve_process_group(group)))


@_gather_small.register_fake
def _(x, world, group):
    # the size is an argument: a fake must be a function of its arguments alone (a compiled
    # graph is cached by them; a group name is reused by other groups in other runs)
    return x.new_empty((world, *x.shape))


@torch.library.custom_op("credit_parallel::sum_small", mutates_args=())
def _sum_small(x: torch.Tensor, group: str) -> torch.Tensor:
    return sum_small_(x.clone().contiguous(), _resolve_process_group(group))


@_sum_small.register_fake
def _(x, group):
    return torch.empty_like(x)


def _gather_setup(ctx, inputs, output):
    ctx.group = inputs[2]


def _gather_backward(ctx, grad):
    rank = dist.get_rank(_resolve_process_group(ctx.group))
    return torch.ops.credit_parallel.sum_small(grad, ctx.group)[rank], None, None


torch.library.register_autograd(
    "credit_parallel::gather_small", _gather_backward, setup_context=_gather_setup
)


def gather_stacked_traced(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` stacked in group-rank order, differentiable (the backward sums the
    stacked gradient over the ranks; each keeps its slot)."""
    world = dist.get_world_size(group)
    return torch.ops.credit_parallel.gather_small(x, world, group_name(group))


# ----------------------------------------------------------------------------- all-to-all
@torch.library.custom_op("credit_parallel::all_to_all", mutates_args=())
def _all_to_all(
    parts: list[torch.Tensor], recv_shapes: list[int], ndim: int, group: str
) -> list[torch.Tensor]:
    pg, peers = _peers(group)
    shapes = [recv_shapes[i : i + ndim] for i in range(0, len(recv_shapes), ndim)]
    recvs = EAGER_IMPLS["all_to_all"](list(parts), shapes, peers, dist.get_rank(pg), pg)
    return [_owned(t, parts) for t in recvs]


@_all_to_all.register_fake
def _(parts, recv_shapes, ndim, group):
    shapes = [recv_shapes[i : i + ndim] for i in range(0, len(recv_shapes), ndim)]
    return [parts[0].new_empty(s) for s in shapes]


def _a2a_setup(ctx, inputs, output):
    parts, _, ndim, group = inputs
    ctx.send = [v for p in parts for v in p.shape]
    ctx.ndim, ctx.group = ndim, group
    ctx.like = [(o.shape, o.dtype, o.device) for o in output]


def _a2a_backward(ctx, grads):
    grads = [
        torch.zeros(s, dtype=t, device=dev) if g is None else g.contiguous()
        for g, (s, t, dev) in zip(grads, ctx.like)
    ]
    back = torch.ops.credit_parallel.all_to_all(grads, ctx.send, ctx.ndim, ctx.group)
    return list(back), None, None, None


torch.library.register_autograd(
    "credit_parallel::all_to_all", _a2a_backward, setup_context=_a2a_setup
)


def all_to_all_traced(parts, recv_shapes, group) -> list[torch.Tensor]:
    """``parts[q]`` to group rank q, a tensor of ``recv_shapes[q]`` from each; differentiable."""
    ndim = len(recv_shapes[0])
    flat = [int(v) for s in recv_shapes for v in s]
    return list(torch.ops.credit_parallel.all_to_all(list(parts), flat, ndim, group_name(group)))


# ----------------------------------------------------------------------------- rows gathered
# (``exchange/collectives.py``: the nonlocal gather policy and ``gather_tensor`` / ``shard_tensor``)
@torch.library.custom_op("credit_parallel::gather_rows", mutates_args=())
def _gather_rows(x: torch.Tensor, dim: int, sizes: list[int], group: str) -> torch.Tensor:
    return _owned(EAGER_IMPLS["gather_rows"](x, dim, list(sizes), _resolve_process_group(group)))


@_gather_rows.register_fake
def _(x, dim, sizes, group):
    return x.new_empty(_shape_with(x.shape, dim, sum(sizes)))


@torch.library.custom_op("credit_parallel::reduce_rows", mutates_args=())
def _reduce_rows(grad: torch.Tensor, dim: int, start: int, stop: int, group: str) -> torch.Tensor:
    total = grad.contiguous().clone()
    dist.all_reduce(total, group=_resolve_process_group(group))
    return total.narrow(dim, start, stop - start).contiguous()


@_reduce_rows.register_fake
def _(grad, dim, start, stop, group):
    return grad.new_empty(_shape_with(grad.shape, dim, stop - start))


def _own_range(sizes, group: str) -> tuple[int, int]:
    rank = dist.get_rank(_resolve_process_group(group))
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _gather_rows_setup(ctx, inputs, output):
    _, ctx.dim, ctx.sizes, ctx.group = inputs


def _gather_rows_backward(ctx, grad):
    start, stop = _own_range(ctx.sizes, ctx.group)
    back = torch.ops.credit_parallel.reduce_rows(grad, ctx.dim, start, stop, ctx.group)
    return back, None, None, None


torch.library.register_autograd(
    "credit_parallel::gather_rows", _gather_rows_backward, setup_context=_gather_rows_setup
)


@torch.library.custom_op("credit_parallel::scatter_rows", mutates_args=())
def _scatter_rows(
    x: torch.Tensor, dim: int, sizes: list[int], rank: int, group: str
) -> torch.Tensor:
    start = sum(sizes[:rank])
    return x.narrow(dim, start, sizes[rank]).clone(memory_format=torch.contiguous_format)


@_scatter_rows.register_fake
def _(x, dim, sizes, rank, group):
    return x.new_empty(_shape_with(x.shape, dim, sizes[rank]))


def _scatter_rows_setup(ctx, inputs, output):
    _, ctx.dim, ctx.sizes, _, ctx.group = inputs


def _scatter_rows_backward(ctx, grad):
    full = torch.ops.credit_parallel.gather_rows(grad.contiguous(), ctx.dim, ctx.sizes, ctx.group)
    return full, None, None, None, None


torch.library.register_autograd(
    "credit_parallel::scatter_rows", _scatter_rows_backward, setup_context=_scatter_rows_setup
)


def gather_rows_traced(x: torch.Tensor, dim: int, sizes, group) -> torch.Tensor:
    """The rows of every rank (``sizes`` in group-rank order) concatenated along ``dim``, as one
    traced operator; its backward sums the gradient over the ranks and keeps this rank's rows."""
    return torch.ops.credit_parallel.gather_rows(
        x, int(dim), [int(s) for s in sizes], group_name(group)
    )


def scatter_rows_traced(x: torch.Tensor, dim: int, sizes, rank: int, group) -> torch.Tensor:
    """Group rank ``rank``'s (this rank's) rows of a replicated tensor (``sizes`` in group-rank
    order), as one traced operator; its backward gathers the rows of every rank."""
    return torch.ops.credit_parallel.scatter_rows(
        x, int(dim), [int(s) for s in sizes], int(rank), group_name(group)
    )


# ---------------------------------------------------------------------------- one order on every rank
# The operators above talk point to point: every rank must issue them in the same order.  Two of
# them with no data dependency (the q, k and v all-to-alls of sequence attention, the exchanges
# of two branches) may be scheduled in any order by the compiler, and a rank whose graph differs
# (uneven rows: other shapes, another schedule) could run them in another order than its peers
# and wait forever.  Registered as ORDERED side effects, AOTAutograd threads a token through them,
# so each rank runs them in program order, forward and backward.
for _name in (
    "exchange_rows",
    "exchange_rows_backward",
    "return_rows",
    "gather_small",
    "sum_small",
    "all_to_all",
    "gather_rows",
    "reduce_rows",
    "scatter_rows",
):
    _register_effectful_op(getattr(torch.ops.credit_parallel, _name).default, _EffectType.ORDERED)
