"""Domain-parallel GroupNorm: statistics over the whole globe, exact forward and backward.

A GroupNorm normalises each (sample, group) over its channels and ALL spatial positions, so a
rank holding some latitude rows cannot normalise alone.  Each rank reduces its own rows to three
numbers per (sample, group) — count, mean and M2 (sum of squared deviations from that mean),
held in float64 for float32/float64 inputs (float32 for bf16/half) — the ranks exchange them in ONE
differentiable all-gather (:func:`~credit_parallel.domain.collective_ops.all_gather_stacked`),
and every rank merges them with Chan's parallel formula::

    mean = sum_i n_i m_i / N,    M2 = sum_i M2_i + sum_i n_i (m_i - mean)^2

which never subtracts large sums (a naive sum-of-squares merge loses every digit once the mean is
large against the spread).  The merge and the all-gather are ordinary autograd, so the backward
carries the gradient of the statistics back to every rank's rows: the input gradient is the exact
GroupNorm gradient, not the "statistics held fixed" approximation a non-differentiable all-reduce
would give.  The two per-element steps (local moments, normalisation) are small autograd
Functions that save only the input, so the layer keeps no more activations than
``nn.GroupNorm``; they run in the input's precision (float32 for bf16/half) on data shifted by
the mean (split as ``hi + lo`` in that precision), so a mean far from zero costs no accuracy and
float32 layers do not pay for float64 passes over the activations.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .collective_ops import all_gather_stacked
from .manager import resolve_manager
from .wrap import DomainWrapper

__all__ = ["DomainParallelGroupNorm", "merge_group_moments", "statistics_dtype"]


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the statistics (and their merge) for inputs of ``dtype``."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the per-element passes: the input's own, float32 for bf16/half."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _split_mean(mean: torch.Tensor, dtype: torch.dtype):
    """``mean`` (statistics precision) as ``hi + lo`` with ``hi`` in ``dtype``: ``x - hi`` is then
    accurate to the rounding of the CENTRED value, and ``lo`` is applied to small sums only."""
    hi = mean.to(dtype)
    return hi, mean - hi.to(mean.dtype)


class _LocalMoments(torch.autograd.Function):
    """Per (sample, group) mean and M2 of this rank's rows, returned in the statistics dtype.

    ``x`` is (B, G, K).  The data are shifted by a first estimate of the mean before any sum of
    squares (the shifted-data algorithm), so a large mean costs no precision even though the
    per-element passes run in the input's precision.  Backward: d mean/dx = 1/K,
    d M2/dx = 2 (x - mean).
    """

    @staticmethod
    def forward(ctx, x, stat_dtype):
        xc = x.to(_compute_dtype(x.dtype))
        count = xc.shape[-1]
        if count == 0:  # a rank without rows contributes nothing (weight n_i = 0)
            mean = xc.new_zeros(xc.shape[:-1], dtype=stat_dtype)
            m2 = torch.zeros_like(mean)
        else:
            shift = xc.mean(-1, keepdim=True)
            centred = xc - shift
            mean_c = centred.sum(-1).to(stat_dtype) / count
            mean = shift.squeeze(-1).to(stat_dtype) + mean_c
            m2 = centred.square_().sum(-1).to(stat_dtype) - count * mean_c**2
            m2 = m2.clamp_min(0)
        ctx.save_for_backward(x, mean)
        return mean, m2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_mean, grad_m2):
        x, mean = ctx.saved_tensors
        count = max(x.shape[-1], 1)
        xc = x.to(_compute_dtype(x.dtype))
        hi, lo = _split_mean(mean, xc.dtype)
        # 2 g_m2 (x - hi - lo) + g_mean / K, with the small terms folded into one constant
        slope = (2 * grad_m2).unsqueeze(-1)
        const = (grad_mean / count).unsqueeze(-1) - slope * lo.unsqueeze(-1)
        grad = (xc - hi.unsqueeze(-1)).mul_(slope.to(xc.dtype)).add_(const.to(xc.dtype))
        return grad.to(x.dtype), None


class _Normalize(torch.autograd.Function):
    """``y = (x - mean) * rstd * weight + bias`` per (sample, group, channel).

    ``x`` is (B, G, Cg, R); ``mean``/``rstd`` (B, G) in the statistics dtype; ``weight``/``bias``
    (C,) or None.  The backward returns the direct input gradient and the gradients of ``mean``
    and ``rstd`` (these flow on through the merge and the all-gather to every rank's rows).
    """

    @staticmethod
    def forward(ctx, x, mean, rstd, weight, bias):
        b, g, cg, _ = x.shape
        xc = x.to(_compute_dtype(x.dtype))
        hi, lo = _split_mean(mean, xc.dtype)
        scale = rstd.view(b, g, 1, 1).expand(b, g, cg, 1)
        if weight is not None:
            scale = scale * weight.to(rstd.dtype).view(1, g, cg, 1)
        shift = -lo.view(b, g, 1, 1) * scale
        if bias is not None:
            shift = shift + bias.to(rstd.dtype).view(1, g, cg, 1)
        y = (xc - hi.view(b, g, 1, 1)).mul_(scale.to(xc.dtype)).add_(shift.to(xc.dtype))
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        b, g, cg, _ = x.shape
        stat = rstd.dtype
        xc = x.to(_compute_dtype(x.dtype))
        gy = grad_y.to(xc.dtype)
        hi, lo = _split_mean(mean, xc.dtype)
        # per (sample, group, channel): sum(gy) and sum(gy * (x - mean)), the only full passes
        sum_gy = gy.sum(-1).to(stat)
        sum_gy_centred = (xc - hi.view(b, g, 1, 1)).mul_(gy).sum(-1).to(stat)
        sum_gy_centred = sum_gy_centred - lo.view(b, g, 1) * sum_gy
        w = weight.to(stat).view(1, g, cg) if weight is not None else None
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[3]:
            grad_weight = (sum_gy_centred * rstd.view(b, g, 1)).sum(0).reshape(-1)
            grad_weight = grad_weight.to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[4]:
            grad_bias = sum_gy.sum(0).reshape(-1).to(bias.dtype)
        w_sum_gy = sum_gy if w is None else w * sum_gy
        w_sum_gy_centred = sum_gy_centred if w is None else w * sum_gy_centred
        grad_mean = -w_sum_gy.sum(-1) * rstd
        grad_rstd = w_sum_gy_centred.sum(-1)
        direct = rstd.view(b, g, 1).expand(b, g, cg) if w is None else w * rstd.view(b, g, 1)
        grad_x = (gy * direct.unsqueeze(-1).to(xc.dtype)).to(x.dtype)
        return grad_x, grad_mean, grad_rstd, grad_weight, grad_bias


def merge_group_moments(counts, means, m2s):
    """Chan's parallel merge of per-rank moments stacked along dim 0: returns (mean, M2)."""
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total.clamp_min(1)
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return mean, m2


class DomainParallelGroupNorm(DomainWrapper):
    """Domain-parallel ``nn.GroupNorm``: statistics over the channels of a group and every
    spatial position of every rank (any spatial rank: B,C,H,W and B,C,Z,H,W alike).  Shares the
    norm's parameters and state_dict keys; exact forward and backward; one all-gather per call."""

    domain_form = "collective"
    domain_kind = "group_norm"

    def __init__(self, norm: nn.GroupNorm, manager=None):
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
        b, c = x.shape[:2]
        g = self.num_groups
        stat = statistics_dtype(x.dtype)
        # explicit sizes: a rank with an empty shard reshapes a tensor of 0 elements
        positions = math.prod(x.shape[2:])
        grouped = x.reshape(b, g, (c // g) * positions)
        mean, m2 = _LocalMoments.apply(grouped, stat)
        count = torch.full_like(mean, grouped.shape[-1])
        gathered = all_gather_stacked(torch.stack((count, mean, m2)), mgr)
        mean, m2 = merge_group_moments(gathered[:, 0], gathered[:, 1], gathered[:, 2])
        var = m2 / gathered[:, 0].sum(0)  # biased, like nn.GroupNorm
        rstd = torch.rsqrt(var + self.eps)
        y = _Normalize.apply(x.reshape(b, g, c // g, positions), mean, rstd, weight, bias)
        return y.reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{self.wrapped!r}"
