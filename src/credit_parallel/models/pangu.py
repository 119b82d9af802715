"""A Pangu-style 3-D model: upper-air levels and the surface share one (Z, H, W) latent.

Upper air (B, C_upper, Z, H, W) is patch-embedded with an ``nn.Conv3d`` (kernel = stride =
``patch_size``), the surface (B, C_surf, H, W) with an ``nn.Conv2d`` (kernel = stride = the
horizontal patch), and the surface latent is appended as one extra level: a (B, D, Z', H', W')
latent with Z' = Z / patch_z + 1. Two stages of 3-D conv blocks (3x3x3 convs, GroupNorm, GELU)
and channels-last ``nn.Linear`` feed-forwards (tensor-parallel; ``nn.Conv3d`` is not) sit around a
horizontal 2x down/up-sampling; patch recovery uses transposed convs with kernel = stride.

Grid constraints (checked at construction): Z must be a multiple of ``patch_size[0]``, H and W
multiples of ``2 * patch_size[1]`` and ``2 * patch_size[2]`` (patch embedding then the stage
down-sampling). Under domain parallelism H is sharded (dim 3 of the 5-D tensors, dim 2 of the
surface); every layer that changes the height is a stock conv module the converter makes exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from credit_parallel.models.layers import (
    ChannelsLastFeedForward,
    check_int_tuple,
    check_positive_int,
    group_norm,
)

__all__ = ["Pangu3D", "PanguBlock3D"]


class PanguBlock3D(nn.Module):
    """Residual (GroupNorm, 3x3x3 conv, GELU, 3x3x3 conv) then residual channels-last FFN."""

    _fsdp2_shard = True

    def __init__(self, dim: int, norm_groups: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm = group_norm(norm_groups, dim)
        self.conv1 = nn.Conv3d(dim, dim, 3, padding=1)
        self.act = nn.GELU()
        self.conv2 = nn.Conv3d(dim, dim, 3, padding=1)
        self.ff = ChannelsLastFeedForward(dim, mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.conv2(self.act(self.conv1(self.norm(x))))
        return x + self.ff(x)


class Pangu3D(nn.Module):
    """forward(upper (B, C_upper, Z, H, W), surface (B, C_surf, H, W)) -> (upper_out, surface_out),
    ``surface_out`` ``(B, C_surf + output_only_channels, H, W)``.

    Args:
        upper_channels, surface_channels: variables per level / surface variables.
        levels: Z, the number of pressure levels.
        image_height, image_width: the global grid.
        dim: latent channels of the first stage (the second stage has 2 * dim).
        patch_size: (z, h, w) patch of the embedding; kernel = stride.
        depths: blocks in the first and second stage.
        mlp_ratio: feed-forward hidden width in multiples of the stage width.
        norm_groups: GroupNorm groups; must divide dim.
        output_only_channels: diagnostic fields predicted after the surface ones (CREDIT's
            name; ``data.diagnostic_variables``), never an input.
    """

    def __init__(
        self,
        upper_channels: int,
        surface_channels: int,
        levels: int,
        image_height: int,
        image_width: int,
        dim: int = 16,
        patch_size: Sequence[int] = (2, 2, 2),
        depths: Sequence[int] = (1, 1),
        mlp_ratio: int = 4,
        norm_groups: int = 4,
        output_only_channels: int = 0,
    ) -> None:
        super().__init__()
        upper_channels = check_positive_int("upper_channels", upper_channels)
        surface_channels = check_positive_int("surface_channels", surface_channels)
        levels = check_positive_int("levels", levels)
        image_height = check_positive_int("image_height", image_height)
        image_width = check_positive_int("image_width", image_width)
        dim = check_positive_int("dim", dim)
        patch_size = check_int_tuple("patch_size", patch_size, 3)
        depths = check_int_tuple("depths", depths, 2)
        mlp_ratio = check_positive_int("mlp_ratio", mlp_ratio)
        norm_groups = check_positive_int("norm_groups", norm_groups)
        if isinstance(output_only_channels, bool) or not isinstance(output_only_channels, int):
            raise ValueError(
                f"output_only_channels must be an int >= 0, got {output_only_channels!r}"
            )
        if output_only_channels < 0:
            raise ValueError(f"output_only_channels must be >= 0, got {output_only_channels}")
        pz, ph, pw = patch_size
        for name, size, factor in (
            ("levels", levels, pz),
            ("image_height", image_height, 2 * ph),
            ("image_width", image_width, 2 * pw),
        ):
            if size % factor:
                raise ValueError(
                    f"{name}={size} is not a multiple of {factor} (patch_size={list(patch_size)}"
                    + (", times the stage down-sampling 2)" if name != "levels" else ")")
                )

        self.upper_channels = upper_channels
        self.surface_channels = surface_channels
        self.output_only_channels = output_only_channels
        self.levels = levels
        self.image_height = image_height
        self.image_width = image_width
        self.patch_size = patch_size

        self.upper_embed = nn.Conv3d(upper_channels, dim, patch_size, stride=patch_size)
        self.surface_embed = nn.Conv2d(surface_channels, dim, (ph, pw), stride=(ph, pw))
        self.stage1 = nn.Sequential(
            *(PanguBlock3D(dim, norm_groups, mlp_ratio) for _ in range(depths[0]))
        )
        self.down = nn.Conv3d(dim, 2 * dim, (1, 2, 2), stride=(1, 2, 2))
        self.stage2 = nn.Sequential(
            *(PanguBlock3D(2 * dim, norm_groups, mlp_ratio) for _ in range(depths[1]))
        )
        self.up = nn.ConvTranspose3d(2 * dim, dim, (1, 2, 2), stride=(1, 2, 2))
        self.upper_recovery = nn.ConvTranspose3d(2 * dim, upper_channels, patch_size, patch_size)
        self.surface_recovery = nn.ConvTranspose2d(
            2 * dim, surface_channels + output_only_channels, (ph, pw), stride=(ph, pw)
        )

    def forward(
        self, upper: torch.Tensor, surface: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if upper.dim() != 5 or upper.shape[1:3] != (self.upper_channels, self.levels):
            raise ValueError(
                f"Pangu3D: upper must be (B, {self.upper_channels}, {self.levels}, H, W), "
                f"got {tuple(upper.shape)}"
            )
        if surface.dim() != 4 or surface.shape[1] != self.surface_channels:
            raise ValueError(
                f"Pangu3D: surface must be (B, {self.surface_channels}, H, W), "
                f"got {tuple(surface.shape)}"
            )
        # The surface becomes one more level at the top of the Z axis (dim 2; H stays dim 3).
        latent = torch.cat(
            [self.upper_embed(upper), self.surface_embed(surface).unsqueeze(2)], dim=2
        )
        skip = self.stage1(latent)
        deep = self.stage2(self.down(skip))
        latent = torch.cat([self.up(deep), skip], dim=1)
        return self.upper_recovery(latent[:, :, :-1]), self.surface_recovery(latent[:, :, -1])
