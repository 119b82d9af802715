"""The row exchange of domain parallelism, differentiable, and the seed's :class:`HaloExchange`.

One exchange path.  :func:`exchange_rows_batched` turns the local shards of one or more tensors
into the windows of global rows the layers need in ONE batched P2P call per direction, one
message per peer (``p2p.py``), the windows assembled by ``windows.py``; its backward sends every
window's gradient rows back to their owners, again in one call, and accumulates them.
:func:`exchange_rows` is that path with one tensor; :func:`exchange_planned` takes plans a layer
has cached.  Layers with their own backward (``layers/split_conv.py``) use the two halves
directly (``p2p.post_rows``, ``windows.assemble_window``, ``p2p.post_gradient_return``): the
messages, the arithmetic and the order in which gradient rows are accumulated are the same
whichever way a layer calls it.  Under ``torch.compile`` the exchange is one traced operator
(``ops.py``); selected with ``functional.exchange_path("all_to_all")``, one functional
``all_to_all_single`` instead (eager and compiled alike).

The exchange of a lat x lon TILE (SPEC §3b) is this exchange along each axis in turn:
:func:`exchange_tile` fetches the rows over the latitude ranks (the manager's ``lat`` view),
then the columns of the row-extended tile over the longitude ranks (``lon``), each element sent
once.  On a Q > 1 domain the rows are fetched COMPACT (each real row once: no fill row, no
repeat such as the rows a reflect or circular rule maps beyond a pole), so that the column
exchange, which carries the columns of every fetched row (the corners), sends nothing twice and
no zeros; the window is then expanded locally (:func:`compact_windows`).  At Q = 1 the row
window is planned as it is (no compaction, no local expansion: the 1-D exchange, with no extra
copy) and the column pass moves nothing.  :func:`tile_plan` makes the plans once per geometry,
:func:`exchange_tile` replays them; its backward (autograd through the exchanges and the local
expansion) is the exact adjoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from ..manager import require_manager, resolve_manager
from ..rows import FILL, RankExchangePlan, edge_source_row, plan_exchange, shard_range
from .functional import all_to_all_windows, current_exchange_path
from .ops import EAGER_IMPLS, exchange_traced
from .p2p import exchange_gradients, exchange_windows, post_backward, post_forward
from .replay import forward_messages
from .streams import comm_stream_for
from .windows import assemble_window

__all__ = [
    "HaloExchange",
    "TilePlan",
    "compact_windows",
    "exchange_planned",
    "exchange_rows",
    "exchange_rows_batched",
    "exchange_tile",
    "exchange_tile_columns",
    "expand_rows",
    "halo_window",
    "tile_plan",
]


def _windows_now(xs, specs, peers, group) -> list[torch.Tensor]:
    """The windows of :func:`exchange_planned`, not differentiable (the traced operator's body)."""
    shapes = [x.shape for x in xs]
    return exchange_windows(forward_messages(specs, shapes, peers, group, xs[0].device), xs)


def _window_grads_now(grads, specs, peers, group, x_shapes) -> list[torch.Tensor]:
    """The shard gradients of :func:`_windows_now` from its window gradients ``grads``."""
    program = forward_messages(specs, x_shapes, peers, group, grads[0].device)
    out = exchange_gradients(program, grads)
    if out is None:
        back = program.backward
        out = post_backward(grads, specs, peers, group, x_shapes, False, None, back).wait()
    return list(out)


EAGER_IMPLS.update(exchange_rows=_windows_now, exchange_rows_backward=_window_grads_now)


class _ExchangeRows(torch.autograd.Function):
    """Forward: every tensor's window in one batched call (one message per peer).  Backward: all
    gradient rows back to their owners in one batched call.  ``program``: the replayed
    messages (``replay.ForwardMessages``) of the specs ``(plan, dim, fill)``; ``stream``: a
    side stream to post on, or None."""

    @staticmethod
    def forward(ctx, program, stream, *xs):
        ctx.program, ctx.stream = program, stream
        if stream is None:
            return tuple(exchange_windows(program, xs))
        specs, peers, group = program.specs, program.peers, program.group
        received = post_forward(xs, specs, peers, group, False, stream).wait()
        return tuple(program.assemble(xs, received))

    @staticmethod
    def backward(ctx, *grads):
        program, stream = ctx.program, ctx.stream
        out = exchange_gradients(program, grads) if stream is None else None
        if out is None:
            specs, peers, group = program.specs, program.peers, program.group
            pending = post_backward(
                grads, specs, peers, group, program.shapes, False, stream, program.backward
            )
            out = pending.wait()
        return (None, None, *out)


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
    if current_exchange_path() == "all_to_all":  # one functional collective (functional.py)
        return all_to_all_windows(xs, specs, manager)
    if torch.compiler.is_compiling():  # one traced operator (ops.py)
        if all(not p.sends and not p.recvs for p, _, _ in specs):
            return [assemble_window(x, [], p, d, f) for x, (p, d, f) in zip(xs, specs)]
        return exchange_traced(xs, specs, manager.domain_group)
    device = xs[0].device
    program = forward_messages(
        specs, [x.shape for x in xs], manager.domain_ranks, manager.domain_group, device
    )
    if not program.moves:
        # nothing to move on any rank's side with us: own and fill rows only (a view if it can)
        return [assemble_window(x, [], p, d, f) for x, (p, d, f) in zip(xs, specs)]
    stream = comm_stream_for(device) if side_stream else None
    return list(_ExchangeRows.apply(program, stream, *xs))


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


# ----------------------------------------------------------------------------- tiles (SPEC §3b)
@dataclass(frozen=True)
class TilePlan:
    """This rank's plans of one tile exchange: ``rows`` (the compact rows over the latitude
    ranks), ``cols`` (the columns over the longitude ranks) and ``expand`` (the local map from
    the compact rows to the row window; None when they are the same)."""

    rows: RankExchangePlan
    cols: RankExchangePlan
    expand: RankExchangePlan | None


@lru_cache(maxsize=1024)
def compact_windows(windows: tuple) -> tuple[tuple, tuple]:
    """``(compact, expand)``: per rank, its window's real rows sorted, each once, and the
    local plan that rebuilds the window from them (None when the window is already that)."""
    compact, expand = [], []
    for window in windows:
        rows = tuple(sorted({g for g in window if g != FILL}))
        compact.append(rows)
        if rows == tuple(window):
            expand.append(None)
            continue
        position = {g: i for i, g in enumerate(rows)}
        mapped = tuple(FILL if g == FILL else position[g] for g in window)
        expand.append(plan_exchange(len(rows), 1, (mapped,))[0])  # own rows and fills only
    return tuple(compact), tuple(expand)


def tile_plan(height: int, width: int, shape, coords, rows: tuple, cols: tuple) -> TilePlan:
    """The :class:`TilePlan` of the tile ``coords`` = (lat, lon) of a ``shape`` = (P, Q)
    domain, for the row windows ``rows`` (one per latitude rank, over ``height`` rows) and the
    column windows ``cols`` (one per longitude rank, over ``width`` columns); at Q = 1 the rows
    are not compacted (module docstring)."""
    (p, q), (lat, lon) = shape, coords
    if q == 1:  # the row window as it is: the 1-D exchange (module docstring)
        return TilePlan(plan_exchange(height, p, rows)[lat], plan_exchange(width, 1, cols)[0], None)
    compact, expand = compact_windows(rows)
    return TilePlan(
        plan_exchange(height, p, compact)[lat], plan_exchange(width, q, cols)[lon], expand[lat]
    )


def exchange_tile(
    x: torch.Tensor, plan: TilePlan, dims: tuple[int, int], manager, fill_value: float = 0.0
) -> torch.Tensor:
    """The window of the tile ``x`` (rows along ``dims[0]``, columns along ``dims[1]``, both
    non-negative) under the tiled ``manager``.  Differentiable."""
    dim_h, dim_w = dims
    (x,) = exchange_planned([x], [(plan.rows, dim_h, fill_value)], manager.lat)
    return exchange_tile_columns(x, plan, dims, manager, fill_value)


def exchange_tile_columns(
    rows: torch.Tensor, plan: TilePlan, dims: tuple[int, int], manager, fill_value: float = 0.0
) -> torch.Tensor:
    """The second half of :func:`exchange_tile`: from ``rows`` (the compact rows of
    ``plan.rows``, assembled), the columns over the longitude ranks, then the local expansion
    (e.g. after the rows came with a norm's statistics, ``norm_halo.py``).  Differentiable."""
    dim_h, dim_w = dims
    (x,) = exchange_planned([rows], [(plan.cols, dim_w, fill_value)], manager.lon)
    return expand_rows(x, plan, dim_h, fill_value)


def expand_rows(x: torch.Tensor, plan: TilePlan, dim_h: int, fill_value: float = 0.0):
    """The row window from the compact rows ``x`` (repeats copied, fill rows added)."""
    if plan.expand is not None:
        x = assemble_window(x, [], plan.expand, dim_h, fill_value)
    return x
