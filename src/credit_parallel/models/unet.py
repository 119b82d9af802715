"""A small U-Net on a global lat-lon grid, built only from layers domain parallelism can make exact.

Encoder: periodic 3x3 residual blocks (GroupNorm, SiLU) and stride-2 3x3 down-sampling convs;
bottleneck: a residual block and a 1x1-conv feed-forward opted into tensor parallelism; decoder:
bilinear ``nn.Upsample`` to the exact GLOBAL size of each skip connection (33 -> 17 -> 9 down,
9 -> 17 -> 33 up), concatenation, residual block. The model is built for one grid
(``image_height`` x ``image_width``) because the up-sampling targets are fixed at construction:
under domain parallelism a forward only sees its local shard, so no size may be read from a
tensor shape at run time. Any H >= 2 and W work (odd sizes included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from credit_parallel.models.layers import (
    ConvFeedForward,
    check_int_tuple,
    check_positive_int,
    group_norm,
)
from credit_parallel.models.periodic import PeriodicConv2d

__all__ = ["UNet", "UNetBottleneckMLP", "UNetResBlock"]


def _downsampled(size: int) -> int:
    """Output size of ``nn.Conv2d(kernel_size=3, stride=2, padding=1)``: ceil(size / 2)."""
    return (size - 1) // 2 + 1


class UNetResBlock(nn.Module):
    """GroupNorm-SiLU-PeriodicConv x2 with a residual (1x1 conv when channels change)."""

    _fsdp2_shard = True
    # each conv's input is exactly the activation of the norm's output (forward below): the
    # domain converter sends the norm's statistics with the conv's halo exchange
    _domain_norm_act_conv = (("norm1", "act", "conv1"), ("norm2", "act", "conv2"))

    def __init__(self, dim_in: int, dim_out: int, norm_groups: int) -> None:
        super().__init__()
        self.norm1 = group_norm(norm_groups, dim_in)
        self.conv1 = PeriodicConv2d(dim_in, dim_out, 3, padding=1)
        self.norm2 = group_norm(norm_groups, dim_out)
        self.conv2 = PeriodicConv2d(dim_out, dim_out, 3, padding=1)
        self.act = nn.SiLU()
        self.skip = nn.Conv2d(dim_in, dim_out, 1) if dim_in != dim_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.act(self.norm1(x)))
        h = self.conv2(self.act(self.norm2(h)))
        return self.skip(x) + h


class UNetBottleneckMLP(nn.Module):
    """Residual GroupNorm + 1x1-conv feed-forward; the feed-forward is tensor-parallel."""

    _fsdp2_shard = True

    def __init__(self, channels: int, norm_groups: int, ratio: int) -> None:
        super().__init__()
        self.norm = group_norm(norm_groups, channels)
        self.ff = ConvFeedForward(channels, ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class UNet(nn.Module):
    """U-Net for (B, in_channels, image_height, image_width) -> (B, out_channels, same).

    The head's conv input is exactly the activation of the head norm's output (``forward``):
    declared, so the domain converter sends that norm's statistics with the head's halo
    exchange (``domain/layers/norm_halo.py``).

    Args:
        in_channels, out_channels: channel counts of input and output.
        image_height, image_width: the global grid the model is built for.
        base_channels: channels of the first level; level i has base_channels * channel_mults[i].
        channel_mults: one entry per level; levels after the first are reached by a stride-2 conv.
        norm_groups: GroupNorm groups; must divide every channel count.
        mlp_ratio: hidden width of the bottleneck feed-forward, in multiples of its channels.
    """

    _domain_norm_act_conv = (("head_norm", "head_act", "head"),)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        image_height: int,
        image_width: int,
        base_channels: int = 8,
        channel_mults: Sequence[int] = (1, 2, 2),
        norm_groups: int = 4,
        mlp_ratio: int = 4,
    ) -> None:
        super().__init__()
        in_channels = check_positive_int("in_channels", in_channels)
        out_channels = check_positive_int("out_channels", out_channels)
        image_height = check_positive_int("image_height", image_height)
        image_width = check_positive_int("image_width", image_width)
        base_channels = check_positive_int("base_channels", base_channels)
        channel_mults = check_int_tuple("channel_mults", channel_mults)
        norm_groups = check_positive_int("norm_groups", norm_groups)
        mlp_ratio = check_positive_int("mlp_ratio", mlp_ratio)
        if image_height < 2:
            raise ValueError(f"image_height must be >= 2 (reflect padding), got {image_height}")

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.image_height = image_height
        self.image_width = image_width

        level_channels = [base_channels * m for m in channel_mults]
        sizes = [(image_height, image_width)]
        for _ in channel_mults[1:]:
            h, w = sizes[-1]
            sizes.append((_downsampled(h), _downsampled(w)))
        # Reflect padding at the poles needs at least 2 rows at every level.
        if sizes[-1][0] < 2:
            raise ValueError(
                f"image_height={image_height} is too small for {len(channel_mults)} levels "
                f"(the coarsest level would have {sizes[-1][0]} row); use fewer channel_mults"
            )
        self.level_sizes = sizes

        self.stem = PeriodicConv2d(in_channels, base_channels, 3, padding=1)
        self.encoder = nn.ModuleList()
        self.downsample = nn.ModuleList()
        channels = base_channels
        for i, ch in enumerate(level_channels):
            self.encoder.append(UNetResBlock(channels, ch, norm_groups))
            channels = ch
            if i < len(level_channels) - 1:
                self.downsample.append(nn.Conv2d(channels, channels, 3, stride=2, padding=1))

        self.mid_block = UNetResBlock(channels, channels, norm_groups)
        self.mid_mlp = UNetBottleneckMLP(channels, norm_groups, mlp_ratio)

        self.upsample = nn.ModuleList()
        self.decoder = nn.ModuleList()
        for i in reversed(range(len(level_channels) - 1)):
            # The GLOBAL size of the skip connection: under domain parallelism the converter
            # turns this into a sharded interpolation that still targets the whole grid.
            self.upsample.append(nn.Upsample(size=sizes[i], mode="bilinear", align_corners=False))
            self.decoder.append(
                UNetResBlock(channels + level_channels[i], level_channels[i], norm_groups)
            )
            channels = level_channels[i]

        self.head_norm = group_norm(norm_groups, channels)
        self.head_act = nn.SiLU()
        self.head = PeriodicConv2d(channels, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on a lat x lon tile (SPEC §3b) the input holds some of the columns only
        tiled = getattr(vars(self).get("_domain_manager"), "is_tiled", False)
        if x.shape[1] != self.in_channels or (x.shape[-1] != self.image_width and not tiled):
            raise ValueError(
                f"UNet expects (B, {self.in_channels}, H, {self.image_width}) "
                f"(built for a {self.image_height} x {self.image_width} grid), got {tuple(x.shape)}"
            )
        x = self.stem(x)
        skips = []
        for i, block in enumerate(self.encoder):
            x = block(x)
            if i < len(self.downsample):
                skips.append(x)
                x = self.downsample[i](x)
        x = self.mid_mlp(self.mid_block(x))
        for upsample, block in zip(self.upsample, self.decoder):
            x = block(torch.cat([upsample(x), skips.pop()], dim=1))
        return self.head(self.head_act(self.head_norm(x)))
