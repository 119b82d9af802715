"""A Swin / FuXi-style model: patch embedding, shifted-window transformer blocks, transposed-conv
decoder.

Blocks alternate plain windows and windows shifted by half a window (Swin's cyclic shift:
``torch.roll`` over H and W). Longitude is periodic, so the roll over W wraps physically; over
latitude the rolled windows at the bottom hold rows from both poles, and a mask built from the
windows' GLOBAL row indices keeps the two parts apart (two rows attend to each other only if they
are consecutive rows of the globe inside the window). ``ShiftedWindowAttention`` declares this
structure (``_domain_attention`` with ``"entry": "forward_rows"``), so the domain-parallel
converter performs the roll over H as part of a row exchange and calls ``forward_rows`` with the
global rows each rank holds: exact for any shard layout.
"""

from __future__ import annotations

import torch
from torch import nn

from credit_parallel.models.layers import (
    AttentionBlock,
    check_positive_int,
    group_norm,
)
from credit_parallel.models.periodic import PeriodicConv2d

__all__ = ["ShiftedWindowAttention", "SwinBlock", "SwinNet"]


def row_segments(rows: torch.Tensor) -> torch.Tensor:
    """Segment id per held row: a new segment starts where the next global row is not the
    previous one plus one (the pole-to-pole seam of a cyclic shift)."""
    breaks = torch.ones_like(rows, dtype=torch.long)
    breaks[0] = 0
    breaks[1:] = (rows[1:] != rows[:-1] + 1).long()
    return torch.cumsum(breaks, 0)


class ShiftedWindowAttention(nn.Module):
    """Multi-head attention within ``window_size`` x ``window_size`` windows of a grid rolled by
    ``-shift`` in both directions (``shift = 0``: plain windows)."""

    _tp_col = "to_qkv"
    _tp_row = "to_out"
    _tp_fused = {"to_qkv": 3}

    def __init__(self, dim: int, dim_head: int, window_size: int, shift: int) -> None:
        super().__init__()
        if dim % dim_head:
            raise ValueError(f"dim_head={dim_head} does not divide dim={dim}")
        if not 0 <= shift < window_size:
            raise ValueError(f"shift={shift} must lie in [0, window_size={window_size})")
        self.dim_head, self._tp_head_dim = dim_head, dim_head
        self.window_size, self.shift = window_size, shift
        self.scale = dim_head**-0.5
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1, bias=False)
        self.to_out = nn.Conv2d(dim, dim, 1)

    @property
    def _domain_attention(self) -> dict:
        if self.shift == 0:
            return {"form": "windows", "rows": self.window_size}
        return {
            "form": "shifted_windows",
            "rows": self.window_size,
            "shift": self.shift,
            "entry": "forward_rows",
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-2]
        rows = (torch.arange(h, device=x.device) + self.shift) % h
        y = self.forward_rows(torch.roll(x, -self.shift, dims=-2), rows)
        return torch.roll(y, self.shift, dims=-2)

    def forward_rows(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Attention on rows already rolled over H: ``x`` holds whole windows, ``rows`` their
        global row indices (what a domain rank holds)."""
        b, _, h, w = x.shape
        ws, s = self.window_size, self.shift
        if h % ws or w % ws:
            raise ValueError(
                f"ShiftedWindowAttention: the grid {h} x {w} is not a multiple of window_size={ws}"
            )
        q, k, v = self.to_qkv(torch.roll(x, -s, dims=-1)).chunk(3, dim=1)
        heads, d = q.shape[1] // self.dim_head, self.dim_head
        nr, nc = h // ws, w // ws

        def windows(t):  # (b, heads*d, h, w) -> (b, heads, nr, nc, ws*ws, d)
            t = t.reshape(b, heads, d, nr, ws, nc, ws).permute(0, 1, 3, 5, 4, 6, 2)
            return t.reshape(b, heads, nr, nc, ws * ws, d)

        q, k, v = windows(q), windows(k), windows(v)
        seg = row_segments(rows.to(x.device)).reshape(nr, ws, 1).expand(nr, ws, ws)
        seg = seg.reshape(nr, 1, ws * ws)  # per token of a window: its row's segment
        allowed = (seg.unsqueeze(-1) == seg.unsqueeze(-2)).unsqueeze(0).unsqueeze(0)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # (b, heads, nr, nc, ws*ws, d)
        out = out.reshape(b, heads, nr, nc, ws, ws, d).permute(0, 1, 6, 2, 4, 3, 5)
        out = torch.roll(out.reshape(b, heads * d, h, w), s, dims=-1)
        return self.to_out(out)


class SwinBlock(AttentionBlock):
    """Pre-norm block: (shifted-)window attention and a 1x1-conv feed-forward, both residual."""

    def __init__(self, dim: int, dim_head: int, window_size: int, shift: int, mlp_ratio: int):
        super().__init__(dim, ShiftedWindowAttention(dim, dim_head, window_size, shift), mlp_ratio)


class SwinNet(nn.Module):
    """(B, in_channels, H, W) -> (B, out_channels, H, W): a ``patch`` x ``patch`` embedding,
    ``depth`` Swin blocks (even ones plain windows, odd ones shifted by ``window_size // 2``),
    a transposed-conv decoder back to the input grid, and a periodic 3x3 head on the decoded
    features concatenated with the input (FuXi's U-shaped skip in one level).

    ``image_height`` / ``image_width`` must be multiples of ``patch * window_size``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        image_height: int,
        image_width: int,
        dim: int = 32,
        depth: int = 2,
        dim_head: int = 8,
        window_size: int = 4,
        patch: int = 2,
        mlp_ratio: int = 4,
        norm_groups: int = 4,
    ) -> None:
        super().__init__()
        names = ("in_channels", "out_channels", "image_height", "image_width", "dim", "depth")
        values = (in_channels, out_channels, image_height, image_width, dim, depth)
        for name, value in zip(names, values):
            check_positive_int(name, value)
        for name, value in (("dim_head", dim_head), ("window_size", window_size)):
            check_positive_int(name, value)
        for name, value in (("patch", patch), ("mlp_ratio", mlp_ratio)):
            check_positive_int(name, value)
        for name, size in (("image_height", image_height), ("image_width", image_width)):
            if size % (patch * window_size):
                raise ValueError(
                    f"{name}={size} is not a multiple of patch x window_size = "
                    f"{patch} x {window_size}"
                )
        if dim % dim_head:
            raise ValueError(f"dim_head={dim_head} does not divide dim={dim}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.image_height, self.image_width = image_height, image_width
        self.embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        shifts = [0 if i % 2 == 0 else window_size // 2 for i in range(depth)]
        self.blocks = nn.Sequential(
            *(SwinBlock(dim, dim_head, window_size, s, mlp_ratio) for s in shifts)
        )
        self.up = nn.Sequential(
            nn.ConvTranspose2d(dim, dim, patch, stride=patch),
            group_norm(norm_groups, dim),
            nn.SiLU(),
        )
        self.head = PeriodicConv2d(dim + in_channels, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on a lat x lon tile (SPEC §3b) the input holds some of the columns only
        tiled = getattr(vars(self).get("_domain_manager"), "is_tiled", False)
        if x.shape[1] != self.in_channels or (x.shape[-1] != self.image_width and not tiled):
            raise ValueError(
                f"SwinNet expects (B, {self.in_channels}, H, {self.image_width}), got "
                f"{tuple(x.shape)}"
            )
        h = self.up(self.blocks(self.embed(x)))
        return self.head(torch.cat([h, x], dim=1))
