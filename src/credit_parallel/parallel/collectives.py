"""Gradient collectives: bucketed all-reduce of gradients and global-norm clipping across meshes.

* :func:`allreduce_grads` is the one bucketing routine: gradients are grouped by (dtype, device),
  packed into flat buckets of at most ``bucket_cap_mb`` (a larger tensor travels alone), reduced
  with one ``all_reduce`` per bucket, and written back in place whatever their memory layout.
  DTensor gradients are reduced on their local shards.  :func:`allreduce_grads_avg` and
  :func:`sync_domain_gradients` are thin callers.
* :func:`clip_grad_norm_` computes the true global norm of gradients that live on different
  meshes (plain tensors, TP DTensors, FSDP2 DTensors, 2-D dp x tp DTensors): each local shard is
  counted once by summing over exactly the mesh axes it is sharded on, never over the axes it is
  replicated on.

Every rank of a group must pass gradients of the same shapes in the same order (they do when
every rank holds the same model); otherwise the buckets of different ranks would not line up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate

from ..layout.config import DP_DOMAIN
from ..layout.small_collectives import sum_small_
from .grad_overlap import OVERLAP_ATTR

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "allreduce_grads",
    "allreduce_grads_avg",
    "clip_grad_norm_",
    "sync_domain_gradients",
]

DEFAULT_BUCKET_CAP_MB = 25.0
_REDUCE_OPS = ("avg", "sum")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard (same storage: writes land in the DTensor)."""
    if isinstance(tensor, DTensor):
        # Outside autograd, to_local() returns the DTensor's own local tensor, not a copy.
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Split tensors into buckets of one (dtype, device) and at most ``cap_bytes`` each.

    Order is deterministic (first appearance of each (dtype, device), then list order), so every
    rank builds the same buckets from the same shapes.
    """
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    buckets: list[list[torch.Tensor]] = []
    for members in by_kind.values():
        current: list[torch.Tensor] = []
        current_bytes = 0
        for tensor in members:
            nbytes = tensor.numel() * tensor.element_size()
            if current and current_bytes + nbytes > cap_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(tensor)
            current_bytes += nbytes
        if current:
            buckets.append(current)
    return buckets


def _reduce_bucket(bucket: list[torch.Tensor], group, op: str, world: int) -> None:
    if len(bucket) == 1 and bucket[0].is_contiguous():
        flat = bucket[0]  # reduced in place, no staging copy
    else:
        # reshape(-1) reads each tensor in logical (row-major) order whatever its strides, and the
        # copy_ below writes back in the same logical order, so non-contiguous / channels_last
        # gradients keep their layout and their values line up across ranks.
        flat = torch.cat([t.reshape(-1) for t in bucket])
    sum_small_(flat, group)  # gloo has no AVG; small buckets go point to point on gloo
    if op == "avg":
        flat.div_(world)
    if flat is bucket[0]:
        return
    offset = 0
    for tensor in bucket:
        n = tensor.numel()
        tensor.copy_(flat[offset : offset + n].view(tensor.shape))
        offset += n


def allreduce_grads(
    grads: Iterable[torch.Tensor | None],
    group: ProcessGroup | None = None,
    *,
    op: str = "avg",
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Bucketed in-place all-reduce (``op`` "avg" or "sum") of gradients over ``group``.

    ``None`` entries are skipped; DTensors are reduced on their local shards; buckets hold one
    (dtype, device) and at most ``bucket_cap_mb`` megabytes (2**20 bytes) each, one ``all_reduce``
    per bucket.  ``group=None`` is the default group.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {_REDUCE_OPS}, got {op!r}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    tensors = [_local(g) for g in grads if g is not None]
    if not tensors:
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    cap_bytes = max(1, int(bucket_cap_mb * 2**20))
    with torch.no_grad():
        for bucket in _buckets(tensors, cap_bytes):
            _reduce_bucket(bucket, group, op, world)


def allreduce_grads_avg(
    grads: Iterable[torch.Tensor | None],
    group: ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Bucketed in-place average of ``grads`` over ``group`` (``None`` = default group).

    ``None`` entries are skipped; any memory layout; DTensors reduced on their local shards.
    """
    allreduce_grads(grads, group, op="avg", bucket_cap_mb=bucket_cap_mb)


