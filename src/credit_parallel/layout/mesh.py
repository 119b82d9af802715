"""Device mesh construction from a ``trainer.parallelism`` block (SPEC §2).

Layout: row-major over (dp, tp, domain), domain innermost.  For global rank g:
``domain_coord = g % domain``, ``tp_coord = (g // domain) % tp``, ``dp_rank = g // (tp*domain)``.
With an ensemble axis (``ensemble: E`` > 1) the layout is (dp, ensemble, tp, domain):
``ens = (g // (tp*domain)) % E``, ``dp_rank = g // (E*tp*domain)``.
The degrees, the arithmetic and the meshes belong to :class:`~credit_parallel.layout.config.ParallelDims`;
the functions here are the public entry points of SPEC §2 and delegate to it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .config import (
    ParallelDims,
    has_process_group,
    parse_parallelism_block,
    parse_parallelism_conf,
)
from .ranks import RankLayout

__all__ = [
    "build_device_mesh",
    "data_parallel_coords",
    "dp_world_size",
    "full_rank_layout",
]


def dp_world_size(parallelism_conf: dict, world_size: int) -> int:
    """Number of data-parallel replicas: ``world_size // (ensemble*tensor*domain)``.

    Validates the block like :func:`parse_parallelism_conf`; ``ValueError`` if ``world_size`` is
    not divisible by ``tensor*domain`` or the result would be < 1.
    """
    return ParallelDims.from_block(parallelism_conf, world_size).dp


def full_rank_layout(dims: ParallelDims) -> RankLayout:
    """The (dp, tp, domain) layout of all ranks, size-1 axes included (``dims.rank_layout``)."""
    return dims.rank_layout


def build_device_mesh(
    parallelism_conf: dict, device: str = "cuda"
) -> tuple[DeviceMesh | None, dict]:
    """Build the ("dp", "tp", "domain") DeviceMesh over the default process group.

    Only axes of size > 1 are kept, plus "dp" whenever ``data != "none"`` (even at dp size 1).
    Returns ``(mesh, submeshes)`` with a 1-D submesh per axis of size > 1, or ``(None, {})`` when
    no axis is kept (one process, data "none", tensor = domain = 1; such a call needs no process
    group).  ``device="cpu"`` uses gloo.
    """
    block = parse_parallelism_block(parallelism_conf)
    try:
        meshes = ParallelDims.from_block(block).build_mesh(device)
    except RuntimeError as exc:  # no process group: say which call needed one
        raise RuntimeError(f"build_device_mesh: {exc}") from None
    return meshes.mesh, dict(meshes.submeshes)


def data_parallel_coords(conf: dict) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this process from the FULL config; ``(0, 1)`` without a process group.

    Sampler contract: data is sharded over dp only; ranks that differ only in their tp or domain
    coordinate get the same batch (the members of one sample live on the ensemble axis).
    """
    block = parse_parallelism_conf(conf)
    if not has_process_group():
        return 0, 1
    dims = ParallelDims.from_block(block, dist.get_world_size())
    return dims.coords(dist.get_rank())["dp"], dims.dp
