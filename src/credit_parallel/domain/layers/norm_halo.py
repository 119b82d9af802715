"""GroupNorm statistics that travel with the next convolution's halo exchange.

In ``[GroupNorm, activation, conv]`` the norm's statistics (an all-gather forward, an all-reduce
backward) and the conv's halo exchange (forward rows, backward gradient rows) are two
synchronisation points per direction.  Fused (``fusion.py`` decides it, the converter applies
it through :class:`~credit_parallel.domain.options.LayerOptions` ``fused_norm``), they are ONE
batched point-to-point call per direction, at any domain size:

forward
    the norm computes its local moments (``norm.local_group_moments``) and sends, in one
    ``batch_isend_irecv``, its moments to EVERY domain rank and the RAW (not yet normalised) rows
    of its input that the conv's window needs to their neighbours (the conv's own
    :class:`~credit_parallel.domain.rows.RankExchangePlan`): one message per peer, the moments
    and the rows packed as bytes.  After the one wait every rank merges the same moments
    (Chan's formula, in rank order: bitwise the same statistics on every rank), normalises its
    own rows and the received rows with them (the per-channel affine map is the same on every
    rank, so a received row normalised here is the row its owner normalises, to rounding), the
    activation (elementwise, row-local) runs on both, and the conv assembles its window from
    them without exchanging.
backward
    the gradient reaching the normalised halo rows stays here until the norm's backward, which
    reduces its two per-(sample, group) sums ``A = sum g``, ``B = sum g (x - mean)`` over its
    whole window (own rows and halo rows; both are linear in the gradient, so the ranks' window
    sums add up to the global sums) and sends, in one call, those partial sums to every rank and
    the halo-row gradients back to their owners; after the one wait it adds what came back to
    its own rows' gradient and forms ``dx`` as ``norm.py`` does.

Exact (float64 parity with the single process); one synchronisation point per direction
instead of two.  Under ``torch.compile`` the norm and the conv take their unfused traced paths.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from ..exchange.p2p import PendingExchange, post_messages, send_buffers
from ..exchange.traffic import active_recorder
from ..exchange.windows import shape_with
from ..rows import RankExchangePlan
from .norm import (
    _affine_per_channel,
    _centre,
    affine_from_moments,
    group_norm_input_grad_coefficients,
    local_group_moments,
    statistics_dtype,
)

__all__ = ["ELEMENTWISE_ACTIVATIONS", "NormConvLink"]

# row-local, elementwise, stateless: applying them to received rows gives the owner's rows
ELEMENTWISE_ACTIVATIONS = (
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.SiLU,
    nn.GELU,
    nn.ELU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardswish,
    nn.Softplus,
)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _exchange_bytes(sends: dict, layouts: dict, ref, peers, group, direction: str) -> dict:
    """ONE batched call: ``sends[q]`` (tensors, the statistics first) to domain rank ``q`` as
    one byte message, ``layouts[q]`` ((dtype, shape) per part) received from ``q``; returns, per
    ``q``, the received parts (views of one byte buffer per peer), after the one wait."""
    send_msgs = [(peers[q], torch.cat([_as_bytes(t) for t in parts])) for q, parts in sends.items()]
    recorder = active_recorder()
    if recorder is not None:  # the statistics are not halo bytes (traffic.py)
        statistics = sum(parts[0].numel() * parts[0].element_size() for parts in sends.values())
        recorder.bytes_sent -= statistics
        recorder.by_direction[direction] -= statistics
        recorder.statistics_bytes += statistics
    flat, recv_msgs = {}, []
    for q, layout in layouts.items():
        sizes = [
            math.prod(shape) * torch.empty((), dtype=dt).element_size() for dt, shape in layout
        ]
        flat[q] = ref.new_empty(sum(sizes), dtype=torch.uint8)
        recv_msgs.append((peers[q], flat[q]))
    works, posted = post_messages(send_msgs, recv_msgs, group, direction, False)
    keep = (*send_msgs, *recv_msgs)
    PendingExchange(works, direction, None, keep=keep, posted_s=posted, group=group).wait()
    out = {}
    for q, layout in layouts.items():
        off, parts = 0, []
        for dt, shape in layout:
            size = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            parts.append(flat[q].narrow(0, off, size).view(dt).view(shape))
            off += size
        out[q] = parts
    return out


class _NormWindow(torch.autograd.Function):
    """GroupNorm of the shard ``x`` and of the halo rows the conv's ``plan`` receives, with ONE
    batched call per direction (module docstring).  Returns ``(y, *halos)``: ``halos`` one per
    ``plan.recvs`` entry, normalised."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, plan, dim, rank, n, peers, group):
        b, c = x.shape[:2]
        cg = c // groups
        stat = statistics_dtype(x.dtype)
        t, hi = _centre(x, groups)
        moments = local_group_moments(t, hi, stat)
        others = [q for q in range(n) if q != rank]
        sends = {q: [moments] for q in others}
        for (q, _), buf in zip(plan.sends, send_buffers(x, plan, dim)):
            sends.setdefault(q, []).append(buf)
        layouts = {q: [(stat, tuple(moments.shape))] for q in others}
        for q, rows in plan.recvs:
            layouts.setdefault(q, []).append((x.dtype, tuple(shape_with(x, dim, rows))))
        got = _exchange_bytes(sends, layouts, x, peers, group, "forward")
        gathered = torch.stack([moments if q == rank else got[q].pop(0) for q in range(n)])
        rstd, offset, count, scale, shift = affine_from_moments(
            gathered, hi, weight, bias, eps, groups, cg
        )
        cdt = t.dtype
        scale, shift = scale.reshape(b, c).to(cdt), shift.reshape(b, c).to(cdt)
        y = _affine_per_channel(t.view(b, c, -1), scale, shift).view(x.shape).to(x.dtype)
        halos, centred = [], []
        for q, _ in plan.recvs:
            raw = got[q].pop(0)
            th = raw.reshape(b, groups, -1).to(cdt) - hi.unsqueeze(-1)
            centred.append(th)
            yh = _affine_per_channel(th.view(b, c, -1), scale, shift)
            halos.append(yh.view(raw.shape).to(x.dtype))
        ctx.save_for_backward(t, rstd, offset, count, weight, bias, *centred)
        ctx.plan, ctx.dim, ctx.rank, ctx.n, ctx.peers, ctx.group = plan, dim, rank, n, peers, group
        ctx.groups, ctx.x_shape, ctx.x_dtype = groups, x.shape, x.dtype
        return (y, *halos)

    @staticmethod
    def backward(ctx, grad_y, *grad_halos):
        t, rstd, offset, count, weight, bias, *centred = ctx.saved_tensors
        plan, dim, rank, n, groups = ctx.plan, ctx.dim, ctx.rank, ctx.n, ctx.groups
        b, c = ctx.x_shape[:2]
        cg = c // groups
        stat, cdt = rstd.dtype, t.dtype
        if grad_y is None:
            grad_y = t.new_zeros(ctx.x_shape, dtype=ctx.x_dtype)
        grad_halos = [
            torch.zeros_like(th, dtype=ctx.x_dtype).view(shape_with(grad_y, dim, r))
            if g is None
            else g
            for g, th, (_, r) in zip(grad_halos, centred, plan.recvs)
        ]
        # per (sample, channel) sums over the whole window: own rows and halo rows
        sum_dy = torch.zeros((b, c), dtype=stat, device=t.device)
        sum_dy_t = torch.zeros((b, c), dtype=stat, device=t.device)
        for g, tc in [(grad_y, t), *zip(grad_halos, centred)]:
            gc = g.to(cdt).reshape(b, c, -1)
            sum_dy += gc.sum(-1).to(stat)
            sum_dy_t += torch.einsum("bcl,bcl->bc", gc, tc.view(b, c, -1)).to(stat)
        sum_dy, sum_dy_t = sum_dy.view(b, groups, cg), sum_dy_t.view(b, groups, cg)
        sum_dy_centred = sum_dy_t - offset.unsqueeze(-1) * sum_dy
        w = weight.to(stat).view(groups, cg) if weight is not None else None
        g_dy = sum_dy if w is None else sum_dy * w
        g_dy_centred = sum_dy_centred if w is None else sum_dy_centred * w
        partial = torch.stack((g_dy.sum(-1), g_dy_centred.sum(-1)))
        # one call: the partial sums to every rank, the halo gradients back to their owners
        others = [q for q in range(n) if q != rank]
        sends = {q: [partial] for q in others}
        for (q, _), g in zip(plan.recvs, grad_halos):
            sends.setdefault(q, []).append(g)
        layouts = {q: [(stat, tuple(partial.shape))] for q in others}
        for q, runs in plan.sends:
            rows = sum(k for _, k in runs)
            layouts.setdefault(q, []).append((grad_y.dtype, tuple(shape_with(grad_y, dim, rows))))
        got = _exchange_bytes(sends, layouts, grad_y, ctx.peers, ctx.group, "backward")
        sums = partial if rank == 0 else got[0].pop(0).clone()
        for q in range(1, n):
            sums = sums + (partial if q == rank else got[q].pop(0))
        gy = grad_y.contiguous().clone()
        for q, runs in plan.sends:
            back, off = got[q].pop(0), 0
            for s, k in runs:
                gy.narrow(dim, s, k).add_(back.narrow(dim, off, k))
                off += k
        alpha, beta, const = group_norm_input_grad_coefficients(
            rstd, offset, sums[0], sums[1], count, w
        )
        gyc = gy.to(cdt).reshape(b, c, -1)
        const = const.unsqueeze(-1).expand(b, groups, cg).reshape(b, c).to(cdt)
        grad_x = _affine_per_channel(gyc, alpha.expand(b, groups, cg).reshape(b, c).to(cdt), const)
        grad_x.view(b, groups, -1).addcmul_(t, beta.to(cdt).unsqueeze(-1))
        grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_centred * rstd.unsqueeze(-1)).sum(0).reshape(-1).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.sum(0).reshape(-1).to(bias.dtype)
        return (grad_x, grad_weight, grad_bias) + (None,) * 8


