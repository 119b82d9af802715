"""Exact forecast metrics on sharded fields: latitude-weighted RMSE, anomaly correlation, the fair
CRPS and the ensemble spread, each from GLOBAL sums, so the value does not depend on how the
grid (rows, and column tiles), the initial times or the ensemble members are split over ranks.

Every function takes this rank's part of the fields: ``(B, C, [Z,] H_local, W_local)`` tensors
(``B`` initial times, channels, levels, the rank's latitude rows and longitude columns) and the
latitude weights of the rank's rows ``(H_local,)`` (any positive scale: the weights are
normalised by their GLOBAL sum, ``sum_h w_h * W``).  ``manager`` is the domain manager of the
layout (None: the fields are whole).  Definitions (SPEC §7; ``w`` the normalised weights, means
over the globe):

* spatial MSE ``mse_t = sum_hw w_h (f - y)^2 / sum_hw w_h`` per initial time ``t`` and channel;
  ``rmse = sqrt(mean_t mse_t)``.
* anomaly correlation, uncentred (as WeatherBench 2): with anomalies ``f' = f - c``, ``y' = y - c``
  against the climatology ``c`` (the time mean of the training range at each grid point),
  ``acc_t = sum w f'y' / sqrt(sum w f'^2 * sum w y'^2)``; ``acc = mean_t acc_t``.
  ``centered=True`` removes each anomaly's weighted spatial mean first (CREDIT's "debiased"
  ACC, Bonavita & Geer 2026, eq. A8).
* fair CRPS of ``M`` members ``x_i`` at a point: ``mean_i |x_i - y| - sum_ij |x_i - x_j| /
  (2 M (M - 1))`` (Ferro 2014; ``M = 1``: the absolute error), its weighted spatial mean per
  ``t`` and channel, then ``crps = mean_t``.
* spread: ``sqrt(mean_t sum w var_i(x_i) / sum w)`` with the unbiased member variance.

Per-initial-time forms (``spatial_mse``, ``spatial_acc``, ``spatial_crps``,
``spatial_variance``) keep the batch and channel axes; the aggregates (``weighted_rmse``,
``anomaly_correlation``, ``crps``, ``spread``) average over the batch and, unless
``per_channel``, the channels too.  ``batch_group``: a process group over which further initial
times are spread (each on exactly one of its ranks, e.g. the manager's data-parallel group when
each dp rank scores its own initial times); the mean over initial times then covers them all.

Members: ``members`` is ``(M_local, B, C, ..., H_local, W_local)``; ``member_group`` a group of
ranks holding the other members of the same initial times and rows (None: all members are
here).  The members of a grid point are gathered over ``member_group`` (this rank's rows only)
and sorted, so the CRPS and the variance are bitwise the same for any split of the members.

Arithmetic is float64 whatever the input dtype.  Communication: one sum of a few numbers per
channel over the domain group per call (``small_collectives.sum_small_``), one all-gather of the
members over ``member_group``, one sum over ``batch_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout.compat import all_gather_single
from ..layout.small_collectives import gather_small, sum_small_

__all__ = [
    "anomaly_correlation",
    "crps",
    "gather_members",
    "spatial_acc",
    "spatial_crps",
    "spatial_mse",
    "spatial_variance",
    "spread",
    "weighted_rmse",
]


# ------------------------------------------------------------------ communication
def _group_size(group) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over ``group`` (in place; a group of one rank or None: ``t`` itself)."""
    if _group_size(group) > 1:
        sum_small_(t, group)
    return t


def _domain_group(manager):
    return None if manager is None else manager.domain_group


def gather_members(members: torch.Tensor, member_group=None) -> torch.Tensor:
    """Every rank's members of ``member_group`` concatenated along dim 0, in group-rank order
    (ranks may hold different numbers of members, none included)."""
    if _group_size(member_group) == 1:
        return members
    count = torch.tensor([members.shape[0]], dtype=torch.int64, device=members.device)
    counts = [int(c) for c in gather_small(count, member_group).flatten()]
    most = max(counts)
    padded = members.new_zeros((most, *members.shape[1:]))
    padded[: members.shape[0]] = members
    out = members.new_empty((len(counts) * most, *members.shape[1:]))
    all_gather_single(out, padded.contiguous(), group=member_group)
    return torch.cat([out[r * most : r * most + c] for r, c in enumerate(counts)])


