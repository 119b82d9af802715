"""Tests of the data layer: the synthetic ERA5-like store, ERA5Dataset and dp-only sampling."""

import numpy as np
import pytest
import torch
import xarray as xr

from credit_parallel import data_parallel_coords
from credit_parallel.data import (
    DistributedDPSampler,
    ERA5Dataset,
    default_stats_path,
    latitude_weights,
    make_dataloader,
    write_sample_dataset,
    zonal_angular_speed,
)
from credit_parallel.testing import run_on_ranks

UPPER = ["Z", "T", "U", "V"]
SURFACE = ["SP", "t2m"]
N_TIMES = 24


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_sample_dataset(tmp_path_factory.mktemp("era5") / "sample.zarr", n_times=N_TIMES)


@pytest.fixture(scope="module")
def raw(store):
    return xr.open_zarr(store, consolidated=False).load()


@pytest.fixture(scope="module")
def stats(store):
    return xr.open_zarr(default_stats_path(store), consolidated=False).load()


def _all_times(dataset, key="x"):
    """Every time of a history_len=forecast_len=1 dataset, (T, C, H, W): all x plus the last y."""
    steps = [dataset[i][key] for i in range(len(dataset))] + [dataset[len(dataset) - 1]["y"]]
    return torch.stack(steps).double()


# ---- the sample store ---------------------------------------------------------------------------
def test_sample_store_has_both_poles_on_the_era5_grid(raw):
    lat, lon = raw.latitude.values, raw.longitude.values
    assert lat.shape == (33,) and lon.shape == (64,)
    assert lat[0] == 90.0 and lat[-1] == -90.0 and np.all(np.diff(lat) == -5.625)
    assert lon[0] == 0.0 and lon[-1] == 354.375 and np.all(np.diff(lon) == 5.625)
    assert np.all(np.diff(raw.time.values) == np.timedelta64(6, "h"))
    assert raw.Z.dims == ("time", "level", "latitude", "longitude")
    assert raw.t2m.dims == ("time", "latitude", "longitude")
    assert list(raw.level.values) == [500.0, 850.0]
    # at a pole every longitude is the same point: the fields must not vary along it
    for name in UPPER + SURFACE:
        field = raw[name].values.astype(np.float64)
        for pole in (0, -1):
            ring = field[..., pole, :]
            assert np.ptp(ring, axis=-1).max() <= 1e-5 * max(1.0, np.abs(field).max()), name


@pytest.mark.parametrize("lat", [45.0, -45.0, 0.0, 67.5])
def test_sample_z500_pattern_moves_east_at_the_flow_speed(raw, lat):
    row = raw.Z.sel(level=500.0, latitude=lat).values  # (time, lon)
    lon_of_max = raw.longitude.values[row.argmax(axis=1)]
    step_shift = (np.diff(lon_of_max) + 180.0) % 360.0 - 180.0  # eastward, wrapped
    expected = zonal_angular_speed(lat, 500.0) * 6.0
    # each step: the maximum lands on the grid cell nearest the moved pattern
    assert np.all(np.abs(step_shift - expected) <= 5.625), (step_shift, expected)
    # over the whole record the grid error does not accumulate
    assert abs(step_shift.mean() - expected) <= 5.625 / len(step_shift) + 1e-9


def test_sample_jet_is_faster_in_midlatitudes_and_aloft():
    assert zonal_angular_speed(45.0, 500) > 3 * zonal_angular_speed(0.0, 500)
    assert zonal_angular_speed(45.0, 500) > zonal_angular_speed(45.0, 850) > 0.0
    assert zonal_angular_speed(45.0, 500) == zonal_angular_speed(-45.0, 500)


def test_sample_zonal_wind_is_the_wind_of_the_advecting_flow(raw):
    # zonal mean U (the wave part averages out) = angular speed * R cos(lat)
    lat = raw.latitude.values
    speed = np.deg2rad(zonal_angular_speed(lat, 500.0)) / 3600.0 * 6.371e6 * np.cos(np.deg2rad(lat))
    zonal_mean = raw.U.sel(level=500.0).mean(("time", "longitude")).values
    assert np.abs(zonal_mean - speed).max() < 0.3
    assert 25.0 < speed.max() < 40.0  # a realistic jet


