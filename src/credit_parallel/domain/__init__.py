"""Domain (latitude) parallelism: row algebra, exchange, layers, conversion and sharding.

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
