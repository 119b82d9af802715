"""Joining the process group a launcher (torchrun, SLURM, the CLI) set up, with bounded timeouts.

The entry points (``credit_parallel.train.main``, ``credit_parallel.tools.verify``) only read the
environment variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

Timeouts.  :func:`init_distributed_from_env` gives the default group ``trainer.dist_timeout_s``
and makes every group created later (DeviceMesh axes, domain and dp groups) inherit it
(:func:`set_subgroup_timeout`) — torch would otherwise give those groups 30 minutes.  Starting
local ranks and telling which one failed first is a tool above the library:
:mod:`credit_parallel.tools.launcher` and :mod:`credit_parallel.tools.forensics`.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .device import backend_for, choose_device, requested_device, set_local_cuda_device

__all__ = [
    "DEFAULT_RENDEZVOUS_TIMEOUT_S",
    "RESTART_COUNT_ENV",
    "elastic_restart_count",
    "group_timeout",
    "init_distributed_from_env",
    "set_subgroup_timeout",
    "wait_all",
    "under_launcher",
]

DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


# torchrun's elastic agent numbers the starts of its worker group: 0 first, 1.. after restarts
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def elastic_restart_count() -> int:
    """How many times torchrun's agent (``--max-restarts``) has restarted this rank's worker
    group: 0 on the first start and outside torchrun."""
    try:
        return max(0, int(os.environ.get(RESTART_COUNT_ENV, "0")))
    except ValueError:
        return 0


def init_distributed_from_env(
    timeout_s: float = 600.0, *, rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
) -> None:
    """Initialise the default process group from torchrun's environment: NCCL on
    ``cuda:LOCAL_RANK`` when the command line chose CUDA (``--device``, passed as
    :data:`~credit_parallel.layout.device.DEVICE_ENV`) or, with ``auto``, when this node has at least as
    many visible GPUs as local ranks (``LOCAL_WORLD_SIZE``); else gloo on the CPU.  Under NCCL the
    rank's device is set once (:func:`~credit_parallel.layout.device.set_local_cuda_device`) and given to
    ``init_process_group`` as ``device_id`` (no "guessing device ID" and no hang on a
    heterogeneous rank-to-GPU mapping).

    ``timeout_s`` (``trainer.dist_timeout_s``) bounds every collective of the default group AND
    of every group created afterwards (:func:`set_subgroup_timeout`): a rank waiting for a peer
    that stopped responding raises after it instead of waiting forever.  The initial rendezvous
    alone may wait ``max(timeout_s, rendezvous_timeout_s)``: ranks start seconds or minutes
    apart (imports, containers), which is not a failure (a rank that dies before the rendezvous
    is noticed by the launcher, which then stops the others).
    """
    for key, value in (
        ("trainer.dist_timeout_s", timeout_s),
        ("rendezvous_timeout_s", rendezvous_timeout_s),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{key} must be a number of seconds > 0, got {value!r}")
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=float(timeout_s))
    rendezvous = max(timeout, datetime.timedelta(seconds=float(rendezvous_timeout_s)))
    # torchrun sets LOCAL_WORLD_SIZE; elsewhere (srun) the rank needs at least its own GPU
    local_ranks = int(
        os.environ.get("LOCAL_WORLD_SIZE", int(os.environ.get("LOCAL_RANK", "0")) + 1)
    )
    device = choose_device(requested_device(), local_ranks)
    kwargs = {}
    if device == "cuda":
        kwargs["device_id"] = set_local_cuda_device()
    dist.init_process_group(backend_for(device), timeout=rendezvous, **kwargs)
    if rendezvous != timeout:
        import torch.distributed.distributed_c10d as c10d

        c10d._set_pg_timeout(timeout)  # from now on, collectives wait at most `timeout`
    set_subgroup_timeout(timeout)


def set_subgroup_timeout(timeout: datetime.timedelta) -> None:
    """Make process groups created later without a timeout (``dist.new_group``: the DeviceMesh
    axes, the domain and dp groups) use ``timeout``.

    torch gives such groups its own default of 30 minutes, NOT the default group's timeout, so
    a peer that stops responding inside a domain exchange or a dp all-reduce would hold every
    other rank for half an hour whatever ``trainer.dist_timeout_s`` says.  torch reads that
    default from a module global of ``torch.distributed.distributed_c10d`` at each
    ``new_group`` call; this sets it (for gloo and, when built, NCCL).
    """
    import torch.distributed.distributed_c10d as c10d

    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = timeout


def group_timeout(group=None) -> datetime.timedelta | None:
    """The timeout of ``group`` (default: the default group), or None when torch hides it."""
    import torch.distributed.distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(pg)) else "cpu")
    try:
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _point_to_point_timeout(group) -> datetime.timedelta | None:
    """The bound to give a point-to-point wait on ``group`` explicitly: gloo waits for a receive
    up to the timeout its transport was CREATED with, which for the default group is the longer
    rendezvous timeout (:func:`init_distributed_from_env` lowers only the collectives' bound
    afterwards), so a peer that stops responding in a halo exchange would hold the others for
    minutes.  None for other backends (an NCCL wait with a timeout would block the CPU)."""
    group = dist.group.WORLD if group is None else group
    if str(dist.get_backend(group)) != "gloo":
        return None
    return group_timeout(group)


def wait_all(works, group) -> None:
    """Wait for the point-to-point ``works`` posted on ``group``, each within the group's own
    timeout (``trainer.dist_timeout_s``), as its collectives are."""
    timeout = _point_to_point_timeout(group) if works else None
    for work in works:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
