"""CREDIT 2026.2's parallel names, as thin entry points onto credit-parallel's own.

miles-credit 2026.2's training code and newer models use names beyond the seed pages
(``credit.parallel.tensor_parallel``, ``credit.parallel.domain``, ``credit.parallel.fsdp2``).
Each is here under the same name and call signature, doing what credit-parallel does:

=============================  ===============================================================
CREDIT                          here
=============================  ===============================================================
``supports_native_tp(model)``   any ``_tp_plan`` OR ``_tp_col``/``_tp_row`` declaration (both
                                are one plan in ``tensor_parallel``)
``apply_native_tensor_parallel``  :func:`~credit_parallel.apply_tensor_parallel` (1x1 convs,
                                fused q|k|v and the dpb-style partial gradients included)
``TpColConv2d`` ...             :class:`~credit_parallel.parallel.tensor_parallel.TensorParallelProjection`
                                built from ``(layer, tp_group)``
``shard_lat_weights``           this rank's rows of the balanced layout (uneven H too)
``gather_spatial``              :func:`~credit_parallel.gather_tensor` (uneven, differentiable)
``fsdp2_is_applied``            the same test (``isinstance(model, FSDPModule)``)
=============================  ===============================================================

Differences by design (docs/credit.md): H need not divide by the domain size; the Tp modules
keep the original parameter names and full shapes (DTensors: ``weight``, not ``conv.weight``
/ ``linear.weight`` holding a slice) and a column module all-reduces its input gradient
(Megatron's "f", which CREDIT's lacks); ``gather_spatial`` is differentiable; a block whose
projections carry spectral norm is split too, the norm of each whole weight computed from its
shards (``tensor_parallel_spectral``), where CREDIT leaves the block replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..domain.manager import get_domain_parallel_manager
from ..domain.rows import shard_range
from ..domain.sharding import gather_tensor
from .tensor_parallel import COLUMN, ROW, TensorParallelProjection, apply_tensor_parallel

__all__ = [
    "TpColConv2d",
    "TpColLinear",
    "TpRowConv2d",
    "TpRowLinear",
    "apply_native_tensor_parallel",
    "fsdp2_is_applied",
    "gather_spatial",
    "shard_lat_weights",
    "supports_native_tp",
]


def supports_native_tp(model: nn.Module) -> bool:
    """True when any submodule declares tensor parallelism: CREDIT's ``_tp_plan`` or our
    ``_tp_col`` / ``_tp_row`` (CREDIT 2026.2 counts ``_tp_plan`` only; both are honoured here)."""
    return any(
        getattr(m, attr, None)
        for m in model.modules()
        for attr in ("_tp_plan", "_tp_col", "_tp_row")
    )


def apply_native_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """CREDIT's entry point: :func:`~credit_parallel.apply_tensor_parallel` on ``tp_mesh`` (a 1-D
    mesh), in place; raises ``ValueError`` when nothing declares tensor parallelism (as CREDIT
    does).  Sets ``model._tp_group`` and ``model._tp_native`` as CREDIT's trainer expects."""
    if not supports_native_tp(model):
        raise ValueError(
            f"apply_native_tensor_parallel: no module of {type(model).__name__} declares "
            "_tp_plan or _tp_col/_tp_row; declare them on the blocks to split, or set "
            "trainer.parallelism.tensor: 1"
        )
    apply_tensor_parallel(model, tp_mesh)
    model._tp_group = tp_mesh.get_group()
    model._tp_native = True
    return model


def _tp_mesh_of(tp_group):
    from torch.distributed.device_mesh import DeviceMesh

    device = "cuda" if dist.get_backend(tp_group) == "nccl" else "cpu"
    return DeviceMesh.from_group(tp_group, device, mesh_dim_names=("tp",))


