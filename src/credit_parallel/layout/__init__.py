"""The layout: who computes what, where.  The lowest layer of the library; it knows nothing of
domains, tensor parallelism or training.

* ``config`` — the ``trainer.parallelism`` block, YAML loading and :class:`ParallelDims`, THE
  layout object (degrees, divisibility, every problem of a layout at once, the mesh);
* ``run_config`` — :class:`RunConfig`: every ``trainer.*`` / ``data.*`` / ``model.*`` key, typed
  and validated once;
* ``ranks`` — :class:`RankLayout`: pure row-major rank index math (no process group);
* ``mesh`` — ``build_device_mesh``, ``dp_world_size``, ``data_parallel_coords``;
* ``device`` — where a rank computes (``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo);
* ``launch`` — joining the launcher's process group, with bounded timeouts;
* ``small_collectives`` — sums and gathers of a few numbers over small groups (point to point);
* ``compat`` — the torch APIs that differ between the supported releases, in one place.

A new layout axis, a new launcher or a new torch-version difference goes here.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "RankLayout": "ranks",
    "ParallelDims": "config",
    "ParallelMesh": "config",
    "DataMode": "config",
    "MeshAxis": "config",
    "load_config": "config",
    "parse_parallelism_conf": "config",
    "RunConfig": "run_config",
    "build_device_mesh": "mesh",
    "dp_world_size": "mesh",
    "data_parallel_coords": "mesh",
    "device_for_process_group": "device",
    "init_distributed_from_env": "launch",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
