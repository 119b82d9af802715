"""CREDIT's boundary padding (``credit.boundary_padding.TensorPadding``) inside a model's forward,
exact on latitude shards and on lat x lon tiles.

miles-credit's CrossFormer family calls ``self.padding_opt.pad(x)`` first and
``self.padding_opt.unpad(x)`` last in its forward (``padding_conf.activate``): plain tensor
operations on the global grid ("earth": the rows beyond each pole are the pole rows flipped and
rolled by 180 degrees of longitude; "mirror": reflected; longitude padded circularly).  On a
shard they would pad every shard's own edges.  :class:`DomainPaddedModel` runs the model's own
forward with ``padding_opt`` replaced, for the duration of the call, by
:class:`.stand_ins._ShardedPadding`:

* on latitude shards, ``pad`` is one row exchange from the global row map
  (``stand_ins.tensor_padding_rows``: each rank receives its balanced share of the padded rows, the
  "earth" rows then rolled over the whole width) and ``unpad`` one exchange to the balanced share
  of the rows the global crop keeps; longitude stays local;
* on lat x lon tiles, each moves the tile to its latitude strip (``tiles_relayout.move_blocks``),
  does the same over ``manager.strips`` and moves the result back to tiles of the padded
  (cropped) grid: the 180-degree roll reads columns of other longitude tiles.

The model's layers are converted as anywhere else (the wrapper converts its children).
"""

from __future__ import annotations

from torch import nn

from ..manager import resolve_manager
from ..wrap import DomainWrapper
from .stand_ins import (
    _Key,
    _RecordingPadding,
    _ShardedPadding,
    _share,
    _swapped,
    tensor_padding_rows,
    tensor_unpadding_rows,
)

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
