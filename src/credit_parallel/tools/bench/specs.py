"""What the benchmark runs: reference models at a few sizes and the parallel layouts (dp, tp, domain)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["Layout", "ModelSpec", "build_conv_stack", "default_layouts", "default_models"]


def build_conv_stack(channels: int, blocks: int, groups: int) -> nn.Sequential:
    """``blocks`` x [3x3 conv (padding 1), GroupNorm(groups), SiLU] at a fixed width."""
    layers = []
    for _ in range(blocks):
        layers += [
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.GroupNorm(groups, channels),
            nn.SiLU(),
        ]
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class ModelSpec:
    """A reference model at one size: ``kind`` "conv_stack" or "unet" (``credit_parallel.models``)."""

    kind: str
    size: str
    channels: int
    height: int
    width: int
    batch: int = 1
    blocks: int = 4  # conv_stack
    groups: int = 8  # GroupNorm groups
    base_channels: int = 16  # unet
    channel_mults: tuple = (1, 2, 2)  # unet

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.size}"

    def describe(self) -> str:
        if self.kind == "conv_stack":
            return (
                f"conv_stack {self.size}: {self.blocks} x [conv3x3 p1, GroupNorm({self.groups}), "
                f"SiLU], C={self.channels}, {self.height}x{self.width}, batch {self.batch}"
            )
        return (
            f"unet {self.size}: in/out {self.channels}, {self.height}x{self.width}, base "
            f"{self.base_channels} x {list(self.channel_mults)}, GroupNorm({self.groups}), "
            f"batch {self.batch}"
        )

    def build(self) -> nn.Module:
        if self.kind == "conv_stack":
            return build_conv_stack(self.channels, self.blocks, self.groups)
        if self.kind == "unet":
            from ...models import UNet

            return UNet(
                self.channels,
                self.channels,
                self.height,
                self.width,
                base_channels=self.base_channels,
                channel_mults=self.channel_mults,
                norm_groups=self.groups,
            )
        raise ValueError(f"unknown benchmark model kind {self.kind!r} (conv_stack, unet)")

    @property
    def input_shape(self) -> tuple:
        """Per-sample input (and output) shape, C x H x W."""
        return (self.channels, self.height, self.width)

    @property
    def has_tensor_parallel(self) -> bool:
        return self.kind == "unet"


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one run; ranks are laid out row-major over (dp, tp, domain)."""

    dp: int = 1
    tp: int = 1
    domain: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.domain

    @property
    def data(self) -> str:
        if self.dp == 1:
            return "none"
        return "ddp" if self.tp == 1 else "fsdp2"

    @property
    def name(self) -> str:
        return f"dp{self.dp} tp{self.tp} d{self.domain}"

    def conf(self, batch: int) -> dict:
        return {
            "trainer": {
                "parallelism": {"data": self.data, "tensor": self.tp, "domain": self.domain},
                "batch_size": batch,
            }
        }


def default_models(quick: bool = False) -> list[ModelSpec]:
    if quick:
        return [
            ModelSpec("conv_stack", "tiny", channels=8, height=24, width=32, blocks=2, groups=2),
            ModelSpec(
                "unet",
                "tiny",
                channels=4,
                height=17,
                width=16,
                base_channels=8,
                groups=2,
                channel_mults=(1, 2),
            ),
        ]
    return [
        ModelSpec("conv_stack", "small", channels=32, height=96, width=192),
        ModelSpec("conv_stack", "large", channels=64, height=192, width=384),
        ModelSpec("unet", "small", channels=8, height=33, width=64, base_channels=16, groups=4),
        ModelSpec("unet", "large", channels=8, height=97, width=192, base_channels=32, groups=4),
    ]


def default_layouts(quick: bool = False) -> list[Layout]:
    if quick:
        return [Layout(), Layout(domain=2), Layout(tp=2), Layout(dp=2)]
    return [
        Layout(),
        Layout(domain=2),
        Layout(domain=4),
        Layout(tp=2),
        Layout(tp=2, domain=2),
        Layout(dp=2),
        Layout(dp=2, domain=2),
    ]
