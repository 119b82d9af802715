"""CREDIT's interpolation to the global image size inside a model's forward (``model.interp:
true``), exact on latitude shards and on lat x lon tiles.

miles-credit's CrossFormer family ends its forward with::

    if self.use_padding:
        x = self.padding_opt.unpad(x)
    if self.use_interp:
        x = F.interpolate(x, size=(self.image_height, self.image_width), mode="bilinear")
    b, _, h, w = x.shape
    x = x.view(b, self.base_output_channels, self.output_frames, h, w)
    if self.use_post_block:
        x = self.postblock({"y_pred": x, "x": x_copy})

(``credit.models.crossformer.CrossFormer``, ``credit.models.wxformer.crossformer.CrossFormer``
(``wxformer`` / ``wxformer_base``), ``credit.models.camulator.Camulator``,
``crossformer_diffusion.CrossFormerDiffusion``: its time embedding is per sample, its
``x_cond`` sharded like ``x``).  On a shard that
``F.interpolate`` would resample each shard's own rows to the whole globe's size.
:class:`DomainInterpModel` runs the model's own forward with ``use_interp`` set off for the
duration of the call, and applies :class:`~..layers.resample.DomainParallelInterpolate` (global
output size, bilinear; its output in the balanced layout of that size, on tiles too) to the
output: per channel, so interpolating the ``(b, C * T, h, w)`` tensor CREDIT interpolates and
the ``(b, C, T, h, w)`` view it returns are the same.  Composed with the rest of the tail:

* CREDIT's ``TensorPadding`` (``padding_conf.activate``) is replaced by the sharded stand-in of
  :mod:`.tensor_padding` during the call, so the interpolation reads the cropped grid, as in
  CREDIT;
* with a post block (``post_conf.activate``) the interpolation goes in front of it (a forward
  pre-hook on ``postblock`` for the duration of the call rewrites its ``y_pred``), so the post
  block sees the interpolated prediction, as in CREDIT.

The other gen-2 models that interpolate in their forward (``crossformer-ensemble``'s
``CrossFormerWithNoise``: per-pixel noise; the regional ``swin_wrf`` / ``dscale_wrf``) stay
refused by name at domain > 1, whatever their ``interp`` (``regional.py``).  Parameters, buffers and ``state_dict`` keys are the model's.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.resample import DomainParallelInterpolate
from ..manager import resolve_manager
from ..wrap import DomainWrapper
from .fuxi import INTERP_MODELS, credit_model_decision
from .nextgen import nextgen_model_decision
from .stand_ins import _Key, _RecordingPadding, _ShardedPadding, _swapped
from .tensor_padding import PADDING_MODES, is_tensor_padding, padded_model_decision

__all__ = ["INTERP_MODELS", "DomainInterpModel", "credit_adapter_decision", "interp_model_decision"]


def _qualified(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def is_interp_model(module: nn.Module) -> bool:
    """A model of :data:`INTERP_MODELS` with ``use_interp`` on."""
    return _qualified(module) in INTERP_MODELS and bool(getattr(module, "use_interp", False))


def _padding(model: nn.Module):
    """The model's CREDIT ``TensorPadding`` when its forward pads, else None."""
    padding = model.__dict__.get("padding_opt") if getattr(model, "use_padding", False) else None
    if padding is None:
        return None
    if not is_tensor_padding(padding):
        raise TypeError(f"{type(model).__name__}: padding_opt is not CREDIT's TensorPadding")
    if padding.mode not in PADDING_MODES:
        raise ValueError(
            f"{type(model).__name__}: padding_conf.mode {padding.mode!r} is not one of "
            f"{PADDING_MODES}"
        )
    return padding


