"""Domain-parallel 2-D padding modules: padding over latitude at the global edges only.

``nn.ZeroPad2d``/``ConstantPad2d``/``ReflectionPad2d``/``ReplicationPad2d``/``CircularPad2d``
pad H by ``top``/``bottom`` rows and W by ``left``/``right`` columns.  Sharded over H, only the
poles are edges: the output is the balanced layout of the padded GLOBAL height
``H + top + bottom``, and each rank assembles its output rows in one :func:`exchange_rows` call
whose window maps every output row to the global row it copies (or to a fill row of the pad
constant).  Interior shard boundaries are never padded; circular padding wraps around the ring of
ranks; a pad wider than a shard simply reads from further ranks.  W is not sharded, so its
padding is applied locally with ``F.pad`` in the module's own mode.

Negative padding (cropping) follows PyTorch: the crop is applied first, then the remaining rows
are padded by the mode's rule relative to the cropped tensor (so ``CircularPad2d((0, 0, -1, 2))``
wraps to the first KEPT row, as ``F.pad`` does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..exchange.halo import exchange_rows, exchange_tile, tile_plan
from ..manager import resolve_manager
from ..options import LayerOptions
from ..rows import FILL, edge_source_row, pure_cached, shard_range
from ..wrap import DomainWrapper

__all__ = [
    "DomainParallelPad",
    "checked_pad_windows",
    "pad_mode_of",
    "pad_rows",
    "pad_windows",
]

# ZeroPad2d is a ConstantPad2d with value 0
_PAD_MODES = (
    (nn.ConstantPad2d, "constant"),
    (nn.ReflectionPad2d, "reflect"),
    (nn.ReplicationPad2d, "replicate"),
    (nn.CircularPad2d, "circular"),
)


def pad_mode_of(module: nn.Module) -> str:
    """The ``F.pad`` mode of a 2-D padding module; ``TypeError`` for anything else."""
    for cls, mode in _PAD_MODES:
        if isinstance(module, cls):
            return mode
    raise TypeError(
        "DomainParallelPad wraps ZeroPad2d, ConstantPad2d, ReflectionPad2d, ReplicationPad2d or "
        f"CircularPad2d, got {type(module).__name__}"
    )


def pad_windows(length: int, n: int, top: int, bottom: int, mode: str) -> tuple:
    """For each of ``n`` ranks, the global input rows (or FILL) of the output rows it owns in the
    balanced layout of the padded height ``length + top + bottom``."""
    out_len = length + top + bottom
    return tuple(pad_rows(length, top, bottom, mode, *shard_range(out_len, n, r)) for r in range(n))


def pad_rows(length: int, top: int, bottom: int, mode: str, o0: int, o1: int) -> tuple:
    """The input rows (or FILL) of output rows ``[o0, o1)`` of the padded height
    ``length + top + bottom`` (any range; :func:`pad_windows` asks for each rank's own)."""
    kept_start = max(0, -top)  # negative padding crops first ...
    kept = length - kept_start - max(0, -bottom)
    rows = []
    for p in range(o0, o1):
        # ... and the padding rule then applies relative to the kept rows
        src = edge_source_row(p - max(0, top), kept, mode)
        rows.append(FILL if src == FILL else kept_start + src)
    return tuple(rows)


@pure_cached(maxsize=1024)
def checked_pad_windows(length: int, n: int, top: int, bottom: int, mode: str, what: str) -> tuple:
    """:func:`pad_windows`, after letting PyTorch judge whether the GLOBAL padding is legal
    (reflect wider than the height, circular wrapping more than once, ...): every rank decides
    identically.  ``what`` names the module in the error."""
    # a real one-column tensor: the first meta-device pad costs seconds of imports
    probe = torch.zeros((1, 1, length, 1))
    try:
        F.pad(probe, (0, 0, top, bottom), mode=mode)
    except (RuntimeError, ValueError, NotImplementedError) as err:
        raise ValueError(f"{what}: invalid for the global height {length}: {err}") from None
    return pad_windows(length, n, top, bottom, mode)


class DomainParallelPad(DomainWrapper):
    """Domain-parallel 2-D padding module (latitude = dim -2 of (B,)C,H,W); see module docs."""

    domain_form = "halo"
    domain_kind = "pad"
    tile_exact = True  # exact on lat x lon tiles too (_forward_tile)

    def __init__(self, pad_module: nn.Module, *, manager=None, options: LayerOptions | None = None):
        mode = pad_mode_of(pad_module)
        super().__init__(pad_module)
        if options is not None:
            self._options = options
        self.mode = mode
        self.manager = manager

    @property
    def fused_into(self) -> nn.Module | None:
        """The conv that exchanges and pads for this layer (``fusion.py``), or None."""
        return self._options.fused_into

    @property
    def padding(self) -> tuple:
        """(left, right, top, bottom), as on the wrapped module."""
        return tuple(self.wrapped.padding)

    @property
    def value(self) -> float:
        return float(getattr(self.wrapped, "value", 0.0))

    # ---- geometry (domain/geometry.py)
    def output_height(self, input_height: int) -> int:
        _, _, top, bottom = self.padding
        return input_height + top + bottom

    def input_windows(self, input_height: int, n: int) -> tuple:
        _, _, top, bottom = self.padding
        what = f"{type(self.wrapped).__name__}{self.padding}"
        return checked_pad_windows(input_height, n, top, bottom, self.mode, what)

    def tile_windows(self, height: int, width: int, shape, *, double: bool = False) -> tuple:
        """(row windows over the P latitude ranks, column windows over the Q longitude ranks)
        of a ``height`` x ``width`` input on a ``shape`` = (P, Q) domain (:meth:`_forward_tile`)."""
        left, right, top, bottom = self.padding
        what = f"{type(self.wrapped).__name__}{self.padding}"
        return (
            checked_pad_windows(height, shape[0], top, bottom, self.mode, what),
            checked_pad_windows(width, shape[1], left, right, self.mode, what),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (3, 4):
            raise ValueError(
                f"{type(self.wrapped).__name__} expects a 3-D or 4-D input, got shape {tuple(x.shape)}"
            )
        if self._options.fused_into is not None:
            return x  # the next conv pads and exchanges for both (fusion.py), any domain size
        mgr = resolve_manager(self.manager, type(self).__name__)
        if getattr(mgr, "is_tiled", False):  # a lat x lon tile (SPEC §3b)
            return self._forward_tile(x, mgr)
        n = mgr.domain_world_size
        dim = x.dim() - 2
        length = mgr.global_length(self, x.shape[dim])
        if n == 1:
            return self.wrapped(x)
        windows = self.input_windows(length, n)
        rows = exchange_rows(x, windows, length, dim, mgr, fill_value=self.value)
        return self.pad_width(rows)

    def _forward_tile(self, x: torch.Tensor, mgr) -> torch.Tensor:
        """On a lat x lon tile (SPEC §3b): the output is the padded global tensor in the
        balanced tile layout of its padded height AND width; the rows are a window over the
        latitude ranks, the columns one over the longitude ranks by the same rule (circular
        wraps longitude across them), exchanged along H, then along W of the H-extended tensor
        (so the corners come with it; ``conv_tiles.py``)."""
        dim_h, dim_w = x.dim() - 2, x.dim() - 1
        height = mgr.global_height(self, x.shape[dim_h])
        width = mgr.global_width(self, x.shape[dim_w])
        rows, cols = self.tile_windows(height, width, mgr.domain_shape)
        plan = tile_plan(height, width, mgr.domain_shape, mgr.domain_coords, rows, cols)
        return exchange_tile(x, plan, (dim_h, dim_w), mgr, self.value)

    def pad_width(self, rows: torch.Tensor) -> torch.Tensor:
        """The padding of the unsharded width (W, the last dim), applied locally."""
        left, right, _, _ = self.padding
        if left == 0 and right == 0:
            return rows
        if self.mode == "constant":
            return F.pad(rows, (left, right, 0, 0), mode="constant", value=self.value)
        return F.pad(rows, (left, right, 0, 0), mode=self.mode)

    def extra_repr(self) -> str:
        return f"{self.wrapped!r}"
