"""The periodic convolution of global lat-lon grids.

Longitude wraps around the globe, so the W axis is padded circularly; at the poles the H axis is
padded by reflection (row -1 is row 1, row H is row H-2), which keeps the field continuous across
the pole row instead of inventing a zero band. The padding is done inside ``forward`` with
``F.pad``: this is the one place in the models allowed to pad over H in a forward, because the
domain-parallel converter replaces the whole ``PeriodicConv2d`` (it reads ``.conv`` and
``.padding``) rather than looking inside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PeriodicConv2d"]


class PeriodicConv2d(nn.Module):
    """``nn.Conv2d`` on a lat-lon grid: circular padding on W, reflect padding on H.

    Attributes (the contract the domain-parallel converter relies on):
        conv: the wrapped ``nn.Conv2d`` with ``padding=0``; it holds all parameters.
        padding: the number of rows/columns padded on each side (an int).

    The reflect padding needs H > padding and the circular padding W >= padding.
    """

    def __init__(
        self,
        dim_in: int,
        dim_out: int,
        kernel_size: int,
        padding: int = 1,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"PeriodicConv2d: padding must be an int >= 0, got {padding!r}")
        self.padding = padding
        self.conv = nn.Conv2d(dim_in, dim_out, kernel_size, padding=0, bias=bias)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """The padded input the convolution sees (circular on W, reflect on H)."""
        p = self.padding
        if p == 0:
            return x
        # The two paddings act on different axes and commute; the corners hold x[1, W-1] etc.
        x = F.pad(x, (p, p, 0, 0), mode="circular")
        return F.pad(x, (0, 0, p, p), mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pad(x))

    def extra_repr(self) -> str:
        return f"padding={self.padding} (circular W, reflect H)"
