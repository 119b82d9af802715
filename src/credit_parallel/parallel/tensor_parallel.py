"""Tensor parallelism (SPEC §4): the ``_tp_col`` / ``_tp_row`` plan and the projection styles.

A model opts in by declaring, on any module, class (or instance) attributes

* ``_tp_col`` / ``_tp_row``: a dotted path (str) or a list/tuple of dotted paths, relative to
  the declaring module, naming an ``nn.Linear`` or a 1x1 ``nn.Conv2d`` to split column-wise
  (output features/channels) or row-wise (input features/channels); or CREDIT 2026.2's
  ``_tp_plan = {"to_q": "colwise", "to_out": "rowwise"}`` (same meaning; with its optional
  ``_tp_constraints(instance, tp_size)`` check);
* ``_tp_fused = {"to_qkv": 3}``: a column target whose output is ``parts`` equal-width blocks
  concatenated along the output axis (q|k|v).  It is split *per part*: tp rank t computes
  ``[q_t | k_t | v_t]`` (slice t of every part), so attention heads stay whole;
* ``_tp_head_dim = 16`` (an int for every column target of the declaring module, or a dict
  ``{path: head_dim}``): each part's per-rank width must hold whole heads.

:func:`build_tensor_parallel_plan` turns the declarations into a plan ``{full_module_path:
style}`` (the ``parallelize_module`` plan shape) after checking every target; it needs no process
group.  :func:`apply_tensor_parallel` then applies the plan on a 1-D tp mesh.  Semantics are
Megatron's: the input of a column layer is replicated and its gradient is all-reduced over tp in
backward ("f"); the output of a row layer is all-reduced in forward ("g"), its bias added once.
Between a column layer and its row layer activations stay local (sharded features/channels) as
plain tensors, so pointwise ops in between work unchanged; the pair's inputs and outputs are plain
replicated tensors.

Styles: a plain column ``nn.Linear`` uses PyTorch's ``ColwiseParallel(use_local_output=True)``.
Row layers (Linear and 1x1 conv), 1x1 column convolutions and fused column layers use
:class:`RowwiseProjectionParallel` / :class:`ColwiseProjectionParallel`, which replace the layer
by a :class:`TensorParallelProjection` computing on local shards.  PyTorch's ``RowwiseParallel``
is not used: it turns the replicated bias into a ``Partial`` by giving every rank ``bias / tp``
(``Partial._partition_value``) and sums those shares, so the bias is not added once and the
result is not bit-equal to the single-process one at tp = 3.  Parameter names are kept and every
split parameter is an ``nn.Parameter`` wrapping a DTensor on the tp mesh whose full shape and
``full_tensor()`` equal the original (so FSDP2 and DCP treat all of them alike); row biases are
``Replicate()`` DTensors.

Fused projections are *stored* as plain ``Shard(0)`` DTensors and regrouped into the per-part
layout at each forward (one all-gather of the weight over tp, its gradient back the same way):
``_StridedShard(0, split_factor=parts)`` expresses that layout, but DCP cannot save it (one
block per rank assumed) and FSDP2 on top of it gives a silently wrong ``full_tensor()`` (torch
2.13).  When that all-gather matters, declare separate q, k and v Linears instead.

Attention modules that are TP-ready derive their head count from the projection output width at
run time (``heads_local = width // head_dim``), never from a stored ``heads`` attribute: after
conversion each tp rank sees ``heads / tp`` heads.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..layout.compat import regroup_parts
from .tensor_parallel_guard import (
    CopyToTensorParallel,
    ReduceFromTensorParallel,
    install_partial_gradient_guard,
)
from .tensor_parallel_heads import check_stored_heads, undeclared_fused_message
from .tensor_parallel_spectral import attach_spectral_norm, spectral_norm_of, spectral_sigma
from .tp_declarations import COLUMN, ROW, _declared_roles, _declarer, _join, _where

__all__ = [
    "ColwiseProjectionParallel",
    "convert_projection_in_place",
    "RowwiseProjectionParallel",
    "TensorParallelProjection",
    "TensorParallelTarget",
    "apply_tensor_parallel",
    "build_tensor_parallel_plan",
    "collect_tensor_parallel_targets",
    "tp_replicated_parameters",
]

_DECLARATION = {COLUMN: "_tp_col", ROW: "_tp_row"}
# Set on the root model by apply_tensor_parallel: names of the parameters it turned into
# DTensors on the tp mesh (read by tp_replicated_parameters).
_TP_PARAMETERS_ATTR = "_tp_parameter_names"


# --------------------------------------------------------------------------------------------
# The projection module and its two styles (row layers, 1x1 convs, fused column layers).
# --------------------------------------------------------------------------------------------


def _distribute(param, tp_mesh, placement, src_data_rank) -> nn.Parameter:
    dtensor = distribute_tensor(param.detach(), tp_mesh, [placement], src_data_rank=src_data_rank)
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


class TensorParallelProjection(nn.Module):
    """A Linear or 1x1 Conv2d split over the channel axis of a tp mesh, computed on local shards.

    ``role="col"``: ``weight`` is ``Shard(0)`` (output channels), ``bias`` ``Shard(0)``; the input
    is replicated (gradient all-reduced in backward) and the output holds this rank's channels.
    With ``parts > 1`` the output axis is ``parts`` concatenated blocks and this rank computes
    ``[block_0 slice t | block_1 slice t | ...]``.  ``role="row"``: ``weight`` is ``Shard(1)``
    (input channels), ``bias`` ``Replicate()``; the input holds this rank's channels, the partial
    outputs are all-reduced and the bias is added once, after the sum.

    Parameter names (``weight``, ``bias``) and full shapes are those of the wrapped layer, so
    ``state_dict`` keys do not change (a spectral-normed weight keeps its form's names:
    ``tensor_parallel_spectral``).  Linear acts on the last dim, the conv on dim -3 (C of
    CHW/BCHW).  The styles convert a layer IN PLACE (:func:`convert_projection_in_place`: the
    layer's class becomes a subclass of this one and of its own class, as FSDP2 does), which is
    what torch's ``parallelize_module`` needs; this constructor builds a separate module.
    """

    _spectral = None  # a SpectralNormSpec when the weight is spectrally normalised

    def __init__(
        self,
        layer: nn.Linear | nn.Conv2d,
        tp_mesh: DeviceMesh,
        role: str,
        *,
        parts: int = 1,
        src_data_rank: int | None = 0,
    ):
        super().__init__()
        self._split(layer, tp_mesh, role, parts, src_data_rank)

    def _split(self, layer, tp_mesh, role, parts, src_data_rank) -> None:
        """Set the projection's attributes and its DTensor parameters from ``layer``'s."""
        if role not in (COLUMN, ROW):
            raise ValueError(f"role must be {COLUMN!r} or {ROW!r}, got {role!r}")
        if role == ROW and parts != 1:
            raise ValueError("only a column-parallel projection can be fused (parts > 1)")
        self.kind = "linear" if isinstance(layer, nn.Linear) else "conv1x1"
        self.role = role
        self.parts = parts
        if self.kind == "linear":
            self.in_features, self.out_features = layer.in_features, layer.out_features
        else:
            self.in_features, self.out_features = layer.in_channels, layer.out_channels
        self.tp_size = tp_mesh.size()
        # The mesh is not stored: forward reads it from the weight, which under FSDP2 is the
        # unsharded DTensor on the tp mesh.
        weight_placement = Shard(0) if role == COLUMN else Shard(1)
        bias_placement = Shard(0) if role == COLUMN else Replicate()
        spec = spectral_norm_of(layer)  # then the weight is its original (..._spectral)
        weight = layer.weight if spec is None else layer.get_parameter(spec.orig)
        weight, bias = _distribute(weight, tp_mesh, weight_placement, src_data_rank), layer.bias
        if spec is None:
            self.weight = weight
        else:
            attach_spectral_norm(self, layer, spec, weight, type(layer).__name__)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _distribute(bias, tp_mesh, bias_placement, src_data_rank)

    def _local(self, param: nn.Parameter | None) -> torch.Tensor | None:
        """This rank's slice of ``param`` as a differentiable plain tensor."""
        if param is None:
            return None
        if self.parts > 1:
            # Stored as Shard(0) (DCP/FSDP2-safe); regroup to the per-part layout here.  The
            # backward of the redistribute brings the gradient back to Shard(0).
            return regroup_parts(param, self.parts)
        return param.to_local()

    def _project(self, x, weight, bias):
        if self.kind == "linear":
            return F.linear(x, weight, bias)
        return F.conv2d(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        param = self.weight if (spec := self._spectral) is None else self.get_parameter(spec.orig)
        group = param.device_mesh.get_group()
        weight, bias = self._local(param), self._local(self.bias)
        if spec is not None:  # the norm of the whole weight, from the shards
            weight = weight / spectral_sigma(self, param, group)
        if self.role == COLUMN:
            x = CopyToTensorParallel.apply(x, group)
            return self._project(x, weight, bias)
        out = ReduceFromTensorParallel.apply(self._project(x, weight, None), group)
        if bias is not None:
            out = out + (bias if self.kind == "linear" else bias.view(-1, 1, 1))
        return out

    def extra_repr(self) -> str:
        fused = f", parts={self.parts}" if self.parts > 1 else ""
        return (
            f"{self.kind}, role={self.role}, in={self.in_features}, out={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp_size}{fused}"
        )


_PROJECTION_CLASSES: dict[type, type] = {}


def convert_projection_in_place(
    layer: nn.Linear | nn.Conv2d,
    tp_mesh: DeviceMesh,
    role: str,
    *,
    parts: int = 1,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Turn ``layer`` itself into a :class:`TensorParallelProjection`; returns it.

    Its class becomes ``TensorParallelProjection`` x its own class (hooks, module identity,
    parent references and ``isinstance(layer, nn.Linear)`` stay), its parameters DTensors.
    """
    base = type(layer)
    if base not in _PROJECTION_CLASSES:
        _PROJECTION_CLASSES[base] = type(
            "TensorParallelProjection", (TensorParallelProjection, base), {}
        )
    projection = _PROJECTION_CLASSES[base]
    if isinstance(layer, TensorParallelProjection):
        raise ValueError(f"{type(layer).__name__} is already tensor-parallel")
    layer.__class__ = projection
    layer._split(layer, tp_mesh, role, parts, src_data_rank)
    return layer


class ColwiseProjectionParallel(ParallelStyle):
    """Column style for a 1x1 ``nn.Conv2d`` or a fused ``nn.Linear``: turns the layer, in place,
    into a column :class:`TensorParallelProjection`.  Usable in a plan dict for torch's
    ``parallelize_module``."""

    def __init__(self, *, parts: int = 1):
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return convert_projection_in_place(
            module, device_mesh, COLUMN, parts=self.parts, src_data_rank=self.src_data_rank
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(parts={self.parts})"


class RowwiseProjectionParallel(ParallelStyle):
    """Row style for an ``nn.Linear`` or a 1x1 ``nn.Conv2d``: turns the layer, in place, into a
    row :class:`TensorParallelProjection` (partial sums all-reduced, then the bias added once).
    Usable in a plan dict for torch's ``parallelize_module``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return convert_projection_in_place(
            module, device_mesh, ROW, src_data_rank=self.src_data_rank
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# --------------------------------------------------------------------------------------------
# Declarations -> targets -> checked plan.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorParallelTarget:
    """One declared layer: full path from the root, role, and where it was declared."""

    path: str
    role: str
    declared_by: str
    declared_as: str
    parts: int = 1
    head_dim: int | None = None
    fused_declared: bool = False  # listed in _tp_fused (even with 1 part: "not fused, checked")

    def describe(self) -> str:
        owner = self.declared_by or "<root>"
        attr = _DECLARATION[self.role]
        return f"{self.path!r} (declared as {self.declared_as!r} in {attr} of {owner!r})"


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    return value


def collect_tensor_parallel_targets(model: nn.Module) -> list[TensorParallelTarget]:
    """Read every ``_tp_col`` / ``_tp_row`` / ``_tp_fused`` / ``_tp_head_dim`` declaration.

    Returns the targets in ``named_modules`` order with full paths; checks the declarations
    themselves (types, fused/head-dim entries naming declared column paths, one role per layer)
    but not the layers they point at (see :func:`build_tensor_parallel_plan`).
    """
    targets: dict[str, TensorParallelTarget] = {}
    for name, module in model.named_modules():
        cols, rows = _declared_roles(module, name)
        fused = getattr(_declarer(module), "_tp_fused", None) or {}
        head_dim = getattr(_declarer(module), "_tp_head_dim", None)
        if not isinstance(fused, dict):
            raise TypeError(
                f"_tp_fused of module {_where(name)} must be a dict {{path: parts}}, got {fused!r}"
            )
        for rel, parts in fused.items():
            _positive_int(parts, f"_tp_fused[{rel!r}] of module {_where(name)}")
            if rel not in cols:
                raise ValueError(
                    f"_tp_fused of module {_where(name)} names {rel!r}, which is not one of its "
                    f"column targets (_tp_col = {cols}); only column layers can be fused"
                )
        if isinstance(head_dim, dict):
            for rel, hd in head_dim.items():
                _positive_int(hd, f"_tp_head_dim[{rel!r}] of module {_where(name)}")
                if rel not in cols:
                    raise ValueError(
                        f"_tp_head_dim of module {_where(name)} names {rel!r}, which is not one "
                        f"of its column targets (_tp_col = {cols})"
                    )
        elif head_dim is not None:
            _positive_int(head_dim, f"_tp_head_dim of module {_where(name)}")

        for role, rels in ((COLUMN, cols), (ROW, rows)):
            for rel in rels:
                if role == COLUMN:
                    hd = head_dim.get(rel) if isinstance(head_dim, dict) else head_dim
                    target = TensorParallelTarget(
                        _join(name, rel), role, name, rel, fused.get(rel, 1), hd, rel in fused
                    )
                else:
                    target = TensorParallelTarget(_join(name, rel), role, name, rel)
                seen = targets.get(target.path)
                if seen is None or (
                    target.fused_declared
                    and not seen.fused_declared
                    and (seen.role, seen.parts, seen.head_dim)
                    == (target.role, target.parts, target.head_dim)
                ):
                    targets[target.path] = target
                elif (seen.role, seen.parts, seen.head_dim) != (
                    target.role,
                    target.parts,
                    target.head_dim,
                ):
                    raise ValueError(
                        f"tensor-parallel target {target.path!r} is declared twice with "
                        f"different settings: {seen.describe()} [{seen.role}, parts={seen.parts}, "
                        f"head_dim={seen.head_dim}] and {target.describe()} [{target.role}, "
                        f"parts={target.parts}, head_dim={target.head_dim}]; keep one declaration"
                    )
    return list(targets.values())


def _is_fused_name(path: str) -> bool:
    return "kv" in path.rsplit(".", 1)[-1].lower()  # also catches "qkv"


def _resolve(model: nn.Module, target: TensorParallelTarget) -> nn.Module:
    try:
        return model.get_submodule(target.path)
    except AttributeError as err:
        raise ValueError(
            f"tensor-parallel target {target.describe()} does not exist in "
            f"{type(model).__name__} ({err}); fix the dotted path, relative to the declaring module"
        ) from None


def _check_divisible(target, what: str, width: int, tp_size: int) -> None:
    if width % tp_size:
        raise ValueError(
            f"tensor-parallel target {target.describe()}: {what} = {width} is not divisible by "
            f"the tp size {tp_size}; choose a width that is a multiple of {tp_size} or another "
            "tensor degree"
        )


def _check_layer(layer: nn.Module, target: TensorParallelTarget, tp_size: int) -> None:
    for pname, param in layer.named_parameters(recurse=False):
        if isinstance(param, DTensor):
            raise ValueError(
                f"tensor-parallel target {target.describe()}: parameter {pname!r} is already a "
                "DTensor (apply_tensor_parallel called twice?)"
            )
    for base in (nn.Linear, nn.Conv2d):
        if isinstance(layer, base) and type(layer).forward is not base.forward:
            raise TypeError(
                f"tensor-parallel target {target.describe()} is a {type(layer).__name__} with "
                f"its own forward; only a plain {base.__name__} can be converted"
            )
    if isinstance(layer, nn.Linear):
        out_width, in_width = layer.out_features, layer.in_features
        out_name, in_name = "out_features", "in_features"
    elif isinstance(layer, nn.Conv2d):
        problems = []
        if tuple(layer.kernel_size) != (1, 1):
            problems.append(f"kernel_size={tuple(layer.kernel_size)} (must be 1x1)")
        if tuple(layer.stride) != (1, 1):
            problems.append(f"stride={tuple(layer.stride)} (must be 1)")
        padding = layer.padding
        if not (
            (isinstance(padding, str) and padding in ("valid", "same"))
            or (not isinstance(padding, str) and all(p == 0 for p in padding))
        ):
            problems.append(f"padding={padding} (must be 0)")
        if tuple(layer.dilation) != (1, 1):
            problems.append(f"dilation={tuple(layer.dilation)} (must be 1)")
        if layer.groups != 1:
            problems.append(f"groups={layer.groups} (must be 1)")
        if problems:
            raise ValueError(
                f"tensor-parallel target {target.describe()} is an nn.Conv2d with "
                f"{', '.join(problems)}; only 1x1 convolutions (stride 1, no padding, dilation "
                "1, groups 1) can be split over channels; remove it from the declaration"
            )
        out_width, in_width = layer.out_channels, layer.in_channels
        out_name, in_name = "out_channels", "in_channels"
    else:
        raise TypeError(
            f"tensor-parallel target {target.describe()} is a {type(layer).__name__}; only "
            "nn.Linear and 1x1 nn.Conv2d can be split over tp"
        )

    if target.role == ROW:
        _check_divisible(target, in_name, in_width, tp_size)
        return
    if target.parts == 1 and _is_fused_name(target.path) and not target.fused_declared:
        raise ValueError(undeclared_fused_message(target))
    if out_width % target.parts:
        raise ValueError(
            f"tensor-parallel target {target.describe()}: {out_name} = {out_width} is not "
            f"{target.parts} equal parts (_tp_fused)"
        )
    part_width = out_width // target.parts
    what = f"{out_name} per part" if target.parts > 1 else out_name
    _check_divisible(target, what, part_width, tp_size)
    if target.head_dim is not None and (part_width // tp_size) % target.head_dim:
        raise ValueError(
            f"tensor-parallel target {target.describe()}: {what} = {part_width} over tp "
            f"{tp_size} gives {part_width // tp_size} per rank, not a multiple of head_dim "
            f"{target.head_dim}, so attention heads would be split; use a tensor degree that "
            "divides the number of heads"
        )


def _style_for(layer: nn.Module, target: TensorParallelTarget) -> ParallelStyle:
    norm = spectral_norm_of(layer, target.describe())  # refuses any other weight hook
    if target.role == ROW:
        return RowwiseProjectionParallel()
    if isinstance(layer, nn.Linear) and target.parts == 1 and norm is None:
        return ColwiseParallel(use_local_output=True)
    return ColwiseProjectionParallel(parts=target.parts)


def _role_of(style: ParallelStyle) -> str:
    return ROW if isinstance(style, RowwiseProjectionParallel) else COLUMN


def build_tensor_parallel_plan(model: nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """Check every declared target against ``tp_size`` and return ``{full_path: style}``.

    Pure (no process group): raises ``ValueError`` / ``TypeError`` naming the full module path
    for a missing path, a layer that is not ``nn.Linear`` / 1x1 ``nn.Conv2d``, a width not
    divisible by ``tp_size`` (per part for fused layers), heads that would be split, or an
    undeclared fused projection (a column target whose last name component contains "qkv"/"kv").
    """
    _positive_int(tp_size, "tp_size")
    for _, module in model.named_modules():  # CREDIT's optional per-block check
        module = _declarer(module)
        check = getattr(type(module), "_tp_constraints", None)
        if check is not None and getattr(module, "_tp_plan", None):
            check(module, tp_size)
    plan = {}
    for target in collect_tensor_parallel_targets(model):
        layer = _resolve(model, target)
        owner = _declarer(model.get_submodule(target.declared_by))
        check_stored_heads(owner, target, _is_fused_name)
        _check_layer(layer, target, tp_size)
        plan[target.path] = _style_for(layer, target)
    return plan


# --------------------------------------------------------------------------------------------
# Entry points.
# --------------------------------------------------------------------------------------------


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh | None, *, src_data_rank: int | None = 0
) -> nn.Module:
    """Split the layers ``model`` declares (``_tp_col`` / ``_tp_row``) over ``tp_mesh``; in place.

    Every target is checked before anything changes (no half-converted model).  Call it before
    FSDP2: parameters become ``nn.Parameter`` s wrapping DTensors on ``tp_mesh`` (a 1-D submesh of
    the full mesh), which ``fully_shard`` shards further over dp.  The first forward is traced
    (``tensor_parallel_guard``; under ``torch.compile`` at trace time, on a meta twin): replicated
    tensors meeting sharded activations get their gradient all-reduced over tp.

    Args:
        model: the model to convert (its opted-in blocks name their column/row layers).
        tp_mesh: the 1-D tensor-parallel mesh (``mesh["tp"]``); None or of size 1: untouched.
        src_data_rank: the tp rank whose weights every rank takes (0: the converted model equals
            rank 0's original); None takes each rank's own copy without communication (a model
            on the meta device, materialised afterwards).

    Returns:
        ``model`` itself, converted.

    Example::

        mesh, sub = build_device_mesh(conf["trainer"]["parallelism"])
        model = apply_tensor_parallel(model, sub.get("tp"))
    """
    if tp_mesh is None:
        return model
    if not isinstance(tp_mesh, DeviceMesh):
        raise TypeError(f"tp_mesh must be a DeviceMesh or None, got {type(tp_mesh).__name__}")
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"tp_mesh must be 1-D, got a mesh of shape {tuple(tp_mesh.shape)} with dims "
            f"{tp_mesh.mesh_dim_names}; pass the tp submesh (mesh['tp'])"
        )
    tp_size = tp_mesh.size()
    if tp_size == 1:
        return model
    plan = build_tensor_parallel_plan(model, tp_size)
    converted = set(getattr(model, _TP_PARAMETERS_ATTR, ()))
    for path in plan:
        converted.update(_join(path, n) for n, _ in model.get_submodule(path).named_parameters())
    # replicated tensors meeting sharded activations: found on the first forward, made exact
    roles = {role: {p for p, t in plan.items() if _role_of(t) == role} for role in (COLUMN, ROW)}
    install_partial_gradient_guard(model, roles[COLUMN], roles[ROW], tp_mesh.get_group())
    # every style converts its layer in place, so torch's own walker applies the plan
    parallelize_module(model, tp_mesh, plan, src_data_rank=src_data_rank)
    setattr(model, _TP_PARAMETERS_ATTR, frozenset(converted))
    return model


def tp_replicated_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter NOT split by :func:`apply_tensor_parallel`.

    These stay plain tensors, identical on every tp rank (norm weights, embeddings, convolutions
    outside the tp pairs...), reduced over dp/domain only and counted once, not once per tp
    rank, in a global norm.  Their gradients are identical across tp ranks when every path from
    them to the loss either stays replicated or enters the tp region through a column layer
    (whose "f" all-reduces the input gradient).  A replicated tensor that meets tp-sharded
    activations directly (a position bias added to the local heads' attention scores) gets
    only its rank's heads' share: :mod:`tensor_parallel_guard` finds such tensors on the first
    forward and all-reduces their gradients over tp, so the gradients are equal again, and
    ``credit-parallel verify`` reports any that still differ.  Row-layer biases are not listed:
    they are ``Replicate()`` DTensors on the tp mesh.  Names are those of ``model`` (FSDP2 keeps
    them).  On a model never converted, every parameter is listed.
    """
    converted = getattr(model, _TP_PARAMETERS_ATTR, frozenset())
    return [(n, p) for n, p in model.named_parameters() if n not in converted]
