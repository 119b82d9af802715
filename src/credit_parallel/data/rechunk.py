"""Rewriting an ERA5-layout zarr store with the chunking domain-parallel training reads fastest.

A training sample reads one time step (or a few) of every variable, and a domain rank reads only
its latitude rows.  So the chunks that serve it are one time step deep, all longitudes wide and a
few latitude rows tall: ``RECOMMENDED_LAT_CHUNK`` rows (``docs/data.md`` has the measurements
behind the number).  ERA5 stores as published are usually chunked the other way round (many times,
the whole globe); ``rechunk_store`` copies one into the recommended layout, a block of time steps
at a time, so memory stays bounded by one block of the whole globe.

The statistics store (``default_stats_path``) is copied along when it exists, so the rechunked
store is ready for ``ERA5Dataset`` as it is.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import xarray as xr

from .store import LAT_NAMES, LON_NAMES, TIME_NAMES, default_stats_path, find_dim

__all__ = ["RECOMMENDED_LAT_CHUNK", "rechunk_store"]

# rows per chunk: serves domain 1 (few requests) and domain 8 at 721 rows (a rank's 90-91 rows
# over-read by at most 2 x 15 rows); see docs/data.md "Chunking" for the measured table
RECOMMENDED_LAT_CHUNK = 16


def _positive(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"rechunk_store: {key} must be an integer >= 1, got {value!r}")
    return value


def rechunk_store(
    src,
    dst,
    *,
    lat_chunk: int = RECOMMENDED_LAT_CHUNK,
    time_chunk: int = 1,
    compress: bool = True,
    block_times: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Copy the zarr store ``src`` to ``dst`` chunked ``(time_chunk, [level,] lat_chunk, W)``.

    Every data variable with time, latitude and longitude dims gets that chunking (levels whole);
    other variables and the coordinates are copied as they are.  ``compress=False`` writes
    uncompressed chunks (zarr's default codec otherwise).  ``block_times`` time steps are read
    and written at a time (default: ``time_chunk`` rounded up to at least 8 steps).  ``dst``
    must not exist unless ``overwrite``.  The statistics store of ``src`` is copied to
    ``default_stats_path(dst)``.  Returns ``Path(dst)``.
    """
    src, dst = Path(src), Path(dst)
    lat_chunk = _positive(lat_chunk, "lat_chunk")
    time_chunk = _positive(time_chunk, "time_chunk")
    if not src.exists():
        raise FileNotFoundError(f"rechunk_store: no zarr store at {str(src)!r}")
    if dst.exists() and not overwrite:
        raise FileExistsError(
            f"rechunk_store: {str(dst)!r} exists; pass overwrite=True (--overwrite) to replace it"
        )
    if src.resolve() == dst.resolve():
        raise ValueError("rechunk_store: src and dst are the same store; write to a new path")
    block = time_chunk * max(1, -(-8 // time_chunk)) if block_times is None else block_times
    block = -(-_positive(block, "block_times") // time_chunk) * time_chunk  # whole chunks
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*consolidated metadata.*")
        ds = xr.open_zarr(src, chunks=None, consolidated=None)
    time_dim = find_dim(ds.dims, TIME_NAMES)
    lat_dim = find_dim(ds.dims, LAT_NAMES)
    lon_dim = find_dim(ds.dims, LON_NAMES)
    if None in (time_dim, lat_dim, lon_dim):
        raise ValueError(
            f"rechunk_store: {str(src)!r} needs time, latitude and longitude dims "
            f"(got {list(ds.dims)})"
        )
    encoding = {}
    for name, variable in ds.data_vars.items():
        variable.encoding.clear()
        if {time_dim, lat_dim, lon_dim} <= set(variable.dims):
            sizes = {time_dim: time_chunk, lat_dim: lat_chunk}
            chunks = tuple(min(sizes.get(d, n), n) for d, n in variable.sizes.items())
            encoding[name] = {"chunks": chunks}
            if not compress:
                encoding[name]["compressors"] = None
    for name in ds.coords:
        ds[name].encoding.clear()
    if dst.exists():
        shutil.rmtree(dst)
    n_times = ds.sizes[time_dim]
    for first in range(0, n_times, block):
        part = ds.isel({time_dim: slice(first, first + block)}).load()
        if first == 0:
            part.to_zarr(dst, mode="w", encoding=encoding, consolidated=False, zarr_format=3)
        else:
            part.to_zarr(dst, append_dim=time_dim, consolidated=False)
    ds.close()
    stats = default_stats_path(src)
    if stats.exists():
        target = default_stats_path(dst)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(stats, target)
    return dst
