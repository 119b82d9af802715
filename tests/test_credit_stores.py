"""CREDIT's data layout read as it is: one zarr store per year (a glob, ONE time axis), the
static fields in a store of their own, and CREDIT's netCDF mean / std files.

The sample store is split along time into three stores whose names do not sort in time order,
its static fields written to a store of their own (latitude ascending, a dummy time dim of size
1, as CREDIT's static files may have), and its statistics written as CREDIT's two netCDF files.
The dataset over them gives the single store's samples exactly (whole globe, rows and tiles,
both chunk readers, cached and lazy), samples whose window crosses a store boundary included;
each rank reads the same bytes as from the single store.  Mismatched stores are refused naming
both.  The normalisation equals miles-credit's own classes on the same files.  miles-credit's
gen-2 example, rewritten in paths only (a glob, the static store, the netCDF files) and to a
tiny model, trains 2 steps at domain 2 as on one process, also through ``credit-parallel
train``; and so does the example AS WRITTEN (its diagnostic group, EMA, earth padding,
interpolation and post block on), only its names and sizes changed.
"""

from __future__ import annotations

import copy
import glob

import numpy as np
import pytest
import torch
import xarray as xr
import yaml

from credit_parallel.data import ERA5Dataset, default_stats_path, write_sample_dataset
from credit_parallel.data.chunk_reader import tensorstore_available
from credit_parallel.layout.credit_gen2 import credit_gen2_conf
from credit_parallel.layout.run_config import RunConfig
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit
from test_credit_examples import H, W, _assert_trained_alike, _on_sample, _train

UPPER, SURFACE, FORCING = ["T", "U", "V"], ["SP", "t2m"], ["tsi"]
STATIC = ["orography", "land_sea_mask"]
# name -> times of the sample store it holds: the glob's name order is not the time order
YEARS = {"ERA5_plevel_6h_2020.zarr": (0, 5), "ERA5_plevel_6h_2021.zarr": (5, 11)}
YEARS["ERA5_plevel_6h_2019.zarr"] = (11, 16)
IN_TIME_ORDER = ["ERA5_plevel_6h_2020.zarr", "ERA5_plevel_6h_2021.zarr", "ERA5_plevel_6h_2019.zarr"]
READERS = ["zarr", "tensorstore"] if tensorstore_available() else ["zarr"]


def _write(ds: xr.Dataset, path) -> None:
    """``ds`` as a zarr store: one time per chunk, 4 rows per chunk, uncompressed (the sample
    store's chunks, so bytes read compare one to one)."""
    ds = ds.copy()
    for variable in ds.variables.values():
        variable.encoding = {}
    rows = {"time": 1, "latitude": 4}
    encoding = {
        name: {
            "chunks": tuple(rows.get(d, ds.sizes[d]) for d in ds[name].dims),
            "compressors": None,
        }
        for name in ds.data_vars
    }
    ds.to_zarr(path, mode="w", encoding=encoding, consolidated=False)


def _netcdf_stats(stats_path, out_dir, names=None) -> tuple[str, str]:
    """The statistics store as CREDIT's two netCDF files (a level dim for upper-air variables)."""
    stats = xr.open_dataset(stats_path, engine="zarr", consolidated=False).load()
    names = list(stats.data_vars) if names is None else names
    paths = []
    for index, kind in enumerate(("mean", "std")):
        path = out_dir / f"{kind}_6h_2020_2lev.nc"
        xr.Dataset({n: stats[n].isel(statistic=index) for n in names}).to_netcdf(
            path, engine="h5netcdf"
        )
        paths.append(str(path))
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import_credit("credit.trainers.utils")  # miles-credit's inject_flat_var_keys
    import_credit("credit.models.crossformer")
    root = tmp_path_factory.mktemp("stores")
    single = write_sample_dataset(
        root / "single.zarr", n_times=16, nlat=H, nlon=W, time_chunk=1, lat_chunk=4, compress=False
    )
    ds = xr.open_dataset(single, engine="zarr", chunks=None, consolidated=False).load()
    years = root / "all_in_one"
    years.mkdir()
    for name, (a, b) in YEARS.items():
        _write(ds.drop_vars(STATIC).isel(time=slice(a, b)), years / name)
    static = ds[STATIC].sortby("latitude").expand_dims(time=ds.time.values[:1])
    (root / "static").mkdir()
    _write(static, root / "static" / "ERA5_plevel_6h_static.zarr")
    mean, std = _netcdf_stats(default_stats_path(single), root)
    return {
        "root": root,
        "single": str(single),
        "glob": str(years / "ERA5_plevel_6h_*.zarr"),
        "years": [str(years / name) for name in IN_TIME_ORDER],
        "static": str(root / "static" / "ERA5_plevel_6h_static.zarr"),
        "mean": mean,
        "std": std,
        "raw": ds,
    }


