"""CREDIT's boundary padding (``credit.boundary_padding.TensorPadding``) inside a model's forward,
exact on latitude shards and on lat x lon tiles.

miles-credit's CrossFormer family calls ``self.padding_opt.pad(x)`` first and
``self.padding_opt.unpad(x)`` last in its forward (``padding_conf.activate``): plain tensor
operations on the global grid ("earth": the rows beyond each pole are the pole rows flipped and
rolled by 180 degrees of longitude; "mirror": reflected; longitude padded circularly).  On a
shard they would pad every shard's own edges.  :class:`DomainPaddedModel` runs the model's own
forward with ``padding_opt`` replaced, for the duration of the call, by
:class:`_ShardedPadding`:

* on latitude shards, ``pad`` is one row exchange from the global row map
  (``fuxi.tensor_padding_rows``: each rank receives its balanced share of the padded rows, the
  "earth" rows then rolled over the whole width) and ``unpad`` one exchange to the balanced share
  of the rows the global crop keeps; longitude stays local;
* on lat x lon tiles, each moves the tile to its latitude strip (``tiles_relayout.move_blocks``),
  does the same over ``manager.strips`` and moves the result back to tiles of the padded
  (cropped) grid: the 180-degree roll reads columns of other longitude tiles.

The model's layers are converted as anywhere else (the wrapper converts its children).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..exchange.halo import exchange_rows
from ..manager import resolve_manager
from ..rows import shard_range
from ..tiles_relayout import move_blocks, strip_rects, tile_rects
from ..wrap import DomainWrapper
from .fuxi import _swapped, tensor_padding_rows, tensor_unpadding_rows

__all__ = [
    "DomainPaddedModel",
    "PaddingCall",
    "is_tensor_padding",
    "padded_model_decision",
]

PADDING_MODES = ("earth", "mirror")


def is_tensor_padding(obj) -> bool:
    """Whether ``obj`` is CREDIT's ``TensorPadding`` (by qualified name, never imported)."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}" == "credit.boundary_padding.TensorPadding"


def _share(rows, n: int) -> tuple:
    return tuple(tuple(rows[slice(*shard_range(len(rows), n, r))]) for r in range(n))


class _Key:
    """An owner under which a global height or width is learned."""


class PaddingCall:
    """The geometry of one ``pad`` (``unpad`` = False) or ``unpad`` call of a
    :class:`DomainPaddedModel` for the planner (``domain/geometry.py``): on latitude shards one
    row exchange whose windows are each rank's balanced share of the padded (kept) global rows;
    on lat x lon tiles no tile windows of its own: the planner counts a move to the strips and
    back (``tiles_relayout``) and that row exchange over the P x Q strips.  Pure arithmetic."""

    domain_form = "halo"
    shard_dim = -2

    def __init__(self, original, unpad: bool):
        self.mode, self.unpad = original.mode, unpad
        self.domain_kind = "tensor_unpadding" if unpad else "tensor_padding"
        self.top, self.bottom = (int(v) for v in original.pad_NS)
        self.left, self.right = (int(v) for v in original.pad_WE)

    def _rows(self, height: int):
        if self.unpad:
            return tuple(tensor_unpadding_rows(self.mode, height, self.top, self.bottom))
        return tensor_padding_rows(self.mode, height, self.top, self.bottom)[0]

    def output_height(self, input_height: int) -> int:
        return len(self._rows(input_height))

    def input_windows(self, input_height: int, n: int):
        return _share(self._rows(input_height), n)


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


class DomainPaddedModel(DomainWrapper):
    """Run a model whose forward calls ``self.padding_opt.pad`` / ``unpad`` (CREDIT's
    ``TensorPadding``) with a sharded stand-in; see the module docstring.  Its layers are
    converted like anywhere else; parameter names and ``state_dict`` keys are the model's."""

    # not itself a domain-parallel layer (as DomainFuxi): every layer inside it is converted
    _domain_parallel = False
    tile_exact = True  # the stand-in moves tiles to strips and back

    def __init__(self, model: nn.Module, *, manager=None):
        super().__init__(model)
        if not is_tensor_padding(model.__dict__.get("padding_opt")):
            raise TypeError(f"{type(model).__name__}: no CREDIT TensorPadding as padding_opt")
        if model.padding_opt.mode not in PADDING_MODES:
            raise ValueError(
                f"{type(model).__name__}: padding_conf.mode {model.padding_opt.mode!r} is not "
                f"one of {PADDING_MODES}"
            )
        self.manager = manager
        self._keys = (_Key(), _Key())

    def padding_calls(self) -> tuple[PaddingCall, PaddingCall]:
        """The planner's geometry of the ``pad`` and the ``unpad`` call (:class:`PaddingCall`)."""
        original = self.wrapped.padding_opt
        return PaddingCall(original, unpad=False), PaddingCall(original, unpad=True)

    def twin_forward(self, real, probe, x, *args, **kwargs):
        """The forward of the shape twin (global shapes, ``traced_heights``): the model's own,
        the heights noted for ``real``'s stand-in."""
        stand_in = _RecordingPadding(self.wrapped.padding_opt, probe, real._keys)
        with _swapped(self.wrapped, "padding_opt", stand_in):
            return self.wrapped(x, *args, **kwargs)

    def forward(self, x, *args, **kwargs):
        model = self.wrapped
        model.training = self.training
        if "_twin_of" in self.__dict__:
            return self.twin_forward(*self._twin_of, x, *args, **kwargs)
        mgr = resolve_manager(self.manager, type(model).__name__)
        if mgr.domain_world_size == 1:
            return model(x, *args, **kwargs)
        stand_in = _ShardedPadding(model.padding_opt, mgr, self._keys)
        with _swapped(model, "padding_opt", stand_in):
            return model(x, *args, **kwargs)


def padded_model_decision(module: nn.Module, path: str, manager):
    """The converter's step for a model padded by CREDIT's ``TensorPadding`` in its forward
    (``use_padding`` and ``padding_opt``): its :class:`DomainPaddedModel`, or None."""
    if not getattr(module, "use_padding", False):
        return None
    if not is_tensor_padding(module.__dict__.get("padding_opt")):
        return None
    where = path or "<root>"
    try:
        replacement = DomainPaddedModel(module, manager=manager)
    except ValueError as err:
        raise ValueError(f"convert_to_domain_parallel: {where}: {err}") from None
    return replacement.configure(module_path=where)
