"""Swin-V2 blocks of timm and miles-credit, exact under latitude sharding without the globe.

``timm.models.swin_transformer_v2.SwinTransformerV2Block`` (the blocks of CREDIT's FuXi) and
``credit.models.swin.SwinTransformerV2CrBlock`` take (B, H, W, C) tensors: H is dim 1, whatever
shard dim the rest of the model uses.  Their attention method rolls the grid by
``-shift_size`` over H and W, cuts it into windows, runs the block's ``attn`` with a mask built
for the GLOBAL grid (rows of the (nW, N, N) mask are indexed by the global window number,
row-major: window row j covers mask rows ``[j*nWw, (j+1)*nWw)``), and rolls back.

:class:`DomainSwinBlock` recognises them by qualified class name (the library never imports
timm or credit) and replaces, for the duration of each forward, that one method by an exact
one: the H-roll becomes the row exchange of :func:`shifted_window_layout` (each rank receives
whole window rows of the rolled grid), the W-roll and W padding stay local (W is not sharded),
the block's own ``attn`` runs on the held windows with the slice of the global mask for the
window rows held, and :func:`return_rows` sends every row back to its owner.  The rest of the
block's own forward (norm1 residual, MLP, norm2, all row-local) then runs unmodified on the
owned rows.  Parameter names and state_dict keys are the block's.

Their patch merging (2 x 2 patches to channels, timm's padding an odd H at the end) is
:class:`DomainSwinPatchMerging`: each rank receives the row pairs of its share of the output.

What cannot be exact is refused, naming the module: a height that is not a multiple of the
window rows (timm pads the ROLLED grid at its end, a row no rank holds in order), or a global
height other than the one the block's static mask was built for.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.relayout import DomainRowGroupAttention, _no_rows, return_rows
from ..exchange.halo import exchange_rows
from ..manager import resolve_manager
from ..rows import shard_range
from ..wrap import DomainWrapper

__all__ = [
    "SWIN_BLOCKS",
    "SWIN_PATCH_MERGING",
    "SWIN_SHARD_DIM",
    "DomainSwinBlock",
    "DomainSwinPatchMerging",
    "SwinFamily",
    "is_swin_patch_merging",
    "swin_family",
    "swin_unshardable_reason",
]

SWIN_SHARD_DIM = -3  # H of a (B, H, W, C) tensor


@dataclass(frozen=True)
class SwinFamily:
    """What differs between the recognised block classes."""

    attention_method: str  # the block's method: roll -> windows -> attn(mask) -> roll back
    resolution: str  # attribute holding the configured global (H, W)
    pads_width: bool  # pads W to a window multiple (timm) instead of requiring one
    fixed_grid: bool  # its forward reads the configured (H, W), not the input's (credit)


SWIN_BLOCKS = {
    "timm.models.swin_transformer_v2.SwinTransformerV2Block": SwinFamily(
        "_attn", "input_resolution", pads_width=True, fixed_grid=False
    ),
    "credit.models.swin.SwinTransformerV2CrBlock": SwinFamily(
        "_shifted_window_attn", "feat_size", pads_width=False, fixed_grid=True
    ),
}


def swin_family(module: nn.Module) -> SwinFamily | None:
    cls = type(module)
    return SWIN_BLOCKS.get(f"{cls.__module__}.{cls.__qualname__}")


def _gather_hint() -> str:
    return (
        "run it on the whole globe instead with nonlocal_policy='gather' (or "
        "custom_converters={type(block): lambda m: DomainGatherModule(m, -3)})"
    )


def swin_unshardable_reason(module: nn.Module) -> str | None:
    """Why a recognised Swin block cannot be made exact without the globe, from its
    configuration (None when it can, or when ``module`` is not such a block)."""
    family = swin_family(module)
    if family is None:
        return None
    functions = sys.modules.get(type(module).__module__)
    if not all(hasattr(functions, f) for f in ("window_partition", "window_reverse")):
        return "its module defines no window_partition / window_reverse; " + _gather_hint()
    height = int(getattr(module, family.resolution)[0])
    rows = int(module.window_size[0])
    if height % rows:
        return (
            f"its height of {height} rows is not a multiple of its {rows}-row windows (the block "
            "pads the rolled grid at its end, which no rank can reproduce on its own rows); "
            + _gather_hint()
        )
    return None


class DomainSwinBlock(DomainRowGroupAttention):
    """A recognised Swin-V2 block on (B, H, W, C) shards along H; exact forward and backward.

    The row layout is the base class's ``"shifted_windows"`` one (``rows`` = window height,
    ``shift`` = shift over H; plain windows when it is 0); ``entry`` names the block's
    attention method, which this wrapper overrides on the block while its forward runs."""

    def __init__(self, block: nn.Module, *, manager=None):
        family = swin_family(block)
        if family is None:
            raise TypeError(
                f"DomainSwinBlock: {type(block).__qualname__} is not a known Swin block"
            )
        reason = swin_unshardable_reason(block)
        if reason is not None:
            raise ValueError(f"{type(block).__name__}: {reason}")
        rows, shift = int(block.window_size[0]), int(block.shift_size[0])
        form = "shifted_windows" if shift else "windows"
        super().__init__(
            block, form, rows, shift, SWIN_SHARD_DIM, manager=manager, entry=family.attention_method
        )
        self.family = family
        functions = sys.modules[type(block).__module__]
        self._partition, self._reverse = functions.window_partition, functions.window_reverse

    def _name(self) -> str:
        path = getattr(self, "module_path", None) or "<root>"
        return f"{path} ({type(self.wrapped).__name__})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mgr = resolve_manager(self.manager, type(self.wrapped).__name__)
        if mgr.domain_world_size == 1:
            return self.wrapped(x)
        if x.dim() != 4:
            raise ValueError(f"{self._name()}: expects a (B, H, W, C) shard, got {tuple(x.shape)}")
        block = self.wrapped
        if (int(block.window_size[0]), int(block.shift_size[0])) != (self.rows, self.shift):
            raise ValueError(
                f"{self._name()}: window or shift changed after conversion "
                "(set_input_size / update_input_size); convert the model again"
            )
        # an instance attribute shadows the class's method while the block's own forward runs
        block.__dict__[self.entry] = functools.partial(self._held_window_attention, mgr)
        try:
            return block(x)
        finally:
            del block.__dict__[self.entry]

    def _check_height(self, height: int, width: int) -> None:
        block, rows = self.wrapped, self.rows
        if height % rows:
            raise ValueError(
                f"{self._name()}: a global height of {height} rows is not a multiple of its "
                f"{rows}-row windows; " + _gather_hint()
            )
        configured = tuple(int(v) for v in getattr(block, self.family.resolution))
        if self.family.fixed_grid and (height, width) != configured:
            raise ValueError(
                f"{self._name()}: the global grid is {height} x {width} but the block was built "
                f"for {configured} (the block itself would fail on the whole globe)"
            )
        if not self.family.pads_width and width % int(block.window_size[1]):
            raise ValueError(
                f"{self._name()}: a width of {width} is not a multiple of its window width "
                f"{block.window_size[1]} (the block itself would fail on the whole globe)"
            )
        if not getattr(block, "dynamic_mask", False) and block.attn_mask is not None:
            cols = -(-width // int(block.window_size[1]))
            if block.attn_mask.shape[0] != (height // rows) * cols:
                raise ValueError(
                    f"{self._name()}: its mask has {block.attn_mask.shape[0]} windows, built for "
                    f"{configured}, but the global grid is "
                    f"{height} x {width}"
                )

    def _held_window_attention(self, mgr, x: torch.Tensor) -> torch.Tensor:
        """The block's attention method on this rank's owned rows ``x`` (B, h, W, C): whole
        window rows of the rolled grid in, attention, rows back to their owners."""
        height = mgr.global_length(self, x.shape[1])
        self._check_height(height, x.shape[2])
        n, rank = mgr.domain_world_size, mgr.domain_rank
        layout = self.layout(height, n)
        held = exchange_rows(x, layout, height, 1, mgr)
        if held.shape[1] == 0:
            y = _no_rows(held, self.wrapped.attn)
        else:
            first_window_row = shard_range(height // self.rows, n, rank)[0]
            y = self._window_attention(held, first_window_row, height)
        return return_rows(y, layout, height, 1, mgr)

    def _window_attention(self, held: torch.Tensor, first: int, height: int) -> torch.Tensor:
        """What the block's method does after its H-roll, on whole window rows ``first``,
        ``first + 1``, ... of the rolled grid: roll and pad W, windows, attention, back."""
        block = self.wrapped
        _, h, width, channels = held.shape
        win = (int(block.window_size[0]), int(block.window_size[1]))
        shift_w = int(block.shift_size[1])
        x = torch.roll(held, -shift_w, dims=2) if shift_w else held
        pad_w = (win[1] - width % win[1]) % win[1] if self.family.pads_width else 0
        if pad_w:
            x = F.pad(x, (0, 0, 0, pad_w))
        padded = width + pad_w
        windows = self._partition(x, win).view(-1, win[0] * win[1], channels)
        mask = self._mask_rows(first, h // win[0], height, padded, held)
        out = block.attn(windows, mask=mask).view(-1, win[0], win[1], channels)
        y = self._reverse(out, win, (h, padded))
        if pad_w:
            y = y[:, :, :width].contiguous()
        return torch.roll(y, shift_w, dims=2) if shift_w else y

    def _mask_rows(self, first: int, count: int, height: int, padded_w: int, like):
        """Rows of the global (nW, N, N) mask for window rows ``[first, first + count)``."""
        block = self.wrapped
        cols = padded_w // int(block.window_size[1])
        if getattr(block, "dynamic_mask", False):
            return self._dynamic_mask_rows(first, count, height, padded_w, like)
        mask = block.attn_mask
        return None if mask is None else mask[first * cols : (first + count) * cols]

    def _dynamic_mask_rows(self, first: int, count: int, height: int, padded_w: int, like):
        """timm's ``dynamic_mask``: its ``get_attn_mask`` marks only the LAST window row of the
        grid (where the rolled-in rows meet), so a grid of two window rows gives the mask of
        every interior window row and of the last one; never the whole globe's mask."""
        block, rows = self.wrapped, self.rows
        total = height // rows
        small_rows = min(total, 2)
        grid = like.new_empty((1, small_rows * rows, padded_w, 0))  # only its shape is read
        small = block.get_attn_mask(grid)
        if small is None:
            return None
        small = small.view(small_rows, -1, *small.shape[1:])
        index = [small_rows - 1 if j == total - 1 else 0 for j in range(first, first + count)]
        picked = small[torch.tensor(index, dtype=torch.long, device=small.device)]
        return picked.reshape(-1, *small.shape[2:])