def _pair(data, **kwargs):
    """(the single store's dataset, the per-year stores' dataset) of the same selection."""
    base = dict(levels=[500, 850], dynamic_forcing_variables=FORCING, static_variables=STATIC)
    base.update(kwargs)
    single = ERA5Dataset(data["single"], UPPER, SURFACE, **base)
    multi = ERA5Dataset(
        data["glob"],
        UPPER,
        SURFACE,
        static_path=data["static"],
        mean_path=data["mean"],
        std_path=data["std"],
        **base,
    )
    return single, multi


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --------------------------------------------------------------------------- one time axis
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("window", [None, (1, 2), (3, (2, 2))])
@pytest.mark.parametrize("cache", [0, 1 << 30])
def test_per_year_stores_give_the_single_stores_samples(data, reader, window, cache):
    shard = {"domain_shard": window} if window else {}
    single, multi = _pair(
        data, history_len=2, forecast_len=2, reader=reader, cache_limit_bytes=cache, **shard
    )
    assert [str(p) for p in multi.store_paths] == data["years"]  # ordered by time, not name
    assert len(multi) == len(single) == 13 and np.array_equal(multi.times, single.times)
    assert multi.cached == single.cached == bool(cache)
    if not cache:
        assert multi.reader == reader
    for index in range(len(single)):  # windows 3..6, 4..7 (and more) cross store boundaries
        _assert_same(single[index], multi[index])
    assert np.array_equal(multi.read_steps(2, 13), single.read_steps(2, 13))
    assert multi.variable_units == single.variable_units


def test_a_boundary_crossing_window_and_a_labelled_time_slice(data):
    kwargs = dict(history_len=3, forecast_len=2, time_slice=("2020-01-01T18", "2020-01-03T18"))
    single, multi = _pair(data, cache_limit_bytes=0, domain_shard=(0, 3), **kwargs)
    assert multi.times[0] == np.datetime64("2020-01-01T18") and len(multi) == 5
    # sample 1: times 4, 5 | 6, 7, 8 of the store: history in two stores, forecast in one
    assert int(multi[1]["time_index"]) == 4
    for index in range(len(single)):
        _assert_same(single[index], multi[index])
    listed = ERA5Dataset(
        list(reversed(data["years"])),
        UPPER,
        SURFACE,
        static_path=data["static"],
        stats_path=str(default_stats_path(data["single"])),
        levels=[500, 850],
        static_variables=STATIC,
        dynamic_forcing_variables=FORCING,
        cache_limit_bytes=0,
        domain_shard=(0, 3),
        **kwargs,
    )
    for index in range(len(single)):
        _assert_same(single[index], listed[index])


@pytest.mark.parametrize("reader", READERS)
def test_each_rank_reads_its_rows_of_each_store_as_of_one_store(data, reader):
    """Rank 1 of 2 reads the same chunks as from the single store (same chunking), a share of a
    whole-globe read; the counts are summed over the stores."""
    counts = {}
    for shard in (None, (1, 2)):
        kwargs = dict(history_len=2, forecast_len=2, reader=reader, cache_limit_bytes=0)
        if shard:
            kwargs["domain_shard"] = shard
        single, multi = _pair(data, **kwargs)
        for ds in (single, multi):
            ds.reset_bytes_read()
            ds[3]  # times 3, 4 | 5, 6: two stores
            ds[9]  # times 9, 10 | 11, 12
        assert multi.bytes_read == single.bytes_read > 0
        assert multi.read_counter.chunk_reads == single.read_counter.chunk_reads
        counts[shard] = multi.bytes_read
    assert counts[(1, 2)] == counts[None] // 2  # 16 of 32 rows, 4 rows per chunk