def test_sample_t2m_diurnal_cycle_has_a_24h_period(raw):
    t2m = raw.t2m.values.astype(np.float64)
    anomaly = t2m - t2m.mean(axis=0)

    def lag_correlation(lag):
        return np.corrcoef(anomaly[:-lag].ravel(), anomaly[lag:].ravel())[0, 1]

    one_day, half_day = lag_correlation(4), lag_correlation(2)
    assert one_day > 0.9 and half_day < 0.0 and one_day > half_day
    # the sun moves west: the 24-h harmonic of the tropical mean at 90E leads the one at 0E by 6 h
    hours = (raw.time.values - raw.time.values[0]) / np.timedelta64(1, "h")
    tropics = raw.t2m.sel(latitude=slice(30.0, -30.0)).mean("latitude")
    harmonic = (tropics - tropics.mean("time")).values.T @ np.exp(-2j * np.pi * hours / 24.0)
    lead = np.angle(harmonic[16] / harmonic[0])  # longitude index 16 is 90E
    assert abs(lead - np.pi / 2) < 0.1, lead


def test_sample_store_is_deterministic_by_seed(tmp_path):
    paths = [
        write_sample_dataset(tmp_path / f"s{i}.zarr", n_times=4, seed=seed)
        for i, seed in enumerate((3, 3, 4))
    ]
    a, b, c = (xr.open_zarr(p, consolidated=False).load() for p in paths)
    for name in UPPER + SURFACE:
        np.testing.assert_array_equal(a[name].values, b[name].values)
    assert not np.array_equal(a.Z.values, c.Z.values)


def test_sample_store_writes_the_statistics_store(store, raw, stats):
    assert default_stats_path(store).name == "sample_stats.zarr"
    assert stats.attrs["statistic_order"] == ["mean", "std"]
    t850 = raw.T.sel(level=850.0).values.astype(np.float64)
    np.testing.assert_allclose(stats.T.sel(level=850.0).values, [t850.mean(), t850.std()])
    t2m = raw.t2m.values.astype(np.float64)
    np.testing.assert_allclose(stats.t2m.values, [t2m.mean(), t2m.std()])


def test_sample_store_of_200_steps_is_written_quickly(tmp_path):
    import time

    write_sample_dataset(tmp_path / "warm.zarr", n_times=2)  # first-call imports
    # CPU time (all threads) rather than wall time: other jobs on a shared machine do not count
    start = time.process_time()
    write_sample_dataset(tmp_path / "big.zarr", n_times=200)
    assert time.process_time() - start < 2.0


# ---- ERA5Dataset ------------------------------------------------------------------------------
def test_dataset_shapes_channel_order_and_hand_normalisation(store, raw, stats):
    ds = ERA5Dataset(store, UPPER, SURFACE)
    assert len(ds) == N_TIMES - 1 and ds.cached and ds.nbytes == N_TIMES * 10 * 33 * 64 * 4
    assert ds.grid_shape == (33, 64) and ds.channels_in == ds.channels_out == 10
    assert ds.variable_names == [
        "Z_500", "Z_850", "T_500", "T_850", "U_500", "U_850", "V_500", "V_850", "SP", "t2m",
    ]  # fmt: skip
    assert ds.channel_names_out[0] == "Z_500@t+1" and ds.channel_names_in[-1] == "t2m@t"
    sample = ds[5]
    assert sample["x"].shape == sample["y"].shape == (10, 33, 64)
    assert sample["x"].dtype == torch.float32 and int(sample["time_index"]) == 5
    for channel, name, level in ((3, "T", 850.0), (8, "SP", None), (9, "t2m", None)):
        field, stat = raw[name], stats[name]
        if level is not None:
            field, stat = field.sel(level=level), stat.sel(level=level)
        for key, t in (("x", 5), ("y", 6)):
            by_hand = (field.isel(time=t).values.astype(np.float64) - stat.values[0]) / stat.values[
                1
            ]
            np.testing.assert_allclose(sample[key][channel].numpy(), by_hand, atol=2e-6, rtol=1e-6)


def test_dataset_normalised_channels_have_zero_mean_unit_std(store):
    values = _all_times(ERA5Dataset(store, UPPER, SURFACE))
    mean, std = values.mean(dim=(0, 2, 3)), values.std(dim=(0, 2, 3), unbiased=False)
    assert torch.allclose(mean, torch.zeros(10, dtype=torch.float64), atol=1e-5), mean
    assert torch.allclose(std, torch.ones(10, dtype=torch.float64), atol=1e-5), std


def test_dataset_unnormalised_returns_raw_values(store, raw):
    ds = ERA5Dataset(store, ["U"], ["SP"], levels=[850], normalize=False)
    assert ds.variable_names == ["U_850", "SP"]
    np.testing.assert_array_equal(ds[2]["x"][0].numpy(), raw.U.sel(level=850.0).values[2])
    np.testing.assert_array_equal(ds[2]["y"][1].numpy(), raw.SP.values[3])


