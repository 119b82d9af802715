"""What the CREDIT adapters share: the stand-ins they swap into a client model for the duration
of one forward, and the pure row arithmetic of CREDIT's ``TensorPadding``.

* :func:`_swapped` sets an instance attribute for the duration of a block (restored on errors);
* :func:`tensor_padding_rows` / :func:`tensor_unpadding_rows`: the global rows
  ``TensorPadding.pad`` reads and ``unpad`` keeps (plain functions, tested against the class);
* :class:`_ShardedPadding` stands in for ``padding_opt`` on latitude shards and lat x lon tiles
  (:mod:`.tensor_padding`, :mod:`.credit_interp`), :class:`_RecordingPadding` in the shape twin
  (``traced_heights``), both keyed by :class:`_Key` owners of the global heights.

Used by :mod:`.fuxi`, :mod:`.tensor_padding` and :mod:`.credit_interp`; imports none of them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..exchange.halo import exchange_rows
from ..rows import edge_source_row, shard_range
from ..tiles_relayout import move_blocks, strip_rects, tile_rects

__all__ = ["tensor_padding_rows", "tensor_unpadding_rows"]


def tensor_padding_rows(mode: str, height: int, top: int, bottom: int) -> tuple:
    """``(sources, rolled)``: the global input row of every latitude row ``TensorPadding.pad``
    gives an input of ``height`` rows, and whether that row is also rolled by half the width
    ("earth": the rows beyond each pole are the first / last rows flipped and shifted by 180
    degrees; "mirror": reflect).  Python's slicing rules as in the class (a bottom of 0
    with a top > 0 flips the whole globe in "earth" mode: ``x[..., -0:, :]``)."""
    rows = list(range(height))
    if not (top > 0 or bottom > 0):
        return tuple(rows), (False,) * height
    if mode == "earth":
        above, below = rows[:top][::-1], rows[-bottom:][::-1]
        flags = (True,) * len(above) + (False,) * height + (True,) * len(below)
        return tuple(above + rows + below), flags
    sources = tuple(
        edge_source_row(p - top, height, "reflect") for p in range(height + top + bottom)
    )
    return sources, (False,) * len(sources)


def tensor_unpadding_rows(mode: str, height: int, top: int, bottom: int) -> range:
    """The global rows ``TensorPadding.unpad`` keeps of an output of ``height`` rows."""
    if not (top > 0 or bottom > 0):
        return range(height)
    if mode == "earth":
        return range(height)[top : (-bottom if bottom > 0 else None)]
    return range(height)[top:-bottom]


def _share(rows, n: int) -> tuple:
    """Each rank's balanced share of the global row list ``rows``."""
    return tuple(tuple(rows[slice(*shard_range(len(rows), n, r))]) for r in range(n))


class _Key:
    """An owner under which a global height or width is learned."""


@contextmanager
def _swapped(obj, name: str, value):
    """``obj.name = value`` for the duration of the block (an instance attribute)."""
    old = obj.__dict__[name]
    obj.__dict__[name] = value
    try:
        yield
    finally:
        obj.__dict__[name] = old


class _ShardedPadding:
    """Stands in for ``padding_opt`` during one forward of a :class:`DomainPaddedModel`."""

    def __init__(self, original, manager, keys):
        self.rows, self.kept = tensor_padding_rows, tensor_unpadding_rows
        self.mode, self.manager, self.keys = original.mode, manager, keys
        self.top, self.bottom = (int(v) for v in original.pad_NS)
        self.left, self.right = (int(v) for v in original.pad_WE)

    # ---- on latitude shards of ``mgr`` (rows at dim -2, every column)
    def _pad_rows(self, x, height: int, mgr):
        sources, rolled = self.rows(self.mode, height, self.top, self.bottom)
        n = mgr.domain_world_size
        held = exchange_rows(x, _share(sources, n), height, x.dim() - 2, mgr)
        flags = _share(rolled, n)[mgr.domain_rank]
        if any(flags):
            pole = torch.tensor(flags, device=held.device).view(-1, 1)
            held = torch.where(pole, torch.roll(held, x.shape[-1] // 2, dims=-1), held)
        if self.left > 0 or self.right > 0:
            pads = (self.left, self.right) + (0, 0) * (held.dim() - 2)
            held = F.pad(held, pads[: 2 * (held.dim() - 2)], mode="circular")
        return held

    def _unpad_rows(self, x, height: int, mgr):
        kept = self.kept(self.mode, height, self.top, self.bottom)
        y = exchange_rows(x, _share(kept, mgr.domain_world_size), height, x.dim() - 2, mgr)
        if self.left > 0 or self.right > 0:
            end = -self.right if self.right > 0 or self.mode == "mirror" else None
            y = y[..., :, self.left : end]
        return y

    # ---- the model's calls
    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x, self._pad_rows, self.keys[0], self._padded_hw)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x, self._unpad_rows, self.keys[1], self._cropped_hw)

    def _padded_hw(self, height: int, width: int) -> tuple[int, int]:
        return len(self.rows(self.mode, height, self.top, self.bottom)[0]), (
            width + self.left + self.right
        )

    def _cropped_hw(self, height: int, width: int) -> tuple[int, int]:
        return len(self.kept(self.mode, height, self.top, self.bottom)), (
            width - self.left - self.right
        )

    def _call(self, x, rows_op, key, out_hw):
        mgr = self.manager
        if not getattr(mgr, "is_tiled", False):
            return rows_op(x, mgr.global_length(key, x.shape[-2]), mgr)
        height, width = mgr.global_height(key, x.shape[-2]), mgr.global_width(key, x.shape[-1])
        shape, strips = mgr.domain_shape, mgr.strips
        n = strips.domain_world_size
        strip = move_blocks(
            x, tile_rects(height, width, shape), strip_rects(height, width, n), -2, -1, strips
        )
        y = rows_op(strip, height, strips)
        out_h, out_w = out_hw(height, width)
        return move_blocks(
            y, strip_rects(out_h, out_w, n), tile_rects(out_h, out_w, shape), -2, -1, strips
        )


class _RecordingPadding:
    """In the shape twin (``traced_heights``): the model's own global padding, the heights its
    sharded stand-in asks for noted under the real wrapper's keys."""

    def __init__(self, original, probe, keys):
        self.original, self.probe, self.keys = original, probe, keys

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        self.probe.sink(self.keys[0], x.shape[-2], x.shape[-1])
        return self.original.pad(x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        self.probe.sink(self.keys[1], x.shape[-2], x.shape[-1])
        return self.original.unpad(x)
