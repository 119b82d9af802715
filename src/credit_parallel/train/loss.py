"""Latitude-weighted MSE that is exact on uneven domain shards.

Each domain rank holds some rows of the prediction.  Its loss SHARE is the weighted sum of
squared errors over its own rows divided by the GLOBAL element count of the dp replica's batch
(batch x channels x global H x W).  Summed over the domain ranks (``sync_domain_gradients(...,
op="sum")`` for the gradients) the shares give exactly the single-process mean, whatever the
shard sizes; averaged over dp (DDP/FSDP2 do that) they give the mean over the global batch.
"""

from __future__ import annotations

import math

import torch

__all__ = ["latitude_weighted_mse_share", "local_lat_weights"]


def local_lat_weights(lat_weights: torch.Tensor, manager) -> torch.Tensor:
    """This domain rank's rows of the global (H,) latitude weights."""
    from ..domain.rows import shard_range

    if manager is None or manager.domain_world_size == 1:
        return lat_weights
    if getattr(manager, "is_tiled", False):  # a lat x lon tile: the rows of its latitude shard
        (p, _), (lat, _) = manager.domain_shape, manager.domain_coords
        a, b = shard_range(lat_weights.shape[0], p, lat)
        return lat_weights[a:b]
    a, b = shard_range(lat_weights.shape[0], manager.domain_world_size, manager.domain_rank)
    return lat_weights[a:b]


def latitude_weighted_mse_share(
    pred: torch.Tensor,
    target: torch.Tensor,
    lat_weights_local: torch.Tensor,
    global_height: int,
    global_width: int | None = None,
) -> torch.Tensor:
    """sum_{rows of this rank} w_h (pred - target)^2 / (B * C * [Z] * H_global * W).

    ``pred``/``target``: (B, C, H_local, W) or (B, C, Z, H_local, W); ``lat_weights_local``:
    (H_local,), normalised to mean 1 over the GLOBAL grid.  ``global_width``: the global W when
    the last dim holds this rank's columns only (a lat x lon tile, SPEC §3b).
    """
    if pred.shape != target.shape:
        raise ValueError(
            f"prediction shape {tuple(pred.shape)} != target shape {tuple(target.shape)}"
        )
    # at least float32 (bf16 under amp is promoted), float64 stays float64 (exactness checks)
    dtype = torch.promote_types(pred.dtype, torch.float32)
    diff = (pred.to(dtype) - target.to(dtype)) ** 2
    w = lat_weights_local.to(diff.dtype).view(-1, 1)
    if global_width is not None:
        count = math.prod(diff.shape[:-2]) * global_height * global_width
    else:
        count = diff.numel() // diff.shape[-2] * global_height
    return (diff * w).sum() / count