# --------------------------------------------------------------------------- patch merging
# (B, H, W, C) -> (B, ceil(H/2), ceil(W/2), C'): 2 x 2 patches concatenated, then a Linear and
# a LayerNorm over channels.  timm pads an odd H / W with one zero row / column at the end
# first; miles-credit's requires even sizes.  On a shard of odd length timm's would pad in the
# middle of the globe: silently wrong, so it is never left alone.
SWIN_PATCH_MERGING = {
    "timm.models.swin_transformer_v2.PatchMerging": True,  # pads an odd H itself
    "credit.models.swin.PatchMerging": False,
}


def is_swin_patch_merging(module: nn.Module) -> bool:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}" in SWIN_PATCH_MERGING


def _merging_windows(height: int, n: int) -> tuple:
    """Input rows of each rank's balanced share of the ceil(H/2) output rows: output row o
    reads rows 2o and 2o + 1 (the last one absent, padded by the module, when H is odd)."""
    out_h = -(-height // 2)
    return tuple(
        tuple(range(2 * a, min(2 * b, height)))
        for a, b in (shard_range(out_h, n, r) for r in range(n))
    )


class DomainSwinPatchMerging(DomainWrapper):
    """A recognised Swin patch merging on (B, H, W, C) shards along H: each rank receives the
    row pairs of its balanced share of the output rows (one exchange in, none out) and runs
    the unmodified module on them; the only odd row count, if any, is at the globe's end,
    where the module's own padding is the global one."""

    domain_form = "halo"
    domain_kind = "patch_merging"

    def __init__(self, module: nn.Module, *, manager=None):
        if not is_swin_patch_merging(module):
            raise TypeError(f"DomainSwinPatchMerging: {type(module).__qualname__} is not known")
        super().__init__(module)
        self.pads_height = SWIN_PATCH_MERGING[
            f"{type(module).__module__}.{type(module).__qualname__}"
        ]
        self.shard_dim = SWIN_SHARD_DIM
        self.manager = manager

    # ---- geometry (domain/geometry.py)
    def output_height(self, input_height: int) -> int:
        if input_height % 2 and not self.pads_height:
            raise ValueError(
                f"{getattr(self, 'module_path', None) or '<root>'} "
                f"({type(self.wrapped).__name__}): a height of {input_height} rows is odd (the "
                "module itself would fail on the whole globe)"
            )
        return -(-input_height // 2)

    def input_windows(self, input_height: int, n: int) -> tuple:
        self.output_height(input_height)
        return _merging_windows(input_height, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mgr = resolve_manager(self.manager, type(self.wrapped).__name__)
        if mgr.domain_world_size == 1:
            return self.wrapped(x)
        height = mgr.global_length(self, x.shape[1])
        windows = self.input_windows(height, mgr.domain_world_size)
        held = exchange_rows(x, windows, height, 1, mgr)
        return self.wrapped(held)  # an empty window gives an empty, graph-attached output
