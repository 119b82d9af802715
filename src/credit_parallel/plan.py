"""The layout planner and cost model behind ``credit-parallel plan`` (pure: no processes).

:func:`make_plan` reads a full config and a world size and works out, without starting a single
process or process group:

1. the rank layout: the parallel degrees (:class:`~credit_parallel.config.ParallelDims`), the
   mesh axes ``build_device_mesh`` would keep, and every rank's (dp, tp, domain) coordinates and
   the global ranks of its dp / tp / domain groups (:func:`~credit_parallel.mesh.full_rank_layout`);
2. the rows every domain rank owns at every resolution level, and for every module that
   ``convert_to_domain_parallel`` would replace the halo rows each rank receives.  The model is
   built and run ONCE on the ``meta`` device (no memory, no arithmetic) with forward hooks; the
   windows come from the very functions the layers call (``conv._conv_windows``,
   ``conv._convt_windows``, ``resample.interp_row_plan``, ``padding.pad_windows``...) and the
   exchange plans from ``rows.plan_exchange``, so the numbers are what the layers will do;
3. an estimate of the memory per rank (parameters, gradients, AdamW state, saved activations)
   and of the communication per training step (halo bytes, collectives by kind);
4. every constraint the configuration violates, collected rather than stopping at the first.

The two cost functions :func:`predicted_halo_bytes` and :func:`predicted_collectives` are public
so the benchmarks can compare them with what a run measures
(``credit_parallel.domain.exchange.exchange_stats``).

Naming: an *axis* is a mesh axis ("dp", "tp", "domain"); a *dim* is a tensor dimension.  Heights
are GLOBAL row counts along the sharded dim (latitude: dim -2 of B,C,H,W and of B,C,Z,H,W).
Input shapes of the known model types (assumptions, read from the built model's attributes,
which mirror the ``model:`` config keys):

* ``unet``, ``crossformer``: one input ``(B, in_channels, image_height, image_width)``;
* ``pangu``: ``upper (B, upper_channels, levels, image_height, image_width)`` and
  ``surface (B, surface_channels, image_height, image_width)``;
* any other model may define ``input_shapes`` (a list of per-sample shapes WITHOUT the batch
  dim, or a method returning one); a model with ``in_channels``/``image_height``/
  ``image_width`` attributes is taken to have one B,C,H,W input.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import DataMode, ParallelDims, parse_parallelism_conf
from .domain.rows import FILL, plan_exchange, shard_range, shard_sizes

__all__ = [
    "DomainLayerPlan",
    "MemoryEstimate",
    "Plan",
    "RankEntry",
    "format_plan",
    "make_plan",
    "model_input_shapes",
    "predicted_collectives",
    "predicted_halo_bytes",
]

SHARD_DIM = -2  # latitude, as convert_to_domain_parallel shards it by default
MAX_RANKS_LISTED = 64  # every rank is listed up to this world size, else a sample
_SAMPLE_HEAD, _SAMPLE_TAIL = 32, 8
_MIB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * _MIB  # torch's DDP: a small first bucket, then bucket_cap_mb
DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default and credit_parallel.collectives' default
_PARAM_BYTES = 4  # parameters, gradients and AdamW moments stay fp32 (also under amp)


# --------------------------------------------------------------------------- result types
@dataclass(frozen=True)
class RankEntry:
    """One global rank: its (dp, tp, domain) coordinates and the global ranks of its groups."""

    rank: int
    dp: int
    tp: int
    domain: int
    dp_group: tuple[int, ...]
    tp_group: tuple[int, ...]
    domain_group: tuple[int, ...]


@dataclass(frozen=True)
class DomainLayerPlan:
    """One call of a module that ``convert_to_domain_parallel`` replaces, as the layer will run.

    ``out_rows[r]``: output rows domain rank r owns (balanced layout of ``out_height``).
    ``halo_before[r]`` / ``halo_after[r]``: distinct rows rank r receives from other ranks that
    sit before / after its own rows (north / south; rows of a rank with no own row in the window
    count by global index).  ``rows_received[r]`` / ``rows_sent[r]``: rows rank r receives /
    sends in the forward exchange (``RankExchangePlan.rows_received`` / ``.rows_sent``; the
    backward moves the same rows the other way).  ``row_elements``: elements of one input row at
    batch 1 (channels x every other non-sharded dim).  ``peers[r]``: domain ranks rank r receives
    from.  ``error``: why the layer cannot run at this layout (None when it can).
    """

    path: str
    kind: str
    in_height: int
    out_height: int
    out_rows: tuple[int, ...]
    halo_before: tuple[int, ...]
    halo_after: tuple[int, ...]
    rows_received: tuple[int, ...]
    rows_sent: tuple[int, ...]
    row_elements: int
    peers: tuple[tuple[int, ...], ...] = ()
    error: str | None = None

    @property
    def exchanges(self) -> bool:
        """Whether any rank sends or receives rows in this layer."""
        return any(self.rows_received) or any(self.rows_sent)

    def rank_exchanges(self, domain_rank: int) -> bool:
        """Whether ``domain_rank`` takes part in a P2P call (it skips it with nothing to move)."""
        if not self.rows_received:
            return False
        return bool(self.rows_received[domain_rank] or self.rows_sent[domain_rank])


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (the largest rank where ranks differ); an estimate, see ``format_plan``."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    param_bytes_unsharded: int  # the whole model, fp32, on one rank
    fsdp_largest_unit_bytes: int  # unsharded (all-gathered) size of the largest FSDP2 unit
    activation_dtype_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass
class Plan:
    """Everything ``credit-parallel plan`` reports; built by :func:`make_plan`."""

    world_size: int
    data: str
    tp: int
    domain: int
    dp: int  # world_size // (tp * domain); 0 when that is not a whole number >= 1
    dims: ParallelDims | None  # None when the world size does not fit the degrees
    mesh_axes: tuple[tuple[str, int], ...]
    ranks: list[RankEntry]
    ranks_omitted: int
    model_type: str
    model_class: str
    input_shapes: tuple[tuple[int, ...], ...]  # per sample, without the batch dim
    batch_size: int
    amp: bool
    parameter_count: int
    levels: list[
        tuple[int, tuple[int, ...]]
    ]  # (global height, rows per domain rank), largest first
    layers: list[DomainLayerPlan]
    memory: MemoryEstimate
    halo_bytes_per_rank: tuple[int, ...]  # bytes each domain rank sends per step (fwd + bwd)
    halo_bytes_per_step: int  # summed over one domain group
    collectives: dict[str, int]
    tp_targets: list[tuple[str, str]]  # (module path, "col" | "row")
    fsdp_units: list[str]
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


# --------------------------------------------------------------------------- cost functions
def predicted_halo_bytes(
    layers: Sequence[DomainLayerPlan],
    *,
    batch_size: int,
    dtype_bytes: int,
    domain_rank: int | None = None,
) -> int:
    """Halo bytes of one training step (forward + backward) of one domain group.

    Inputs: ``layers`` from :func:`make_plan` (``plan.layers``), the per-rank ``batch_size``
    (``trainer.batch_size``) and the activation element size (4 for fp32, 2 for bf16 under amp).

    With ``domain_rank`` r: the bytes rank r SENDS — its halo rows to peers in forward plus the
    gradients of the rows it received in backward, ``(rows_sent + rows_received) x row size`` —
    which is what ``exchange_stats.bytes_sent`` counts on that rank.  With ``domain_rank=None``:
    the total over the group, ``2 x rows exchanged x other dims x dtype bytes``.
    """
    total = 0
    for layer in layers:
        if not layer.rows_received:
            continue
        row_bytes = layer.row_elements * batch_size * dtype_bytes
        if domain_rank is None:
            total += 2 * sum(layer.rows_received) * row_bytes
        else:
            rows = layer.rows_sent[domain_rank] + layer.rows_received[domain_rank]
            total += rows * row_bytes
    return total


def _greedy_buckets(sizes: Sequence[int], cap: int, first_cap: int | None = None) -> int:
    """Number of buckets when ``sizes`` (bytes) are packed in order, a new bucket when the next
    tensor would overflow the cap (a larger tensor travels alone), as ``collectives._buckets``."""
    count, current, limit = 0, 0, first_cap if first_cap is not None else cap
    open_bucket = False
    for nbytes in sizes:
        if open_bucket and current + nbytes > limit:
            count += 1
            current, open_bucket, limit = 0, False, cap
        current += nbytes
        open_bucket = True
    return count + (1 if open_bucket else 0)


def predicted_collectives(
    layers: Sequence[DomainLayerPlan],
    *,
    data: str,
    dp: int,
    tp: int,
    domain: int,
    tp_row_layers: int = 0,
    tp_col_layers: int = 0,
    tp_fused_layers: int = 0,
    fsdp_units: int = 0,
    grad_sizes_bytes: Sequence[int] = (),
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    domain_rank: int | None = None,
) -> dict[str, int]:
    """Collective calls ONE rank issues per training step (forward, backward, gradient sync), by kind.

    Inputs: ``layers`` (``plan.layers``); the degrees ``data``/``dp``/``tp``/``domain``; the
    number of row- and column-parallel tensor-parallel layers (``tp_fused_layers``: column layers
    with ``_tp_fused`` parts > 1, counted in ``tp_col_layers`` too); ``fsdp_units``: FSDP2 units
    that own parameters (opted-in blocks plus the root); ``grad_sizes_bytes``: this rank's local
    gradient sizes in parameter order (after TP/FSDP sharding) for the bucketed reductions.
    ``domain_rank``: count for that domain rank; None = the busiest rank.

    Keys (all present, 0 when not applicable):

    * ``domain_p2p``: ``batch_isend_irecv`` calls, 2 per domain layer this rank exchanges in
      (forward rows + backward gradients);
    * ``domain_all_gather`` / ``domain_all_reduce_norm``: per GroupNorm call one all-gather of the
      statistics in forward and its adjoint all-reduce in backward;
    * ``domain_grad_all_reduce``: buckets of ``sync_domain_gradients`` (domain > 1);
    * ``tp_all_reduce``: one per row-parallel layer (forward) plus one per column layer (backward);
    * ``tp_weight_regroup``: fused column layers regroup their weight (forward and backward);
    * ``fsdp_all_gather``: one per unit in forward plus one per non-root unit in backward (the
      root is not resharded after forward); ``fsdp_reduce_scatter``: one per unit;
    * ``ddp_all_reduce``: DDP buckets (1 MiB first bucket, then ``bucket_cap_mb``; approximate).

    Steady state: the global heights are cached per input shape, so the one all-gather of local
    heights per domain layer of the first step is not counted.
    """
    counts = dict.fromkeys(
        (
            "domain_p2p",
            "domain_all_gather",
            "domain_all_reduce_norm",
            "domain_grad_all_reduce",
            "tp_all_reduce",
            "tp_weight_regroup",
            "fsdp_all_gather",
            "fsdp_reduce_scatter",
            "ddp_all_reduce",
        ),
        0,
    )
    cap = max(1, int(bucket_cap_mb * _MIB))
    if domain > 1:
        ranks = range(domain) if domain_rank is None else (domain_rank,)
        counts["domain_p2p"] = 2 * max(
            sum(1 for layer in layers if layer.rank_exchanges(r)) for r in ranks
        )
        norms = sum(1 for layer in layers if layer.kind == "group_norm")
        counts["domain_all_gather"] = norms
        counts["domain_all_reduce_norm"] = norms
        counts["domain_grad_all_reduce"] = _greedy_buckets(grad_sizes_bytes, cap)
    if tp > 1:
        counts["tp_all_reduce"] = tp_row_layers + tp_col_layers
        counts["tp_weight_regroup"] = 2 * tp_fused_layers
    if data == DataMode.FSDP2:
        counts["fsdp_all_gather"] = fsdp_units + max(0, fsdp_units - 1)
        counts["fsdp_reduce_scatter"] = fsdp_units
    elif data == DataMode.DDP and dp > 1:
        counts["ddp_all_reduce"] = _greedy_buckets(
            list(reversed(grad_sizes_bytes)), cap, DDP_FIRST_BUCKET_BYTES
        )
    return counts


# --------------------------------------------------------------------------- the model
def model_input_shapes(model: nn.Module) -> tuple[tuple[int, ...], ...]:
    """Per-sample input shapes (no batch dim) of a model, by the rules in the module docstring."""
    declared = getattr(model, "input_shapes", None)
    if declared is not None:
        shapes = declared() if callable(declared) else declared
        return tuple(tuple(int(v) for v in s) for s in shapes)
    attrs = {
        k: getattr(model, k, None)
        for k in (
            "in_channels",
            "upper_channels",
            "surface_channels",
            "levels",
            "image_height",
            "image_width",
        )
    }
    h, w = attrs["image_height"], attrs["image_width"]
    if all(isinstance(attrs[k], int) for k in ("upper_channels", "surface_channels", "levels")):
        return (
            (attrs["upper_channels"], attrs["levels"], h, w),
            (attrs["surface_channels"], h, w),
        )
    if all(isinstance(v, int) for v in (attrs["in_channels"], h, w)):
        return ((attrs["in_channels"], h, w),)
    raise ValueError(
        f"cannot tell the input shape of {type(model).__name__}: give it an `input_shapes` "
        "attribute (per-sample shapes without the batch dim) or in_channels/image_height/"
        "image_width attributes"
    )


def _build_meta_model(conf: dict) -> tuple[nn.Module, str]:
    from .models import build_model

    conf_model = conf.get("model")
    if not isinstance(conf_model, dict):
        raise ValueError(
            "config is missing the 'model' section (e.g. {type: unet, in_channels: 8, ...})"
        )
    with torch.device("meta"):
        model = build_model(conf_model)
    return model, str(conf_model.get("type"))


def _domain_targets(model: nn.Module):
    """Walk the module tree exactly as ``convert_to_domain_parallel`` does (no custom converters):
    returns ``(targets, unsafe)``; ``targets`` are ``(path, module, replacement or error)``."""
    from .domain.convert import _builtin_rule, walk_domain_modules

    targets, unsafe = [], []

    def candidate(parent, name, path, child) -> bool:
        try:
            replacement = _builtin_rule(child, None, SHARD_DIM)
        except (ValueError, TypeError) as err:
            targets.append((path, child, err))
            return True
        if replacement is None:
            return False
        targets.append((path, child, replacement))
        return True

    walk_domain_modules(model, candidate, lambda path, reason: unsafe.append((path, reason)))
    return targets, unsafe


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


_SHAPE_PRESERVING = (nn.GroupNorm, nn.LayerNorm)


def _same_shape(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class _Trace:
    calls: list  # (path, module, replacement, in_shape, out_shape)
    leaf_outputs: list  # (path, out_shape)
    model_outputs: list  # shapes


def _trace(model: nn.Module, input_shapes, targets) -> _Trace:
    """One forward on meta tensors (batch 1) recording domain-layer calls and leaf outputs."""
    calls, leaf_outputs, handles = [], [], []
    dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    by_module = {}
    for path, module, replacement in targets:
        by_module.setdefault(id(module), (path, module, replacement))
    try:
        for path, module, replacement in by_module.values():

            def record(mod, args, out, path=path, replacement=replacement):
                ins = list(_tensors(args))
                outs = list(_tensors(out))
                if ins and outs:
                    calls.append(
                        (path, mod, replacement, tuple(ins[0].shape), tuple(outs[0].shape))
                    )

            handles.append(module.register_forward_hook(record))
        for path, module in model.named_modules():
            if next(module.children(), None) is not None:
                continue

            def leaf(mod, args, out, path=path):
                for t in _tensors(out):
                    leaf_outputs.append((path or "<root>", tuple(t.shape)))

            handles.append(module.register_forward_hook(leaf))
        for module in model.modules():
            # Normalisations keep the shape; on meta tensors their reference decompositions cost
            # seconds of imports for nothing, so the (private, meta) copy skips them.
            if type(module) in _SHAPE_PRESERVING:
                module.forward = _same_shape
        inputs = [torch.empty((1, *s), device="meta", dtype=dtype) for s in input_shapes]
        with torch.no_grad():
            out = model(*inputs)
    except Exception as err:  # a forward that cannot run on meta tensors: unusable for planning
        raise ValueError(
            f"could not trace {type(model).__name__} on the meta device with inputs "
            f"{[(1, *s) for s in input_shapes]}: {type(err).__name__}: {err}"
        ) from err
    finally:
        for h in handles:
            h.remove()
    return _Trace(calls, leaf_outputs, [tuple(t.shape) for t in _tensors(out)])


# --------------------------------------------------------------------------- domain layers
_KINDS = {
    "DomainParallelPeriodicConv2d": "periodic_conv",
    "DomainParallelConv2d": "conv",
    "DomainParallelConv3d": "conv",
    "DomainParallelConvTranspose2d": "conv_transpose",
    "DomainParallelConvTranspose3d": "conv_transpose",
    "DomainParallelGroupNorm": "group_norm",
    "DomainParallelInterpolate": "interpolate",
    "DomainParallelPixelShuffle": "pixel_shuffle",
    "DomainParallelPixelUnshuffle": "pixel_unshuffle",
    "DomainParallelPad": "pad",
}


def _layer_kind(replacement) -> str:
    for cls in type(replacement).__mro__:
        if cls.__name__ in _KINDS:
            return _KINDS[cls.__name__]
    return type(replacement).__name__


def _kind_and_windows(replacement, in_shape, out_shape, n: int, double: bool):
    """(kind, windows or None) of one layer call, from the layer's own window functions."""
    from .domain import conv as conv_mod
    from .domain.norm import DomainParallelGroupNorm
    from .domain.padding import DomainParallelPad
    from .domain.resample import (
        DomainParallelInterpolate,
        DomainParallelPixelShuffle,
        DomainParallelPixelUnshuffle,
        interp_output_size,
        interp_row_plan,
    )
    from .domain.rows import check_min_rows

    ndim = len(in_shape)
    dim = SHARD_DIM % ndim
    in_h = in_shape[dim]
    if isinstance(replacement, conv_mod._DomainParallelConvNd):
        geo, i = replacement.geometry, replacement.spatial_index
        if isinstance(replacement, conv_mod.DomainParallelPeriodicConv2d):
            kind = "periodic_conv"
        else:
            kind = "conv_transpose" if geo.transposed else "conv"
        if geo.transposed:
            windows, _ = conv_mod._convt_windows(geo, i, in_h, n)
            for r, w in enumerate(windows):
                if not w:
                    raise ValueError(
                        f"the output rows of domain rank {r} receive no input (kernel "
                        f"{geo.kernel[i]} x dilation {geo.dilation[i]} < stride {geo.stride[i]}); "
                        "this layer cannot be sharded over this many ranks"
                    )
        else:
            windows, _ = conv_mod._conv_windows(geo, i, in_h, n)
        return kind, windows
    if isinstance(replacement, DomainParallelGroupNorm):
        return "group_norm", None
    if isinstance(replacement, DomainParallelInterpolate):
        (out_h, _), (scale_h, _) = interp_output_size(
            (in_h, in_shape[-1]),
            replacement.size,
            replacement.scale_factor,
            replacement.recompute_scale_factor,
        )
        check_min_rows(out_h, n, f"interpolation (output height {out_h})")
        plan = interp_row_plan(
            replacement.mode,
            in_h,
            out_h,
            n,
            align_corners=replacement.align_corners,
            scale_factor=scale_h,
            double=double,
        )
        return "interpolate", plan.windows
    if isinstance(replacement, DomainParallelPixelShuffle):
        check_min_rows(in_h * replacement.upscale_factor, n, "PixelShuffle output")
        return "pixel_shuffle", replacement._windows(in_h, n)
    if isinstance(replacement, DomainParallelPixelUnshuffle):
        r = replacement.downscale_factor
        if in_h % r:
            raise ValueError(f"the global height {in_h} is not divisible by {r}")
        check_min_rows(in_h // r, n, "PixelUnshuffle output")
        windows = tuple(
            tuple(range(o0 * r, o1 * r))
            for o0, o1 in (shard_range(in_h // r, n, k) for k in range(n))
        )
        return "pixel_unshuffle", windows
    if isinstance(replacement, DomainParallelPad):
        _, _, top, bottom = replacement.padding
        return "pad", replacement._windows(in_h, n, top, bottom)
    return type(replacement).__name__, None  # a layer this planner does not model: no halo


def _layer_plan(path, replacement, in_shape, out_shape, n: int, double: bool) -> DomainLayerPlan:
    dim = SHARD_DIM % len(in_shape)
    in_h, out_h = in_shape[dim], out_shape[SHARD_DIM % len(out_shape)]
    row_elements = math.prod(in_shape) // max(in_h, 1)
    out_rows = shard_sizes(out_h, n)

    def without_exchange(kind: str, error: str | None = None) -> DomainLayerPlan:
        zeros = (0,) * n
        peers = ((),) * n if error is None else ()
        return DomainLayerPlan(
            path,
            kind,
            in_h,
            out_h,
            out_rows,
            zeros,
            zeros,
            zeros,
            zeros,
            row_elements,
            peers,
            error,
        )

    try:
        kind, windows = _kind_and_windows(replacement, in_shape, out_shape, n, double)
    except ValueError as err:
        return without_exchange(_layer_kind(replacement), str(err))
    if windows is None:
        return without_exchange(kind)
    try:
        plans = plan_exchange(in_h, n, tuple(windows))
    except ValueError as err:
        return without_exchange(kind, str(err))
    before, after = [], []
    for r, window in enumerate(windows):
        start, stop = shard_range(in_h, n, r)
        own_positions = [p for p, g in enumerate(window) if start <= g < stop]
        first_own = own_positions[0] if own_positions else None
        rows_before, rows_after = set(), set()
        for p, g in enumerate(window):
            if g == FILL or start <= g < stop:
                continue
            north = p < first_own if first_own is not None else g < start
            (rows_before if north else rows_after).add(g)
        before.append(len(rows_before))
        after.append(len(rows_after))
    return DomainLayerPlan(
        path,
        kind,
        in_h,
        out_h,
        out_rows,
        tuple(before),
        tuple(after),
        tuple(p.rows_received for p in plans),
        tuple(p.rows_sent for p in plans),
        row_elements,
        tuple(tuple(q for q, _ in p.recvs) for p in plans),
    )


# --------------------------------------------------------------------------- memory
def _tp_split_dims(model: nn.Module, tp: int, violations: list[str]):
    """``{parameter name: dim split over tp}`` from the ``_tp_col``/``_tp_row`` declarations,
    checking every target (all problems collected into ``violations``)."""
    from .tensor_parallel import (
        COLUMN,
        _check_layer,
        _resolve,
        collect_tensor_parallel_targets,
    )

    try:
        targets = collect_tensor_parallel_targets(model)
    except (ValueError, TypeError) as err:
        violations.append(f"tensor parallelism declarations: {err}")
        return {}, []
    split, listed = {}, []
    for target in targets:
        try:
            layer = _resolve(model, target)
        except ValueError as err:
            if tp > 1:
                violations.append(f"trainer.parallelism.tensor={tp}: {err}")
            continue
        listed.append(target)
        if tp > 1:
            try:
                _check_layer(layer, target, tp)
            except (ValueError, TypeError) as err:
                violations.append(f"trainer.parallelism.tensor={tp}: {err}")
        for pname, _ in layer.named_parameters(recurse=False):
            full = f"{target.path}.{pname}"
            if target.role == COLUMN:
                split[full] = 0  # weight and bias: output features/channels
            elif pname == "weight":
                split[full] = 1  # input features/channels; the row bias stays replicated
    return split, listed


def _fsdp_units(model: nn.Module) -> list[tuple[str, set[str]]]:
    """FSDP2 units in ``apply_fsdp2`` order and the parameter names each one manages."""
    blocks = [
        name
        for name, module in model.named_modules()
        if module is not model and getattr(module, "_fsdp2_shard", False) is True
    ]
    owned: dict[str, set[str]] = {name: set() for name in [*blocks, ""]}
    for pname, _ in model.named_parameters():
        owner = ""
        for block in blocks:  # the deepest opted-in block containing the parameter
            if pname.startswith(block + ".") and len(block) > len(owner):
                owner = block
        owned[owner].add(pname)
    return [(name, names) for name, names in owned.items() if names]


def _local_numel(shape, split_dim, tp: int, fsdp_dp: int) -> int:
    shape = list(shape)
    if split_dim is not None and tp > 1 and len(shape) > split_dim:
        shape[split_dim] = -(-shape[split_dim] // tp)
    if fsdp_dp > 1 and shape:
        shape[0] = -(-shape[0] // fsdp_dp)  # FSDP2 shards dim 0, padded to a multiple of dp
    return math.prod(shape)


# --------------------------------------------------------------------------- the plan
def _trainer_value(conf: dict, key: str, default, check, what: str, violations: list[str]):
    trainer = conf.get("trainer") or {}
    if key not in trainer:
        return default
    value = trainer[key]
    if not check(value):
        violations.append(f"trainer.{key} = {value!r} is not {what}; assuming {default!r}")
        return default
    return value


def _rank_entries(dims: ParallelDims) -> tuple[list[RankEntry], int]:
    from .mesh import full_rank_layout

    layout = full_rank_layout(dims)
    world = dims.world_size
    if world <= MAX_RANKS_LISTED:
        chosen = list(range(world))
    else:
        chosen = list(range(_SAMPLE_HEAD)) + list(range(world - _SAMPLE_TAIL, world))
    entries = []
    for g in chosen:
        dp, tp, dom = layout.coords(g)
        entries.append(
            RankEntry(
                g,
                dp,
                tp,
                dom,
                tuple(layout.ranks_along_dim("dp", g)),
                tuple(layout.ranks_along_dim("tp", g)),
                tuple(layout.ranks_along_dim("domain", g)),
            )
        )
    return entries, world - len(chosen)


def make_plan(
    conf: dict,
    world_size: int,
    *,
    model: nn.Module | None = None,
    input_shapes: Sequence[Sequence[int]] | None = None,
) -> Plan:
    """Plan a run of ``conf`` on ``world_size`` ranks, without starting any process.

    ``conf`` is the FULL config (``model:``, ``trainer: {parallelism: ..., batch_size, amp}``).
    ``model``/``input_shapes`` override building ``conf["model"]`` and the input-shape rules
    (for models outside the registry; per-sample shapes without the batch dim).  Raises
    ``ValueError`` only for an unusable config: a bad ``trainer.parallelism`` block, a world size
    that is not an integer >= 1, a missing/unknown ``model.type`` or bad model arguments, or a
    model that cannot be traced on the meta device.  Every other problem is collected in
    ``plan.violations``.
    """
    block = parse_parallelism_conf(conf)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--world-size must be an integer >= 1, got {world_size!r}")
    violations: list[str] = []
    notes: list[str] = []
    data, tp, n = block["data"], block["tensor"], block["domain"]
    inner = tp * n
    dims = None
    if world_size % inner:
        violations.append(
            f"world size {world_size} is not divisible by trainer.parallelism.tensor*domain = "
            f"{tp}*{n} = {inner}: use a world size that is a multiple of {inner}, or change "
            "tensor/domain"
        )
        dp = 0
        notes.append("no rank layout: the world size does not fit the parallel degrees")
    else:
        dims = ParallelDims(data, tp, n, world_size)
        dp = dims.dp
    if data == DataMode.DDP and tp > 1:
        violations.append(
            "trainer.parallelism: data 'ddp' cannot be combined with tensor > 1 (DDP does not "
            "reduce tensor-parallel DTensor gradients); use data: fsdp2"
        )
    # samples per data-parallel rank (the sampler's contract); CREDIT spells it train_batch_size
    trainer = conf.get("trainer") or {}
    batch_key = (
        "train_batch_size"
        if "batch_size" not in trainer and "train_batch_size" in trainer
        else "batch_size"
    )
    batch_size = _trainer_value(
        conf,
        batch_key,
        1,
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "an integer >= 1",
        violations,
    )
    amp = _trainer_value(
        conf, "amp", False, lambda v: isinstance(v, bool), "true/false", violations
    )

    # ---- the model, on meta
    if model is None:
        model, model_type = _build_meta_model(conf)
    else:
        model_type = str((conf.get("model") or {}).get("type", type(model).__name__))
        model = copy.deepcopy(model).to("meta")
    shapes = tuple(
        tuple(int(v) for v in s)
        for s in (input_shapes if input_shapes is not None else model_input_shapes(model))
    )
    targets, unsafe = _domain_targets(model)
    trace = _trace(model, shapes, [t for t in targets if not isinstance(t[2], Exception)])
    for path, _, err in targets:
        if isinstance(err, Exception) and n > 1:
            violations.append(f"{path}: convert_to_domain_parallel cannot convert it: {err}")
    if n > 1:
        for path, reason in unsafe:
            violations.append(
                f"{path}: {reason}; convert_to_domain_parallel refuses it under domain > 1 "
                "(replace it, declare _domain_local = True if it truly is row-local, or use "
                "trainer.parallelism.domain: 1)"
            )
    param_dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    double = param_dtype == torch.float64 and not amp

    # ---- rows and halos per layer call
    layers = []
    seen_calls: dict[str, int] = {}
    for path, _, replacement, in_shape, out_shape in trace.calls:
        seen_calls[path] = seen_calls.get(path, 0) + 1
        label = path if seen_calls[path] == 1 else f"{path} (call {seen_calls[path]})"
        layers.append(_layer_plan(label, replacement, in_shape, out_shape, n, double))

    # ---- resolution levels: every height an input, a domain layer or an output has
    first_seen: dict[int, str] = {}
    for s in shapes:
        first_seen.setdefault(s[SHARD_DIM % (len(s) + 1) - 1], "model input")
    for layer in layers:
        first_seen.setdefault(layer.in_height, f"input of {layer.path}")
        first_seen.setdefault(layer.out_height, f"output of {layer.path}")
    for s in trace.model_outputs:
        if len(s) >= 3:
            first_seen.setdefault(s[SHARD_DIM % len(s)], "model output")
    heights = sorted(first_seen, reverse=True)
    levels = [(h, shard_sizes(h, n) if h >= n else ()) for h in heights]
    for index, h in enumerate(heights):
        if h < n:
            violations.append(
                f"level {index} has {h} rows, fewer than domain ranks ({n}) ({first_seen[h]}): "
                f"use trainer.parallelism.domain <= {h}, or a larger model.image_height / fewer "
                "down-sampling levels"
            )
    for layer in layers:
        if layer.error is None:
            continue
        if layer.in_height < n or layer.out_height < n:
            continue  # already reported as a level with fewer rows than ranks
        violations.append(f"{layer.path}: cannot run over {n} domain ranks: {layer.error}")
    for layer in layers:
        for r, peers in enumerate(layer.peers):
            far = [q for q in peers if abs(q - r) > 1 and {q, r} != {0, n - 1}]
            if far:
                notes.append(
                    f"{layer.path}: domain rank {r} receives rows from rank(s) {far} beyond its "
                    "neighbours (a shard thinner than the halo it serves; multi-hop exchange, "
                    "exact but more messages)"
                )

    # ---- sharding constraints of the model (window sizes)
    if n > 1 and shapes:
        from .domain.convert import validate_sharding_constraints

        h0 = shapes[0][SHARD_DIM % (len(shapes[0]) + 1) - 1]
        sizes = shard_sizes(h0, n)
        for local_h in sorted(set(s for s in sizes if s >= 1)):
            ranks = [r for r, s in enumerate(sizes) if s == local_h]
            for warning in validate_sharding_constraints(model, local_h):
                violations.append(
                    f"validate_sharding_constraints(local_h={local_h}, domain ranks {ranks}): "
                    f"{warning}; choose model.image_height and trainer.parallelism.domain so "
                    "every shard is a multiple of window size x level stride"
                )

    # ---- tensor parallelism and memory
    split, tp_listed = _tp_split_dims(model, tp, violations)
    if tp > 1 and not tp_listed:
        notes.append(
            "tensor > 1 but the model declares no _tp_col/_tp_row layers: every tp rank "
            "repeats the same work"
        )
    fsdp_dp = dp if data == DataMode.FSDP2 and dp > 1 else 1
    local_numels, full_numel = {}, 0
    for pname, p in model.named_parameters():
        full_numel += p.numel()
        local_numels[pname] = _local_numel(p.shape, split.get(pname), tp, fsdp_dp)
    param_bytes = sum(local_numels.values()) * _PARAM_BYTES
    units = _fsdp_units(model) if data == DataMode.FSDP2 else []
    params = dict(model.named_parameters())
    largest_unit = max(
        (
            sum(_local_numel(params[p].shape, split.get(p), tp, 1) for p in names)
            for _, names in units
        ),
        default=0,
    )
    act_bytes = 2 if amp else param_dtype.itemsize
    col_outputs = {t.path for t in tp_listed if t.role == "col"} if tp > 1 else set()
    activation_elems = 0
    for path, shape in trace.leaf_outputs:
        numel = math.prod(shape) * batch_size
        if len(shape) in (4, 5) and n > 1:
            h = shape[SHARD_DIM]
            numel = numel // max(h, 1) * max(1, -(-h // n))  # the largest rank's rows
        if path in col_outputs:
            numel = -(-numel // tp)
        activation_elems += numel
    memory = MemoryEstimate(
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=2 * param_bytes,
        activation_bytes=activation_elems * act_bytes,
        param_bytes_unsharded=full_numel * _PARAM_BYTES,
        fsdp_largest_unit_bytes=largest_unit * (2 if amp else _PARAM_BYTES),
        activation_dtype_bytes=act_bytes,
    )

    # ---- communication
    halo_per_rank = tuple(
        predicted_halo_bytes(layers, batch_size=batch_size, dtype_bytes=act_bytes, domain_rank=r)
        for r in range(n)
    )
    halo_total = predicted_halo_bytes(layers, batch_size=batch_size, dtype_bytes=act_bytes)
    collectives = predicted_collectives(
        layers,
        data=data,
        dp=max(dp, 1),
        tp=tp,
        domain=n,
        tp_row_layers=sum(1 for t in tp_listed if t.role == "row"),
        tp_col_layers=sum(1 for t in tp_listed if t.role == "col"),
        tp_fused_layers=sum(1 for t in tp_listed if t.role == "col" and t.parts > 1),
        fsdp_units=len(units),
        grad_sizes_bytes=[v * _PARAM_BYTES for v in local_numels.values()],
    )
    if n > 1 and layers:
        notes.append(
            "first step only: one all-gather of local heights per domain layer call (cached "
            "per input shape afterwards; not counted above)"
        )

    ranks, omitted = _rank_entries(dims) if dims is not None else ([], 0)
    return Plan(
        world_size=world_size,
        data=data,
        tp=tp,
        domain=n,
        dp=dp,
        dims=dims,
        mesh_axes=dims.mesh_axes if dims is not None else (),
        ranks=ranks,
        ranks_omitted=omitted,
        model_type=model_type,
        model_class=type(model).__name__,
        input_shapes=shapes,
        batch_size=batch_size,
        amp=amp,
        parameter_count=full_numel,
        levels=levels,
        layers=layers,
        memory=memory,
        halo_bytes_per_rank=halo_per_rank,
        halo_bytes_per_step=halo_total,
        collectives=collectives,
        tp_targets=[(t.path, t.role) for t in tp_listed],
        fsdp_units=[name or "<root>" for name, _ in units],
        violations=violations,
        notes=notes,
    )


# --------------------------------------------------------------------------- the report
def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def _ranges(height: int, n: int) -> str:
    return " ".join(f"[{a}:{b})" for a, b in (shard_range(height, n, r) for r in range(n)))


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def format_plan(plan: Plan) -> str:
    """A readable multi-section report of ``plan`` (what ``credit-parallel plan`` prints)."""
    out: list[str] = []
    n = plan.domain
    shapes = ", ".join(str((plan.batch_size, *s)) for s in plan.input_shapes)
    out.append(
        f"credit-parallel plan: model {plan.model_type} ({plan.model_class}, "
        f"{plan.parameter_count:,} parameters), world size {plan.world_size}"
    )
    out.append(f"inputs per rank (batch x shape): {shapes}; amp={plan.amp}")

    out.append("")
    out.append("== Layout ==")
    dp = plan.dp if plan.dims is not None else "-"
    out.append(
        f"trainer.parallelism: data={plan.data} tensor={plan.tp} domain={n} -> "
        f"dp={dp} x tp={plan.tp} x domain={n}"
    )
    if plan.dims is not None:
        axes = ", ".join(f"{name}={size}" for name, size in plan.mesh_axes) or "(none: no mesh)"
        out.append(f"mesh axes kept (build_device_mesh): {axes}")
        h0 = plan.input_shapes[0][-2] if plan.input_shapes else None
        rows = [["rank", "dp", "tp", "domain", "dp group", "tp group", "domain group", "rows"]]
        for e in plan.ranks:
            own = "-"
            if h0 is not None and h0 >= n:
                a, b = shard_range(h0, n, e.domain)
                own = f"[{a}:{b}) of {h0}"
            rows.append(
                [
                    str(e.rank),
                    str(e.dp),
                    str(e.tp),
                    str(e.domain),
                    str(list(e.dp_group)),
                    str(list(e.tp_group)),
                    str(list(e.domain_group)),
                    own,
                ]
            )
        out.extend(_table(rows))
        if plan.ranks_omitted:
            out.append(
                f"... {plan.ranks_omitted} ranks not listed (world size > {MAX_RANKS_LISTED}; "
                "the layout repeats: rank g has domain g % domain, tp (g // domain) % tp, "
                "dp g // (tp*domain))"
            )
    else:
        out.append("no rank layout (see violations)")

    out.append("")
    out.append(f"== Rows per domain rank by resolution level (domain = {n}) ==")
    for index, (h, sizes) in enumerate(plan.levels):
        if sizes:
            out.append(f"level {index}: H={h}  rows {list(sizes)}  {_ranges(h, n)}")
        else:
            out.append(f"level {index}: H={h}  fewer rows than domain ranks")

    out.append("")
    out.append(f"== Domain-parallel layers ({len(plan.layers)} calls) ==")
    if plan.layers:
        rows = [["module", "kind", "H in->out", "out rows/rank", "halo before", "halo after", ""]]
        for layer in plan.layers:
            rows.append(
                [
                    layer.path,
                    layer.kind,
                    f"{layer.in_height}->{layer.out_height}",
                    str(list(layer.out_rows)),
                    str(list(layer.halo_before)),
                    str(list(layer.halo_after)),
                    f"ERROR: {layer.error}" if layer.error else "",
                ]
            )
        out.extend(_table(rows))
    else:
        out.append("(none)")

    m = plan.memory
    out.append("")
    out.append("== Memory per rank (estimate) ==")
    if plan.data == DataMode.FSDP2:
        sharding = f"sharded over dp={max(plan.dp, 1)} (FSDP2, dim 0 padded)"
    else:
        sharding = f"replicated over dp ({plan.data})"
    tp_part = f", TP layers split over tp={plan.tp}" if plan.tp > 1 else ""
    out.append(
        f"parameters      {_human(m.param_bytes):>12}  fp32, {sharding}{tp_part}; "
        f"whole model {_human(m.param_bytes_unsharded)}"
    )
    out.append(f"gradients       {_human(m.grad_bytes):>12}  same layout as the parameters")
    out.append(f"AdamW state     {_human(m.optimizer_bytes):>12}  2 x parameters (fp32 moments)")
    out.append(
        f"activations     {_human(m.activation_bytes):>12}  estimate of saved activations: "
        f"leaf-module outputs x batch {plan.batch_size} x {m.activation_dtype_bytes} B, "
        f"4-D/5-D ones at the largest rank's share of the rows"
    )
    out.append(f"total           {_human(m.total_bytes):>12}")
    if plan.fsdp_units:
        out.append(
            f"FSDP2 units: {len(plan.fsdp_units)} (largest unsharded while in use: "
            f"{_human(m.fsdp_largest_unit_bytes)})"
        )

    out.append("")
    out.append("== Communication per training step ==")
    per_rank = ", ".join(f"r{r}: {_human(b)}" for r, b in enumerate(plan.halo_bytes_per_rank))
    out.append(
        f"halo bytes (forward + backward): {_human(plan.halo_bytes_per_step)} per domain group"
        + (f"; sent per domain rank {per_rank}" if n > 1 else "")
    )
    out.append("collectives per rank (busiest domain rank):")
    nonzero = {k: v for k, v in plan.collectives.items() if v}
    if nonzero:
        for kind, count in nonzero.items():
            out.append(f"  {kind:<24} {count}")
    else:
        out.append("  (none)")
    if plan.tp_targets and plan.tp > 1:
        listed = ", ".join(f"{p} ({role})" for p, role in plan.tp_targets)
        out.append(f"tensor-parallel layers: {listed}")

    out.append("")
    out.append(f"== Constraints ({len(plan.violations)} violated) ==")
    if plan.violations:
        out.extend(f"- {v}" for v in plan.violations)
    else:
        out.append("all satisfied")
    if plan.notes:
        out.append("")
        out.append("== Notes ==")
        out.extend(f"- {note}" for note in plan.notes)
    return "\n".join(out) + "\n"
