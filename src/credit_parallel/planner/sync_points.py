"""Synchronisation points of one training step: the places a rank WAITS for another rank.

Built from the planner's collective counts (``plan.collectives``,
:func:`~credit_parallel.planner.cost.predicted_collectives`); pure arithmetic.  A blocking call
is one point; asynchronous calls that the step waits for together count once:

* ``halo``: every batched halo exchange (forward rows, backward gradients) is waited for at once;
* ``norm``: GroupNorm statistics all-gathers (forward) and their adjoint all-reduces (backward)
  and the all-gathers of gathered modules;
* ``domain_grad``: the domain group's gradient all-reduce after the backward, one blocking call
  per bucket; with the overlapped reduction (``credit_parallel.parallel.grad_overlap``) the buckets are
  launched during the backward and the step waits for all of them once;
* ``tp``: tensor-parallel all-reduces and weight regroups (blocking);
* ``data``: FSDP2 all-gathers and reduce-scatters (counted per call), DDP's buckets (launched
  during the backward, waited for once).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["sync_points_per_step"]


def sync_points_per_step(
    collectives: Mapping[str, int], *, overlapped_domain_grads: bool = False
) -> dict[str, int]:
    """Synchronisation points per step by part, and their ``total`` (module docstring).

    ``collectives``: ``plan.collectives`` (every key of ``predicted_collectives``);
    ``overlapped_domain_grads``: the domain gradients are reduced by ``grad_overlap``."""
    c = collectives
    buckets = c["domain_grad_all_reduce"]
    points = {
        "halo": c["domain_p2p"],
        "norm": c["domain_all_gather"] + c["domain_all_reduce_norm"],
        "domain_grad": min(buckets, 1) if overlapped_domain_grads else buckets,
        "tp": c["tp_all_reduce"] + c["tp_weight_regroup"],
        "data": c["fsdp_all_gather"] + c["fsdp_reduce_scatter"] + min(c["ddp_all_reduce"], 1),
    }
    points["total"] = sum(points.values())
    return points
