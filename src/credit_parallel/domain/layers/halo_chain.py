"""Communication-avoiding halos: ONE exchange feeds a chain of stencil layers (1-D latitude rows).

In an ``nn.Sequential``, a run of stencil layers (non-transposed 2-D convolutions, the periodic
convolution, padding layers) with elementwise activations and GroupNorms between them normally
exchanges once per stencil.  A chain exchanges once: rank r receives every row of the chain's
input that its OWN output rows of the last stencil depend on, through all the stencils of the
chain (the rows each stencil reads, mapped through its boundary rule at the poles, composed from
the last stencil back to the first), and each stencil then computes its owned rows and the
redundant edge rows the next stencil reads.  The values are the single process's: every row a
rank computes is computed from exactly the rows the whole-globe layer reads (rows beyond the
poles by the layer's own rule: zeros, the pad constant, reflect, replicate, circular), and no row
of the chain's output depends on anything else.  The gradients are too: the loss reaches every
parameter through the owned output rows of exactly one rank, so each rank's backward through
its redundant rows is its share, and the domain gradient sum adds the shares up; the exchange's
backward returns the gradient of the received rows to their owners (one call).

* A GroupNorm inside a chain takes its statistics from its OWNED rows only (every row counted
  once over the group: the statistics of the whole globe), gathered in one collective as the
  unchained norm does (``norm.py``'s moments and merge), and normalises all the rows it holds;
  the backward is derived by autograd (the gather's adjoint is one all-reduce).  A norm inside a
  chain keeps its synchronisation point, so the cost model never chains across one
  (``halo_chains="auto"``); a fixed length (``halo_chains=k``) may.
* Which stencils form a chain, per call geometry (global height, ranks, batch, channels,
  width): :func:`chain_pieces`.  ``"auto"`` chooses by an alpha-beta cost (:class:`ChainCosts`):
  a chain of m stencils saves m - 1 exchanges per direction (latency ``alpha_s`` each) and pays
  the extra bytes of its wider first exchange and the redundant rows it computes (forward +
  backward flops at ``flops_per_s``); ``k``: chains of at most k stencils, left to right.
* It applies where every rank holds a contiguous, non-empty range of rows at every step of the
  chain; elsewhere (a rank without rows, a wrap-around the ring) the members run one by one, as
  unchained layers: exact either way, decided from the global geometry, so every rank decides
  alike.  Eager only: under ``torch.compile`` and on lat x lon tiles the members run unchained.

The converter decides the chains (``fusion.find_halo_chains``, ``plan.HaloChainFusion``) and
runs them through :class:`ChainedSequential`, an ``nn.Sequential`` with the same children and
state_dict keys whose forward hands each run of chain members to its :class:`HaloChainRun`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from ..exchange.collectives import all_gather_stacked
from ..exchange.halo import exchange_planned
from ..manager import resolve_manager
from ..rows import FILL, RankExchangePlan, plan_exchange, shard_range
from .conv import _DomainParallelConvNd
from .conv_geometry import conv_rows
from .norm import DomainParallelGroupNorm, merge_group_moments, statistics_dtype
from .norm_halo import ELEMENTWISE_ACTIVATIONS
from .padding import DomainParallelPad, pad_rows

__all__ = [
    "ChainCosts",
    "ChainGeometry",
    "ChainedSequential",
    "HaloChainRun",
    "chain_geometry",
    "chain_pieces",
    "chain_role",
]

STENCIL, NORM, LOCAL = "stencil", "norm", "local"


def chain_role(module) -> str | None:
    """A module's part in a chain: ``"stencil"`` (a non-transposed 2-D conv on latitude, not
    fused otherwise, or a padding layer), ``"norm"`` (a domain GroupNorm not linked to a conv),
    ``"local"`` (an elementwise activation) or None (it ends a run)."""
    if isinstance(module, DomainParallelPad):
        return STENCIL if module.fused_into is None else None
    if isinstance(module, _DomainParallelConvNd):
        o = module.options
        plain = not module.geometry.transposed and o.fused_pad is None and o.shared_input is None
        plain = plain and o.fused_norm is None and not o.side_stream
        return STENCIL if plain and module.nd == 2 and module.spatial_index == 0 else None
    if isinstance(module, DomainParallelGroupNorm):
        return NORM if module.options.fused_norm is None else None
    if type(module) in ELEMENTWISE_ACTIVATIONS:
        return LOCAL
    return None


def _rows_read(layer, length: int, o0: int, o1: int) -> tuple:
    """Input rows (or FILL) that output rows ``[o0, o1)`` of the stencil ``layer`` read."""
    if isinstance(layer, DomainParallelPad):
        _, _, top, bottom = layer.padding
        layer.input_windows(length, 1)  # PyTorch judges the global padding (reflect width, ...)
        return pad_rows(length, top, bottom, layer.mode, o0, o1)
    return conv_rows(layer.geometry, layer.spatial_index, length, o0, o1)


def _pieces_of(rows: tuple, start: int) -> tuple:
    """``rows`` (global rows or FILL) as ``("rows", offset, count)`` runs of consecutive rows
    relative to ``start`` and ``("fill", 0, count)`` runs."""
    out: list = []
    for g in rows:
        if g == FILL:
            if out and out[-1][0] == "fill":
                out[-1][2] += 1
            else:
                out.append(["fill", 0, 1])
        elif out and out[-1][0] == "rows" and out[-1][1] + out[-1][2] == g - start:
            out[-1][2] += 1
        else:
            out.append(["rows", g - start, 1])
    return tuple(tuple(p) for p in out)


@dataclass(frozen=True)
class ChainStep:
    """One member's part on one rank: it holds the rows ``rows_in`` (global ``[a, b)``) of its
    input and makes the rows ``rows_out`` of its output; a stencil assembles its window from
    ``pieces`` (relative to ``a``), a norm takes its statistics from ``own`` (offset, count)."""

    rows_in: tuple[int, int]
    rows_out: tuple[int, int]
    pieces: tuple = ()
    own: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class ChainGeometry:
    """A chain at one (global input height, ranks): per rank its exchange plan of the chain's
    input (``windows[r]``: the rows rank r holds, in order) and its :class:`ChainStep` s."""

    windows: tuple
    plans: tuple[RankExchangePlan, ...]
    steps: tuple

    def redundant_rows(self, heights: tuple, n: int, member: int) -> int:
        """The most rows a rank computes for ``member`` beyond the output rows it owns."""
        h = heights[member + 1]
        return max(
            (s[member].rows_out[1] - s[member].rows_out[0])
            - (shard_range(h, n, r)[1] - shard_range(h, n, r)[0])
            for r, s in enumerate(self.steps)
        )


def chain_heights(layers: tuple, length: int) -> tuple:
    """Global heights before each member and after the last (``layers[j]``: (role, layer))."""
    heights = [length]
    for role, layer in layers:
        heights.append(layer.output_height(heights[-1]) if role == STENCIL else heights[-1])
    return tuple(heights)


def chain_geometry(layers: tuple, length: int, n: int) -> ChainGeometry | None:
    """The chain of ``layers`` (``(role, layer)`` pairs, the first and last stencils) over an
    input of ``length`` rows on ``n`` ranks, or None where it does not apply (module docstring)."""
    return _chain_geometry(tuple((role, layer) for role, layer in layers), length, n)


@lru_cache(maxsize=512)
def _chain_geometry(layers: tuple, length: int, n: int) -> ChainGeometry | None:
    heights = chain_heights(layers, length)
    windows, all_steps = [], []
    for r in range(n):
        need = shard_range(heights[-1], n, r)
        steps = []
        for j in reversed(range(len(layers))):
            role, layer = layers[j]
            h_in = heights[j]
            own = shard_range(h_in, n, r)
            if role == NORM:  # statistics from the owned rows: hold them
                need = (min(need[0], own[0]), max(need[1], own[1]))
            if need[0] >= need[1]:
                return None
            if role == STENCIL:
                try:
                    rows = _rows_read(layer, h_in, *need)
                except ValueError:
                    return None  # the unchained layers name the problem
                real = [g for g in rows if g != FILL]
                if not real:
                    return None
                held = (min(real), max(real) + 1)
                steps.append(ChainStep(held, need, _pieces_of(rows, held[0])))
                need = held
            else:
                steps.append(ChainStep(need, need, (), (own[0] - need[0], own[1] - own[0])))
        steps.reverse()
        windows.append(tuple(range(*need)))
        all_steps.append(tuple(steps))
    windows = tuple(windows)
    return ChainGeometry(windows, plan_exchange(length, n, windows), tuple(all_steps))


# --------------------------------------------------------------------------- the cost model
@dataclass(frozen=True)
class ChainCosts:
    """The alpha-beta terms of ``halo_chains="auto"``: ``alpha_s`` per exchange and direction
    (latency and host time of one batched call), ``beta_s`` per byte of the busiest rank,
    ``flops_per_s`` of the convolutions (the redundant rows' forward + backward, 3x a forward)."""

    alpha_s: float
    beta_s: float
    flops_per_s: float

    @classmethod
    def for_device(cls, device: str) -> ChainCosts:
        """CUDA: an NVLink 4 exchange and its host time (30 us, 360 GB/s; the projection's
        link, docs/performance.md) and an H100's fp32 convolutions (50 TFLOP/s); CPU: the gloo
        exchange measured on the 2-core machine (0.33 ms a round trip, about 2 GB/s) and one
        core's convolution (30 GFLOP/s)."""
        if device == "cuda":
            return cls(30e-6, 1 / 360e9, 50e12)
        return cls(330e-6, 1 / 2e9, 30e9)


def _stencil_shapes(layers: tuple, channels: int, width: int) -> list[tuple[int, int, int]]:
    """(input channels, input width, row flops of one output row at batch 1) per member."""
    out = []
    for role, layer in layers:
        flops = 0
        if role == STENCIL and isinstance(layer, DomainParallelPad):
            left, right, _, _ = layer.padding
            out.append((channels, width, 0))
            width += left + right
            continue
        if role == STENCIL:
            geo, conv = layer.geometry, layer.conv
            w_out = geo.output_length(width, 1)
            flops = 2 * (conv.in_channels // geo.groups) * conv.out_channels * geo.kernel[0]
            flops *= geo.kernel[1] * w_out
            out.append((channels, width, flops))
            channels, width = conv.out_channels, w_out
            continue
        out.append((channels, width, 0))
    return out


def _exchange_seconds(plans, row_bytes: int, costs: ChainCosts) -> float:
    """Forward + backward of one exchange: 2 x (alpha + busiest rank's bytes x beta); 0 when no
    rank moves a row."""
    busiest = max(max(p.rows_sent, p.rows_received) for p in plans)
    if not any(p.sends or p.recvs for p in plans):
        return 0.0
    return 2 * (costs.alpha_s + busiest * row_bytes * costs.beta_s)


@lru_cache(maxsize=512)
def chain_pieces(
    layers: tuple, mode, length: int, n: int, batch: int, channels: int, width: int,
    itemsize: int, costs: ChainCosts,
) -> tuple:  # fmt: skip
    """How the run ``layers`` (``(role, layer)`` pairs, starting with a stencil) is cut at one
    call geometry: ``((start, stop, ChainGeometry or None), ...)`` covering every member, a
    piece with a geometry one chain, a piece without one run member by member.  ``mode``: an
    int k (chains of at most k stencils, left to right) or ``"auto"`` (the cheapest cut by
    :class:`ChainCosts`, no chain across a norm).  Pure: the planner and every rank agree."""
    heights = chain_heights(layers, length)
    shapes = _stencil_shapes(layers, channels, width)
    starts = [j for j, (role, _) in enumerate(layers) if role == STENCIL]
    bounds = [*starts[1:], len(layers)]

    def piece(i: int, k: int):  # stencils i .. k-1 (indices into starts)
        a, b = starts[i], bounds[k - 1]
        if k - i < 2:
            return None, None
        geo = chain_geometry(layers[a:b], heights[a], n)
        return geo, (a, b)

    if mode != "auto":
        out, i = [], 0
        while i < len(starts):
            k = min(len(starts), i + int(mode))
            geo, _ = piece(i, k)
            if geo is None and k - i >= 2:
                k = i + 1  # does not apply here: this stencil alone, try again after it
            out.append((starts[i], bounds[k - 1], geo))
            i = k
        return tuple(out)

    def alone_cost(i: int) -> float:
        role, layer = layers[starts[i]]
        h = heights[starts[i]]
        try:
            plans = plan_exchange(h, n, layer.input_windows(h, n))
        except ValueError:
            return 0.0
        c, w, _ = shapes[starts[i]]
        return _exchange_seconds(plans, batch * c * w * itemsize, costs)

    def chain_cost(i: int, k: int) -> float | None:
        a, b = starts[i], bounds[k - 1]
        if any(role == NORM for role, _ in layers[a : starts[k - 1]]):
            return None  # a norm keeps its own synchronisation point: nothing to save
        geo, _ = piece(i, k)
        if geo is None:
            return None
        c, w, _ = shapes[a]
        seconds = _exchange_seconds(geo.plans, batch * c * w * itemsize, costs)
        sub = chain_heights(layers[a:b], heights[a])
        for j in range(b - a):
            flops = shapes[a + j][2]
            if flops:
                extra = geo.redundant_rows(sub, n, j)
                seconds += 3 * batch * flops * extra / costs.flops_per_s
        return seconds

    # cheapest cut of the stencils 0..m-1 into pieces (dynamic programming, m is small)
    m = len(starts)
    best: list[tuple[float, tuple]] = [(0.0, ())]
    for k in range(1, m + 1):
        options = []
        for i in range(k):
            prior, cut = best[i]
            cost = alone_cost(i) if k - i == 1 else chain_cost(i, k)
            if cost is not None:
                options.append((prior + cost, cut + ((i, k),)))
        best.append(min(options, key=lambda o: o[0]))
    return tuple((starts[i], bounds[k - 1], piece(i, k)[0]) for i, k in best[m][1])


# --------------------------------------------------------------------------- running a chain
def _window(ext: torch.Tensor, pieces: tuple, dim: int, fill: float) -> torch.Tensor:
    parts = []
    for kind, start, count in pieces:
        if kind == "rows":
            parts.append(ext.narrow(dim, start, count))
        else:
            shape = list(ext.shape)
            shape[dim] = count
            parts.append(ext.new_full(shape, fill))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _norm_on_rows(layer: DomainParallelGroupNorm, ext: torch.Tensor, own: tuple, mgr):
    """``layer`` on the rows ``ext`` holds, its statistics from the owned rows ``own`` (offset,
    count) only, gathered over the domain group (differentiable; the adjoint is one all-reduce)."""
    norm = layer.wrapped_weights(ext)
    groups, b = layer.num_groups, ext.shape[0]
    stat = statistics_dtype(ext.dtype)
    owned = ext.narrow(2, *own).reshape(b, groups, -1).to(stat)
    count = owned.shape[-1]
    if count:
        mean = owned.mean(-1)
        m2 = (owned - mean.unsqueeze(-1)).square().sum(-1)
    else:  # a rank without rows of this tensor: weight 0 in the merge
        mean = m2 = owned.new_zeros((b, groups))
    moments = torch.stack((torch.full_like(mean, count), mean, m2))
    gathered = all_gather_stacked(moments, mgr)
    g_mean, g_m2 = merge_group_moments(gathered[:, 0], gathered[:, 1], gathered[:, 2])
    rstd = torch.rsqrt(g_m2 / gathered[:, 0].sum(0) + layer.eps)
    y = (ext.reshape(b, groups, -1).to(stat) - g_mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    y = y.view(ext.shape).to(ext.dtype)
    shape = (1, -1) + (1,) * (ext.dim() - 2)
    if norm.weight is not None:
        y = y * norm.weight.view(shape)
    if norm.bias is not None:
        y = y + norm.bias.view(shape)
    return y


class HaloChainRun:
    """One run of chain members in a Sequential (children ``first`` .. ``stop - 1``), cut into
    chains per call geometry by :func:`chain_pieces`.  A plain reference (not a module)."""

    def __init__(self, first: int, modules: list, mode, costs: ChainCosts | None = None):
        self.first, self.stop = first, first + len(modules)
        self.modules = list(modules)
        self.layers = tuple((chain_role(m), m) for m in modules)
        if any(role is None for role, _ in self.layers) or self.layers[0][0] != STENCIL:
            raise ValueError("a halo chain run starts with a stencil and holds chain members only")
        self.mode = mode
        self.costs = costs

    def pieces(self, length: int, n: int, shape, itemsize: int, device: str) -> tuple:
        """:func:`chain_pieces` for an input of ``shape`` (B, C, local H, W) on ``device``."""
        costs = self.costs or ChainCosts.for_device(device)
        b, c, _, w = shape
        return chain_pieces(self.layers, self.mode, length, n, b, c, w, itemsize, costs)

    def _hooked(self) -> bool:
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        anchor = self.modules[0]
        mgr = resolve_manager(anchor.manager, "halo chain")
        n = mgr.domain_world_size
        plain = (
            n == 1
            or x.dim() != 4
            or torch.compiler.is_compiling()
            or getattr(mgr, "is_tiled", False)
            or self._hooked()
        )
        if plain:
            return self._members(x, 0, len(self.modules))
        length = mgr.global_length(anchor, x.shape[2])
        heights = chain_heights(self.layers, length)
        cut = self.pieces(length, n, tuple(x.shape), x.element_size(), x.device.type)
        for start, stop, geo in cut:
            if geo is None:
                x = self._members(x, start, stop)
            else:
                x = self._chain(x, geo, start, stop, mgr, heights[start])
        return x

    def _members(self, x, start: int, stop: int):
        for m in self.modules[start:stop]:
            x = m(x)
        return x

    def _chain(self, x, geo: ChainGeometry, start: int, stop: int, mgr, length: int):
        rank = mgr.domain_rank
        (ext,) = exchange_planned([x], [(geo.plans[rank], 2, 0.0)], mgr)
        for (role, layer), step in zip(self.layers[start:stop], geo.steps[rank]):
            if role == STENCIL and isinstance(layer, DomainParallelPad):
                ext = layer.pad_width(_window(ext, step.pieces, 2, layer.value))
            elif role == STENCIL:
                weight, bias = layer._weight_and_bias(ext)
                ext = layer.op(_window(ext, step.pieces, 2, 0.0), weight, bias)
            elif role == NORM:
                ext = _norm_on_rows(layer, ext, step.own, mgr)
            else:
                ext = layer(ext)
        return ext

    def __repr__(self) -> str:
        return f"HaloChainRun(children {self.first}..{self.stop - 1}, mode={self.mode!r})"


class ChainedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose runs of chain members run as :class:`HaloChainRun` s (the
    converter swaps the class of a plain Sequential: same children, same state_dict keys)."""

    def forward(self, x):
        runs = {run.first: run for run in vars(self).get("_halo_chain_runs", ())}
        modules = list(self._modules.values())
        i = 0
        while i < len(modules):
            run = runs.get(i)
            if run is not None:
                x, i = run(x), run.stop
            else:
                x, i = modules[i](x), i + 1
        return x


def install_halo_chains(sequential: nn.Sequential, runs: list[HaloChainRun]) -> None:
    """Make ``sequential`` (exactly an ``nn.Sequential``) run ``runs``."""
    if type(sequential) not in (nn.Sequential, ChainedSequential):
        raise TypeError(f"halo chains run in an nn.Sequential, not {type(sequential).__name__}")
    sequential.__class__ = ChainedSequential
    vars(sequential)["_halo_chain_runs"] = tuple(runs)