# --------------------------------------------------------------------------- refusals
def test_mismatched_stores_are_refused_naming_both(data, tmp_path):
    raw = data["raw"].drop_vars(STATIC)
    _write(raw.isel(time=slice(3, 7)), tmp_path / "overlap.zarr")
    kwargs = dict(levels=[500, 850], stats_path=str(default_stats_path(data["single"])))
    with pytest.raises(
        ValueError, match=r"ERA5_plevel_6h_2020\.zarr.*overlap\.zarr.*overlap in time"
    ):
        ERA5Dataset([data["years"][0], str(tmp_path / "overlap.zarr")], UPPER, SURFACE, **kwargs)
    with pytest.raises(
        ValueError, match=r"ERA5_plevel_6h_2020\.zarr.*ERA5_plevel_6h_2019\.zarr.*gap"
    ):
        ERA5Dataset([data["years"][0], data["years"][2]], UPPER, SURFACE, **kwargs)
    # an hourly store right after the 6-hourly one (its first time 6 h on): one axis, two steps
    hourly = raw.isel(time=slice(5, 11))
    hourly = hourly.assign_coords(time=raw.time.values[5] + np.arange(6) * np.timedelta64(1, "h"))
    _write(hourly, tmp_path / "hourly.zarr")
    with pytest.raises(
        ValueError, match=r"6h_2020\.zarr' \(time step .*hourly\.zarr' .*differ in time"
    ):
        ERA5Dataset([data["years"][0], str(tmp_path / "hourly.zarr")], UPPER, SURFACE, **kwargs)
    shifted = raw.isel(time=slice(5, 11)).assign_coords(longitude=raw.longitude + 1.0)
    _write(shifted, tmp_path / "shifted.zarr")
    with pytest.raises(ValueError, match=r"differ in the 'longitude' coordinate values"):
        ERA5Dataset([data["years"][0], str(tmp_path / "shifted.zarr")], UPPER, SURFACE, **kwargs)
    retyped = raw.isel(time=slice(5, 11)).assign(T=raw["T"].isel(time=slice(5, 11)).astype("f8"))
    _write(retyped, tmp_path / "retyped.zarr")
    with pytest.raises(ValueError, match=r"retyped\.zarr.* differ in variable 'T'.*float64"):
        ERA5Dataset([data["years"][0], str(tmp_path / "retyped.zarr")], UPPER, SURFACE, **kwargs)
    relevelled = raw.isel(time=slice(5, 11)).assign_coords(level=[400.0, 850.0])
    _write(relevelled, tmp_path / "relevelled.zarr")
    with pytest.raises(ValueError, match=r"relevelled\.zarr' differ in the 'level' coordinate"):
        ERA5Dataset([data["years"][0], str(tmp_path / "relevelled.zarr")], UPPER, SURFACE, **kwargs)
    _write(raw.isel(time=slice(5, 11)).drop_vars("SP"), tmp_path / "no_sp.zarr")
    with pytest.raises(ValueError, match=r"no_sp\.zarr': variable 'SP' is missing from the second"):
        ERA5Dataset([data["years"][0], str(tmp_path / "no_sp.zarr")], UPPER, SURFACE, **kwargs)
    with pytest.raises(FileNotFoundError, match=r"the glob .*nothing_\*\.zarr' matches no"):
        ERA5Dataset(str(tmp_path / "nothing_*.zarr"), UPPER, SURFACE, **kwargs)
    with pytest.raises(ValueError, match=r"names 3 stores; give their statistics"):
        ERA5Dataset(data["glob"], UPPER, SURFACE, levels=[500, 850])


