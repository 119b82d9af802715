"""Modules not exact on lat x lon tiles, made exact by a relayout to latitude strips and back.

Windowed / shifted-window / long-distance / sequence / token attention, the FuXi and Swin
adapters, the gather policy and modules that are only row-local are exact on 1-D latitude
strips (their domain layers over a 1-D manager).  On a P x Q tile layout,
:class:`TileStripRelayout` runs such a module's 1-D replacement unchanged:

1. one all-to-all over the flattened domain group re-lays the input from the tiles (rows
   ``shard_range(H, P, lat)`` x columns ``shard_range(W, Q, lon)``) into the balanced 1-D
   layout over all P x Q ranks (domain rank r: rows ``shard_range(H, P*Q, r)``, every column);
2. the 1-D replacement runs on the strip under ``manager.strips`` (a 1-D manager over the
   flattened group, ``manager.py``): its exchanges and heights are those of a 1-D domain;
3. one all-to-all re-lays the output (of its own global height and width, e.g. H + 2p x W + 2p
   after a padding) back to tiles.

Both moves are permutations of the elements, so the backward of each is the other move
(:class:`_MoveBlocks`).  The cost: two all-to-alls per wrapped module (each rank sends every
element of its tile that another rank's strip holds: :func:`moved_elements`), and a strip holds
as many elements as a tile (both are balanced shares of H x W).
"""

from __future__ import annotations

import torch
from torch import nn

from .exchange.ops import all_to_all_traced
from .exchange.p2p import PendingExchange, post_messages
from .manager import resolve_manager
from .rows import shard_range
from .wrap import DomainWrapper

__all__ = [
    "TileStripRelayout",
    "move_blocks",
    "moved_elements",
    "moved_peers",
    "strip_rects",
    "tile_rects",
]


# --------------------------------------------------------------------------- pure layout
def tile_rects(height: int, width: int, shape: tuple[int, int]) -> list:
    """``((row start, stop), (column start, stop))`` of every tile, by domain rank lat*Q + lon."""
    p, q = shape
    return [
        (shard_range(height, p, lat), shard_range(width, q, lon))
        for lat in range(p)
        for lon in range(q)
    ]


def strip_rects(height: int, width: int, n: int) -> list:
    """The same for the balanced latitude strips of ``n`` ranks (every column)."""
    return [(shard_range(height, n, r), (0, width)) for r in range(n)]


def _overlap(a, b):
    """The rectangle common to ``a`` and ``b`` (global rows, columns), or None."""
    (r0, r1), (c0, c1) = a
    (s0, s1), (d0, d1) = b
    rows, cols = (max(r0, s0), min(r1, s1)), (max(c0, d0), min(c1, d1))
    if rows[1] <= rows[0] or cols[1] <= cols[0]:
        return None
    return rows, cols


def moved_elements(src: list, dst: list) -> list[int]:
    """Per rank, the (rows x columns) elements it sends to other ranks moving from the layout
    ``src`` to ``dst`` (multiply by the other dims and the item size for bytes)."""
    out = []
    for me, mine in enumerate(src):
        total = 0
        for q, theirs in enumerate(dst):
            block = _overlap(mine, theirs) if q != me else None
            if block is not None:
                total += (block[0][1] - block[0][0]) * (block[1][1] - block[1][0])
        out.append(total)
    return out


def moved_peers(src: list, dst: list) -> list[int]:
    """Per rank, the messages it sends moving from ``src`` to ``dst`` (one per other rank
    whose rectangle overlaps its own)."""
    return [
        sum(1 for q, theirs in enumerate(dst) if q != me and _overlap(mine, theirs) is not None)
        for me, mine in enumerate(src)
    ]


# --------------------------------------------------------------------------- the move
def _local(block, rect, x, hdim, wdim):
    """The part of ``x`` (holding ``rect``) covering the global ``block``."""
    (r0, r1), (c0, c1) = block
    return x.narrow(hdim, r0 - rect[0][0], r1 - r0).narrow(wdim, c0 - rect[1][0], c1 - c0)


