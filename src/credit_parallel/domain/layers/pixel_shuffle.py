"""Domain-parallel PixelShuffle / PixelUnshuffle: the output in the balanced layout of its own
global height, each rank exchanging exactly the input rows its output rows read."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..exchange.halo import exchange_rows
from ..manager import resolve_manager
from ..rows import pure_cached, shard_range
from ..wrap import DomainWrapper

__all__ = [
    "DomainParallelPixelShuffle",
    "DomainParallelPixelUnshuffle",
    "pixel_shuffle_windows",
    "pixel_unshuffle_windows",
]


# --------------------------------------------------------------------------- pixel (un)shuffle
def _check_height_dim(x: torch.Tensor, what: str) -> None:
    if x.dim() < 3:
        raise ValueError(f"{what}: needs an input of at least 3 dims (..., C, H, W), got {x.dim()}")


@pure_cached(maxsize=1024)
def pixel_shuffle_windows(in_h: int, n: int, r: int) -> tuple:
    """Input rows of each rank's balanced share of the ``in_h * r`` output rows of
    PixelShuffle(r) (output row o reads input row o // r)."""
    windows = []
    for rank in range(n):
        o0, o1 = shard_range(in_h * r, n, rank)
        windows.append(tuple(range(o0 // r, (o1 - 1) // r + 1)) if o1 > o0 else ())
    return tuple(windows)


@pure_cached(maxsize=1024)
def pixel_unshuffle_windows(in_h: int, n: int, r: int) -> tuple:
    """Input rows of each rank's share of the ``in_h // r`` output rows of PixelUnshuffle(r)
    (output row o reads rows o*r .. o*r+r-1)."""
    out_h = in_h // r
    return tuple(
        tuple(range(o0 * r, o1 * r)) for o0, o1 in (shard_range(out_h, n, k) for k in range(n))
    )


class DomainParallelPixelShuffle(DomainWrapper):
    """Domain-parallel ``nn.PixelShuffle(r)``: output row o reads input row o // r; each rank
    gathers the input rows its balanced share of the ``H * r`` output rows needs."""

    domain_form = "halo"
    domain_kind = "pixel_shuffle"
    tile_exact = True  # exact on lat x lon tiles too (_forward_tile)

    def __init__(self, module: nn.PixelShuffle, *, manager=None):
        if not isinstance(module, nn.PixelShuffle):
            raise TypeError(
                f"DomainParallelPixelShuffle wraps an nn.PixelShuffle, got {type(module).__name__}"
            )
        super().__init__(module)
        self.upscale_factor = int(module.upscale_factor)
        self.manager = manager

    # ---- geometry (domain/geometry.py)
    def output_height(self, input_height: int) -> int:
        return input_height * self.upscale_factor

    def input_windows(self, input_height: int, n: int) -> tuple:
        return pixel_shuffle_windows(input_height, n, self.upscale_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_height_dim(x, "DomainParallelPixelShuffle")
        mgr = resolve_manager(self.manager, "DomainParallelPixelShuffle")
        if getattr(mgr, "is_tiled", False):  # a lat x lon tile (SPEC §3b)
            return self._forward_tile(x, mgr)
        n, r = mgr.domain_world_size, self.upscale_factor
        dim = x.dim() - 2
        in_h = mgr.global_length(self, x.shape[dim])
        windows = self.input_windows(in_h, n)
        window = exchange_rows(x, windows, in_h, dim, mgr)
        y = F.pixel_shuffle(window, r)
        o0, o1 = shard_range(in_h * r, n, mgr.domain_rank)
        if o0 == o1:  # an empty shard: no output row, an empty window
            return y
        return y.narrow(dim, o0 - windows[mgr.domain_rank][0] * r, o1 - o0)

    def _forward_tile(self, x: torch.Tensor, mgr) -> torch.Tensor:
        """On a lat x lon tile: the input rows of the owned output rows over the latitude
        ranks, then the input columns of the owned output columns (the same rule) over the
        longitude ranks; the shuffle of that window, cropped to the owned outputs."""
        r = self.upscale_factor
        crops = []
        for axis, dim, length in _tile_axes(self, x, mgr):
            n, rank = axis.domain_world_size, axis.domain_rank
            windows = pixel_shuffle_windows(length, n, r)
            x = exchange_rows(x, windows, length, dim, axis)
            o0, o1 = shard_range(length * r, n, rank)
            crops.append((dim, o0 - windows[rank][0] * r if o1 > o0 else 0, o1 - o0))
        y = F.pixel_shuffle(x, r)
        for dim, first, count in crops:
            y = y.narrow(dim, first, count)
        return y

    def extra_repr(self) -> str:
        return f"upscale_factor={self.upscale_factor}"


class DomainParallelPixelUnshuffle(DomainWrapper):
    """Domain-parallel ``nn.PixelUnshuffle(r)``: output row o reads input rows o*r .. o*r+r-1;
    the global height must be divisible by r."""

    domain_form = "halo"
    domain_kind = "pixel_unshuffle"
    tile_exact = True  # exact on lat x lon tiles too (_forward_tile)

    def __init__(self, module: nn.PixelUnshuffle, *, manager=None):
        if not isinstance(module, nn.PixelUnshuffle):
            raise TypeError(
                "DomainParallelPixelUnshuffle wraps an nn.PixelUnshuffle, got "
                f"{type(module).__name__}"
            )
        super().__init__(module)
        self.downscale_factor = int(module.downscale_factor)
        self.manager = manager

    # ---- geometry (domain/geometry.py)
    def output_height(self, input_height: int) -> int:
        r = self.downscale_factor
        if input_height % r:
            raise ValueError(
                f"DomainParallelPixelUnshuffle(downscale_factor={r}): the global height "
                f"{input_height} is not divisible by {r}; pad or crop the height to a multiple of {r}"
            )
        return input_height // r

    def input_windows(self, input_height: int, n: int) -> tuple:
        self.output_height(input_height)  # the divisibility check
        return pixel_unshuffle_windows(input_height, n, self.downscale_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_height_dim(x, "DomainParallelPixelUnshuffle")
        mgr = resolve_manager(self.manager, "DomainParallelPixelUnshuffle")
        if getattr(mgr, "is_tiled", False):  # a lat x lon tile (SPEC §3b)
            return self._forward_tile(x, mgr)
        n, r = mgr.domain_world_size, self.downscale_factor
        dim = x.dim() - 2
        in_h = mgr.global_length(self, x.shape[dim])
        window = exchange_rows(x, self.input_windows(in_h, n), in_h, dim, mgr)
        if window.shape[dim] == 0:
            # an empty shard (F.pixel_unshuffle returns an empty input unchanged); a reshape
            # keeps it attached to the graph
            *lead, c, _, w = window.shape
            return window.reshape(*lead, c * r * r, 0, w // r)
        return F.pixel_unshuffle(window, r)

    def _forward_tile(self, x: torch.Tensor, mgr) -> torch.Tensor:
        """On a lat x lon tile: the input rows, then the input columns, of the owned outputs
        (global height and width divisible by r), unshuffled."""
        r = self.downscale_factor
        for axis, dim, length in _tile_axes(self, x, mgr):
            if length % r:
                what = "height" if axis is mgr.lat else "width"
                raise ValueError(
                    f"DomainParallelPixelUnshuffle(downscale_factor={r}): the global {what} "
                    f"{length} is not divisible by {r}"
                )
            windows = pixel_unshuffle_windows(length, axis.domain_world_size, r)
            x = exchange_rows(x, windows, length, dim, axis)
        if x.shape[-2] == 0 or x.shape[-1] == 0:  # an empty tile: keep it on the graph
            *lead, c, h, w = x.shape
            return x.reshape(*lead, c * r * r, h // r, w // r)
        return F.pixel_unshuffle(x, r)

    def extra_repr(self) -> str:
        return f"downscale_factor={self.downscale_factor}"


def _tile_axes(layer, x: torch.Tensor, mgr):
    """(axis manager, dim, global length) of the rows and of the columns of a tile."""
    dim_h, dim_w = x.dim() - 2, x.dim() - 1
    return (
        (mgr.lat, dim_h, mgr.global_height(layer, x.shape[dim_h])),
        (mgr.lon, dim_w, mgr.global_width(layer, x.shape[dim_w])),
    )
