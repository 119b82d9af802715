"""The domain group's gradient all-reduce, bucketed and overlapped with the backward.

Without it, :func:`~credit_parallel.parallel.collectives.sync_domain_gradients` reduces every gradient
after the backward has finished: the reduction is a synchronisation point the whole step waits
for.  :class:`OverlappedDomainGradSync` does what DDP and FSDP do: the parameters are packed into
buckets (reverse parameter order, the order the backward produces their gradients), a
``register_post_accumulate_grad_hook`` per parameter marks its gradient ready, and a bucket whose
gradients are all ready is summed over the domain group with an asynchronous ``all_reduce``
while the backward goes on.  ``sync_domain_gradients`` then only waits for the buckets in flight,
launches the ones the backward did not complete (parameters without a gradient) and writes the
sums back; the result is the same SUM over the domain ranks, identical on every rank.

Rules that keep it exact and deadlock-free:

* the buckets of the first step follow the reverse parameter order; after it they are rebuilt
  in the order the gradients became ready (rank 0's order, broadcast), parameters without a
  gradient in buckets of their own, last, as DDP rebuilds its buckets;
* buckets are launched strictly in bucket order (a completed bucket waits for the ones before
  it), on a process group of their own (:func:`dedicated_groups`), so every rank issues the same
  collectives in the same order whatever order its hooks fire in, and the domain layers'
  exchanges and statistics collectives in the backward never interleave with them;
* a hook that fires again for a bucket already in flight (a second backward before the step's
  reduction: gradient accumulation) waits for that reduction, discards it and marks the bucket
  pending again: the gradients keep accumulating locally and the last backward's sums are the
  ones written back (:meth:`OverlappedDomainGradSync.no_sync` avoids the wasted reductions);
* the gradients themselves are written only by :meth:`OverlappedDomainGradSync.finish`; until
  then each bucket in flight holds a flat copy of its gradients (at most one copy of all the
  gradients per rank, as DDP's bucket buffers; the after-backward path holds one bucket), which
  is what makes a repeated backward (accumulation) safe;
* only layouts whose one axis is the domain (``data: none``, ``tensor: 1``) and plain-tensor
  parameters: DDP (whose hooks rewrite the gradients of the raw model too), FSDP2 and tensor
  parallelism are refused, since their own reductions own those gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "OVERLAP_ATTR",
    "OverlappedDomainGradSync",
    "dedicated_groups",
    "enable_overlapped_domain_grad_sync",
]

OVERLAP_ATTR = "_cp_domain_grad_overlap"  # where the model keeps its reducer
_MIB = 2**20


def dedicated_groups(group) -> object:
    """A new process group with the same ranks as ``group`` (every rank of the world calls
    this, each with its own group; the groups of all ranks are created in one agreed order)."""
    mine = tuple(dist.get_process_group_ranks(group)) if group is not None else None
    world = dist.get_world_size()
    if mine is None:
        mine = tuple(range(world))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    result = None
    for ranks in sorted(set(everyone)):
        created = dist.new_group(list(ranks))
        if ranks == mine:
            result = created
    return result


class _Bucket:
    __slots__ = ("flat", "index", "params", "ready", "work")

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index, self.params = index, params
        self.ready: set[int] = set()
        self.work = None
        self.flat: torch.Tensor | None = None


class OverlappedDomainGradSync:
    """Per-bucket hooks that sum the gradients of ``model``'s parameters over ``group`` while
    the backward runs (module docstring).  Build it with
    :func:`enable_overlapped_domain_grad_sync`; :meth:`finish` (called by
    ``sync_domain_gradients``) completes the step's reduction."""

    def __init__(self, model: nn.Module, group, *, bucket_cap_mb: float = 25.0):
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        params = [p for p in model.parameters() if p.requires_grad]
        bad = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
        if bad:
            raise ValueError(
                f"overlapped domain gradient sync: parameter {bad[0]!r} is a DTensor (FSDP2 or "
                f"tensor parallelism reduces it); use sync_domain_gradients without overlap"
            )
        self.group = group
        self._params = params
        self._cap = max(1, int(bucket_cap_mb * _MIB))
        self._build(list(reversed(range(len(params)))))
        self._fired: list[int] = []  # parameter indices in the order their hooks fired
        self._index = {id(p): i for i, p in enumerate(params)}
        self._rebuilt = False
        self._paused = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _build(self, order: list[int], idle: list[int] = ()) -> None:
        """Buckets of the parameters in ``order``, then buckets of their own for ``idle`` ones
        (no gradient in the first step: they would hold back a bucket they shared)."""
        self.buckets = _pack([self._params[i] for i in order], self._cap)
        for bucket in _pack([self._params[i] for i in idle], self._cap):
            bucket.index = len(self.buckets)
            self.buckets.append(bucket)
        self._where = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0  # the first bucket not yet launched

    def _rebuild_from_first_step(self) -> None:
        """After the first step, as DDP does: buckets in the order the gradients became ready
        (rank 0's order, broadcast, so every rank builds the same buckets), the parameters that
        got no gradient in buckets of their own, last."""
        seen = list(dict.fromkeys(self._fired))
        idle = [i for i in reversed(range(len(self._params))) if i not in set(seen)]
        box = [(seen, idle)]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        self._build(*box[0])
        self._rebuilt = True

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, param: nn.Parameter) -> None:
        if self._paused:
            return
        if not self._rebuilt:
            self._fired.append(self._index[id(param)])
        bucket = self._where[id(param)]
        if bucket.work is not None or bucket.index < self._next:
            self._restart()  # another backward before the reduction: accumulate, start over
        bucket.ready.add(id(param))
        self._launch_ready()

    def _restart(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work, bucket.flat = None, None
            bucket.ready.clear()
        self._next = 0

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params if p.grad is not None]
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in grads]) if grads else None
        bucket.flat = flat
        if flat is not None:
            bucket.work = dist.all_reduce(flat, group=self.group, async_op=True)
        else:
            bucket.work = None
        self._next = bucket.index + 1

    # ------------------------------------------------------------------ the step
    @property
    def pending(self) -> bool:
        """Whether a backward since the last :meth:`finish` has started a reduction."""
        return self._next > 0 or any(b.ready for b in self.buckets)

    def finish(self) -> None:
        """Launch the buckets the backward left incomplete (in order), wait for every bucket and
        write the sums into the gradients; the reducer is then ready for the next step."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                if bucket.flat is not None:
                    offset = 0
                    for p in bucket.params:
                        if p.grad is None:
                            continue
                        n = p.grad.numel()
                        p.grad.copy_(bucket.flat[offset : offset + n].view_as(p.grad))
                        offset += n
                bucket.work, bucket.flat = None, None
                bucket.ready.clear()
        self._next = 0
        if not self._rebuilt and self._fired:
            self._rebuild_from_first_step()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """No reduction is started by the backwards inside the block (gradient accumulation)."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def remove(self) -> None:
        """Unregister the hooks (after :meth:`finish`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def bucket_count(self) -> int:
        return len(self.buckets)


def _pack(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """Greedy buckets of at most ``cap_bytes`` (a larger tensor travels alone), one dtype and
    device each, in the given order."""
    buckets: list[_Bucket] = []
    current: list[nn.Parameter] = []
    size, kind = 0, None
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or (p.dtype, p.device) != kind):
            buckets.append(_Bucket(len(buckets), current))
            current, size = [], 0
        current.append(p)
        size += nbytes
        kind = (p.dtype, p.device)
    if current:
        buckets.append(_Bucket(len(buckets), current))
    return buckets


def enable_overlapped_domain_grad_sync(
    model: nn.Module, *, manager, bucket_cap_mb: float = 25.0
) -> OverlappedDomainGradSync | None:
    """Attach an :class:`OverlappedDomainGradSync` to ``model`` (the raw model, the one passed
    to ``sync_domain_gradients``) for ``manager``'s domain group; every rank of the world must
    call it (it creates process groups).  Returns None (nothing attached) for a domain of 1."""
    if manager is None or int(manager.domain_world_size) <= 1:
        return None
    domain = int(manager.domain_world_size)
    if dist.get_world_size() != domain:
        # the raw model under DDP looks like any other: DDP's hooks would write the dp-averaged
        # gradients that finish() then overwrites with sums of the un-averaged ones
        raise ValueError(
            f"overlapped domain gradient sync: the world has {dist.get_world_size()} ranks but "
            f"the domain group {domain}; it supports layouts whose only axis is the domain "
            "(trainer.parallelism {data: none, tensor: 1}); leave it off with dp or tp replicas"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "overlapped domain gradient sync: the model is wrapped in DDP, whose hooks own the "
            "gradients; attach it to a model without DDP (data: none) or leave it off"
        )
    reducer = OverlappedDomainGradSync(
        model, dedicated_groups(manager.domain_group), bucket_cap_mb=bucket_cap_mb
    )
    setattr(model, OVERLAP_ATTR, reducer)
    return reducer