@pytest.fixture
def opened(monkeypatch):
    """The stores the data package opens, each with whether it was closed since."""
    from credit_parallel.data import multistore

    stores, closed, open_store, close = [], set(), multistore.open_store, xr.Dataset.close

    def recording_open(path, what):
        ds, counter = open_store(path, what)
        stores.append(ds)
        return ds, counter

    def recording_close(self):
        closed.add(id(self))
        close(self)

    monkeypatch.setattr(multistore, "open_store", recording_open)
    monkeypatch.setattr(xr.Dataset, "close", recording_close)
    return lambda: [id(ds) in closed for ds in stores]


def test_a_failure_while_the_dataset_is_built_closes_every_store_it_opened(data, tmp_path, opened):
    """Missing statistics, an empty time slice, a static store on another grid, overlapping
    stores: the error comes, and every store opened before it is closed."""
    coarse = data["raw"][STATIC].isel(latitude=slice(0, 16))
    _write(coarse, tmp_path / "coarse.zarr")
    _write(data["raw"].drop_vars(STATIC).isel(time=slice(3, 7)), tmp_path / "overlap.zarr")
    stats, static = dict(mean_path=data["mean"], std_path=data["std"]), data["static"]
    cases = [
        (FileNotFoundError, dict(stats_path=str(tmp_path / "absent.zarr"), static_path=static)),
        (ValueError, dict(time_slice=("2031-01-01", "2031-02-01"), static_path=static, **stats)),
        (ValueError, dict(static_path=str(tmp_path / "coarse.zarr"), **stats)),
    ]
    for error, kwargs in cases:
        with pytest.raises(error):
            ERA5Dataset(
                data["glob"], UPPER, SURFACE, levels=[500, 850], static_variables=STATIC, **kwargs
            )
    with pytest.raises(ValueError, match="overlap in time"):
        ERA5Dataset([data["years"][0], str(tmp_path / "overlap.zarr")], UPPER, SURFACE, **stats)
    closed = opened()
    assert len(closed) == 4 + 3 + 4 + 2 and all(closed), closed


def test_a_static_store_on_another_grid_and_incomplete_statistics_are_refused(data, tmp_path):
    coarse = data["raw"][STATIC].isel(latitude=slice(0, 16))
    _write(coarse, tmp_path / "coarse.zarr")
    common = dict(levels=[500, 850], static_variables=STATIC, mean_path=data["mean"])
    common["std_path"] = data["std"]
    with pytest.raises(ValueError, match=r"data\.static_path .*static_variables is empty"):
        ERA5Dataset(data["glob"], UPPER, SURFACE, static_path=data["static"], **common | {"static_variables": []})  # fmt: skip
    with pytest.raises(ValueError, match=r"static store .*coarse\.zarr' is on another grid"):
        ERA5Dataset(
            data["glob"], UPPER, SURFACE, static_path=str(tmp_path / "coarse.zarr"), **common
        )
    with pytest.raises(ValueError, match=r"has no static variable 'orography'"):
        ERA5Dataset(data["glob"], UPPER, SURFACE, static_path=data["years"][0], **common)
    mean, std = _netcdf_stats(default_stats_path(data["single"]), tmp_path, ["T", "U", "SP"])
    with pytest.raises(ValueError, match=r"'V' \(in neither file\), 't2m' \(in neither file\)"):
        ERA5Dataset(data["glob"], UPPER, SURFACE, levels=[500, 850], mean_path=mean, std_path=std)
    with pytest.raises(ValueError, match=r"mean_path and data.std_path go together"):
        ERA5Dataset(data["glob"], UPPER, SURFACE, levels=[500, 850], mean_path=mean)