def interpolate_channels(layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """``layer`` (a 4-D interpolation) on ``y`` of shape (B, ..., H, W): the dims between the
    batch and the grid taken as channels."""
    flat = y.reshape(y.shape[0], -1, *y.shape[-2:])
    out = layer(flat)
    return out.reshape(*y.shape[:-2], *out.shape[-2:])


class DomainInterpModel(DomainWrapper):
    """A model of :data:`INTERP_MODELS` with ``use_interp`` on, on shards or tiles; see the
    module docstring.  Its layers are converted like anywhere else."""

    # not itself a domain-parallel layer (as DomainPaddedModel): every layer inside is converted
    _domain_parallel = False
    tile_exact = True  # the interpolation and the padding stand-in are exact on tiles

    def __init__(self, model: nn.Module, *, manager=None):
        if not is_interp_model(model):
            raise TypeError(
                f"DomainInterpModel: {_qualified(model)} with use_interp "
                f"{getattr(model, 'use_interp', None)!r} is not one of {sorted(INTERP_MODELS)} "
                "with model.interp: true"
            )
        super().__init__(model)
        _padding(model)  # refuse an unknown padding now, not at the first forward
        self.manager = manager
        size = (int(model.image_height), int(model.image_width))
        # not registered in the dicts shared with the wrapped model: no new modules or keys
        self.__dict__.update(_keys=(_Key(), _Key()), _size=size, _layers={})

    def _layer(self, mgr) -> DomainParallelInterpolate:
        built = self._layers.get("bilinear")
        if built is None or built[0] is not mgr:
            layer = DomainParallelInterpolate(size=self._size, mode="bilinear", manager=mgr)
            built = self._layers["bilinear"] = (mgr, layer)
        return built[1]

    def twin_forward(self, real, probe, x, *args, **kwargs):
        """The forward of the shape twin (global shapes, ``traced_heights``): the model's own
        padding, ``F.interpolate``; the heights noted for ``real``'s stand-in and layer."""
        layer = real._layer(probe.manager)

        def recorded(y):
            probe.sink(layer, y.shape[-2], y.shape[-1])
            return F.interpolate(y, size=self._size, mode="bilinear")

        padding = _padding(self.wrapped)
        stand_in = None if padding is None else _RecordingPadding(padding, probe, real._keys)
        return self._run(recorded, stand_in, x, *args, **kwargs)

    def forward(self, x, *args, **kwargs):
        self.wrapped.training = self.training
        if "_twin_of" in self.__dict__:
            return self.twin_forward(*self._twin_of, x, *args, **kwargs)
        mgr = resolve_manager(self.manager, type(self.wrapped).__name__)
        if mgr.domain_world_size == 1:
            return self.wrapped(x, *args, **kwargs)
        padding = _padding(self.wrapped)
        stand_in = None if padding is None else _ShardedPadding(padding, mgr, self._keys)
        return self._run(self._layer(mgr), stand_in, x, *args, **kwargs)

    def _run(self, layer, stand_in, x, *args, **kwargs):
        """The model's forward with ``use_interp`` off, ``stand_in`` as its padding (None: as
        it is), ``layer`` interpolating its output (or the post block's ``y_pred``)."""
        model = self.wrapped
        post = bool(getattr(model, "use_post_block", False))
        with ExitStack() as stack:
            stack.enter_context(_swapped(model, "use_interp", False))
            if stand_in is not None:
                stack.enter_context(_swapped(model, "padding_opt", stand_in))
            if post:

                def interpolated_first(_module, args):
                    (inputs,) = args
                    return ({**inputs, "y_pred": interpolate_channels(layer, inputs["y_pred"])},)

                hook = model.postblock.register_forward_pre_hook(interpolated_first)
                stack.callback(hook.remove)
            y = model(x, *args, **kwargs)
        return y if post else interpolate_channels(layer, y)


def interp_model_decision(module: nn.Module, path: str, manager):
    """The converter's step for a model of :data:`INTERP_MODELS` with ``use_interp`` on: its
    :class:`DomainInterpModel` (which also takes care of its ``TensorPadding``), or None."""
    if not is_interp_model(module):
        return None
    where = path or "<root>"
    try:
        replacement = DomainInterpModel(module, manager=manager)
    except (TypeError, ValueError) as err:
        raise ValueError(f"convert_to_domain_parallel: {where}: {err}") from None
    return replacement.configure(module_path=where)


def credit_adapter_decision(module: nn.Module, path: str, manager, *args, **kwargs):
    """The converter's CREDIT-model step: FuXi and the refusals (``fuxi.credit_model_decision``,
    same arguments), else a model interpolating to the global size
    (:func:`interp_model_decision`), else a model padded by ``TensorPadding``
    (``tensor_padding.padded_model_decision``)."""
    decided = credit_model_decision(module, path, manager, *args, **kwargs)
    if decided is not None:
        return decided
    decided = nextgen_model_decision(module, path, manager)
    if decided is not None:
        return decided
    decided = interp_model_decision(module, path, manager)
    if decided is not None:
        return decided
    return padded_model_decision(module, path, manager)