def sync_domain_gradients(
    model: torch.nn.Module,
    manager,
    op: str = "avg",
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> None:
    """Reduce every parameter gradient of ``model`` over ``manager.domain_group``; in place.

    ``manager`` needs ``.domain_group`` (a ProcessGroup, ``None`` = default group) and
    ``.domain_world_size``; a domain size of 1 (or ``manager=None``) is a no-op.  Parameters
    without a gradient are skipped.

    * ``op="avg"`` is exact when each domain rank's loss is the mean over its own shard and the
      shards are equally sized (the mean of equal-weight means is the global mean).
    * ``op="sum"`` is exact for any shards (uneven grids) when each rank's loss is its share of a
      globally normalised loss: the sum over its own points divided by the global count.

    Parameters FSDP2 shards over the flattened dp x domain axis (``parallelize`` with fsdp2 and
    domain > 1) already had their gradients summed over the domain ranks by the reduce-scatter;
    they only get the op's scaling (avg: divided by the domain size; sum: nothing).  Call it
    once per optimizer step, after the last backward.

    A model with an overlapped reducer attached (``grad_overlap.enable_overlapped_domain_grad_sync``)
    has had its buckets summed during the backward: this only completes them (same sums).
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"sync_domain_gradients: op must be one of {_REDUCE_OPS}, got {op!r}")
    if manager is None or int(manager.domain_world_size) <= 1:
        return
    overlapped = getattr(model, OVERLAP_ATTR, None)
    if overlapped is not None:
        overlapped.finish()
        if op == "avg":
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(int(manager.domain_world_size))
        return
    reduced, to_reduce = [], []
    for p in model.parameters():
        if p.grad is not None:
            (reduced if _reduced_over_domain(p.grad) else to_reduce).append(p.grad)
    if op == "avg" and reduced:
        with torch.no_grad():
            for grad in reduced:
                _local(grad).div_(int(manager.domain_world_size))
    allreduce_grads(to_reduce, manager.domain_group, op=op, bucket_cap_mb=bucket_cap_mb)


def _reduced_over_domain(grad: torch.Tensor) -> bool:
    """Whether FSDP2 reduce-scattered this gradient over the flattened dp x domain axis."""
    if not isinstance(grad, DTensor):
        return False
    return DP_DOMAIN in tuple(grad.device_mesh.mesh_dim_names or ())


# --------------------------------------------------------------------------------------------
# global gradient norm


def _sharded_groups(grad: DTensor) -> tuple[DTensor, tuple[ProcessGroup, ...]]:
    """(DTensor whose local shard carries this gradient's share, groups to sum that share over).

    A DTensor's local shard is summed over every mesh axis that
    is not Replicate (Shard, and also _StridedShard, which FSDP2 puts on dp over a TP Shard(0)
    and which is not a Shard subclass) and counted once over the Replicate axes.
    Partial placements are first reduced to Replicate (a Partial local tensor is not a piece of
    the gradient, so its norm would be meaningless).
    """
    mesh = grad.device_mesh
    placements = list(grad.placements)
    if any(p.is_partial() for p in placements):
        grad = grad.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])
        placements = list(grad.placements)
    groups = tuple(
        mesh.get_group(axis)
        for axis, placement in enumerate(placements)
        if not placement.is_replicate() and mesh.size(axis) > 1
    )
    return grad, groups


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a local norm is computed in: float32 for 16-bit gradients, else their own."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _foreach_contribution(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Sum |x|^p (max |x| for the inf norm) over ``tensors`` (one device and dtype), in float64,
    from ONE fused ``torch._foreach_norm`` kernel (per-tensor norms), not one kernel per tensor."""
    device = tensors[0].device
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, norm_type, dtype=_norm_dtype(tensors[0].dtype))
    norms = torch.stack(norms).to(torch.float64)
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def _global_norm(
    grads: list[torch.Tensor], norm_type: float, extra_groups: Sequence[ProcessGroup]
) -> torch.Tensor:
    """The global norm: local shards grouped by (groups to reduce over, device, dtype), one fused
    norm kernel per group, then one all-reduce per distinct tuple of groups (one in total for
    an FSDP2 model on one mesh)."""
    is_inf = math.isinf(norm_type)
    reduce_op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    device = _local(grads[0]).device
    # Insertion order is the parameter order, identical on every rank, so all ranks issue the
    # same collectives in the same order.
    buckets: dict[tuple, list[torch.Tensor]] = {}
    groups_of: dict[tuple, tuple[ProcessGroup, ...]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            key = (grad.device_mesh, tuple(grad.placements))
            if key not in groups_of or any(p.is_partial() for p in grad.placements):
                carrier, groups_of[key] = _sharded_groups(grad)
            else:
                carrier = grad
            groups = groups_of[key]
        else:
            carrier, groups = grad, tuple(extra_groups)
        local = _local(carrier)
        buckets.setdefault((groups, local.device, local.dtype), []).append(local)
    partials: dict[tuple[ProcessGroup, ...], torch.Tensor] = {}
    for (groups, _, _), tensors in buckets.items():
        contribution = _foreach_contribution(tensors, norm_type).to(device)
        if groups in partials:
            previous = partials[groups]
            partials[groups] = (
                torch.maximum(previous, contribution) if is_inf else previous + contribution
            )
        else:
            partials[groups] = contribution
    total = torch.zeros((), dtype=torch.float64, device=device)
    for groups, partial in partials.items():
        for group in groups:
            if is_inf:
                dist.all_reduce(partial, op=reduce_op, group=group)
            else:
                sum_small_(partial, group)
        total = torch.maximum(total, partial) if is_inf else total + partial
    return total if is_inf else total ** (1.0 / norm_type)


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Every gradient's local shard times ``coef``, one fused kernel per device and dtype."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        local = _local(grad)
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), tensors in by_kind.items():
        torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    groups: Sequence[ProcessGroup] | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by their TRUE global norm, wherever they live; returns that norm.

    Like ``torch.nn.utils.clip_grad_norm_`` (gradients scaled in place by
    ``min(1, max_norm / (norm + 1e-6))``), but the norm is the one the unsharded model would have:
    plain tensors are replicated and counted once; a DTensor's local shards are summed over the
    mesh axes it is sharded on (TP ``Shard``, FSDP2 ``Shard(0)`` on dp, or both on a 2-D mesh) and
    counted once over its ``Replicate`` axes.  Under domain parallelism call it after
    :func:`sync_domain_gradients`: domain ranks then hold identical gradients, counted once.

    ``groups``: process groups over which the *plain* (non-DTensor) gradients are split into
    disjoint pieces (hand-sharded parameters); their contributions are summed over each group.
    Default: none, plain gradients are replicated.

    ``norm_type`` is a positive number or ``inf``.  The norm is returned as a plain tensor (float64
    if any gradient is float64, else float32), identical on every rank.  A non-finite norm is
    returned without touching the gradients (the caller applies its policy, e.g. skip the step),
    unless ``error_if_nonfinite`` is true, which raises ``RuntimeError``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    if not (norm_type > 0 or norm_type == math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    result_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    with torch.no_grad():
        total = _global_norm(grads, norm_type, tuple(groups or ())).to(result_dtype)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                f"{total.item()} (non-finite); set error_if_nonfinite=False to get it returned"
            )
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        # Without a host sync: a non-finite norm leaves the gradients as they are.
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        _scale_(grads, coef)
    return total