# --------------------------------------------------------------------------- CREDIT's statistics
def test_netcdf_statistics_normalise_as_miles_credits_own_classes(data):
    """Row mode (float32, what every domain rank computes) equals miles-credit's gen-2
    ``ERA5Normalizer`` bitwise; the whole-globe reference (float64, rounded once) equals
    ``Normalize_ERA5_and_Forcing.transform`` (xarray, float64) rounded to float32, bitwise."""
    norm = import_credit("credit.preblock.norm")
    gen1 = import_credit("credit.transforms.transforms_global")
    normalizer = norm.ERA5Normalizer(data["mean"], data["std"])
    kwargs = dict(dynamic_forcing_variables=FORCING, static_variables=STATIC, cache_limit_bytes=0)
    _, rows = _pair(data, domain_shard=(0, 1), **kwargs)  # row mode over every row
    _, globe = _pair(data, **kwargs)
    time = 7
    sample_rows, sample_globe = rows[time]["x"], globe[time]["x"]
    names = [*UPPER, *SURFACE, *FORCING, *STATIC]
    conf = {
        "data": {
            "mean_path": data["mean"],
            "std_path": data["std"],
            "all_varnames": names,
            "levels": 2,
            "variables": UPPER,
            "surface_variables": SURFACE,
            "dynamic_forcing_variables": FORCING,
            "static_variables": [],
        }
    }
    transform = gen1.Normalize_ERA5_and_Forcing(conf)
    sample = data["raw"][names].isel(time=[time])
    theirs = transform.transform({"historical_ERA5_images": sample})["historical_ERA5_images"]
    channel = 0
    for name in names:
        raw = data["raw"][name]
        raw = raw.isel(time=time) if "time" in raw.dims else raw
        width = 2 if name in UPPER else 1
        field = torch.from_numpy(np.ascontiguousarray(raw.values)).reshape(1, width, 1, H, W)
        kind = "3d" if name in UPPER else "2d"
        credit_gen2 = normalizer._normalize_tensor(f"era5/prognostic/{kind}/{name}", field)
        ours = sample_rows[channel : channel + width]
        assert torch.equal(ours, credit_gen2.reshape(width, H, W)), name
        credit_gen1 = theirs[name]
        credit_gen1 = credit_gen1.isel(time=0) if "time" in credit_gen1.dims else credit_gen1
        credit_gen1 = credit_gen1.values.astype(np.float32)
        ours = sample_globe[channel : channel + width].numpy()
        assert np.array_equal(ours, credit_gen1.reshape(width, H, W)), name
        channel += width
    assert channel == sample_rows.shape[0]


def test_variables_absent_from_the_netcdf_files_pass_through_and_levels_match_by_value(
    data, tmp_path
):
    """As ``ERA5Normalizer``: static (and forcing) variables absent from both files pass through
    unchanged; a file whose levels run the other way is matched by its level coordinate."""
    stats = default_stats_path(data["single"])
    mean, std = _netcdf_stats(stats, tmp_path, [*UPPER, *SURFACE, *FORCING])
    for path in (mean, std):  # levels 850, 500 in the files
        flipped = xr.open_dataset(path).load().sortby("level", ascending=False)
        flipped.to_netcdf(path, engine="h5netcdf")
    kwargs = dict(levels=[500, 850], static_variables=STATIC, dynamic_forcing_variables=FORCING)
    ours = ERA5Dataset(data["glob"], UPPER, SURFACE, static_path=data["static"], **kwargs,
                       mean_path=mean, std_path=std)  # fmt: skip
    single = ERA5Dataset(data["single"], UPPER, SURFACE, **kwargs)
    x, ref = ours[4]["x"], single[4]["x"]
    prognostic = x.shape[0] - len(STATIC)
    assert torch.equal(x[:prognostic], ref[:prognostic])
    raw_static = np.stack([data["raw"][n].values for n in STATIC])
    assert np.array_equal(x[prognostic:].numpy(), raw_static)  # unchanged


