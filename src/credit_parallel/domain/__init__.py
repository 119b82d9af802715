"""Domain (latitude) parallelism: what a user of it imports, and where everything lives.

    from credit_parallel.domain import (
        DomainParallelManager, convert_to_domain_parallel, shard_batch, gather_tensor,
    )

The package, lowest first (a module imports only its own level or lower ones):

* ``rows`` — pure row algebra: which rows each rank owns, which rows a layer's output rows read,
  exchange plans (no processes); ``geometry`` — the protocol every layer answers (form, output
  height, windows), which the planner, the cost model and the fusions ask;
* ``manager`` — :class:`DomainParallelManager`: the domain / data-parallel process groups and the
  global-height bookkeeping; ``options`` — a layer's construction-time options;
* ``exchange/`` — where domain ranks talk: ``halo`` (halo rows and their gradients, one batched
  point-to-point call per layer and direction; :class:`HaloExchange`), ``collectives`` (rows
  gathered / scattered), ``ops`` (the same communication as ``torch.library`` custom ops, traced by
  ``torch.compile``), ``functional`` (the exchange as one functional all-to-all, selectable:
  :func:`exchange_path`), ``shared_input`` (one exchange for sibling convolutions), ``streams``,
  ``traffic`` (opt-in counters);
* ``layers/`` — one file per layer family: ``conv`` (+ ``conv_geometry``, ``split_conv``),
  ``norm`` (+ ``norm_halo``), ``halo_chain`` (opt-in: one exchange for a chain of stencils),
  ``padding``, ``resample`` (+ ``interp_rows``), ``pixel_shuffle``, ``gather``
  (``nonlocal_policy="gather"``);
* ``attention/`` — attention made exact under latitude sharding (row groups, sequence parallel,
  token attention);
* ``adapters/`` — model-specific recognition and wrappers of client classes (miles-credit's and
  timm's attention and Swin blocks, FuXi), recognised by qualified class name;
* ``plan``, ``fusion``, ``convert`` — the converter: one :class:`ConversionPlan` decided per model,
  then applied; ``guard`` — functional calls that mix rows; ``sharding`` — shard / gather / whole
  batches; ``wrap`` — wrapping a module without renaming its parameters.

Naming convention (the whole library keeps it):

* ``shard_dim`` is the tensor dimension split over the ranks of a domain group: the latitude
  axis, ``-2`` of B,C,H,W and B,C,T,H,W (``3`` for the 3-D convolutions' B,C,Z,H,W).  Every
  layer, the converter, the manager, ``shard_batch`` (``shard_dim_5d`` / ``shard_dim_4d``) and
  the test harness use this name.  The CREDIT signatures that SPEC §3 fixes keep their ``dim``:
  ``HaloExchange(halo_width, dim=-2)``, ``HaloExchange.trim(..., dim=-2)``,
  ``shard_tensor(x, dim=-2)``, ``gather_tensor(x, dim=-2)``; it means the same.  Below the layers,
  the row primitives (``exchange``, ``collective_ops``, ``rows``) move rows along whatever
  ``dim`` they are handed.
* A dimension of the device mesh is an *axis* (``config.MeshAxis``: dp, tp, domain).
* ``manager`` (a :class:`~credit_parallel.domain.manager.DomainParallelManager`) is keyword-only
  (``DomainParallelConv2d(conv, manager=mgr)``), except where SPEC §3/§4 fix its position:
  ``shard_tensor`` / ``gather_tensor`` / ``shard_batch`` / ``HaloExchange`` (after the dims),
  ``shard_spatial(tensor, manager)``, ``unpad_shard_interp(y_pred, padding_opt, manager, ...)``,
  ``convert_to_domain_parallel(model, manager, ...)``,
  ``collectives.sync_domain_gradients(model, manager, op)``.
"""

from __future__ import annotations

from ..lazy import lazy_exports

# the names a user of domain parallelism imports -> their home modules (resolved lazily, PEP 562)
_EXPORTS = {
    "DomainParallelManager": "manager",
    "initialize_domain_parallel": "manager",
    "get_domain_parallel_manager": "manager",
    "TiledDomainManager": "manager",
    "initialize_tiled_domain_parallel": "manager",
    "HaloExchange": "exchange.halo",
    "exchange_path": "exchange.functional",
    "DomainParallelConv2d": "layers.conv",
    "DomainParallelConv3d": "layers.conv",
    "DomainParallelConvTranspose2d": "layers.conv",
    "DomainParallelConvTranspose3d": "layers.conv",
    "DomainParallelPeriodicConv2d": "layers.conv",
    "DomainParallelGroupNorm": "layers.norm",
    "DomainParallelInterpolate": "layers.resample",
    "DomainParallelPixelShuffle": "layers.pixel_shuffle",
    "DomainParallelPixelUnshuffle": "layers.pixel_shuffle",
    "DomainParallelPad": "layers.padding",
    "DomainGatherModule": "layers.gather",
    "set_model_overlap": "layers.split_conv",
    "DomainRowGroupAttention": "attention.relayout",
    "DomainSequenceAttention": "attention.sequence",
    "DomainTokenAttention": "attention.tokens",
    "sequence_parallel_attention": "attention.tokens",
    "ConversionPlan": "plan",
    "LayerOptions": "options",
    "convert_to_domain_parallel": "convert",
    "plan_conversion": "convert",
    "register_domain_rule": "convert",
    "validate_sharding_constraints": "convert",
    "FunctionalCallGuard": "guard",
    "shard_tensor": "sharding",
    "gather_tensor": "sharding",
    "shard_batch": "sharding",
    "declare_global_shape": "sharding",
    "shard_spatial": "sharding",
    "unpad_shard_interp": "sharding",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(
    __name__, _EXPORTS, globals(), ("adapters", "attention", "exchange", "layers")
)