def _on_domain_ranks(plan: RankExchangePlan, mgr, axis: str) -> RankExchangePlan:
    """``plan`` (over the latitude ranks of this rank's longitude column, ``axis`` "rows", or
    the longitude ranks of its latitude band, "cols") with its peers named by their index in
    the flattened P x Q domain group (``lat * Q + lon``)."""
    q, (lat, lon) = mgr.domain_shape[1], mgr.domain_coords
    index = (lambda p: p * q + lon) if axis == "rows" else (lambda p: lat * q + p)
    return replace(
        plan,
        sends=tuple((index(p), runs) for p, runs in plan.sends),
        recvs=tuple((index(p), rows) for p, rows in plan.recvs),
    )


class NormConvLink:
    """A GroupNorm (``norm``), an optional elementwise ``activation`` and the conv after them in
    one ``nn.Sequential``, fused (module docstring).  Plain references (no submodules): held in
    the ``fused_norm`` option of the norm and of the conv.  The norm's forward leaves the
    normalised halo rows here; the conv's next forward takes them (once)."""

    def __init__(self, norm, activation, conv):
        self.norm, self.activation, self.conv = norm, activation, conv
        self._pending = None  # (expected conv input shape, normalised halos)
        self.tile_axis = "rows"  # on tiles: the exchange pass the halos came with

    def norm_forward(self, x, weight, bias, mgr) -> torch.Tensor:
        """The norm's output ``y`` of the shard ``x``; its halo rows wait here for the conv."""
        if getattr(mgr, "is_tiled", False):
            return self._norm_forward_tile(x, weight, bias, mgr)
        conv = self.conv
        dim = conv.spatial_index + 2
        n, rank = mgr.domain_world_size, mgr.domain_rank
        length = mgr.global_length(self.norm, x.shape[dim])
        plan = conv._call_geometry(length, n, rank).plan
        args = (self.norm.num_groups, self.norm.eps, plan, dim, rank, n)
        y, *halos = _NormWindow.apply(x, weight, bias, *args, mgr.domain_ranks, mgr.domain_group)
        self._pending = (tuple(y.shape), halos)
        return y

    def _norm_forward_tile(self, x, weight, bias, mgr) -> torch.Tensor:
        """On a lat x lon tile (SPEC §3b): the statistics go to every rank of the P x Q group in
        ONE call per direction with the first pass of the conv's tile exchange that has peers
        (``exchange/halo.py``): the compact rows to the latitude neighbours, or at P = 1 (no
        latitude neighbour) the columns to the longitude neighbours; the conv then does the
        rest of its exchange (``conv_tiles._linked_window``)."""
        from .conv_tiles import tile_conv_call

        conv = self.conv
        dim_h, dim_w = conv.spatial_index + 2, conv.nd + 1
        height = mgr.global_height(conv, x.shape[dim_h])
        width = mgr.global_width(conv, x.shape[dim_w])
        call = tile_conv_call(conv, height, width, mgr.domain_shape, mgr.domain_coords)
        self.tile_axis = "rows" if mgr.domain_shape[0] > 1 else "cols"
        axis_plan, dim = (
            (call.plan.rows, dim_h) if self.tile_axis == "rows" else (call.plan.cols, dim_w)
        )
        plan = _on_domain_ranks(axis_plan, mgr, self.tile_axis)
        n, rank = mgr.domain_world_size, mgr.domain_rank
        args = (self.norm.num_groups, self.norm.eps, plan, dim, rank, n)
        y, *halos = _NormWindow.apply(x, weight, bias, *args, mgr.domain_ranks, mgr.domain_group)
        self._pending = (tuple(y.shape), halos)
        return y

    def take_halos(self, z: torch.Tensor):
        """The activated halo rows for the conv input ``z`` (the activation of the norm's last
        output), or None (nothing pending, or ``z`` is not that output: the conv exchanges)."""
        pending, self._pending = self._pending, None
        if pending is None or tuple(z.shape) != pending[0]:
            return None
        act = self.activation
        return [h if act is None else act(h) for h in pending[1]]

    def applies_to(self, x: torch.Tensor) -> bool:
        """Whether the norm's forward on ``x`` takes the fused path (eager, the conv's rank)."""
        return not torch.compiler.is_compiling() and x.dim() == self.conv.nd + 2

    def __repr__(self) -> str:
        return f"NormConvLink({type(self.norm).__name__} -> {type(self.conv).__name__})"