def test_each_netcdf_file_is_matched_by_its_own_levels_and_foreign_levels_are_refused(
    data, tmp_path
):
    """The std file with its levels the other way from the mean file's gives the same samples;
    a level coordinate without the selected levels (same count) is refused, not read by position."""
    stats = default_stats_path(data["single"])
    mean, std = _netcdf_stats(stats, tmp_path, [*UPPER, *SURFACE, *FORCING])
    flipped = xr.open_dataset(std).load().sortby("level", ascending=False)
    flipped.to_netcdf(std, engine="h5netcdf")  # levels 850, 500 in the std file only
    kwargs = dict(levels=[500, 850], dynamic_forcing_variables=FORCING)
    ours = ERA5Dataset(data["single"], UPPER, SURFACE, **kwargs, mean_path=mean, std_path=std)
    single = ERA5Dataset(data["single"], UPPER, SURFACE, **kwargs)
    assert torch.equal(ours[4]["x"], single[4]["x"])
    assert torch.equal(ours[4]["y"], single[4]["y"])
    other = xr.open_dataset(mean).load().assign_coords(level=[300.0, 700.0])
    other.to_netcdf(tmp_path / "other_levels.nc", engine="h5netcdf")
    with pytest.raises(
        ValueError, match=r"data\.mean_path .*selected levels \[500\.0, 850\.0\] are not"
    ):
        ERA5Dataset(data["single"], UPPER, SURFACE, **kwargs,
                    mean_path=str(tmp_path / "other_levels.nc"), std_path=std)  # fmt: skip


# --------------------------------------------------------------------------- the gen-2 example
def _on_stores(data, parallelism: dict) -> dict:
    """The example as ``test_credit_examples._on_sample`` rewrites it, its paths then set as
    CREDIT lays its data out: the glob of per-year stores, the static store, the netCDF files."""
    conf = _on_sample(data["glob"], parallelism)
    variables = conf["data"]["source"]["ERA5"]["variables"]
    variables["static"]["path"] = data["static"]
    conf["data"].update(mean_path=data["mean"], std_path=data["std"])
    conf["trainer"]["use_ema"] = False
    conf["model"]["interp"] = False
    assert "diagnostic" not in variables
    return conf


def test_the_examples_paths_map_to_the_data_keys(data):
    with pytest.warns(UserWarning, match="bookkeeping"):
        d = credit_gen2_conf(_on_stores(data, {"data": "none", "tensor": 1, "domain": 2}))["data"]
    assert d["path"] == data["glob"] and d["static_path"] == data["static"]
    assert (d["mean_path"], d["std_path"]) == (data["mean"], data["std"])
    conf = _on_stores(data, {"data": "none", "tensor": 1, "domain": 2})
    conf["data"]["source"]["ERA5"]["variables"]["prognostic"]["path"] = "/x/era5_%Y.zarr"
    conf["data"]["source"]["ERA5"]["variables"]["dynamic_forcing"]["path"] = "/x/era5_%Y.zarr"
    with pytest.warns(UserWarning):
        assert credit_gen2_conf(conf)["data"]["path"] == "/x/era5_[0-9][0-9][0-9][0-9].zarr"
    # credit-parallel's own keys: a list of stores, the static store, the netCDF files
    mine = {"path": data["years"], "static_path": data["static"], "mean_path": data["mean"]}
    mine["std_path"] = data["std"]
    run = RunConfig.from_conf({"trainer": {"parallelism": {}}, "data": mine})
    assert run.data.path == tuple(data["years"]) and run.data.static_path == data["static"]
    assert (run.data.mean_path, run.data.std_path) == (data["mean"], data["std"])
    with pytest.raises(ValueError, match=r"data.path must be a path, a glob or a list"):
        RunConfig.from_conf({"trainer": {"parallelism": {}}, "data": {"path": [data["glob"], 3]}})


