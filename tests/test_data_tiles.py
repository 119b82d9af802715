"""The loader on lat x lon tiles (SPEC §3b): each rank reads only its tile, rows x columns.

* at (P, Q) = (2, 2) and (1, 3) on a 7 x 10 grid (uneven rows AND columns), a rank's sample is
  bitwise the tile of a ``rows=(0, H)`` read (prognostic, forcing and static channels, 4-D and
  5-D samples), and the bytes it fetches from a store chunked one row x one column are exactly
  its tile's bytes, under both readers; a float64 store (read through xarray) likewise;
* ``build_train_loader`` with ``domain_size=(P, Q)`` gives each rank the tile of the batch of
  the whole-globe loader, from the store and from a dataset without rows of its own
  (``RowView`` cuts rows and columns); a dataset reading another rank's tile is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

from credit_parallel.data import ERA5Dataset, build_train_loader, write_sample_dataset
from credit_parallel.data.loader import RowView, global_width
from credit_parallel.domain.tiles import tile_range

H, W = 7, 10  # rows 4/3 at P = 2; columns 5/5 at Q = 2 and 4/3/3 at Q = 3
UPPER, SURFACE = ["T", "U"], ["SP"]
FORCING, STATIC = ["tsi"], ["orography"]
SHAPES = [(2, 2), (1, 3)]


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    """The sample store rewritten uncompressed in chunks of one time, one row and one column."""
    root = tmp_path_factory.mktemp("tiles")
    base = write_sample_dataset(root / "base.zarr", n_times=4, nlat=H, nlon=W, time_chunk=1)
    ds = xr.open_zarr(base, chunks=None, consolidated=False).load()
    encoding = {}
    for name, var in ds.data_vars.items():
        chunks = tuple(
            1 if d in ("time", "latitude", "longitude") else n for d, n in var.sizes.items()
        )
        encoding[name] = {"chunks": chunks, "compressors": None}
    for var in ds.variables:
        ds[var].encoding.clear()
    path = root / "cells.zarr"
    ds.to_zarr(path, encoding=encoding, consolidated=False)
    stats = xr.open_zarr(str(base).replace(".zarr", "_stats.zarr"), consolidated=False).load()
    stats.to_zarr(root / "cells_stats.zarr", consolidated=False)
    return path


def _dataset(path, **kwargs):
    return ERA5Dataset(
        path,
        UPPER,
        SURFACE,
        dynamic_forcing_variables=FORCING,
        static_variables=STATIC,
        cache_limit_bytes=0,
        **kwargs,
    )


def _tiles(shape):
    p, q = shape
    for rank in range(p * q):
        yield rank, tile_range(H, W, shape, (rank // q, rank % q))


@pytest.mark.parametrize("reader", ["zarr", "tensorstore"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_rank_reads_exactly_its_tile_bytes_and_values(cells, shape, reader):
    whole = _dataset(cells, rows=(0, H), reader=reader)[1]  # float32 row mode, every column
    channels = len(UPPER) * 2 + len(SURFACE) + len(FORCING)  # two levels per upper variable
    window = 2  # history 1 + forecast 1
    seen = np.zeros((H, W), dtype=int)
    for rank, ((r0, r1), (c0, c1)) in _tiles(shape):
        part = _dataset(cells, domain_shard=(rank, shape), reader=reader)
        assert part.reader == reader
        assert (part.rows, part.columns) == ((r0, r1), (c0, c1))
        assert part.sample_grid_shape == (r1 - r0, c1 - c0)
        part.reset_bytes_read()
        sample = part[1]
        assert part.bytes_read == window * channels * (r1 - r0) * (c1 - c0) * 4
        for name in UPPER + SURFACE + FORCING:  # one chunk per (time, row, column, variable)
            assert part.read_counter.chunk_reads[name] == window * (r1 - r0) * (c1 - c0)
        assert sample.keys() == whole.keys()
        for key, value in whole.items():
            want = value[..., r0:r1, c0:c1] if value.dim() == 3 else value
            assert torch.equal(sample[key], want), (rank, key)
        assert torch.equal(part.row_lat_weights, part.lat_weights[r0:r1])
        seen[r0:r1, c0:c1] += 1
    assert (seen == 1).all()  # the tiles cover the grid once


def test_tiles_of_a_store_read_through_xarray_are_the_tiles_of_the_whole_read(cells, tmp_path):
    """A float64 store (zarr cannot decode it into float32: the xarray path) read by tiles."""
    ds = xr.open_zarr(cells, chunks=None, consolidated=False).load()
    ds = ds.assign({n: ds[n].astype(np.float64) for n in ds.data_vars})
    for var in ds.variables:
        ds[var].encoding.clear()
    path = tmp_path / "f64.zarr"
    ds.to_zarr(path, consolidated=False)
    stats = str(cells).replace(".zarr", "_stats.zarr")
    xr.open_zarr(stats, consolidated=False).load().to_zarr(tmp_path / "f64_stats.zarr")
    whole = _dataset(path, rows=(0, H))
    assert not whole._direct  # the xarray path
    whole = whole[0]
    for rank, ((r0, r1), (c0, c1)) in _tiles((2, 2)):
        part = _dataset(path, domain_shard=(rank, (2, 2)))[0]
        for key, value in whole.items():
            want = value[..., r0:r1, c0:c1] if value.dim() == 3 else value
            assert torch.equal(part[key], want), (rank, key)


@pytest.mark.parametrize("shape", SHAPES)
def test_5d_tile_samples_are_the_tiles_of_the_whole_sample(cells, shape):
    whole = ERA5Dataset(cells, UPPER, SURFACE, rows=(0, H), as_5d=True)[2]
    for rank, ((r0, r1), (c0, c1)) in _tiles(shape):
        part = ERA5Dataset(cells, UPPER, SURFACE, domain_shard=(rank, shape), as_5d=True)[2]
        for key in ("x_upper", "x_surface", "y_upper", "y_surface"):
            assert torch.equal(part[key], whole[key][..., r0:r1, c0:c1]), key


def _loader_conf(path):
    data = {
        "path": str(path),
        "upper_air_variables": UPPER,
        "surface_variables": SURFACE,
        "dynamic_forcing_variables": FORCING,
        "static_variables": STATIC,
        "time_slice": [0, 4],
        "num_workers": 0,
    }
    return {"data": data, "trainer": {"batch_size": 2, "seed": 1}}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_loader_gives_each_rank_the_tile_of_the_globe_batch(cells, shape):
    conf = _loader_conf(cells)
    common = {"dp_rank": 0, "dp_size": 1, "device": "cpu", "num_workers": 0}
    globe = ERA5Dataset(**_kwargs(conf), rows=(0, H))
    want = next(iter(build_train_loader(conf, domain_rank=0, domain_size=1, **common)))
    for rank, ((r0, r1), (c0, c1)) in _tiles(shape):
        for source in (None, _WholeOnly(globe)):  # read by tiles, or cut by RowView
            loader = build_train_loader(
                conf, domain_rank=rank, domain_size=shape, dataset=source, **common
            )
            assert isinstance(loader.dataset, RowView) == (source is not None)
            assert global_width(loader.dataset) == W
            got = next(iter(loader))
            for key, value in want.items():
                tile = value[..., r0:r1, c0:c1] if value.dim() == 4 else value
                assert torch.equal(got[key], tile), (rank, key, source)


class _WholeOnly(torch.utils.data.Dataset):
    """A whole-globe dataset without ``rows`` / ``grid_shape`` (a user's own dataset)."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]

    @property
    def lat_weights(self):
        return self.inner.lat_weights


def _kwargs(conf):
    d = dict(conf["data"])
    return {
        "path": d.pop("path"),
        "upper_air_variables": d["upper_air_variables"],
        "surface_variables": d["surface_variables"],
        "dynamic_forcing_variables": d["dynamic_forcing_variables"],
        "static_variables": d["static_variables"],
        "time_slice": tuple(d["time_slice"]),
    }


def test_a_dataset_reading_another_tile_and_bad_domain_shards_are_refused(cells):
    conf = _loader_conf(cells)
    other = _dataset(cells, domain_shard=(1, (2, 2)))
    with pytest.raises(ValueError, match=r"owns rows \(0, 4\) and columns \(0, 5\) of \(7, 10\)"):
        build_train_loader(
            conf,
            dp_rank=0,
            dp_size=1,
            domain_rank=0,
            domain_size=(2, 2),
            device="cpu",
            dataset=other,
            num_workers=0,
        )
    for bad in [(4, (2, 2)), (0, (0, 2)), (0, (2, 2.0)), (0, (2, 2, 1))]:
        with pytest.raises(ValueError, match="domain_shard must be"):
            _dataset(cells, domain_shard=bad)