def test_dataset_history2_forecast2_stacks_consecutive_times(store):
    single = ERA5Dataset(store, UPPER, SURFACE)
    ds = ERA5Dataset(store, UPPER, SURFACE, history_len=2, forecast_len=2)
    assert len(ds) == N_TIMES - 3 and ds.channels_in == ds.channels_out == 20
    assert ds.channel_names_in[:2] == ["Z_500@t-1", "Z_850@t-1"]
    assert ds.channel_names_in[10] == "Z_500@t" and ds.channel_names_out[10] == "Z_500@t+2"
    sample = ds[4]
    assert sample["x"].shape == sample["y"].shape == (20, 33, 64)
    for step, key in ((0, "x"), (1, "x"), (2, "y"), (3, "y")):
        part = sample[key][(step % 2) * 10 : (step % 2 + 1) * 10]
        assert torch.equal(part, single[4 + step]["x"])


def test_dataset_5d_layout_matches_the_flat_channels(store):
    flat = ERA5Dataset(store, UPPER, SURFACE, history_len=2)
    ds = ERA5Dataset(store, UPPER, SURFACE, history_len=2, as_5d=True)
    sample, reference = ds[3], flat[3]
    assert set(sample) == {"x_upper", "x_surface", "y_upper", "y_surface", "time_index"}
    assert sample["x_upper"].shape == (8, 2, 33, 64)  # (history * vars, levels, H, W)
    assert sample["x_surface"].shape == (4, 33, 64)
    assert sample["y_upper"].shape == (4, 2, 33, 64) and sample["y_surface"].shape == (2, 33, 64)
    # history step 1, variable T (index 1), level 850 (index 1) = flat channel 10 + 3
    assert torch.equal(sample["x_upper"][4 + 1, 1], reference["x"][13])
    assert torch.equal(sample["x_surface"][3], reference["x"][19])  # step 1, t2m
    assert torch.equal(sample["y_upper"][2, 0], reference["y"][4])  # U_500


def test_dataset_lazy_reads_match_the_cache(store):
    cached = ERA5Dataset(store, UPPER, SURFACE, history_len=2, time_slice=slice(2, 20))
    lazy = ERA5Dataset(
        store, UPPER, SURFACE, history_len=2, time_slice=slice(2, 20), cache_limit_bytes=0
    )
    assert cached.cached and not lazy.cached and len(lazy) == len(cached) == 16
    for i in (0, 7, 15, -1):
        a, b = cached[i], lazy[i]
        assert all(torch.equal(a[key], b[key]) for key in a)
    with pytest.raises(IndexError):
        lazy[16]


def test_dataset_time_slice_by_position_and_label(store, raw):
    by_position = ERA5Dataset(store, ["T"], [], time_slice=(4, 12))
    assert len(by_position) == 7 and int(by_position[0]["time_index"]) == 4
    labels = slice(raw.time.values[4], raw.time.values[11])  # labels are inclusive
    by_label = ERA5Dataset(store, ["T"], [], time_slice=labels)
    assert len(by_label) == 7
    assert torch.equal(by_label[6]["y"], by_position[6]["y"])
    np.testing.assert_array_equal(by_label.times, raw.time.values[4:12])


def test_dataset_flips_an_ascending_latitude_store(store, tmp_path):
    source = xr.open_zarr(store, consolidated=False).load()
    ascending = tmp_path / "ascending.zarr"
    source.isel(latitude=slice(None, None, -1)).to_zarr(ascending, consolidated=False)
    normal = ERA5Dataset(store, ["Z"], ["t2m"], normalize=False)
    flipped = ERA5Dataset(ascending, ["Z"], ["t2m"], normalize=False, cache_limit_bytes=0)
    assert flipped.latitude[0] == 90.0
    assert torch.equal(flipped[1]["x"], normal[1]["x"])


def test_dataset_missing_variable_or_level_is_named(store):
    with pytest.raises(ValueError, match="'Q'"):
        ERA5Dataset(store, ["T", "Q"], SURFACE)
    with pytest.raises(ValueError, match="'tp'"):
        ERA5Dataset(store, UPPER, ["tp"])
    with pytest.raises(ValueError, match="level 700"):
        ERA5Dataset(store, UPPER, SURFACE, levels=[500, 700])
    with pytest.raises(ValueError, match="'t2m'.*right kind"):
        ERA5Dataset(store, ["t2m"], [])
    with pytest.raises(ValueError, match="no variables"):
        ERA5Dataset(store, [], [])


def test_dataset_bad_lengths_and_paths(store, tmp_path):
    with pytest.raises(ValueError, match="history_len"):
        ERA5Dataset(store, UPPER, SURFACE, history_len=0)
    with pytest.raises(ValueError, match="forecast_len"):
        ERA5Dataset(store, UPPER, SURFACE, forecast_len=0)
    with pytest.raises(ValueError, match="at least 25 time steps"):
        ERA5Dataset(store, UPPER, SURFACE, history_len=20, forecast_len=5)
    with pytest.raises(FileNotFoundError, match="no zarr store"):
        ERA5Dataset(tmp_path / "absent.zarr", UPPER, SURFACE)
    with pytest.raises(FileNotFoundError, match="statistics"):
        ERA5Dataset(store, UPPER, SURFACE, stats_path=tmp_path / "absent_stats.zarr")
    with pytest.raises(ValueError, match="as_5d"):
        ERA5Dataset(store, [], SURFACE, as_5d=True)


