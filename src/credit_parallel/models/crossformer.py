"""A CrossFormer / WXFormer-style encoder-decoder with short- and long-distance window attention.

Each encoder level starts with a cross-scale embedding (several ``nn.Conv2d`` with different
kernels and the same stride, concatenated on channels), followed by transformer blocks of
window attention and a 1x1-conv feed-forward. Blocks alternate between short-distance windows
(``window_size`` contiguous rows by ``window_size`` contiguous columns) and long-distance
windows, whose rows and columns are sampled at intervals of h / window_size and
w / window_size across the whole globe (CREDIT's ``attn_type="long"``), so a long-distance
window reaches from pole to pole. Neither is row-local; both declare their structure
(``_domain_attention``) and the domain-parallel converter makes them exact for any shard
layout: short windows are re-laid out so each rank holds whole windows, long-distance groups
are regrouped so each rank holds whole groups (``credit_parallel.domain.attention``). The
decoder up-samples with transposed convs (GroupNorm, SiLU), concatenates the skip connections,
and ends with a periodic 3x3 conv.

There is no learned relative-position bias: a parameter used inside the tensor-parallel region
but not split by heads would receive only partial gradients per tensor-parallel rank. Position
information enters through the convolutional embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from credit_parallel.models.layers import (
    AttentionBlock,
    ChannelLayerNorm,
    check_int_tuple,
    check_positive_int,
    group_norm,
)
from credit_parallel.models.periodic import PeriodicConv2d

__all__ = [
    "CrossFormer",
    "CrossFormerBlock",
    "CrossScaleEmbedding",
    "UpBlock",
    "WindowAttention",
]


class WindowAttention(nn.Module):
    """Multi-head self-attention within windows of ``window_size`` x ``window_size`` pixels.

    Input and output (B, C, h, w); h and w must be multiples of ``window_size``. With
    ``long_range=False`` a window is a contiguous block; with ``long_range=True`` its rows are
    r, r + h/ws, r + 2h/ws, ... and its columns c, c + w/ws, ... (spread over the whole grid).

    Domain parallelism: ``_domain_attention`` tells the converter which rows a window holds
    (contiguous windows, or strided groups laid out ``(ws, h/ws)``), so it runs this unmodified
    forward on whole windows per rank.

    Tensor parallelism: ``to_qkv`` (fused q, k, v) is column-parallel, ``to_out`` row-parallel;
    the number of heads is derived from the width of the local projection output, so a rank that
    holds a subset of whole heads computes exactly those heads.
    """

    _tp_col = "to_qkv"
    _tp_row = "to_out"
    _tp_fused = {"to_qkv": 3}

    @property
    def _domain_attention(self) -> dict:
        return {"form": "strided" if self.long_range else "windows", "rows": self.window_size}

    def __init__(self, dim: int, dim_head: int, window_size: int, long_range: bool = False) -> None:
        super().__init__()
        if dim % dim_head:
            raise ValueError(f"dim_head={dim_head} does not divide the level width dim={dim}")
        self.dim_head = dim_head
        self._tp_head_dim = dim_head
        self.window_size = window_size
        self.long_range = long_range
        self.scale = dim_head**-0.5
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1, bias=False)
        self.to_out = nn.Conv2d(dim, dim, 1)

    # Window partition of a (B, heads*d, h, w) tensor into (B, heads, nr, nc, ws*ws, d): short
    # windows split H = (nr, ws) and W = (nc, ws); long ones H = (ws, nr) and W = (ws, nc) (a
    # window's rows are r, r + nr, ...). _PERM reorders to (b, heads, nr, nc, wr, wc, d).
    _PERM = {False: (0, 1, 3, 5, 4, 6, 2), True: (0, 1, 4, 6, 3, 5, 2)}

    def _to_windows(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        b, c, h, w = t.shape
        ws = self.window_size
        nr, nc = h // ws, w // ws
        rows, cols = ((ws, nr), (ws, nc)) if self.long_range else ((nr, ws), (nc, ws))
        t = t.reshape(b, heads, c // heads, *rows, *cols).permute(self._PERM[self.long_range])
        return t.reshape(b, heads, nr, nc, ws * ws, c // heads)

    def _from_windows(self, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, heads, nr, nc, _, d = t.shape
        ws = self.window_size
        perm = self._PERM[self.long_range]
        inverse = tuple(perm.index(i) for i in range(len(perm)))
        t = t.reshape(b, heads, nr, nc, ws, ws, d).permute(inverse)
        return t.reshape(b, heads * d, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under domain parallelism h is the height of the whole windows this rank holds
        _, _, h, w = x.shape
        ws = self.window_size
        if h % ws or w % ws:
            raise ValueError(
                f"WindowAttention: the (local) grid {h} x {w} is not a multiple of window_size={ws}"
            )
        q, k, v = self.to_qkv(x).chunk(3, dim=1)
        heads = q.shape[1] // self.dim_head
        q, k, v = (self._to_windows(t, heads) for t in (q, k, v))
        attn = torch.softmax((q @ k.transpose(-2, -1)) * self.scale, dim=-1)
        return self.to_out(self._from_windows(attn @ v, h, w))


class CrossFormerBlock(AttentionBlock):
    """Pre-norm transformer block: window attention and 1x1-conv feed-forward, both residual."""

    def __init__(
        self, dim: int, dim_head: int, window_size: int, long_range: bool, mlp_ratio: int
    ) -> None:
        super().__init__(dim, WindowAttention(dim, dim_head, window_size, long_range), mlp_ratio)


class CrossScaleEmbedding(nn.Module):
    """Convs with several kernel sizes and one stride, concatenated on channels, then LayerNorm.

    Padding (k - stride) // 2 with (k - stride) even gives every branch the output size
    ceil-free ``size / stride`` when the size is a multiple of the stride. Smaller kernels get
    more channels (half the width to the first, a quarter to the next, ...).
    """

    _fsdp2_shard = True

    def __init__(self, dim_in: int, dim_out: int, kernel_sizes: Sequence[int], stride: int):
        super().__init__()
        n = len(kernel_sizes)
        widths = [dim_out // 2 ** (i + 1) for i in range(n - 1)]
        widths.append(dim_out - sum(widths))
        if min(widths) < 1:
            raise ValueError(
                f"embed_kernels: {n} kernels cannot share the {dim_out} channels of a level"
            )
        self.convs = nn.ModuleList(
            nn.Conv2d(dim_in, width, k, stride=stride, padding=(k - stride) // 2)
            for k, width in zip(kernel_sizes, widths)
        )
        self.norm = ChannelLayerNorm(dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.cat([conv(x) for conv in self.convs], dim=1))


class UpBlock(nn.Module):
    """Transposed conv (exact factor ``stride`` up-sampling), GroupNorm, SiLU."""

    _fsdp2_shard = True

    def __init__(
        self, dim_in: int, dim_out: int, stride: int, wide_kernel: bool, norm_groups: int
    ) -> None:
        super().__init__()
        if wide_kernel and stride % 2 == 0:
            # kernel 2s, padding s/2: out = (n - 1) s - s + 2 s = n s, overlapping taps.
            kernel, padding = 2 * stride, stride // 2
        else:
            kernel, padding = stride, 0
        self.conv = nn.ConvTranspose2d(dim_in, dim_out, kernel, stride=stride, padding=padding)
        self.norm = group_norm(norm_groups, dim_out)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


class CrossFormer(nn.Module):
    """CrossFormer-style model for (B, in_channels, H, W) -> (B, out_channels, H, W).

    Args:
        in_channels, out_channels: channel counts of input and output.
        image_height, image_width: the global grid; both must be multiples of the total stride
            ``level_strides[-1]``, and each level's size a multiple of its window size.
        dims: channels of each encoder level.
        depths: transformer blocks per level (alternating short / long-distance windows).
        dim_head: channels per attention head (heads = dims[i] // dim_head).
        window_sizes: attention window (rows = cols) per level.
        embed_kernels: kernel sizes of each level's cross-scale embedding; (k - stride) even.
        embed_strides: down-sampling stride of each level's embedding.
        mlp_ratio: feed-forward hidden width in multiples of the level width.
        norm_groups: GroupNorm groups of the decoder; must divide dims.

    Attributes read by ``validate_sharding_constraints``: ``window_sizes`` (list, per level) and
    ``level_strides`` (list: cumulative down-sampling of each level relative to the input).
    The converter makes any shard layout exact (``WindowAttention._domain_attention``: windows
    re-laid out, long-distance groups regrouped); the planner still reports shards that are not
    multiples of the windows, where aligned shards would move no rows.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        image_height: int,
        image_width: int,
        dims: Sequence[int] = (32, 64),
        depths: Sequence[int] = (2, 2),
        dim_head: int = 8,
        window_sizes: Sequence[int] = (4, 4),
        embed_kernels: Sequence[Sequence[int]] = ((2, 4), (2, 4)),
        embed_strides: Sequence[int] = (2, 2),
        mlp_ratio: int = 4,
        norm_groups: int = 4,
    ) -> None:
        super().__init__()
        in_channels = check_positive_int("in_channels", in_channels)
        out_channels = check_positive_int("out_channels", out_channels)
        image_height = check_positive_int("image_height", image_height)
        image_width = check_positive_int("image_width", image_width)
        dims = check_int_tuple("dims", dims)
        n_levels = len(dims)
        depths = check_int_tuple("depths", depths, n_levels)
        dim_head = check_positive_int("dim_head", dim_head)
        window_sizes = check_int_tuple("window_sizes", window_sizes, n_levels)
        embed_strides = check_int_tuple("embed_strides", embed_strides, n_levels)
        if isinstance(embed_kernels, (str, bytes)) or len(embed_kernels) != n_levels:
            raise ValueError(
                f"embed_kernels must hold one list of kernel sizes per level ({n_levels}), "
                f"got {embed_kernels!r}"
            )
        embed_kernels = tuple(
            check_int_tuple(f"embed_kernels[{i}]", ks) for i, ks in enumerate(embed_kernels)
        )
        mlp_ratio = check_positive_int("mlp_ratio", mlp_ratio)
        norm_groups = check_positive_int("norm_groups", norm_groups)

        for i, (kernels, stride) in enumerate(zip(embed_kernels, embed_strides)):
            for k in kernels:
                if k < stride or (k - stride) % 2:
                    raise ValueError(
                        f"embed_kernels[{i}] has kernel {k} for embed_strides[{i}]={stride}: "
                        "each kernel must be >= the stride with (kernel - stride) even, so all "
                        "branches produce the same size"
                    )
        for i, d in enumerate(dims):
            if d % dim_head:
                raise ValueError(f"dim_head={dim_head} does not divide dims[{i}]={d}")

        level_strides = []
        total = 1
        for s in embed_strides:
            total *= s
            level_strides.append(total)
        for name, size in (("image_height", image_height), ("image_width", image_width)):
            if size % total:
                raise ValueError(
                    f"{name}={size} is not a multiple of the total down-sampling {total} "
                    f"(product of embed_strides {list(embed_strides)})"
                )
            for i, (stride, ws) in enumerate(zip(level_strides, window_sizes)):
                if (size // stride) % ws:
                    raise ValueError(
                        f"{name}={size} gives {size // stride} at level {i} (stride {stride}), "
                        f"not a multiple of window_sizes[{i}]={ws}"
                    )

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.image_height = image_height
        self.image_width = image_width
        self.window_sizes = list(window_sizes)
        self.level_strides = level_strides

        self.embeddings = nn.ModuleList()
        self.levels = nn.ModuleList()
        channels = in_channels
        for i, dim in enumerate(dims):
            self.embeddings.append(
                CrossScaleEmbedding(channels, dim, embed_kernels[i], embed_strides[i])
            )
            self.levels.append(
                nn.Sequential(
                    *(
                        CrossFormerBlock(dim, dim_head, window_sizes[i], j % 2 == 1, mlp_ratio)
                        for j in range(depths[i])
                    )
                )
            )
            channels = dim

        # Decoder: level i -> level i-1 (+ that level's features), then the input grid (+ input)
        self.up_blocks = nn.ModuleList()
        for i in reversed(range(1, n_levels)):
            self.up_blocks.append(
                UpBlock(channels, dims[i - 1], embed_strides[i], True, norm_groups)
            )
            channels = 2 * dims[i - 1]
        self.up_blocks.append(UpBlock(channels, dims[0], embed_strides[0], False, norm_groups))
        self.head = PeriodicConv2d(dims[0] + in_channels, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on a lat x lon tile (SPEC §3b) the input holds some of the columns only
        tiled = getattr(vars(self).get("_domain_manager"), "is_tiled", False)
        if x.shape[1] != self.in_channels or (x.shape[-1] != self.image_width and not tiled):
            raise ValueError(
                f"CrossFormer expects (B, {self.in_channels}, H, {self.image_width}) "
                f"(built for a {self.image_height} x {self.image_width} grid), got {tuple(x.shape)}"
            )
        features = []
        h = x
        for embed, blocks in zip(self.embeddings, self.levels):
            h = blocks(embed(h))
            features.append(h)
        h = features.pop()
        for up in self.up_blocks[:-1]:
            h = torch.cat([up(h), features.pop()], dim=1)
        h = self.up_blocks[-1](h)
        return self.head(torch.cat([h, x], dim=1))