def _shape(like, hdim, wdim, block):
    shape = list(like.shape)
    shape[hdim], shape[wdim] = block[0][1] - block[0][0], block[1][1] - block[1][0]
    return shape


def _assemble(pieces: list, hdim: int, wdim: int):
    """The received blocks (``(global block, tensor)``, a product grid) joined: columns first
    within each band of rows, then the bands."""
    bands: dict = {}
    for block, t in pieces:
        bands.setdefault(block[0], []).append((block[1], t))
    rows = []
    for key in sorted(bands):
        parts = [t for _, t in sorted(bands[key], key=lambda item: item[0])]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, wdim))
    return rows[0] if len(rows) == 1 else torch.cat(rows, hdim)


def _blocks(src, dst, me):
    """(q, block) this rank sends / receives moving from ``src`` to ``dst``."""
    sends = [(q, b) for q, r in enumerate(dst) if (b := _overlap(src[me], r)) is not None]
    recvs = [(q, b) for q, r in enumerate(src) if (b := _overlap(r, dst[me])) is not None]
    return sends, recvs


def _move_eager(x, src, dst, hdim, wdim, ranks, me, group, direction):
    sends, recvs = _blocks(src, dst, me)
    out_msgs, in_bufs, pieces = [], [], []
    for q, block in sends:
        part = _local(block, src[me], x, hdim, wdim)
        if q == me:
            pieces.append((block, part))
        else:
            out_msgs.append((ranks[q], part.contiguous()))
    for q, block in recvs:
        if q != me:
            buf = x.new_empty(_shape(x, hdim, wdim, block))
            in_bufs.append((ranks[q], buf))
            pieces.append((block, buf))
    works, posted_s = post_messages(out_msgs, in_bufs, group, direction, overlapped=False)
    PendingExchange(works, direction, None, posted_s=posted_s, group=group).wait()
    if not pieces:  # an empty rectangle (fewer rows than ranks)
        return x.new_zeros(_shape(x, hdim, wdim, dst[me]))
    return _assemble(pieces, hdim, wdim).contiguous()


