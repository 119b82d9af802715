"""Data layer: a synthetic ERA5-like sample store, the zarr-backed dataset, dp-only sampling and
the row-reading training loader of domain-parallel runs.

- ``sample``: ``write_sample_dataset`` (zarr store + statistics store), ``zonal_angular_speed``;
- ``store``: ``ByteCountingStore`` (bytes read), ``compute_normalization_stats``,
  ``default_stats_path``;
- ``dataset``: ``ERA5Dataset`` (whole globe, or one domain rank's rows), ``latitude_weights``,
  ``dataset_from_conf``; ``era5_schema``: what it reads (dims, variables, channels, grid,
  statistics), worked out once; ``diagnostic``: its output-only (diagnostic) channels;
- ``multistore``: several stores as one time axis (a glob of per-year stores), the static
  fields' own store; ``credit_stats``: the normalisation statistics, CREDIT's netCDF files
  included;
- ``sampler``: ``DistributedDPSampler``, ``StepBatchSampler``, ``make_dataloader`` (shards over
  data parallelism only);
- ``loader``: ``build_train_loader``, ``register_row_batch``, ``RowView``; ``batch_to_device``
  is ``credit_parallel.layout.device``'s (one copy), re-exported here;
- ``prefetch``: ``DevicePrefetcher`` (the next batches copied to the GPU on a side stream, the
  time spent waiting for data);
- ``rechunk``: ``rechunk_store``, ``RECOMMENDED_LAT_CHUNK`` (the chunking training reads fastest;
  docs/data.md).

Names resolve lazily so that importing the sampler does not import xarray.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "write_sample_dataset": "sample",
    "zonal_angular_speed": "sample",
    "SAMPLE_UPPER_AIR_VARIABLES": "sample",
    "SAMPLE_SURFACE_VARIABLES": "sample",
    "SAMPLE_FORCING_VARIABLES": "sample",
    "SAMPLE_STATIC_VARIABLES": "sample",
    "ERA5Dataset": "dataset",
    "dataset_from_conf": "dataset",
    "latitude_weights": "dataset",
    "ByteCountingStore": "store",
    "compute_normalization_stats": "store",
    "default_stats_path": "store",
    "DEFAULT_CACHE_LIMIT_BYTES": "dataset",
    "DistributedDPSampler": "sampler",
    "StepBatchSampler": "sampler",
    "make_dataloader": "sampler",
    "build_train_loader": "loader",
    "register_row_batch": "loader",
    "batch_to_device": "loader",
    "DevicePrefetcher": "prefetch",
    "rechunk_store": "rechunk",
    "RECOMMENDED_LAT_CHUNK": "rechunk",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
