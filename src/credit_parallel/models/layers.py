"""Building blocks shared by the reference models, and the argument checks they use.

Every block here is either a stock ``nn`` module the domain-parallel converter knows, or a module
whose forward is per pixel (channel-only normalisation, 1x1 feed-forward) and says so with
``_domain_local = True`` and ``_tile_local = True`` (per pixel: row- and column-local). The feed-forwards opt into tensor parallelism with ``_tp_col`` /
``_tp_row``: a column layer (C -> ratio*C), a point-wise GELU, a row layer (ratio*C -> C).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "AttentionBlock",
    "ChannelLayerNorm",
    "ChannelsLastFeedForward",
    "ConvFeedForward",
    "check_positive_int",
    "check_int_tuple",
    "group_norm",
]


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, else ``ValueError`` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_int_tuple(name: str, value: Any, length: int | None = None) -> tuple[int, ...]:
    """A sequence of ints >= 1 (a YAML list is fine) as a tuple, else ``ValueError``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {value!r}")
    items = tuple(check_positive_int(f"{name}[{i}]", v) for i, v in enumerate(value))
    if length is not None and len(items) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(items)}: {value!r}")
    return items


def group_norm(num_groups: int, channels: int) -> nn.GroupNorm:
    """``nn.GroupNorm`` with a message naming ``norm_groups`` when it does not divide."""
    if channels % num_groups:
        raise ValueError(
            f"norm_groups={num_groups} does not divide the channel count {channels} of a "
            "GroupNorm; choose norm_groups dividing every channel count of the model"
        )
    return nn.GroupNorm(num_groups, channels)


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channel dim (dim 1) of a (B, C, ...) tensor, independently per pixel."""

    _domain_local = True
    _tile_local = True  # per pixel: exact on lat x lon tiles too (SPEC §3b)

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)


class ConvFeedForward(nn.Module):
    """1x1 conv (C -> ratio*C), GELU, 1x1 conv (ratio*C -> C) on a (B, C, H, W) tensor."""

    _tp_col = "net.0"
    _tp_row = "net.2"

    def __init__(self, channels: int, ratio: int = 4) -> None:
        super().__init__()
        hidden = channels * ratio
        self.net = nn.Sequential(
            nn.Conv2d(channels, hidden, 1), nn.GELU(), nn.Conv2d(hidden, channels, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ChannelsLastFeedForward(nn.Module):
    """LayerNorm + Linear (C -> ratio*C) + GELU + Linear (ratio*C -> C) over the channel dim.

    For tensors of any rank (B, C, ...): channels are moved last, so the feed-forward is made of
    ``nn.Linear`` layers (which tensor parallelism supports, unlike ``nn.Conv3d``) and is point-wise
    in space.
    """

    _domain_local = True
    _tile_local = True  # point-wise in space: exact on lat x lon tiles too
    _tp_col = "net.0"
    _tp_row = "net.2"

    def __init__(self, channels: int, ratio: int = 4) -> None:
        super().__init__()
        hidden = channels * ratio
        self.norm = nn.LayerNorm(channels)
        self.net = nn.Sequential(
            nn.Linear(channels, hidden), nn.GELU(), nn.Linear(hidden, channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.norm(x.movedim(1, -1))).movedim(-1, 1)


class AttentionBlock(nn.Module):
    """Pre-norm transformer block around a given attention module: ``x + attn(norm(x))``, then
    ``x + ff(norm(x))`` with a 1x1-conv feed-forward (the CrossFormer and Swin blocks)."""

    _fsdp2_shard = True

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: int) -> None:
        super().__init__()
        self.attn_norm = ChannelLayerNorm(dim)
        self.attn = attn
        self.ff_norm = ChannelLayerNorm(dim)
        self.ff = ConvFeedForward(dim, mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ff(self.ff_norm(x))