def test_a_year_template_reads_the_year_stores_not_a_stats_store_beside_them(tmp_path):
    """As CREDIT's gen-2 loader filters its glob by ``\\d{4}``: ``ERA5_%Y.zarr`` reads
    ERA5_2020.zarr and ERA5_2021.zarr, not our ERA5_2020_stats.zarr beside them; ``%Y*`` (which
    CREDIT reads as ``\\d{4}[^/]*``) does take it, so the two templates then differ."""
    from credit_parallel.layout.credit_gen2_blocks import as_glob, store_key

    for name in ("ERA5_2020.zarr", "ERA5_2021.zarr", "ERA5_2020_stats.zarr", "ERA5_20.zarr"):
        (tmp_path / name).mkdir()
    years = sorted(glob.glob(as_glob(str(tmp_path / "ERA5_%Y.zarr"))))
    assert years == [str(tmp_path / "ERA5_2020.zarr"), str(tmp_path / "ERA5_2021.zarr")]
    star = sorted(glob.glob(as_glob(str(tmp_path / "ERA5_%Y*.zarr"))))
    assert star == [*years[:1], str(tmp_path / "ERA5_2020_stats.zarr"), years[1]]
    assert store_key(str(tmp_path / "ERA5_%Y.zarr")) != store_key(str(tmp_path / "ERA5_%Y*.zarr"))
    (tmp_path / "ERA5_2020_stats.zarr").rmdir()  # the year stores only: the same store set
    assert store_key(str(tmp_path / "ERA5_%Y.zarr")) == store_key(str(tmp_path / "ERA5_%Y*.zarr"))


def _domain2_worker(rank, world, data):
    return _train(_on_stores(data, {"data": "none", "tensor": 1, "domain": 2}))


def test_the_example_on_per_year_stores_trains_at_domain_2_as_on_one_process(data):
    one = {"data": "none", "tensor": 1, "domain": 1}
    ref_records, ref_params = _train(_on_stores(data, one))
    records, params = run_on_ranks(_domain2_worker, 2, data, timeout=300)[0]
    _assert_trained_alike(records, params, ref_records, ref_params)


def test_credit_parallel_train_reads_the_gen2_yaml(data, tmp_path):
    from credit_parallel import cli

    conf = copy.deepcopy(_on_stores(data, {"data": "none", "tensor": 1, "domain": 1}))
    path = tmp_path / "wxformer_era5_stores.yml"
    path.write_text(yaml.safe_dump(conf))
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(path), "--output", str(out)]) == 0
    lines = (out / "metrics.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("step")


# ------------------------------------------------------------ the example as written, on stores
def _as_written(data, parallelism: dict) -> dict:
    """The example with everything it asks for: the glob of per-year stores, the static store,
    the netCDF statistics, a diagnostic group (``t2m`` predicted, never fed), the moving average
    of the weights, CREDIT's earth padding, the interpolation to the global size and the post
    block's tracer fixer (denormalising with the netCDF files); only the names (the sample
    store's variables) and the sizes (a tiny model, float64, 2 steps) are changed."""
    conf = _on_stores(data, parallelism)
    variables = conf["data"]["source"]["ERA5"]["variables"]
    variables["prognostic"]["vars_2D"] = ["SP"]
    variables["diagnostic"] = {"vars_2D": ["t2m"], "path": data["glob"]}
    conf["trainer"]["use_ema"] = True
    conf["model"].update(
        surface_channels=1,
        output_only_channels=1,
        interp=True,
        padding_conf={"activate": True, "mode": "earth", "pad_lat": [8, 8], "pad_lon": [16, 16]},
        global_window_size=[3, 3, 3, 1],  # windows that tile the padded stages 24 / 12 / 6 / 3
        local_window_size=3,
    )
    conf["model"]["post_conf"]["tracer_fixer"]["tracer_name"] = ["SP"]
    return conf


def _as_written_worker(rank, world, data):
    return _train(_as_written(data, {"data": "none", "tensor": 1, "domain": 2}))


def test_the_example_as_written_trains_at_domain_2_as_on_one_process(data):
    one = {"data": "none", "tensor": 1, "domain": 1}
    with pytest.warns(UserWarning, match="bookkeeping"):
        mapped = credit_gen2_conf(_as_written(data, one))
    assert mapped["data"]["diagnostic_variables"] == ["t2m"] and mapped["trainer"]["use_ema"]
    ref_records, ref_params = _train(_as_written(data, one))
    records, params = run_on_ranks(_as_written_worker, 2, data, timeout=300)[0]
    _assert_trained_alike(records, params, ref_records, ref_params)
