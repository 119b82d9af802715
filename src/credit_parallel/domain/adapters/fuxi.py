"""CREDIT's FuXi (``credit.models.fuxi.Fuxi``) under latitude sharding: exact, or refused.

The converter makes FuXi's layers exact one by one (its Conv3d cube embedding, the down block's
convs and GroupNorms, the ZeroPad2d, the Swin-V2 blocks, the up block's ConvTranspose2d); what
is left is what FuXi's own forwards do between them with the GLOBAL grid in mind:

* ``CubeEmbedding.forward`` reshapes to ``self.patches_resolution`` and ``Fuxi.forward`` to
  ``2 * self.input_resolution``: the global latent grid, not the rows a rank holds;
* ``UTransformer.forward`` crops the latitude padding it added for the Swin windows with
  ``x[:, :, top : rows - bottom]``: on a shard every rank would crop its own edges;
* the un-patchify reshape turns each latent row into ``patch`` output rows, so balanced latent
  shards give unbalanced output shards (and an odd latent share cannot be written as
  ``2 * input_resolution``);
* ``interp=True`` calls ``F.interpolate`` on the sharded output;
* ``padding_conf.activate``: CREDIT's ``TensorPadding`` pads the input's latitude by tensor
  operations (rows beyond each pole: flipped and rolled by half the width, "earth", or
  reflected, "mirror") and crops the output with a slice.

:class:`DomainFuxi` replaces the model (recognised by qualified class name; the library never
imports miles-credit) and runs FuXi's own forward unmodified, with, for the duration of the
call only: the local latent rows in ``patches_resolution`` / ``input_resolution``; the latitude
padding of the crop set to zero while the Swin stage's output goes through one row exchange to
the balanced layout of the unpadded rows (the padding itself is the converted ZeroPad2d's: rows
at the global poles only); the u-transformer's output re-laid out so that every rank holds whole
row pairs (its ``input_resolution`` share is then an integer); the model's output rows sent back
to the balanced layout; ``F.interpolate`` replaced by :class:`DomainParallelInterpolate` (none
when the output already has the image size: bilinear to the same size is the identity); the
``TensorPadding`` replaced by a stand-in whose pad is one row exchange from the global row map
(:func:`.stand_ins.tensor_padding_rows`) and whose unpad returns the output rows and crops globally
(:func:`.stand_ins.tensor_unpadding_rows`).
Parameters, buffers and ``state_dict`` keys are the model's (``DomainWrapper``).

Refused at conversion (``ValueError`` naming the module): a ``padding_conf.mode`` other than
"earth" / "mirror", ``post_conf.activate`` (the post block), ``use_noise`` (per-pixel noise
drawn on each shard's rows) and a ``shard_dim`` other than -2; under
``nonlocal_policy="gather"`` the first three run whole on the globe instead
(:class:`~credit_parallel.domain.layers.gather.DomainGatherModule`, with a warning).
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.relayout import return_rows
from ..exchange.halo import exchange_rows
from ..layers.gather import DomainGatherModule, gather_cost_note
from ..layers.resample import DomainParallelInterpolate
from ..manager import resolve_manager
from ..rows import conv_output_length, conv_transpose_output_length, shard_range
from ..wrap import DomainWrapper, replace_outermost
from .regional import credit_refusal_reason
from .stand_ins import _share, _swapped, tensor_padding_rows, tensor_unpadding_rows

__all__ = [
    "FUXI_MODELS",
    "INTERP_MODELS",
    "NONLOCAL_CLASSES",
    "DomainFuxi",
    "FuxiGeometry",
    "convert_credit_models",
    "credit_model_decision",
    "fuxi_geometry",
    "fuxi_unshardable_reason",
    "is_fuxi",
    "pair_layout",
]

FUXI_MODELS = ("credit.models.fuxi.Fuxi",)
TENSOR_PADDING_MODES = ("earth", "mirror")  # credit.boundary_padding.TensorPadding
SHARD_DIM = -2  # H of FuXi's (B, C, T, H, W) input and output


def is_fuxi(module: nn.Module) -> bool:
    """Whether ``module`` is (a subclass of) a recognised FuXi model class."""
    return any(f"{c.__module__}.{c.__qualname__}" in FUXI_MODELS for c in type(module).__mro__)


def _hint() -> str:
    return (
        "build the model without it, run the whole model on the globe on every rank with "
        "nonlocal_policy='gather' (trainer.domain_nonlocal_policy), or train FuXi without "
        "domain parallelism (trainer.parallelism.domain: 1)"
    )


def fuxi_unshardable_reason(model: nn.Module) -> str | None:
    """Why a FuXi model cannot be made exact under latitude sharding (None when it can)."""
    padding = getattr(model, "padding_opt", None) if getattr(model, "use_padding", False) else None
    if padding is not None and getattr(padding, "mode", None) not in TENSOR_PADDING_MODES:
        return (
            f"padding_conf.mode {getattr(padding, 'mode', None)!r}: its TensorPadding pads "
            f"nothing the converter knows (known: {', '.join(TENSOR_PADDING_MODES)}); " + _hint()
        )
    if getattr(model, "use_post_block", False):
        return "post_conf.activate: its PostBlock is not known to be row-local; " + _hint()
    if getattr(model.u_transformer, "use_noise", False):
        return (
            "use_noise: its StochasticDecompositionLayer draws torch.randn(B, C, H, W) per "
            "forward, which a shard draws for its own rows (not the globe's); " + _hint()
        )
    proj = _plain(model.cube_embedding.proj)
    if proj.padding[1] != 0 or proj.kernel_size[1] != proj.stride[1] or proj.dilation[1] != 1:
        return (
            f"its cube embedding Conv3d (kernel {tuple(proj.kernel_size)}, stride "
            f"{tuple(proj.stride)}, padding {tuple(proj.padding)}) does not cut latitude into "
            "whole non-overlapping patches"
        )
    return None


def _plain(module: nn.Module) -> nn.Module:
    """The original layer behind a domain-parallel wrapper (its kernel, stride, padding)."""
    return getattr(module, "wrapped", module)


def pair_layout(rows: int, n: int, scale: int = 1) -> tuple:
    """Per rank, the rows it holds when ``rows`` (even) rows are dealt out as whole pairs in the
    balanced layout of the pairs, each row standing for ``scale`` consecutive rows."""
    return tuple(
        tuple(range(2 * a * scale, 2 * b * scale))
        for a, b in (shard_range(rows // 2, n, r) for r in range(n))
    )


def _balanced(length: int, n: int) -> tuple:
    return tuple(tuple(range(*shard_range(length, n, r))) for r in range(n))


class _ShardedTensorPadding:
    """Stands in for FuXi's ``padding_opt`` (``TensorPadding``) during a forward: ``pad`` gives
    each rank its balanced share of the padded globe's rows (one exchange; the pole rows of
    "earth" mode rolled over the unsharded width), ``unpad`` takes the output rows from their
    whole-pair layout to the balanced share of the rows the global crop keeps (two exchanges);
    the longitude padding and cropping stay local."""

    def __init__(self, original, exchange, n: int, rank: int, height: int, outputs, out_height):
        self.original, self.exchange, self.n, self.rank = original, exchange, n, rank
        self.height, self.outputs, self.out_height = height, outputs, out_height
        self.top, self.bottom = (int(v) for v in original.pad_NS)
        self.left, self.right = (int(v) for v in original.pad_WE)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        sources, rolled = tensor_padding_rows(
            self.original.mode, self.height, self.top, self.bottom
        )
        held = self.exchange(x, _share(sources, self.n), self.height, SHARD_DIM)
        flags = _share(rolled, self.n)[self.rank]
        if any(flags):
            pole = torch.tensor(flags, device=held.device).view(-1, 1)
            held = torch.where(pole, torch.roll(held, x.shape[-1] // 2, dims=-1), held)
        if self.left > 0 or self.right > 0:
            held = F.pad(held, (self.left, self.right, 0, 0, 0, 0), mode="circular")
        return held

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        y = self.exchange(x, self.outputs, self.out_height, SHARD_DIM, back=True)
        kept = tensor_unpadding_rows(self.original.mode, self.out_height, self.top, self.bottom)
        y = self.exchange(y, _share(kept, self.n), self.out_height, SHARD_DIM)
        if self.left > 0 or self.right > 0:
            end = -self.right if self.right > 0 or self.original.mode == "mirror" else None
            y = y[..., :, self.left : end]
        return y


class FuxiGeometry:
    """The global row counts of one FuXi forward, and the layouts every rank agrees on."""

    def __init__(self, height: int, latent: int, down: int, padded: int, up: int, patch: int):
        self.height, self.latent, self.down, self.padded = height, latent, down, padded
        self.up, self.patch = up, patch
        self.out = up * patch

    def crop_windows(self, top: int, n: int) -> tuple:
        """Per rank, the rows of the padded Swin grid that are its balanced share of the
        unpadded rows (what the global crop keeps)."""
        return tuple(
            tuple(range(top + a, top + b))
            for a, b in (shard_range(self.down, n, r) for r in range(n))
        )


def fuxi_geometry(model: nn.Module, height: int) -> FuxiGeometry:
    """Global rows after each stage of ``model`` for an input of ``height`` rows; a
    ``ValueError`` when the model itself would fail on the whole globe."""
    proj = _plain(model.cube_embedding.proj)
    patch = int(proj.kernel_size[1])
    latent = conv_output_length(height, patch, int(proj.stride[1]), 0, 0, 1)
    configured = int(model.cube_embedding.patches_resolution[1])
    if latent != configured:
        raise ValueError(
            f"an input of {height} rows gives {latent} latent rows but the model was built for "
            f"{configured} (the model itself would fail on the whole globe)"
        )
    ut = model.u_transformer
    conv = _plain(ut.down.conv)
    k, s, p, d = (int(v[0]) for v in (conv.kernel_size, conv.stride, conv.padding, conv.dilation))
    down = conv_output_length(latent, k, s, p, p, d)
    _, _, top, bottom = ut.padding
    tconv = _plain(ut.up.conv)
    up = conv_transpose_output_length(
        down,
        int(tconv.kernel_size[0]),
        int(tconv.stride[0]),
        int(tconv.padding[0]),
        int(tconv.output_padding[0]),
        int(tconv.dilation[0]),
    )
    expected = 2 * int(model.input_resolution[0])
    if up != expected:
        raise ValueError(
            f"its u-transformer gives {up} latent rows but its forward reshapes to {expected} "
            "(the model itself would fail on the whole globe)"
        )
    return FuxiGeometry(height, latent, down, down + top + bottom, up, patch)


class _RowExchange(nn.Module):
    """One exchange of rows between layouts of the same global rows.  A domain-parallel module
    of its own (the functional-call guard does not look inside the library's exchanges);
    ``back=False``: from the balanced layout to ``windows``; ``back=True``: from ``windows``
    (a permutation layout) back to the balanced one."""

    _domain_parallel = True

    def __init__(self, manager):
        super().__init__()
        self.manager = manager

    def forward(self, x, windows: tuple, length: int, dim: int, back: bool = False):
        if windows == _balanced(length, len(windows)):
            return x  # every rank already holds its rows: no exchange on any rank
        if back:
            return return_rows(x, windows, length, dim, self.manager)
        return exchange_rows(x, windows, length, dim, self.manager)


class DomainFuxi(DomainWrapper):
    """miles-credit's ``Fuxi`` on (B, C, T, H, W) shards along H; exact forward and backward.

    Not itself a domain-parallel layer (``_domain_parallel = False``): the converter still
    converts every layer inside it, and ``credit-parallel verify``'s guard still checks the
    functional calls of FuXi's forwards.  See the module docstring for what changes during a
    forward."""

    _domain_parallel = False

    def __init__(self, model: nn.Module, *, manager=None):
        if not is_fuxi(model):
            raise TypeError(f"DomainFuxi: {type(model).__qualname__} is not a known FuXi model")
        reason = fuxi_unshardable_reason(model)
        if reason is not None:
            raise ValueError(f"{type(model).__name__}: {reason}")
        super().__init__(model)
        # not registered in the dicts shared with the wrapped model: no new state_dict keys
        self.__dict__.update(manager=manager, _interpolations={})

    def _name(self) -> str:
        return f"{getattr(self, 'module_path', None) or '<root>'} ({type(self.wrapped).__name__})"

    def forward(self, x: torch.Tensor, noise=None, forecast_step=None):
        mgr = resolve_manager(self.manager, type(self.wrapped).__name__)
        model = self.wrapped
        model.training = self.training
        if mgr.domain_world_size == 1:
            return model(x, noise=noise, forecast_step=forecast_step)
        if x.dim() != 5:
            raise ValueError(
                f"{self._name()}: expects a (B, C, T, H, W) shard, got {tuple(x.shape)}"
            )
        exchange = _RowExchange(mgr)  # this call's manager, resolved above
        n, rank = mgr.domain_world_size, mgr.domain_rank
        input_height = height = mgr.global_length(self, x.shape[SHARD_DIM])
        padding = model.padding_opt if model.use_padding else None
        if padding is not None:
            top, bottom = (int(v) for v in padding.pad_NS)
            height = len(tensor_padding_rows(padding.mode, height, top, bottom)[0])
        try:
            geometry = fuxi_geometry(model, height)
        except ValueError as err:
            raise ValueError(f"{self._name()}: {err}") from None
        outputs = pair_layout(geometry.up, n, geometry.patch)
        with self._local_grid(geometry, n, rank, exchange):
            if padding is None:
                y = model(x, noise=noise, forecast_step=forecast_step)
                y = exchange(y, outputs, geometry.out, SHARD_DIM, back=True)
                out_height = geometry.out
            else:
                stand_in = _ShardedTensorPadding(
                    padding, exchange, n, rank, input_height, outputs, geometry.out
                )
                with _swapped(model, "padding_opt", stand_in):
                    y = model(x, noise=noise, forecast_step=forecast_step)
                out_height = len(
                    tensor_unpadding_rows(padding.mode, geometry.out, stand_in.top, stand_in.bottom)
                )
        if model.use_interp:
            y = self._interpolate(y, out_height, mgr)
        return y

    @contextmanager
    def _local_grid(self, geometry: FuxiGeometry, n: int, rank: int, exchange):
        """FuXi's global-grid attributes set to this rank's rows, the crop and the re-layout of
        the u-transformer's output hooked in; everything restored on exit (also on errors)."""
        model = self.wrapped
        ut, embedding = model.u_transformer, model.cube_embedding
        left, right, top, bottom = ut.padding
        latent_rows = shard_range(geometry.latent, n, rank)
        pairs = shard_range(geometry.up // 2, n, rank)
        with ExitStack() as stack:
            resolution = list(embedding.patches_resolution)
            resolution[1] = latent_rows[1] - latent_rows[0]
            stack.enter_context(_swapped(embedding, "patches_resolution", resolution))
            local = (pairs[1] - pairs[0], model.input_resolution[1])
            stack.enter_context(_swapped(model, "input_resolution", local))
            # the global crop of the Swin grid happens as an exchange after the stage; what
            # the forward then crops itself is the unsharded width only
            stack.enter_context(_swapped(ut, "padding", (left, right, 0, 0)))
            stack.enter_context(_swapped(model, "use_interp", False))
            if top or bottom:
                crop = geometry.crop_windows(top, n)
                stack.callback(
                    ut.layer.register_forward_hook(
                        lambda _m, _a, out: exchange(out, crop, geometry.padded, 1)
                    ).remove
                )
            rows = pair_layout(geometry.up, n)
            stack.callback(
                ut.register_forward_hook(
                    lambda _m, _a, out: exchange(out, rows, geometry.up, SHARD_DIM)
                ).remove
            )
            yield

    def _interpolate(self, y: torch.Tensor, height: int, mgr) -> torch.Tensor:
        """FuXi's ``F.interpolate(x, size=img_size_original[1:], mode="bilinear")`` on the
        balanced shards of its ``height`` output rows (before its ``unsqueeze(2)``)."""
        size = tuple(int(v) for v in self.wrapped.img_size_original[1:])
        if (height, y.shape[-1]) == size:
            return y  # bilinear to the same size copies its input
        built = self._interpolations.get(size)
        if built is None or built[0] is not mgr:
            built = (mgr, DomainParallelInterpolate(size=size, mode="bilinear", manager=mgr))
            self._interpolations[size] = built
        layer = built[1]
        return layer(y.squeeze(2)).unsqueeze(2)


# client classes whose forward mixes every grid point through a parameter over the flattened
# H x W nodes (a shard's rows would meet the wrong columns of the matrix): refused by name, or run
# on the gathered globe under nonlocal_policy="gather" (exact)
# (miles-credit's SpectralGNNBottleneck is made exact by adapters/nextgen.py)
NONLOCAL_CLASSES: dict[str, str] = {}

# whole CREDIT models whose own forward reads the global grid in ways no layer rule can see
# (miles-credit's NextGenWXFormer is made exact by adapters/nextgen.py)
_WHOLE_MODEL_REASONS: dict[str, str] = {}


# miles-credit models whose interpolation to the global image size (after the unpad, before
# the post block) is made exact by credit_interp.DomainInterpModel
INTERP_MODELS = frozenset(
    {
        "credit.models.crossformer.CrossFormer",
        "credit.models.wxformer.crossformer.CrossFormer",
        "credit.models.camulator.Camulator",
        "credit.models.wxformer.crossformer_diffusion.CrossFormerDiffusion",
    }
)


def _global_grid_reason(module: nn.Module) -> str | None:
    """Why a miles-credit model's own forward needs the whole grid: it interpolates to its
    stored global image size in a way no adapter makes exact; None otherwise.  (Its
    ``TensorPadding``, a plain object the converter cannot see as a module, is made exact by
    ``tensor_padding.DomainPaddedModel``; the interpolation of :data:`INTERP_MODELS` by
    ``credit_interp.DomainInterpModel``.)"""
    if not type(module).__module__.startswith("credit.models") or is_fuxi(module):
        return None  # FuXi: made exact whole (DomainFuxi), its interpolation included
    if not getattr(module, "use_interp", False):
        return None
    if f"{type(module).__module__}.{type(module).__qualname__}" in INTERP_MODELS:
        return None
    return (
        f"miles-credit's {type(module).__name__} cannot be domain parallel: its forward "
        "interpolates to the stored global image_height x image_width (model.interp: true), "
        "and only the CrossFormer family's forward (crossformer, wxformer, camulator) is "
        "known to the interpolation adapter; set model.interp: false, use domain: 1, or "
        "trainer.domain_nonlocal_policy: gather to run it whole on every domain rank"
    )


def credit_model_decision(
    module: nn.Module,
    path: str,
    manager,
    shard_dim: int = -2,
    skip_types=(),
    nonlocal_policy: str = "raise",
    on_gather=None,
):
    """The CREDIT-model step of the converter for ``module`` at ``path`` ("" or "<root>" for the
    model), outermost first: None (not a known CREDIT model: look at its children), ``module``
    itself (keep it, children not visited) or its replacement, built with its module path:
    :class:`DomainFuxi` (whose layers the converter then converts like anywhere else), or, when
    it cannot be exact and ``nonlocal_policy="gather"``, a :class:`DomainGatherModule` (then
    ``on_gather(path, why)`` is told).  Raises ``ValueError`` naming the path otherwise."""
    if isinstance(module, (DomainFuxi, *skip_types)) or getattr(module, "_domain_parallel", False):
        return module
    where = path or "<root>"
    whole = _WHOLE_MODEL_REASONS.get(f"{type(module).__module__}.{type(module).__qualname__}")
    whole = whole or credit_refusal_reason(module) or _global_grid_reason(module)
    if whole is not None:  # before its attention is converted: gathered whole, or refused
        if nonlocal_policy != "gather":
            raise ValueError(
                f"convert_to_domain_parallel: {where} ({type(module).__name__}): {whole}"
            )
        if on_gather is not None:
            on_gather(where, f"{type(module).__name__}: {whole}")
        return DomainGatherModule(module, shard_dim, manager=manager).configure(module_path=where)
    if not is_fuxi(module):
        return None
    if shard_dim != SHARD_DIM:
        raise ValueError(
            f"convert_to_domain_parallel: {where} ({type(module).__name__}): FuXi's "
            f"input is (B, C, T, H, W), latitude is shard_dim -2, got {shard_dim}"
        )
    reason = fuxi_unshardable_reason(module)
    if reason is not None and nonlocal_policy != "gather":
        raise ValueError(f"convert_to_domain_parallel: {where} ({type(module).__name__}): {reason}")
    if reason is not None:
        if on_gather is not None:
            on_gather(where, f"{type(module).__name__}: {reason}")
        replacement = DomainGatherModule(module, SHARD_DIM, manager=manager)
    else:
        replacement = DomainFuxi(module, manager=manager)
    return replacement.configure(module_path=where)


def convert_credit_models(
    model: nn.Module, manager, shard_dim: int = -2, skip_types=(), nonlocal_policy="raise"
):
    """Replace, in place, every recognised CREDIT model (FuXi; outermost first) by its exact
    domain-parallel form, or raise ``ValueError`` naming its path and why it cannot be exact
    (``nonlocal_policy="gather"``: run such a model on the whole globe instead, with a
    warning).  Modules of ``skip_types`` (the caller's custom converters) are left to the
    caller.  Returns the model (the root itself may be replaced)."""

    def warn(where: str, why: str) -> None:
        warnings.warn(
            f"nonlocal_policy='gather': {where} ({why}): "
            + gather_cost_note(manager.domain_world_size),
            stacklevel=4,
        )

    def replacement_for(module: nn.Module, path: str):
        return credit_model_decision(
            module, path, manager, shard_dim, skip_types, nonlocal_policy, warn
        )

    return replace_outermost(model, replacement_for)
