"""credit-parallel: exact data, tensor and domain (latitude) parallelism for weather models.

Every public name is importable from here.  Names are resolved lazily (PEP 562) so that
``import credit_parallel`` stays cheap and the layers below never import the layers above.
``_EXPORTS`` maps each name to its home module, the module that defines it
(``tests/test_exports.py`` checks both, and that every name the docs tell users to call is
here).  Conventions of the public API (``manager`` keyword-only where the SPEC does not fix
its position, ``shard_dim`` for the sharded dimension, options beyond the SPEC's positional
parameters keyword-only): the docstring of :mod:`credit_parallel.domain`.
"""

from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    # configuration, layout, mesh
    "parse_parallelism_conf": "config",
    "load_config": "config",
    "ParallelDims": "config",
    "ParallelMesh": "config",
    "DataMode": "config",
    "MeshAxis": "config",
    "RankLayout": "layout",
    "build_device_mesh": "mesh",
    "dp_world_size": "mesh",
    "data_parallel_coords": "mesh",
    "device_for_process_group": "device",
    # domain parallelism
    "DomainParallelManager": "domain.manager",
    "initialize_domain_parallel": "domain.manager",
    "get_domain_parallel_manager": "domain.manager",
    "HaloExchange": "domain.exchange.halo",
    "DomainParallelConv2d": "domain.layers.conv",
    "DomainParallelConv3d": "domain.layers.conv",
    "DomainParallelConvTranspose2d": "domain.layers.conv",
    "DomainParallelConvTranspose3d": "domain.layers.conv",
    "DomainParallelPeriodicConv2d": "domain.layers.conv",
    "DomainParallelGroupNorm": "domain.layers.norm",
    "DomainParallelInterpolate": "domain.layers.resample",
    "DomainParallelPixelShuffle": "domain.layers.pixel_shuffle",
    "DomainParallelPixelUnshuffle": "domain.layers.pixel_shuffle",
    "DomainParallelPad": "domain.layers.padding",
    "set_model_overlap": "domain.layers.split_conv",
    "convert_to_domain_parallel": "domain.convert",
    "register_domain_rule": "domain.convert",
    "validate_sharding_constraints": "domain.convert",
    "shard_tensor": "domain.sharding",
    "gather_tensor": "domain.sharding",
    "shard_batch": "domain.sharding",
    "shard_spatial": "domain.sharding",
    "unpad_shard_interp": "domain.sharding",
    "DomainRowGroupAttention": "domain.attention.relayout",
    "DomainSequenceAttention": "domain.attention.sequence",
    "DomainTokenAttention": "domain.attention.tokens",
    "sequence_parallel_attention": "domain.attention.tokens",
    "form_cost": "domain.attention.cost",
    "DomainGatherModule": "domain.layers.gather",
    "FunctionalCallGuard": "domain.guard",
    # data
    "build_train_loader": "data.loader",
    "DevicePrefetcher": "data.prefetch",
    # tensor parallel, data parallel, collectives, composition
    "apply_tensor_parallel": "tensor_parallel",
    "compile_blocks": "compile",
    "tp_replicated_parameters": "tensor_parallel",
    "apply_fsdp2": "fsdp",
    "apply_ddp": "fsdp",
    "allreduce_grads_avg": "collectives",
    "sync_domain_gradients": "collectives",
    "clip_grad_norm_": "collectives",
    "enable_overlapped_domain_grad_sync": "grad_overlap",
    "parallelize": "composition",
    "build_parallel_model": "model_init",
    "get_domain_manager": "composition",
    "get_raw_model": "composition",
    # planning (no processes)
    "project_step": "planner.projection",
    # training
    "TrainStep": "train.step",
    "latitude_weighted_loss": "train.step",
    "Trainer": "train.trainer",
    # multi-rank test harness
    "run_on_ranks": "testing",
    "RankFailure": "testing",
    "domain_parity_errors": "testing",
    "assert_parity": "testing",
    "fake_process_group": "testing",
    # CREDIT 2026.2's names (credit.parallel.*), thin entry points onto the above
    "supports_native_tp": "credit_api",
    "apply_native_tensor_parallel": "credit_api",
    "TpColConv2d": "credit_api",
    "TpColLinear": "credit_api",
    "TpRowConv2d": "credit_api",
    "TpRowLinear": "credit_api",
    "shard_lat_weights": "credit_api",
    "gather_spatial": "credit_api",
    "fsdp2_is_applied": "credit_api",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), ("__version__",))