class _TpModule(TensorParallelProjection):
    """``TensorParallelProjection`` built from CREDIT's ``(layer, tp_group)`` arguments."""

    _layer_type: type = nn.Module
    _role: str = COLUMN

    def __init__(self, layer: nn.Module, tp_group):
        if not isinstance(layer, self._layer_type):
            raise TypeError(
                f"{type(self).__name__} wraps an {self._layer_type.__name__}, got "
                f"{type(layer).__name__}"
            )
        if isinstance(layer, nn.Conv2d) and not (
            tuple(layer.kernel_size) == (1, 1)
            and tuple(layer.stride) == (1, 1)
            and tuple(layer.dilation) == (1, 1)
            and layer.groups == 1
            and (layer.padding in ("valid", "same") or all(p == 0 for p in layer.padding))
        ):
            raise ValueError(
                f"{type(self).__name__} supports only 1x1 convolutions (stride 1, no padding, "
                f"dilation 1, groups 1), got {layer!r}"
            )
        width = layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels
        if self._role == COLUMN:
            width = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        tp_size = dist.get_world_size(tp_group)
        if width % tp_size:
            side = "output" if self._role == COLUMN else "input"
            raise ValueError(
                f"{type(self).__name__}: {side} width {width} is not divisible by the tp size "
                f"{tp_size}"
            )
        super().__init__(layer, _tp_mesh_of(tp_group), self._role)
        self.tp_group = tp_group


class TpColConv2d(_TpModule):
    """CREDIT's column-parallel 1x1 ``Conv2d``: output channels split over ``tp_group``; the
    input gradient is all-reduced over tp (exact; CREDIT's leaves it partial)."""

    _layer_type, _role = nn.Conv2d, COLUMN


class TpRowConv2d(_TpModule):
    """CREDIT's row-parallel 1x1 ``Conv2d``: input channels split, partial outputs all-reduced,
    the bias added once after the sum."""

    _layer_type, _role = nn.Conv2d, ROW


class TpColLinear(_TpModule):
    """CREDIT's column-parallel ``Linear`` (see :class:`TpColConv2d`)."""

    _layer_type, _role = nn.Linear, COLUMN


class TpRowLinear(_TpModule):
    """CREDIT's row-parallel ``Linear`` (see :class:`TpRowConv2d`)."""

    _layer_type, _role = nn.Linear, ROW


def shard_lat_weights(weights: torch.Tensor, target_h: int, manager=None) -> torch.Tensor:
    """Latitude weights matched to a (possibly domain-sharded) target height: ``weights``
    unchanged when the heights agree, else this rank's rows of the balanced layout along dim
    -2.  Unlike CREDIT, H need not divide by the domain size.  ``manager``: the process-wide
    one when None.  ``ValueError`` when the mismatch is not domain sharding."""
    weights_h = weights.shape[-2]
    manager = manager if manager is not None else get_domain_parallel_manager()
    if getattr(manager, "is_tiled", False):  # a lat x lon tile (SPEC §3b)
        return _tile_lat_weights(weights, target_h, manager)
    if weights_h == target_h:
        return weights
    if manager is None or manager.domain_world_size <= 1:
        raise ValueError(
            f"latitude weights height ({weights_h}) does not match the target height "
            f"({target_h}) and no domain parallelism is active"
        )
    start, stop = shard_range(weights_h, manager.domain_world_size, manager.domain_rank)
    if stop - start != target_h:
        raise ValueError(
            f"latitude weights height {weights_h} gives domain rank {manager.domain_rank} of "
            f"{manager.domain_world_size} {stop - start} rows, but the target has {target_h}"
        )
    return weights.narrow(-2, start, target_h).contiguous()


def _tile_lat_weights(weights: torch.Tensor, target_h: int, manager) -> torch.Tensor:
    """:func:`shard_lat_weights` on a lat x lon tile: this rank's rows (of P) and, when the
    weights have a longitude dim wider than 1, its columns (of Q)."""
    (p, q), (lat, lon) = manager.domain_shape, manager.domain_coords
    weights_h, weights_w = weights.shape[-2], weights.shape[-1]
    start, stop = shard_range(weights_h, p, lat)
    if stop - start != target_h:
        raise ValueError(
            f"latitude weights height {weights_h} gives tile row {lat} of {p} {stop - start} "
            f"rows, but the target has {target_h}"
        )
    out = weights.narrow(-2, start, target_h)
    if weights_w > 1:
        c0, c1 = shard_range(weights_w, q, lon)
        out = out.narrow(-1, c0, c1 - c0)
    return out.contiguous()


def gather_spatial(tensor: torch.Tensor, manager) -> torch.Tensor:
    """CREDIT's inverse of ``shard_spatial``: the domain shards along dim -2 all-gathered into
    the global tensor on every rank (uneven shards too; differentiable, unlike CREDIT's)."""
    if manager is None or manager.domain_world_size <= 1:
        return tensor
    return gather_tensor(tensor, -2, manager)


def fsdp2_is_applied(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` (the config may ask for fsdp2 on a
    layout that leaves the model alone, so AMP / scaler decisions check the model)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