# ---- latitude weights -----------------------------------------------------------------------
def test_latitude_weights_mean_one_symmetric_exact_poles(store):
    lat = np.linspace(90.0, -90.0, 33)
    weights = latitude_weights(lat, dtype=torch.float64)
    assert weights.shape == (33,)
    assert abs(weights.mean().item() - 1.0) < 1e-12
    assert torch.equal(weights, weights.flip(0))
    # the poles keep cos(90 deg) (~6e-17), neither clipped up nor zeroed
    pole = np.cos(np.deg2rad(90.0)) / np.cos(np.deg2rad(lat)).mean()
    assert weights[0].item() == pole and 0.0 < pole < 1e-15
    assert weights[16].item() == weights.max().item()
    dataset = ERA5Dataset(store, ["T"], [])
    assert torch.allclose(dataset.lat_weights, weights.float())
    with pytest.raises(ValueError, match="lat_degrees"):
        latitude_weights([0.0, 95.0])


# ---- sampling over data parallelism -----------------------------------------------------------
def _indices(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sampler_dp3_partitions_without_duplicates():
    for drop_last, expected in ((True, 30), (False, 31)):
        samplers = [DistributedDPSampler(31, r, 3, seed=7, drop_last=drop_last) for r in range(3)]
        shares = [_indices(s, 2) for s in samplers]
        union = [i for share in shares for i in share]
        assert len(union) == len(set(union)) == expected
        assert [len(s) for s in samplers] == [len(share) for share in shares]
        assert set(union) <= set(range(31))
    assert [len(DistributedDPSampler(31, r, 3, drop_last=True)) for r in range(3)] == [10] * 3


def test_sampler_epoch_orders_are_deterministic_and_differ():
    a, b = DistributedDPSampler(40, 1, 3, seed=5), DistributedDPSampler(40, 1, 3, seed=5)
    assert _indices(a, 3) == _indices(b, 3)
    assert _indices(a, 3) != _indices(a, 4)
    assert _indices(a, 0) != _indices(DistributedDPSampler(40, 1, 3, seed=6), 0)
    unshuffled = DistributedDPSampler(10, 1, 3, shuffle=False)
    assert _indices(unshuffled, 0) == _indices(unshuffled, 9) == [1, 4, 7]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dp_rank 3"):
        DistributedDPSampler(10, 3, 3)
    with pytest.raises(ValueError, match="dp_size"):
        DistributedDPSampler(10, 0, 0)
    with pytest.raises(ValueError, match="2 samples"):
        DistributedDPSampler(2, 0, 3)
    with pytest.raises(ValueError, match="epoch"):
        DistributedDPSampler(10, 0, 2).set_epoch(-1)


def _sampler_worker(rank, world, conf):
    dp_rank, dp_size = data_parallel_coords(conf)
    sampler = DistributedDPSampler(23, dp_rank, dp_size, seed=11)
    return dp_rank, dp_size, _indices(sampler, 1)


def test_sampler_with_data_parallel_coords_same_batch_across_tp_ranks():
    conf = {"trainer": {"parallelism": {"data": "fsdp2", "tensor": 2, "domain": 1}}}
    results = run_on_ranks(_sampler_worker, 4, conf)
    assert [(r[0], r[1]) for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert results[0][2] == results[1][2] and results[2][2] == results[3][2]
    assert not set(results[0][2]) & set(results[2][2])
    assert len(results[0][2]) + len(results[2][2]) == 22


def test_make_dataloader_per_rank_batches_are_reproducible(store):
    ds = ERA5Dataset(store, ["T"], ["t2m"])  # 23 samples
    loaders = [make_dataloader(ds, 4, r, 2, shuffle=True, seed=3) for r in range(2)]
    batches = [list(loader) for loader in loaders]
    assert [b["x"].shape[0] for b in batches[0]] == [4, 4, 3]  # per-rank batch of 4
    seen = torch.cat([b["time_index"] for rank in batches for b in rank]).tolist()
    assert len(seen) == len(set(seen)) == 22
    again = list(make_dataloader(ds, 4, 0, 2, shuffle=True, seed=3))
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(again, batches[0]))
    loaders[0].sampler.set_epoch(1)
    assert not torch.equal(next(iter(loaders[0]))["time_index"], batches[0][0]["time_index"])
