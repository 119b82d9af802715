"""miles-credit's ``nextgen_wxformer`` (``credit.models.wxformer.wxformer_next.NextGenWXFormer``)
exact on latitude shards and on lat x lon tiles.

Its layers are converted like anywhere else (the CrossEmbed convs, the short / long window
attention, the UpBlockPS convs, pixel shuffles and GroupNorms); three things in it read the
global grid, and each is made exact here:

* :class:`DomainSpectralBottleneck` (``SpectralGNNBottleneck``): the aggregation
  ``einsum("bcn,kn->bck", x, agg_w)`` is a sum over the H x W grid points, so each rank
  multiplies its own points by its own columns of ``agg_w`` and ONE all-reduce of the (B, C, K)
  partial sums over the domain group gives every rank the whole sum (its backward is the same
  all-reduce of the gradient).  The channel MLP then runs on the same (B, C, K) tensor on every
  rank, and each rank scatters with its own rows of ``scatter_w``.  The ``agg_w`` / ``scatter_w``
  gradients a rank computes are its own columns / rows (zero elsewhere), the MLP's are the
  rank's share: summed over the domain as the library sums domain gradients
  (``sync_domain_gradients``, FSDP2's reduce-scatter), they are one process's.  Its
  ``GroupNorm(1, dim)`` is the converted one (statistics over the whole group).
* :class:`DomainColumnAttention` (``ColumnAttention``): attention over the pressure levels at
  each grid point, point-wise in (H, W); with ``spatial_stride`` s > 1 the field is average
  pooled s x s first (each rank fetches the s rows / columns of its own pooled rows / columns
  from their owners, then pools locally) and the correction is interpolated back to the global
  H x W (``DomainParallelInterpolate``).  Its ``nn.MultiheadAttention`` attends over levels, not
  over grid points, and is left alone.
* :class:`DomainNextGenWXFormer` (the model): its forward interpolates from stage to stage to
  the size of the skip connection, and last to ``image_height x image_width``; here these are
  interpolations of the global field (``DomainParallelInterpolate`` to the skip's GLOBAL size,
  none where the sizes already agree: bilinear to the same size is the identity).  The rest of
  the forward is miles-credit 2026.2.0's, step for step, on the converted submodules: the
  wrapper runs it (a subclass that overrides ``forward`` is refused, except credit-parallel's
  one-frame subclass of a config-built model, whose 4-D input / output it keeps).

Parameters, buffers and ``state_dict`` keys are the model's (``DomainWrapper``).  Exact:
float64 <= 1e-10 against one process (``tests/test_credit_nextgen.py``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..exchange.halo import exchange_rows, exchange_tile, tile_plan
from ..layers.resample import DomainParallelInterpolate
from ..manager import resolve_manager
from ..rows import shard_range
from ..wrap import DomainWrapper
from .stand_ins import _Key

__all__ = [
    "COLUMN_ATTENTION",
    "NEXTGEN_MODEL",
    "SPECTRAL_BOTTLENECK",
    "DomainColumnAttention",
    "DomainNextGenWXFormer",
    "DomainSpectralBottleneck",
    "nextgen_model_decision",
    "nextgen_part_replacement",
]

_MODULE = "credit.models.wxformer.wxformer_next"
NEXTGEN_MODEL = f"{_MODULE}.NextGenWXFormer"
COLUMN_ATTENTION = f"{_MODULE}.ColumnAttention"
SPECTRAL_BOTTLENECK = f"{_MODULE}.SpectralGNNBottleneck"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is(module: nn.Module, name: str) -> bool:
    return any(_qualified(c) == name for c in type(module).__mro__)


# --------------------------------------------------------------------------- the grid
def _tiled(mgr) -> bool:
    return bool(getattr(mgr, "is_tiled", False))


def _global_hw(mgr, owner, x: torch.Tensor) -> tuple[int, int]:
    """The global (H, W) of ``x`` (B, C, h, w) in the balanced layout, learned under ``owner``."""
    if _tiled(mgr):
        return mgr.global_height(owner, x.shape[-2]), mgr.global_width(owner, x.shape[-1])
    return mgr.global_length(owner, x.shape[-2]), x.shape[-1]


def _owned(mgr, hw: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((row start, stop), (column start, stop))`` this rank owns of a global ``hw`` grid."""
    if _tiled(mgr):
        (p, q), (lat, lon) = mgr.domain_shape, mgr.domain_coords
        return shard_range(hw[0], p, lat), shard_range(hw[1], q, lon)
    return shard_range(hw[0], mgr.domain_world_size, mgr.domain_rank), (0, hw[1])


