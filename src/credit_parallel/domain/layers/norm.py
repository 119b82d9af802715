"""Domain-parallel GroupNorm: statistics over the whole globe, exact forward and backward.

A GroupNorm normalises each (sample, group) over its channels and ALL spatial positions, so a
rank holding some latitude rows cannot normalise alone.  The layer is one autograd Function with
exactly one collective per direction and a fixed number of fused per-element passes:

forward
    1. centre: ``t = x - hi`` with ``hi`` the LOCAL mean of each (sample, group) — one pass that
       also serves the normalisation and the backward (``t`` is what is saved, in place of ``x``);
    2. local moments of ``t``: count, mean and M2 (sum of squared deviations) by the
       shifted-data algorithm (``M2 = sum t^2 - n mean_t^2`` on data already centred, so nothing
       cancels), held in float64 for float32/float64 inputs (float32 for bf16/half);
    3. ONE all-gather of (count, mean, M2) per (sample, group), merged on every rank with Chan's
       parallel formula ``mean = sum n_i m_i / N, M2 = sum M2_i + sum n_i (m_i - mean)^2``, which
       never subtracts large sums (a sum / sum-of-squares merge loses every digit once the mean is
       large against the spread);
    4. ``y = t * scale + shift`` per (sample, channel) in one fused pass (the native inference
       batch-norm kernel used as a per-channel affine map); ``shift`` folds in the small offset
       between the global and the local mean, so a mean far from zero costs no accuracy.

backward (``g = dy * gamma``, ``xhat = (x - mean) rstd``, means over the GLOBAL group of M)
    ``dx = rstd (g - mean(g) - xhat mean(g xhat))``: the two per-(sample, group) sums
    ``A = sum g`` and ``B = sum g (x - mean)`` are reduced locally from the per-channel sums
    ``sum dy`` and ``sum dy t`` (one pass over dy and one dot product per channel), summed over
    the ranks in ONE all-reduce, and ``dx = dy alpha + t beta + c`` is formed in two fused passes.
    The parameter gradients are this rank's partial sums (the domain gradient sync adds them up).

The per-element passes run in the input's precision (float32 for bf16/half, where ``x`` is
saved instead of the wider ``t`` and ``t`` is recomputed in the backward).  A rank without rows
contributes count 0 and takes part in both collectives.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ...layout.compat import affine_per_channel
from ..exchange.collectives import all_gather_stacked, all_reduce_sum
from ..exchange.ops import gather_stacked_traced
from ..manager import resolve_manager
from ..wrap import DomainWrapper

__all__ = [
    "DomainParallelGroupNorm",
    "affine_from_moments",
    "group_norm_input_grad_coefficients",
    "local_group_moments",
    "merge_group_moments",
    "statistics_dtype",
]


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the statistics (and their merge) for inputs of ``dtype``."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the per-element passes: the input's own, float32 for bf16/half."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _centre(x: torch.Tensor, groups: int):
    """``(t, hi)``: ``x`` as (B, G, K) minus ``hi``, its per-(sample, group) mean, both in the
    compute dtype.  ``hi`` only has to be close to the mean (its rounding is corrected later)."""
    b = x.shape[0]
    grouped = x.reshape(b, groups, math.prod(x.shape[1:]) // groups)
    cdt = _compute_dtype(x.dtype)
    if grouped.shape[-1] == 0:  # a rank without rows: the mean of nothing is not needed
        hi = grouped.new_zeros((b, groups), dtype=cdt)
    else:
        hi = grouped.mean(-1, dtype=cdt)
    return grouped - hi.unsqueeze(-1), hi


def local_group_moments(t: torch.Tensor, hi: torch.Tensor, stat_dtype: torch.dtype):
    """Count, mean and M2 per (sample, group) of ``x = t + hi`` (``t`` centred, (B, G, K)),
    stacked as (3, B, G) in ``stat_dtype``.  Shifted-data algorithm: with ``t`` already centred,
    ``M2 = sum t^2 - K mean_t^2`` subtracts two small numbers."""
    count = t.shape[-1]
    mean_t = t.sum(-1).to(stat_dtype) / max(count, 1)
    sum_sq = torch.linalg.vector_norm(t, dim=-1).to(stat_dtype).square()
    m2 = (sum_sq - count * mean_t.square()).clamp_min(0)
    mean = hi.to(stat_dtype) + mean_t
    return torch.stack((torch.full_like(mean, count), mean, m2))


def merge_group_moments(counts, means, m2s):
    """Chan's parallel merge of per-rank moments stacked along dim 0: returns (mean, M2).
    Ranks with count 0 carry no weight (and the total is never 0 for a real grid)."""
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total.clamp_min(1)
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return mean, m2


def affine_from_moments(gathered, hi, weight, bias, eps: float, groups: int, cg: int):
    """The per-(sample, channel) affine of a GroupNorm from every rank's moments ``gathered``
    (ranks, 3, B, G) stacked in rank order: merged in that order (so every rank gets bitwise
    the same statistics), ``(rstd, offset, count, scale, shift)`` with ``offset`` the mean
    relative to the centring value ``hi``; biased variance, like ``nn.GroupNorm``."""
    stat = gathered.dtype
    mean, m2 = merge_group_moments(gathered[:, 0], gathered[:, 1], gathered[:, 2])
    count = gathered[:, 0].sum(0)
    rstd = torch.rsqrt(m2 / count + eps)
    offset = mean - hi.to(stat)
    scale = rstd.unsqueeze(-1).expand(rstd.shape[0], groups, cg)
    if weight is not None:
        scale = scale * weight.to(stat).view(1, groups, cg)
    shift = -offset.unsqueeze(-1) * scale
    if bias is not None:
        shift = shift + bias.to(stat).view(1, groups, cg)
    return rstd, offset, count, scale, shift


def _affine_per_channel(t: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor):
    """``t * scale + shift`` with ``t`` (B, C, L) and ``scale``/``shift`` (B, C), in ONE pass
    (:func:`credit_parallel.layout.compat.affine_per_channel`)."""
    return affine_per_channel(t, scale, shift)


def group_norm_input_grad_coefficients(rstd, offset, sum_g, sum_g_centred, count, weight):
    """Coefficients of ``dx = dy * alpha + t * beta + c`` for GroupNorm, from GLOBAL sums.

    ``rstd``, ``offset`` (global mean minus the centring ``hi``), ``sum_g = sum dy gamma``,
    ``sum_g_centred = sum dy gamma (x - mean)`` and ``count`` (elements of the global group) are
    (B, G); ``weight`` (G, Cg) or None.  Returns ``alpha`` (B, G, Cg; (B, G, 1) without a
    weight), ``beta`` (B, G) and ``c`` (B, G), from ``dx = rstd g - rstd A / M - (x - mean) rstd^3 B / M`` with ``x - mean = t -
    offset``."""
    k = rstd.pow(3) * sum_g_centred / count
    beta = -k
    c = -rstd * sum_g / count + offset * k
    alpha = rstd.unsqueeze(-1) if weight is None else rstd.unsqueeze(-1) * weight
    return alpha, beta, c


def _traced_group_norm(x, weight, bias, groups: int, eps: float, group):
    """The forward of :class:`_DomainGroupNorm` in differentiable torch ops, the statistics
    gathered by the traced operator of ``ops.py`` (for ``torch.compile``, which derives the
    backward; the same function, to rounding)."""
    stat = statistics_dtype(x.dtype)
    t, hi = _centre(x, groups)
    gathered = gather_stacked_traced(local_group_moments(t, hi, stat), group)
    mean, m2 = merge_group_moments(gathered[:, 0], gathered[:, 1], gathered[:, 2])
    rstd = torch.rsqrt(m2 / gathered[:, 0].sum(0) + eps)
    y = ((t - (mean - hi.to(stat)).unsqueeze(-1)) * rstd.unsqueeze(-1)).to(t.dtype)
    y = y.view(x.shape)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y.to(x.dtype)


class _DomainGroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, manager):
        b, c = x.shape[:2]
        cg, length = c // groups, math.prod(x.shape[2:])
        stat = statistics_dtype(x.dtype)
        t, hi = _centre(x, groups)
        moments = local_group_moments(t, hi, stat)
        gathered = all_gather_stacked(moments, manager)  # (ranks, 3, B, G): the one collective
        rstd, offset, count, scale, shift = affine_from_moments(
            gathered, hi, weight, bias, eps, groups, cg
        )
        cdt = t.dtype
        y = _affine_per_channel(t.view(b, c, length), scale.to(cdt), shift.to(cdt))
        keep_centred = t.dtype == x.dtype  # bf16/half: t is wider than x; recompute it later
        ctx.save_for_backward(t if keep_centred else x, rstd, offset, count, weight, bias)
        ctx.keep_centred, ctx.groups = keep_centred, groups
        ctx.manager = manager
        return y.view(x.shape).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        saved, rstd, offset, count, weight, bias = ctx.saved_tensors
        groups = ctx.groups
        t = saved if ctx.keep_centred else _centre(saved, groups)[0]
        b, c = grad_y.shape[:2]
        cg, length = c // groups, math.prod(grad_y.shape[2:])
        stat = rstd.dtype
        gy = grad_y.to(t.dtype).reshape(b, c, length)
        t_c = t.view(b, c, length)
        # per (sample, channel): sum dy and sum dy*t — the only full reductions
        sum_dy = gy.sum(-1).to(stat).view(b, groups, cg)
        # a batched dot product: einsum takes a fused path here, bmm with (1, L) x (L, 1)
        # matrices is ten times slower on CPU
        sum_dy_t = torch.einsum("bcl,bcl->bc", gy, t_c).view(b, groups, cg)
        sum_dy_centred = sum_dy_t.to(stat) - offset.unsqueeze(-1) * sum_dy  # sum dy (x - mean)
        w = weight.to(stat).view(groups, cg) if weight is not None else None
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            g_dy = sum_dy if w is None else sum_dy * w
            g_dy_centred = sum_dy_centred if w is None else sum_dy_centred * w
            sums = all_reduce_sum(torch.stack((g_dy.sum(-1), g_dy_centred.sum(-1))), ctx.manager)
            alpha, beta, const = group_norm_input_grad_coefficients(
                rstd, offset, sums[0], sums[1], count, w
            )
            cdt = t.dtype
            const = const.unsqueeze(-1).expand(b, groups, cg)
            grad_x = _affine_per_channel(gy, alpha.expand(b, groups, cg).to(cdt), const.to(cdt))
            grad_x.view(b, groups, cg * length).addcmul_(t, beta.to(cdt).unsqueeze(-1))
            grad_x = grad_x.view(grad_y.shape).to(saved.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_centred * rstd.unsqueeze(-1)).sum(0).reshape(-1)
            grad_weight = grad_weight.to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.sum(0).reshape(-1).to(bias.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None


class DomainParallelGroupNorm(DomainWrapper):
    """Domain-parallel ``nn.GroupNorm``: statistics over the channels of a group and every
    spatial position of every rank (any spatial rank: B,C,H,W and B,C,Z,H,W alike).  Shares the
    norm's parameters and state_dict keys; exact forward and backward; one all-gather forward
    and one all-reduce backward per call."""

    domain_form = "collective"
    domain_kind = "group_norm"
    tile_exact = True  # statistics over the whole (flattened P x Q) domain group (SPEC §3b)

    def __init__(self, norm: nn.GroupNorm, *, manager=None):
        if not isinstance(norm, nn.GroupNorm):
            raise TypeError(
                f"DomainParallelGroupNorm wraps nn.GroupNorm, got {type(norm).__name__}"
            )
        super().__init__(norm)
        self.manager = manager

    # ---- geometry (domain/geometry.py): row-local, plus one statistics collective
    def output_height(self, input_height: int) -> int:
        return input_height

    def input_windows(self, input_height: int, n: int) -> None:
        return None

    @property
    def num_groups(self) -> int:
        return self.wrapped.num_groups

    @property
    def num_channels(self) -> int:
        return self.wrapped.num_channels

    @property
    def eps(self) -> float:
        return self.wrapped.eps

    @property
    def affine(self) -> bool:
        return self.wrapped.affine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mgr = resolve_manager(self.manager, type(self).__name__)
        norm = self.wrapped_weights(x)
        weight, bias = norm.weight, norm.bias
        if mgr.domain_world_size == 1:
            return F.group_norm(x, self.num_groups, weight, bias, self.eps)
        if x.dim() < 3 or x.shape[1] != self.num_channels:
            raise ValueError(
                f"DomainParallelGroupNorm({self.num_groups}, {self.num_channels}) expects a "
                f"(B, {self.num_channels}, *spatial) input with at least one (sharded) spatial "
                f"dim, got shape {tuple(x.shape)}"
            )
        device = x.device.type
        if device == "cuda" and torch.is_autocast_enabled(device):
            # CUDA autocast runs nn.GroupNorm in float32 (its fp32 op list; CPU autocast leaves
            # it in the input's dtype); the layer's own passes are never re-cast (einsum would
            # go to bf16), hence autocast off around them
            x = x.float()
            weight = weight.float() if weight is not None else None
            bias = bias.float() if bias is not None else None
        with torch.autocast(device, enabled=False):
            if torch.compiler.is_compiling():
                args = (x, weight, bias, self.num_groups, self.eps, mgr.domain_group)
                return _traced_group_norm(*args)
            link = self._options.fused_norm  # statistics with the next conv's exchange
            if link is not None and link.applies_to(x):
                return link.norm_forward(x.contiguous(), weight, bias, mgr)
            return _DomainGroupNorm.apply(
                x.contiguous(), weight, bias, self.num_groups, self.eps, mgr
            )

    def extra_repr(self) -> str:
        return f"{self.wrapped!r}"
