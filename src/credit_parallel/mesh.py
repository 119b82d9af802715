"""Device mesh construction from a ``trainer.parallelism`` block.

Layout (SPEC §2): row-major over (dp, tp, domain), domain innermost.  For global rank g:
``domain_coord = g % domain``, ``tp_coord = (g // domain) % tp``, ``dp_rank = g // (tp*domain)``.
All of that arithmetic is :class:`~credit_parallel.layout.RankLayout`; this module only turns it
into a ``torch.distributed.DeviceMesh``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import (
    DataMode,
    MeshAxis,
    ParallelDims,
    parse_parallelism_block,
    parse_parallelism_conf,
)
from .layout import RankLayout

__all__ = [
    "build_device_mesh",
    "data_parallel_coords",
    "dp_world_size",
    "full_rank_layout",
]


def dp_world_size(parallelism_conf: dict, world_size: int) -> int:
    """Number of data-parallel replicas: ``world_size // (tensor*domain)``.

    Validates the block like :func:`parse_parallelism_conf`; ``ValueError`` if ``world_size`` is
    not divisible by ``tensor*domain`` or the result would be < 1.
    """
    return ParallelDims.from_block(parallelism_conf, world_size).dp


def full_rank_layout(dims: ParallelDims) -> RankLayout:
    """The (dp, tp, domain) layout of all ranks, size-1 axes included."""
    return RankLayout(
        dims.full_layout_shape, dims.world_size, (MeshAxis.DP, MeshAxis.TP, MeshAxis.DOMAIN)
    )


def _require_process_group(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first (or launch with torchrun / "
            "`credit-parallel train --nproc N`)"
        )


def build_device_mesh(
    parallelism_conf: dict, device: str = "cuda"
) -> tuple[DeviceMesh | None, dict]:
    """Build the ("dp", "tp", "domain") DeviceMesh over the default process group.

    Only axes of size > 1 are kept, plus "dp" whenever ``data != "none"`` (even at dp size 1).
    Returns ``(mesh, submeshes)`` with a 1-D submesh per axis of size > 1, or ``(None, {})`` when
    data is "none" and tensor = domain = 1.  ``device="cpu"`` uses gloo.
    """
    block = parse_parallelism_block(parallelism_conf)
    if block["data"] == DataMode.NONE and block["tensor"] == 1 and block["domain"] == 1:
        return None, {}
    _require_process_group("build_device_mesh")
    dims = ParallelDims.from_block(block, dist.get_world_size())
    axes = dims.mesh_axes
    names = tuple(name for name, _ in axes)
    shape = tuple(size for _, size in axes)
    # The DeviceMesh rank order is row-major over `shape`, which is exactly RankLayout's order
    # with the size-1 axes dropped; check that once here so the two can never drift apart.
    layout = RankLayout(shape, dims.world_size, names)
    full = full_rank_layout(dims)
    rank = dist.get_rank()
    kept = [full.dim_index(n) for n in names]
    assert tuple(full.coords(rank)[i] for i in kept) == layout.coords(rank)
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    submeshes = {name: mesh[name] for name, size in axes if size > 1}
    return mesh, submeshes


def data_parallel_coords(conf: dict) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of this process from the FULL config; ``(0, 1)`` without a process group.

    Sampler contract: data is sharded over dp only; ranks that differ only in their tp or domain
    coordinate get the same batch.
    """
    block = parse_parallelism_conf(conf)
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    dims = ParallelDims.from_block(block, dist.get_world_size())
    layout = full_rank_layout(dims)
    return layout.coords(dist.get_rank())[0], dims.dp