class _SumOverDomain(torch.autograd.Function):
    """``x`` summed over the domain group; its backward sums the gradient over the group (each
    rank's loss reads the sum, so every rank's partial receives every rank's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Interpolations:
    """``DomainParallelInterpolate`` layers by global output size, for one manager."""

    def __init__(self):
        self._layers: dict = {}

    def __call__(self, mgr, size: tuple[int, int]) -> DomainParallelInterpolate:
        built = self._layers.get(size)
        if built is None or built[0] is not mgr:
            layer = DomainParallelInterpolate(
                size=size, mode="bilinear", align_corners=False, manager=mgr
            )
            built = self._layers[size] = (mgr, layer)
        return built[1]


# --------------------------------------------------------------------------- bottleneck
class DomainSpectralBottleneck(DomainWrapper):
    """miles-credit's ``SpectralGNNBottleneck`` on shards or tiles; see the module docstring."""

    _domain_parallel = False  # its GroupNorm is converted like anywhere else
    domain_form = "collective"  # row-local plus one all-reduce (domain/geometry.py)
    domain_kind = "spectral_bottleneck"
    tile_exact = True

    def __init__(self, module: nn.Module, *, manager=None):
        if not _is(module, SPECTRAL_BOTTLENECK):
            raise TypeError(
                f"DomainSpectralBottleneck: {type(module).__name__} is not {SPECTRAL_BOTTLENECK}"
            )
        super().__init__(module)
        self.manager = manager
        self.__dict__["_grid"] = _Key()

    # ---- geometry and cost, for the planner (domain/geometry.py, domain/attention/cost.py)
    def output_height(self, input_height: int) -> int:
        return input_height

    def input_windows(self, input_height: int, n: int) -> None:
        return None  # no rows move: the (B, C, K) sums do

    def communication_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """Bytes all ranks send in the forward's ring all-reduce of the (B, C, K) partial sums
        (the backward sends as much again)."""
        batch, channels = input_shape[0], input_shape[1]
        return 2 * (n - 1) * batch * channels * self.wrapped.K * itemsize

    def activation_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """The busiest rank's rows of the input plus the whole (B, C, K) sum it holds."""
        height = input_shape[-2]
        per_row = math.prod(input_shape) // max(height, 1)
        spectral = input_shape[0] * input_shape[1] * self.wrapped.K
        return (per_row * -(-height // n) + spectral) * itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = self.wrapped
        mgr = resolve_manager(self.manager, "SpectralGNNBottleneck")
        if mgr.domain_world_size == 1:
            return module(x)
        batch, channels = x.shape[:2]
        hw = _global_hw(mgr, self._grid, x)
        if hw[0] * hw[1] != module.N:
            raise ValueError(
                f"{self.module_path or 'SpectralGNNBottleneck'}: a {hw[0]} x {hw[1]} grid has "
                f"{hw[0] * hw[1]} points, agg_w / scatter_w are sized for {module.N}"
            )
        (r0, r1), (c0, c1) = _owned(mgr, hw)
        rows = torch.arange(r0, r1, device=x.device)
        points = (rows[:, None] * hw[1] + torch.arange(c0, c1, device=x.device)).reshape(-1)
        normed = module.norm(x).reshape(batch, channels, -1)
        partial = torch.einsum("bcn,kn->bck", normed, module.agg_w.index_select(1, points))
        spectral = _SumOverDomain.apply(partial, mgr.domain_group)
        spectral = module.mlp(spectral.permute(0, 2, 1)).permute(0, 2, 1)
        delta = torch.einsum("bck,nk->bcn", spectral, module.scatter_w.index_select(0, points))
        return delta.reshape(x.shape) + x


# --------------------------------------------------------------------------- column attention
def _pool_windows(length: int, n: int, stride: int) -> tuple:
    """Per rank, the global input rows of its balanced share of ``length // stride`` pooled rows."""
    pooled = length // stride
    return tuple(
        tuple(range(stride * a, stride * b))
        for a, b in (shard_range(pooled, n, r) for r in range(n))
    )


class DomainColumnAttention(DomainWrapper):
    """miles-credit's ``ColumnAttention`` on shards or tiles; see the module docstring."""

    _domain_parallel = True  # its attention is over levels at each grid point: left alone
    domain_kind = "column_attention"
    tile_exact = True

    def __init__(self, module: nn.Module, *, manager=None):
        if not _is(module, COLUMN_ATTENTION):
            raise TypeError(
                f"DomainColumnAttention: {type(module).__name__} is not {COLUMN_ATTENTION}"
            )
        super().__init__(module)
        self.manager = manager
        self.__dict__.update(_grid=_Key(), _resize=_Interpolations())

    def _pooled(self, x: torch.Tensor, mgr, hw: tuple[int, int]) -> torch.Tensor:
        """``F.avg_pool2d(x, s, s)`` of the global field, this rank's balanced share of it."""
        s = self.wrapped.spatial_stride
        if _tiled(mgr):
            (p, q), coords = mgr.domain_shape, mgr.domain_coords
            plan = tile_plan(
                hw[0], hw[1], (p, q), coords, _pool_windows(hw[0], p, s), _pool_windows(hw[1], q, s)
            )
            window = exchange_tile(x, plan, (2, 3), mgr)
        else:
            windows = _pool_windows(hw[0], mgr.domain_world_size, s)
            window = exchange_rows(x, windows, hw[0], 2, mgr)
        return F.avg_pool2d(window, s, s)

    def forward(self, x_atmos: torch.Tensor) -> torch.Tensor:
        module = self.wrapped
        mgr = resolve_manager(self.manager, "ColumnAttention")
        stride = module.spatial_stride
        if mgr.domain_world_size == 1 or stride <= 1:
            return module(x_atmos)  # point-wise in (H, W): the model's own forward
        hw = _global_hw(mgr, self._grid, x_atmos)
        pooled = self._pooled(x_atmos, mgr, hw)
        batch, channels, h, w = pooled.shape
        levels = module.levels
        x = pooled.reshape(batch, module.channels, levels, h, w)
        x = x.permute(0, 3, 4, 2, 1).reshape(batch * h * w, levels, module.channels)
        x_n = module.norm(x)
        attn_out, _ = module.attn(x_n, x_n, x_n)
        delta = module.proj(attn_out)
        delta = delta.reshape(batch, h, w, levels, module.channels)
        delta = delta.permute(0, 4, 3, 1, 2).reshape(batch, channels, h, w)
        return x_atmos + self._resize(mgr, hw)(delta)


# --------------------------------------------------------------------------- the model
def _known_forward_reason(model: nn.Module) -> str | None:
    base = next(c for c in type(model).__mro__ if _qualified(c) == NEXTGEN_MODEL)
    if type(model).forward is base.forward or getattr(type(model), "_credit_one_frame", False):
        return None
    return (
        f"{type(model).__name__} overrides NextGenWXFormer.forward; the domain adapter runs "
        "miles-credit 2026.2.0's forward and cannot see inside another one"
    )


class DomainNextGenWXFormer(DomainWrapper):
    """miles-credit's ``NextGenWXFormer`` on shards or tiles; see the module docstring."""

    _domain_parallel = False  # every layer inside is converted
    tile_exact = True  # the interpolations of the global field are exact on tiles

    def __init__(self, model: nn.Module, *, manager=None):
        if not _is(model, NEXTGEN_MODEL):
            raise TypeError(f"DomainNextGenWXFormer: {type(model).__name__} is not {NEXTGEN_MODEL}")
        reason = _known_forward_reason(model)
        if reason is not None:
            raise ValueError(reason)
        super().__init__(model)
        self.manager = manager
        keys = {
            "skips": tuple(_Key() for _ in range(3)),
            "sources": tuple(_Key() for _ in range(4)),
        }
        self.__dict__.update(_keys=keys, _resize=_Interpolations())

    def _to_size(self, x: torch.Tensor, mgr, size: tuple[int, int], source) -> torch.Tensor:
        """``F.interpolate(x, size, bilinear)`` of the global field (``size`` global; the
        global size of ``x`` learned under the key ``source``)."""
        if _global_hw(mgr, source, x) == size:
            return x  # bilinear to the same size is the identity
        return self._resize(mgr, size)(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.wrapped
        mgr = resolve_manager(self.manager, type(model).__name__)
        if mgr.domain_world_size == 1:
            return model(x)
        one_frame = x.dim() == 4 and getattr(type(model), "_credit_one_frame", False)
        y = self._forward(model, x, mgr)
        return y.squeeze(2) if one_frame else y

    def _inputs(self, model, x: torch.Tensor):
        """CREDIT's input handling: frames into channels, the residual base, and the level
        embedding and column attention of each frame's atmospheric channels."""
        if x.dim() == 4:
            x = x.unsqueeze(2)
        batch, channels, frames, h, w = x.shape
        if frames > 1:
            x = x.permute(0, 2, 1, 3, 4).reshape(batch, channels * frames, h, w)
        else:
            x = x.squeeze(2)
        per_frame = model.channels * model.levels + model.surface_channels
        per_frame += model.input_only_channels
        offset = (frames - 1) * per_frame
        x_res = x[:, offset : offset + model.output_channels]
        if x_res.shape[1] < model.output_channels:
            x_res = F.pad(x_res, (0, 0, 0, 0, 0, model.output_channels - x_res.shape[1]))
        atmos = model.channels * model.levels
        slices = []
        for t in range(frames):
            start = t * per_frame
            x_atmos = model.col_attn(model.level_embedding(x[:, start : start + atmos]))
            slices.extend([x_atmos, x[:, start + atmos : start + per_frame]])
        return torch.cat(slices, dim=1), x_res

    def _forward(self, model, x: torch.Tensor, mgr) -> torch.Tensor:
        x, x_res = self._inputs(model, x)
        encodings = []
        for cross_embed, transformer in model.layers:
            x = transformer(cross_embed(x))
            encodings.append(x)
        x = model.spectral_bottleneck(x)
        ups = (model.up_block1, model.up_block2, model.up_block3)
        skips, sources = self._keys["skips"], self._keys["sources"]
        for up, skip, key, source in zip(ups, encodings[2::-1], skips, sources):
            x = self._to_size(up(x), mgr, _global_hw(mgr, key, skip), source)
            x = torch.cat([x, skip], dim=1)
        x = model.up_block4(x)
        image = (int(model.image_height), int(model.image_width))
        x = self._to_size(x, mgr, image, sources[3])
        if model.decoder_col_attn:
            atmos = model.channels * model.levels
            x = torch.cat([model.dec_col_attn(x[:, :atmos]), x[:, atmos:]], dim=1)
        return (x + x_res).unsqueeze(2)


# --------------------------------------------------------------------------- converter steps
def nextgen_part_replacement(module: nn.Module, manager):
    """The exact form of a ``ColumnAttention`` / ``SpectralGNNBottleneck`` (in a NextGenWXFormer
    or anywhere else), or None."""
    if _is(module, COLUMN_ATTENTION):
        return DomainColumnAttention(module, manager=manager)
    if _is(module, SPECTRAL_BOTTLENECK):
        return DomainSpectralBottleneck(module, manager=manager)
    return None


def nextgen_model_decision(module: nn.Module, path: str, manager):
    """The converter's step for a ``NextGenWXFormer``: its :class:`DomainNextGenWXFormer`
    (whose layers, column attention and bottleneck included, the converter then converts), or
    None for any other module."""
    if not _is(module, NEXTGEN_MODEL):
        return None
    where = path or "<root>"
    try:
        replacement = DomainNextGenWXFormer(module, manager=manager)
    except (TypeError, ValueError) as err:
        raise ValueError(f"convert_to_domain_parallel: {where}: {err}") from None
    return replacement.configure(module_path=where)
