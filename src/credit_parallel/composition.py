"""The composed recipe: build the layout, then domain conversion -> tensor parallel -> FSDP2 / DDP.

``parallelize(model, conf)`` is the counterpart of CREDIT's ``distributed_model_wrapper_gen2``:

1. :class:`~credit_parallel.config.ParallelDims` from ``trainer.parallelism`` and the world size
   builds every mesh (CUDA/NCCL when the process group is NCCL, else CPU/gloo — nothing in the
   config is needed for that);
2. domain > 1: a :class:`DomainParallelManager` from the mesh's "domain"/"dp" axes, and
   ``convert_to_domain_parallel``.  The manager is attached to the model, never made the
   process-wide one (that stays solely ``initialize_domain_parallel``'s);
3. tensor > 1: ``apply_tensor_parallel`` on the "tp" axis; ``trainer.compile``: ``compile_blocks``
   (``torch.compile`` per block, before FSDP2, as torchtitan does);
4. data "fsdp2": ``apply_fsdp2`` over the flattened dp x domain axis when domain > 1 (gradients
   summed over domain, averaged over dp), else over "dp"; "ddp": ``apply_ddp`` over "dp".

The mesh and the manager stay reachable from the returned model (``get_device_mesh``,
``get_domain_manager``); ``get_raw_model`` unwraps DDP.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .compile import compile_blocks
from .config import DataMode, MeshAxis, ParallelDims, ParallelMesh
from .device import device_for_process_group
from .domain.convert import convert_to_domain_parallel
from .domain.gather import nonlocal_policy_from_conf
from .domain.manager import DomainParallelManager
from .fsdp import apply_ddp, apply_fsdp2
from .run_config import trainer_option
from .tensor_parallel import apply_tensor_parallel

__all__ = [
    "apply_data_parallel",
    "apply_model_parallel",
    "get_device_mesh",
    "get_domain_manager",
    "get_raw_model",
    "parallel_layout",
    "parallelize",
]


def get_raw_model(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (FSDP2 keeps the module itself)."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def get_domain_manager(model: nn.Module):
    """The DomainParallelManager attached by parallelize / convert_to_domain_parallel, else None."""
    return getattr(get_raw_model(model), "_domain_manager", None)


def get_device_mesh(model: nn.Module):
    """The DeviceMesh attached by parallelize, else None."""
    return getattr(get_raw_model(model), "_device_mesh", None)


def parallel_layout(conf: dict) -> tuple[ParallelDims, ParallelMesh | None]:
    """The layout of ``conf`` on the current process group and its meshes; the meshes are None
    when the layout leaves the model alone (``data: none``, tensor = domain = 1)."""
    dims = ParallelDims.from_conf(conf)
    if not dims.parallelizes_model:
        return dims, None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"parallelize with trainer.parallelism {dims} needs an initialised process group "
            "(launch with `credit-parallel train --nproc N` or torchrun)"
        )
    dims.check_supported()
    return dims, dims.build_mesh(device_for_process_group().type)


def apply_model_parallel(
    model: nn.Module,
    dims: ParallelDims,
    meshes: ParallelMesh,
    *,
    src_data_rank: int | None = 0,
    nonlocal_policy: str = "raise",
) -> nn.Module:
    """Steps 2-3 of the recipe: domain conversion, then tensor parallelism; the mesh and the
    manager are attached to the model.  ``src_data_rank=None``: TP takes each rank's own copy
    (a model on the meta device).  ``nonlocal_policy``: see ``convert_to_domain_parallel``."""
    manager = None
    if dims.domain > 1:
        manager = DomainParallelManager.from_device_mesh(meshes.mesh)
        model = convert_to_domain_parallel(model, manager, nonlocal_policy=nonlocal_policy)
    if dims.tp > 1:
        model = apply_tensor_parallel(model, meshes.axis(MeshAxis.TP), src_data_rank=src_data_rank)
    object.__setattr__(model, "_device_mesh", meshes.mesh)
    object.__setattr__(model, "_domain_manager", manager)
    return model


def apply_data_parallel(
    model: nn.Module, conf: dict, dims: ParallelDims, meshes: ParallelMesh
) -> nn.Module:
    """Step 4 of the recipe: FSDP2 (over dp x domain when domain > 1) or DDP over dp."""
    if dims.data == DataMode.FSDP2:
        # over dp x domain FSDP's reduce-scatter must sum over the domain ranks (each holds its
        # rows' share of the gradient) and average over dp only
        divide = dims.dp if dims.fsdp_over_domain else None
        return apply_fsdp2(model, meshes.fsdp_mesh, conf, gradient_divide_factor=divide)
    if dims.data == DataMode.DDP:
        return apply_ddp(model, meshes.axis(MeshAxis.DP))
    return model


def parallelize(model: nn.Module, conf: dict) -> nn.Module:
    """Apply the configured parallelisms to ``model`` (in place where possible) and return it.

    A layout that does not change the model (``data: none``, tensor = domain = 1, on any number
    of ranks) returns it untouched (compiled per block when ``trainer.compile`` is true).
    """
    dims, meshes = parallel_layout(conf)
    compile_on = trainer_option(conf, "compile")
    if meshes is None:
        if compile_on:
            compile_blocks(model)
        return model
    model = apply_model_parallel(
        model, dims, meshes, nonlocal_policy=nonlocal_policy_from_conf(conf)
    )
    if compile_on:  # per block, after domain conversion and TP, before FSDP2 (as torchtitan)
        compile_blocks(model)
    return apply_data_parallel(model, conf, dims, meshes)
