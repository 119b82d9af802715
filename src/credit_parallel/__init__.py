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

from .lazy import alias_moved_modules, lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    # configuration, layout, mesh
    "parse_parallelism_conf": "layout.config",
    "load_config": "layout.config",
    "ParallelDims": "layout.config",
    "ParallelMesh": "layout.config",
    "DataMode": "layout.config",
    "MeshAxis": "layout.config",
    "RankLayout": "layout.ranks",
    "build_device_mesh": "layout.mesh",
    "dp_world_size": "layout.mesh",
    "data_parallel_coords": "layout.mesh",
    "device_for_process_group": "layout.device",
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
    "register_domain_rule": "domain.rules",
    "validate_sharding_constraints": "domain.convert",
    "shard_tensor": "domain.sharding",
    "gather_tensor": "domain.sharding",
    "shard_batch": "domain.sharding",
    "declare_global_shape": "domain.sharding",
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
    "apply_tensor_parallel": "parallel.tensor_parallel",
    "compile_blocks": "parallel.compile",
    "tp_replicated_parameters": "parallel.tensor_parallel",
    "apply_fsdp2": "parallel.fsdp",
    "apply_ddp": "parallel.fsdp",
    "allreduce_grads_avg": "parallel.collectives",
    "sync_domain_gradients": "parallel.collectives",
    "clip_grad_norm_": "parallel.collectives",
    "enable_overlapped_domain_grad_sync": "parallel.grad_overlap",
    "parallelize": "parallel.composition",
    "build_parallel_model": "train.model_init",
    "get_domain_manager": "parallel.composition",
    "get_raw_model": "parallel.composition",
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
    "supports_native_tp": "parallel.credit_api",
    "apply_native_tensor_parallel": "parallel.credit_api",
    "TpColConv2d": "parallel.credit_api",
    "TpColLinear": "parallel.credit_api",
    "TpRowConv2d": "parallel.credit_api",
    "TpRowLinear": "parallel.credit_api",
    "shard_lat_weights": "parallel.credit_api",
    "gather_spatial": "parallel.credit_api",
    "fsdp2_is_applied": "parallel.credit_api",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), ("__version__",))

#: modules that moved into packages (old path -> new path, below credit_parallel): the old
#: import paths keep working for one release, with a DeprecationWarning naming the new one
#: (``scripts/move_modules.py`` rewrote the library's own imports from this table)
MOVED_MODULES = {
    "config": "layout.config",
    "run_config": "layout.run_config",
    "layout": "layout.ranks",
    "mesh": "layout.mesh",
    "device": "layout.device",
    "launch": "layout.launch",
    "compat": "layout.compat",
    "small_collectives": "layout.small_collectives",
    "tensor_parallel": "parallel.tensor_parallel",
    "tensor_parallel_guard": "parallel.tensor_parallel_guard",
    "credit_api": "parallel.credit_api",
    "fsdp": "parallel.fsdp",
    "grad_overlap": "parallel.grad_overlap",
    "collectives": "parallel.collectives",
    "compile": "parallel.compile",
    "composition": "parallel.composition",
    "model_init": "train.model_init",
    "checkpoint": "train.checkpoint",
    "preflight": "train.preflight",
    "verify": "tools.verify",
    "mesh_demo": "tools.mesh_demo",
}
alias_moved_modules(__name__, MOVED_MODULES)