class _MoveBlocks(torch.autograd.Function):
    """Move a tensor from the rectangle layout ``src`` to ``dst`` (forward) and its gradient
    back from ``dst`` to ``src`` (backward: the same permutation inverted)."""

    @staticmethod
    def forward(ctx, x, src, dst, hdim, wdim, ranks, me, group):
        ctx.args = (src, dst, hdim, wdim, ranks, me, group)
        return _move_eager(x, src, dst, hdim, wdim, ranks, me, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        src, dst, hdim, wdim, ranks, me, group = ctx.args
        back = _move_eager(grad.contiguous(), dst, src, hdim, wdim, ranks, me, group, "backward")
        return back, None, None, None, None, None, None, None


def _move_traced(x, src, dst, hdim, wdim, manager):
    """Under ``torch.compile``: the same move as one ``credit_parallel::all_to_all``."""
    me, n = manager.domain_rank, manager.domain_world_size
    parts, shapes, where = [], [], []
    for q in range(n):
        block = _overlap(src[me], dst[q])
        parts.append(
            _local(block, src[me], x, hdim, wdim)
            if block
            else x.narrow(hdim, 0, 0).narrow(wdim, 0, 0)
        )
        block = _overlap(src[q], dst[me])
        where.append(block)
        shapes.append(_shape(x, hdim, wdim, block if block else ((0, 0), (0, 0))))
    recv = all_to_all_traced(parts, shapes, manager.domain_group)
    pieces = [(b, t) for b, t in zip(where, recv) if b]
    if not pieces:  # an empty rectangle (fewer rows than ranks)
        return x.new_zeros(_shape(x, hdim, wdim, dst[me])) + x.sum() * 0
    return _assemble(pieces, hdim, wdim)


def move_blocks(x: torch.Tensor, src: list, dst: list, hdim: int, wdim: int, manager):
    """``x`` (this rank's rectangle ``src[rank]`` of a global grid, rows along ``hdim``, columns
    along ``wdim``) re-laid to this rank's rectangle of ``dst`` over the domain group of
    ``manager`` (``src`` and ``dst``: one rectangle per domain rank, each a partition of the
    grid whose intersections form a product grid, as tiles and strips do).  Differentiable."""
    hdim, wdim = hdim % x.dim(), wdim % x.dim()
    if torch.compiler.is_compiling():
        return _move_traced(x, src, dst, hdim, wdim, manager)
    ranks, me = list(manager.domain_ranks), manager.domain_rank
    return _MoveBlocks.apply(x, src, dst, hdim, wdim, ranks, me, manager.domain_group)


# --------------------------------------------------------------------------- the wrapper
class _OutputKey:
    """The owner under which the wrapper's output height is learned over the strips."""


class TileStripRelayout(DomainWrapper):
    """Run ``inner`` (the 1-D exact replacement of a module, or a module exact on latitude
    strips as it is) on latitude strips of the whole domain group; see the module docstring.

    ``shard_dim``: the latitude dim of the module's input and output (longitude is the next
    dim: -2 / -1 for (.., H, W), -3 / -2 for Swin's (B, H, W, C)).  The first positional
    argument is re-laid; other tensor arguments of 3 or more dims are refused (they would be
    tiles too).  The output must be one tensor.  ``state_dict`` keys are ``inner``'s.
    """

    tile_exact = True
    domain_form = "strips"

    def __init__(self, inner: nn.Module, shard_dim: int = -2, *, manager=None):
        super().__init__(inner)
        if not -4 <= shard_dim <= -2:
            raise ValueError(f"TileStripRelayout: shard_dim must be -2 or -3, got {shard_dim}")
        self.shard_dim, self.manager = shard_dim, manager
        self._out_key = _OutputKey()
        for attr in ("_tp_col", "_tp_row", "_tp_fused", "_tp_head_dim"):
            if hasattr(inner, attr):
                self.__dict__[attr] = getattr(inner, attr)

    def _name(self) -> str:
        return self.module_path or type(self.wrapped).__name__

    def forward(self, x: torch.Tensor, *args, **kwargs):
        mgr = resolve_manager(self.manager, self._name())
        if not getattr(mgr, "is_tiled", False):
            raise ValueError(f"{self._name()}: TileStripRelayout needs a lat x lon tile manager")
        extra = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.dim() >= 3]
        if extra:
            raise ValueError(
                f"{self._name()}: on lat x lon tiles only the first argument is re-laid to "
                f"strips; another tensor argument of shape {tuple(extra[0].shape)} would be a tile"
            )
        hdim, wdim = self.shard_dim % x.dim(), (self.shard_dim + 1) % x.dim()
        strips, shape = mgr.strips, mgr.domain_shape
        height = mgr.global_height(self, x.shape[hdim])
        width = mgr.global_width(self, x.shape[wdim])
        n = strips.domain_world_size
        strip = move_blocks(
            x, tile_rects(height, width, shape), strip_rects(height, width, n), hdim, wdim, strips
        )
        y = self.wrapped(strip, *args, **kwargs)
        if not torch.is_tensor(y) or y.dim() != x.dim():
            raise ValueError(
                f"{self._name()}: on lat x lon tiles the re-laid module must return one tensor "
                f"of {x.dim()} dims"
            )
        try:
            out_h = strips.global_length(self._out_key, y.shape[hdim])
        except ValueError as err:
            raise ValueError(
                f"{self._name()}: its output on the strips is not the balanced 1-D layout (a "
                "module returning its whole output on every rank, e.g. a gathered module that "
                f"changes the height, cannot go back to tiles): {err}"
            ) from err
        out_w = y.shape[wdim]
        return move_blocks(
            y, strip_rects(out_h, out_w, n), tile_rects(out_h, out_w, shape), hdim, wdim, strips
        )

    def extra_repr(self) -> str:
        return f"strips of {type(self.wrapped).__name__}, shard_dim={self.shard_dim}"
