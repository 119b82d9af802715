"""Ensemble CRPS losses, exact whatever the layout: members on other ranks, rows on other shards.

The K members of a sample are spread over the E ranks of the ensemble axis (SPEC §2), K / E
consecutive members each (CREDIT's ``repeat_interleave`` order: global member
``e * K/E + i`` on ensemble rank e); the domain axis splits their rows (tiles) as for any field.
Every loss here is CRPS-shaped per grid point:

    CRPS(x, y) = mean_i |x_i - y|  -  c * sum_{i,j} |x_i - x_j|

- ``KCRPS`` (``credit.losses.gen_1.kcrps.KCRPSLoss``): c = 1 / (2 K (K-1)) (fair) or
  1 / (2 K^2) (``biased``); CREDIT sorts the members, which is the same sum.
- ``almost-fair-crps`` (``AlmostFairKCRPSLoss``): c = (1 - eps) / (2 K (K-1)),
  eps = (1 - alpha) / K.
- ``ring-crps`` (``credit.losses.crps.RingCRPSLoss``): CREDIT's value is the average over its
  K ranks (one member each, DDP's mean) of ``[|x_r - y| - sum_{j!=r} |x_r - x_j| / (K-1)] / K``.

What a rank computes is its SHARE map (:func:`crps_share`), shaped like the target's local rows:
summed over the ensemble ranks it is the loss map of one process holding all K members (values
to rounding), and its gradient with respect to this rank's members is the one-process gradient.
The other members enter detached: the pairwise term's derivative ``2c sum_j sign(x_i - x_j)``
is then carried by ``2c |x_i - x_j^detached|`` and the value is put right by a detached
``+ c |x_i - x_j|``.  Any linear reduction of the map (a latitude-weighted mean over the GLOBAL
count, CREDIT's BaseLoss per-variable weights) applied per rank and summed over the ensemble and
domain axes (FSDP2 sums there, ``sync_domain_gradients(op="sum")``) is the one-process loss.

Communication and memory (no rank ever holds the K members' full fields): the pairwise term
needs, at each of its points, every member's value there; the K/E-member blocks go round the
ensemble axis in E - 1 ring shifts (as CREDIT's ring-crps), each rank sending and receiving
(E - 1) x K/E x (its rows) values per loss call; it holds its own block, one received block and
the block in flight: 3 x K/E fields of its rows, plus the pairwise accumulator (one more).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layout.ensemble_keys import (  # re-exported: their home before
    CRPS_LOSSES,
    KCRPS,
    RING,
    crps_comm_per_step,
)

__all__ = [
    "CRPS_LOSSES",
    "EnsembleLoss",
    "crps_comm_per_step",
    "crps_share",
    "crps_weighted_loss",
    "ensemble_loss_of",
    "member_blocks",
]


@dataclass(frozen=True)
class EnsembleLoss:
    """One CRPS loss of K = ``members`` members: ``kind`` one of :data:`CRPS_LOSSES`,
    ``biased`` (KCRPS), ``alpha`` (almost-fair)."""

    kind: str
    members: int
    biased: bool = False
    alpha: float = 1.0

    def __post_init__(self):
        if self.kind not in CRPS_LOSSES:
            raise ValueError(f"loss.training_loss {self.kind!r} is not one of {CRPS_LOSSES}")
        if isinstance(self.members, bool) or not isinstance(self.members, int):
            raise ValueError(f"trainer.ensemble_size must be an integer, got {self.members!r}")
        if self.members < 2:
            raise ValueError(
                f"loss.training_loss {self.kind} needs trainer.ensemble_size >= 2 members, got "
                f"{self.members} (a CRPS of one member is its absolute error: use mae)"
            )

    @property
    def spread_coefficient(self) -> float:
        """c of ``mean_i |x_i - y| - c sum_{i,j} |x_i - x_j|`` (KCRPS, almost-fair)."""
        k = self.members
        if self.kind == KCRPS:
            return 1.0 / (2 * k * k) if self.biased else 1.0 / (2 * k * (k - 1))
        eps = (1.0 - self.alpha) / k
        return (1.0 - eps) / (2 * k * (k - 1))


def ensemble_loss_of(loss_conf: Mapping, members: int) -> EnsembleLoss | None:
    """The :class:`EnsembleLoss` a CREDIT ``loss`` section asks for (flat ``training_loss`` or
    ``type: base`` with ``args.training_loss``), None for a deterministic loss."""
    if not isinstance(loss_conf, Mapping):
        return None
    if loss_conf.get("type") == "base":
        args = loss_conf.get("args") or {}
        name, params = args.get("training_loss"), args.get("base_loss_parameters") or {}
    else:
        name = loss_conf.get("training_loss")
        params = loss_conf.get("training_loss_parameters") or {}
    if name not in CRPS_LOSSES:
        return None
    return EnsembleLoss(
        name, members, biased=bool(params.get("biased", False)), alpha=params.get("alpha", 1.0)
    )


def _group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def member_blocks(block: torch.Tensor, group) -> Iterator[torch.Tensor]:
    """Every ensemble rank's member block, detached: this rank's first, then E - 1 ring shifts
    over ``group`` (the ensemble axis; None or one rank: only this rank's)."""
    buf = block.detach().contiguous()
    yield buf
    size = _group_size(group)
    if size == 1:
        return
    rank = dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    recv_from = dist.get_global_rank(group, (rank - 1) % size)
    for _ in range(size - 1):
        incoming = torch.empty_like(buf)
        ops = [
            dist.P2POp(dist.isend, buf, send_to, group=group),
            dist.P2POp(dist.irecv, incoming, recv_from, group=group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        buf = incoming
        yield buf


def _pairwise_abs_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``sum_j |x_i - x_j^detached|`` over all K members j, for this rank's members i
    (``x``: (b, K/E, ...)), live in ``x``; one member of a block at a time."""
    total = torch.zeros_like(x)
    for block in member_blocks(x, group):
        for j in range(block.shape[1]):
            total = total + (x - block[:, j : j + 1]).abs()
    return total


def crps_share(
    pred: torch.Tensor, target: torch.Tensor, loss: EnsembleLoss, group=None
) -> torch.Tensor:
    """This rank's share of the CRPS map (see the module docstring), shaped like ``target``.

    ``pred``: (b * K/E, ...) this rank's members of each sample, consecutive (CREDIT's order);
    ``target``: (b, ...) the same rows; ``group``: the ensemble axis (None: all K members here).
    Computed in at least float32 (float64 stays float64).
    """
    ens = _group_size(group)
    if loss.members % ens:
        raise ValueError(
            f"trainer.ensemble_size = {loss.members} is not a multiple of "
            f"trainer.parallelism.ensemble = {ens}"
        )
    local = loss.members // ens
    batch = target.shape[0]
    if pred.shape[0] != batch * local or pred.shape[1:] != target.shape[1:]:
        raise ValueError(
            f"{loss.kind}: the prediction {tuple(pred.shape)} is not {local} member(s) of each of "
            f"the target's {batch} sample(s) {tuple(target.shape)} (trainer.ensemble_size "
            f"{loss.members} over trainer.parallelism.ensemble {ens})"
        )
    dtype = torch.promote_types(pred.dtype, torch.float32)
    x = pred.to(dtype).reshape(batch, local, *target.shape[1:])
    y = target.to(dtype).unsqueeze(1)
    k = loss.members
    skill = (x - y).abs()
    pairs = _pairwise_abs_sum(x, group)
    if loss.kind == RING:
        return ((skill - pairs / (k - 1)) / k).sum(1) / k
    c = loss.spread_coefficient
    return (skill / k - 2 * c * pairs + c * pairs.detach()).sum(1)


def crps_weighted_loss(
    loss: EnsembleLoss,
    lat_weights_local: torch.Tensor,
    global_height: int,
    global_width: int | None = None,
    group=None,
):
    """The trainer's loss function (``train/step.py``'s ``LossFn``) for ``loss``: per output, the
    latitude-weighted sum of this rank's :func:`crps_share` over the one-process element count
    (b x C x [Z] x H x W of the GLOBAL grid), averaged over the outputs.  Summed over the
    ensemble and domain ranks it is the one-process latitude-weighted mean of the CRPS map."""

    def loss_fn(outputs: tuple, targets: tuple) -> torch.Tensor:
        shares = []
        for out, target in zip(outputs, targets):
            share = crps_share(out, target, loss, group)
            w = lat_weights_local.to(device=share.device, dtype=share.dtype).view(-1, 1)
            width = global_width if global_width is not None else target.shape[-1]
            count = math.prod(target.shape[:-2]) * global_height * width
            shares.append((share * w).sum() / count)
        return sum(shares[1:], shares[0]) / len(shares)

    return loss_fn