# ------------------------------------------------------------------ arithmetic
def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def _check_fields(pred: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor, what: str):
    if pred.shape != truth.shape:
        raise ValueError(
            f"{what}: prediction shape {tuple(pred.shape)} != truth {tuple(truth.shape)}"
        )
    if pred.dim() < 3:
        raise ValueError(f"{what}: fields need (B, C, ..., H, W), got shape {tuple(pred.shape)}")
    if weights.dim() != 1 or weights.shape[0] != pred.shape[-2]:
        raise ValueError(
            f"{what}: lat_weights_local must be (H_local,) = ({pred.shape[-2]},), got "
            f"{tuple(weights.shape)}"
        )


def _weighted_sum(field: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_hw w_h field`` over the last two dims (float64)."""
    return (field * w.view(-1, 1)).sum(dim=(-2, -1))


def _spatial_means(fields: list[torch.Tensor], weights: torch.Tensor, manager) -> list:
    """Global latitude-weighted spatial means of ``fields`` (each ``(..., H_local, W_local)``):
    local weighted sums and the local weight mass, summed over the domain group in ONE call."""
    w = _f64(weights).to(fields[0].device)
    width = fields[0].shape[-1]
    sums = [_weighted_sum(f, w) for f in fields]
    mass = (w.sum() * width).reshape(1)
    flat = torch.cat([s.flatten() for s in sums] + [mass])
    _sum_over(flat, _domain_group(manager))
    total, parts, offset = flat[-1], [], 0
    for s in sums:
        parts.append(flat[offset : offset + s.numel()].view(s.shape) / total)
        offset += s.numel()
    return parts


def _sorted_members(members: torch.Tensor, member_group) -> torch.Tensor:
    return torch.sort(_f64(gather_members(members, member_group)), dim=0).values


def _fair_crps_field(ordered: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Pointwise fair CRPS of sorted members ``(M, ...)``: ``sum_ij |x_i - x_j| = 2 sum_k
    (2k - M - 1) x_(k)`` (k = 1..M), so no M x M array is formed."""
    m = ordered.shape[0]
    skill = (ordered - truth).abs().mean(dim=0)
    if m == 1:
        return skill
    k = torch.arange(1, m + 1, dtype=ordered.dtype, device=ordered.device)
    coeff = (2 * k - m - 1).view(-1, *([1] * (ordered.dim() - 1)))
    return skill - (coeff * ordered).sum(dim=0) / (m * (m - 1))


# ------------------------------------------------------------------ per initial time
def spatial_mse(
    pred: torch.Tensor, truth: torch.Tensor, lat_weights_local: torch.Tensor, *, manager=None
) -> torch.Tensor:
    """Global latitude-weighted spatial mean of ``(pred - truth)^2``, shape ``(B, C, [Z])``."""
    _check_fields(pred, truth, lat_weights_local, "spatial_mse")
    return _spatial_means([(_f64(pred) - _f64(truth)) ** 2], lat_weights_local, manager)[0]


def spatial_acc(
    pred: torch.Tensor,
    truth: torch.Tensor,
    climatology: torch.Tensor,
    lat_weights_local: torch.Tensor,
    *,
    manager=None,
    centered: bool = False,
) -> torch.Tensor:
    """Global latitude-weighted anomaly correlation per initial time and channel ``(B, C, [Z])``;
    ``climatology`` broadcasts against this rank's part of the fields (``(C, [Z,] H_local,
    W_local)`` typically)."""
    _check_fields(pred, truth, lat_weights_local, "spatial_acc")
    clim = _f64(climatology).to(pred.device)
    a, b = _f64(pred) - clim, _f64(truth) - clim
    if centered:
        mean_a, mean_b = _spatial_means([a, b], lat_weights_local, manager)
        a = a - mean_a[..., None, None]
        b = b - mean_b[..., None, None]
    ab, aa, bb = _spatial_means([a * b, a * a, b * b], lat_weights_local, manager)
    return ab / torch.sqrt(aa * bb)


def spatial_crps(
    members: torch.Tensor,
    truth: torch.Tensor,
    lat_weights_local: torch.Tensor,
    *,
    manager=None,
    member_group=None,
) -> torch.Tensor:
    """Global latitude-weighted spatial mean of the fair CRPS, ``(B, C, [Z])``."""
    ordered = _sorted_members(members, member_group)  # a rank may hold no member
    _check_fields(ordered[0], truth, lat_weights_local, "spatial_crps")
    field = _fair_crps_field(ordered, _f64(truth))
    return _spatial_means([field], lat_weights_local, manager)[0]


def spatial_variance(
    members: torch.Tensor, lat_weights_local: torch.Tensor, *, manager=None, member_group=None
) -> torch.Tensor:
    """Global latitude-weighted spatial mean of the unbiased ensemble variance, ``(B, C, [Z])``
    (needs at least two members in all)."""
    ordered = _sorted_members(members, member_group)
    if ordered.shape[0] < 2:
        raise ValueError(
            f"spread/spatial_variance: the ensemble needs at least 2 members, got {ordered.shape[0]}"
        )
    _check_fields(ordered[0], ordered[0], lat_weights_local, "spatial_variance")
    var = ((ordered - ordered.mean(dim=0)) ** 2).sum(dim=0) / (ordered.shape[0] - 1)
    return _spatial_means([var], lat_weights_local, manager)[0]


# ------------------------------------------------------------------ aggregates
def _mean_over_times(per_time: torch.Tensor, per_channel: bool, batch_group) -> torch.Tensor:
    """Mean over initial times (dim 0, also those of ``batch_group``'s other ranks) and, unless
    ``per_channel``, over the channel (and level) axes."""
    total = per_time.sum(dim=0)
    if not per_channel:
        total = total.sum().reshape(1)
    count = torch.full((1,), per_time.numel() // total.numel(), dtype=torch.float64)
    flat = _sum_over(torch.cat([total.flatten(), count.to(total.device)]), batch_group)
    mean = flat[:-1].view(total.shape) / flat[-1]
    return mean if per_channel else mean[0]


def weighted_rmse(
    pred: torch.Tensor,
    truth: torch.Tensor,
    lat_weights_local: torch.Tensor,
    *,
    manager=None,
    per_channel: bool = False,
    batch_group=None,
) -> torch.Tensor:
    """``sqrt(mean over initial times [and channels] of spatial_mse)``: a 0-d tensor, or
    ``(C, [Z])`` with ``per_channel``."""
    mse = spatial_mse(pred, truth, lat_weights_local, manager=manager)
    return torch.sqrt(_mean_over_times(mse, per_channel, batch_group))


def anomaly_correlation(
    pred: torch.Tensor,
    truth: torch.Tensor,
    climatology: torch.Tensor,
    lat_weights_local: torch.Tensor,
    *,
    manager=None,
    per_channel: bool = False,
    batch_group=None,
    centered: bool = False,
) -> torch.Tensor:
    """Mean over initial times [and channels] of :func:`spatial_acc`."""
    acc = spatial_acc(
        pred, truth, climatology, lat_weights_local, manager=manager, centered=centered
    )
    return _mean_over_times(acc, per_channel, batch_group)


def crps(
    members: torch.Tensor,
    truth: torch.Tensor,
    lat_weights_local: torch.Tensor,
    *,
    manager=None,
    member_group=None,
    per_channel: bool = False,
    batch_group=None,
) -> torch.Tensor:
    """Mean over initial times [and channels] of :func:`spatial_crps` (the fair estimator)."""
    per_time = spatial_crps(
        members, truth, lat_weights_local, manager=manager, member_group=member_group
    )
    return _mean_over_times(per_time, per_channel, batch_group)


def spread(
    members: torch.Tensor,
    lat_weights_local: torch.Tensor,
    *,
    manager=None,
    member_group=None,
    per_channel: bool = False,
    batch_group=None,
) -> torch.Tensor:
    """``sqrt(mean over initial times [and channels] of spatial_variance)``."""
    var = spatial_variance(members, lat_weights_local, manager=manager, member_group=member_group)
    return torch.sqrt(_mean_over_times(var, per_channel, batch_group))
