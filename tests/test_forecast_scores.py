"""Forecast scores (forecast/scores.py): the accumulator against NumPy on whole fields, the same
scores at 4 ranks ({dp 2, domain 2}: initial times over dp, uneven rows over domain; and an
ensemble whose members are split over the dp ranks) as on one process, the files (csv / json /
png with SPEC §7's columns), the climatology by rows against xarray, and the map read back from
a forecast store."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
import xarray as xr

from credit_parallel.data.dataset import latitude_weights
from credit_parallel.data.sample import write_sample_dataset
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.forecast import scores as fs
from credit_parallel.testing import run_on_ranks

__all__: list[str] = []

H, W, T, STEPS, M = 9, 8, 4, 3, 4
UPPER, LEVELS, SURFACE = ["T", "U"], [500, 850], ["t2m"]
C = len(UPPER) * len(LEVELS) + len(SURFACE)
TOL = 1e-12


def _case(seed=0):
    """Truth, prediction and ensemble of T initial times x STEPS leads, 5-D outputs (upper,
    surface), the climatology (C, H, W) and the weights."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64)

    truth = [(randn(T, 2, 2, H, W) + 5, randn(T, 1, H, W) + 5) for _ in range(STEPS)]
    pred = [
        tuple(t + (k + 1) * 0.3 * randn(*t.shape) for t in step) for k, step in enumerate(truth)
    ]
    ens = [tuple(t + randn(M, *t.shape) for t in step) for step in truth]
    clim = randn(C, H, W) + 5
    return truth, pred, ens, clim, latitude_weights(np.linspace(90, -90, H), torch.float64)


def _flat(step, member_axis=False):
    return np.asarray(fs.flatten_channels(step, member_axis))


def _numpy_rows(truth, pred, clim, w, ens=None):
    wn = np.broadcast_to(np.asarray(w)[:, None], (H, W))
    wn = wn / wn.sum()
    c = np.asarray(clim)
    rows = []
    for k in range(STEPS):
        y = _flat(truth[k])
        f = _flat(ens[k], True).mean(axis=0) if ens is not None else _flat(pred[k])
        mse = ((f - y) ** 2 * wn).sum(axis=(-2, -1)).mean(axis=0)
        a, b = f - c, y - c
        acc = (a * b * wn).sum((-2, -1)) / np.sqrt(
            (a * a * wn).sum((-2, -1)) * (b * b * wn).sum((-2, -1))
        )
        rows.append((np.sqrt(mse), acc.mean(axis=0)))
    return rows


def _accumulate(acc, truth, pred, times, rows=slice(None), ensemble=False):
    for k in range(STEPS):
        step_pred = tuple(p[:, times] if ensemble else p[times] for p in pred[k])
        acc.add(
            [f"2020-01-0{t + 1}" for t in times.tolist()],
            k + 1,
            tuple(p[..., rows, :] for p in step_pred),
            tuple(t[times][..., rows, :] for t in truth[k]),
        )
    return acc.result()


def _single(ensemble=False):
    truth, pred, ens, clim, w = _case()
    acc = fs.ScoreAccumulator(
        UPPER,
        LEVELS,
        [6.0 * (k + 1) for k in range(STEPS)],
        surface_variables=SURFACE,
        lat_weights_local=w,
        climatology=clim,
        members=M if ensemble else 1,
    )
    return _accumulate(acc, truth, ens if ensemble else pred, torch.arange(T), ensemble=ensemble)


def test_accumulator_rows_equal_numpy_with_spec_columns():
    truth, pred, ens, clim, w = _case()
    rows = _single()
    assert len(rows) == STEPS * C
    assert list(rows[0]) == list(fs.SCORE_COLUMNS)
    assert [(r["variable"], r["level"]) for r in rows[:C]] == [
        ("T", 500),
        ("T", 850),
        ("U", 500),
        ("U", 850),
        ("t2m", None),
    ]
    assert [r["lead_time_hours"] for r in rows[::C]] == [6.0, 12.0, 18.0]
    for k, (rmse, acc) in enumerate(_numpy_rows(truth, pred, clim, w)):
        got = rows[k * C : (k + 1) * C]
        assert np.max(np.abs([r["rmse"] for r in got] - rmse)) <= TOL
        assert np.max(np.abs([r["acc"] for r in got] - acc)) <= TOL
    # the error grows with the lead (0.3, 0.6, 0.9 noise): the rows are in lead order
    assert rows[0]["rmse"] < rows[C]["rmse"] < rows[2 * C]["rmse"]


def test_ensemble_rows_score_the_ensemble_mean_and_add_crps_and_spread():
    truth, pred, ens, clim, w = _case()
    rows = _single(ensemble=True)
    assert list(rows[0]) == list(fs.SCORE_COLUMNS) + ["crps", "spread"]
    for k, (rmse, acc) in enumerate(_numpy_rows(truth, pred, clim, w, ens=ens)):
        got = rows[k * C : (k + 1) * C]
        assert np.max(np.abs([r["rmse"] for r in got] - rmse)) <= TOL
        assert np.max(np.abs([r["acc"] for r in got] - acc)) <= TOL
    # members = truth + N(0, 1): spread ~ 1, CRPS ~ 2 phi(0) - 1/sqrt(pi) = 0.234
    assert all(0.7 < r["spread"] < 1.3 and 0.15 < r["crps"] < 0.35 for r in rows)


def test_add_refuses_a_repeated_time_a_bad_lead_and_wrong_channels():
    truth, pred, _, clim, w = _case()
    acc = fs.ScoreAccumulator(UPPER, LEVELS, [6.0], surface_variables=SURFACE, lat_weights_local=w)
    acc.add(["a", "b", "c", "d"], 1, pred[0], truth[0])
    with pytest.raises(ValueError, match="initial time a lead 1 twice"):
        acc.add(["a", "x", "y", "z"], 1, pred[0], truth[0])
    with pytest.raises(ValueError, match="lead 2 outside forecast steps 1..1"):
        acc.add(["e", "f", "g", "h"], 2, pred[0], truth[0])
    with pytest.raises(ValueError, match="5 channels expected"):
        acc.add(["e", "f", "g", "h"], 1, pred[0][:1], truth[0][:1])
    assert acc.result()[0]["acc"] is None  # no climatology: acc stays empty


def _sharded_worker(rank, world, ensemble, split=(2, 2)):
    torch.set_default_dtype(torch.float64)
    truth, pred, ens, clim, w = _case()
    manager = DomainParallelManager(world, 2)
    a, b = shard_range(H, 2, manager.domain_rank)
    kw = {}
    if ensemble:  # every initial time on every dp rank, the members split over dp
        times = torch.arange(T)
        start = sum(split[: manager.dp_rank])
        mine = slice(start, start + split[manager.dp_rank])
        source = [tuple(p[mine] for p in step) for step in ens]
        kw = {"members": M, "member_group": manager.data_parallel_group}
    else:  # initial times over dp, uneven: 3 + 1
        times = torch.arange(T)[:3] if manager.dp_rank == 0 else torch.arange(T)[3:]
        source = pred
    acc = fs.ScoreAccumulator(
        UPPER,
        LEVELS,
        [6.0 * (k + 1) for k in range(STEPS)],
        surface_variables=SURFACE,
        lat_weights_local=w[a:b],
        climatology=clim[:, a:b],
        manager=manager,
        **kw,
    )
    return _accumulate(acc, truth, source, times, slice(a, b), ensemble)


@pytest.mark.parametrize("ensemble,split", [(False, None), (True, (2, 2)), (True, (4, 0))])
def test_scores_at_4_ranks_equal_one_process(ensemble, split):
    want = _single(ensemble)
    for rows in run_on_ranks(_sharded_worker, 4, ensemble, split):
        assert len(rows) == len(want)
        for got, ref in zip(rows, want):
            assert got.keys() == ref.keys()
            for key, value in ref.items():
                if isinstance(value, float):
                    assert abs(got[key] - value) <= TOL, (key, got, ref)
                else:
                    assert got[key] == value


def test_write_scores_files(tmp_path):
    rows = _single(ensemble=True)
    paths = fs.write_scores(tmp_path, rows)
    with open(paths["csv"]) as fh:
        table = list(csv.reader(fh))
    assert table[0] == ["variable", "level", "lead_time_hours", "rmse", "acc", "crps", "spread"]
    assert len(table) == 1 + len(rows)
    surface = [r for r in table[1:] if r[0] == "t2m"]
    assert surface and all(r[1] == "" for r in surface)
    assert float(table[1][3]) == rows[0]["rmse"]  # full precision
    assert json.loads(paths["json"].read_text()) == rows
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ climatology and the map
@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("clim") / "s.zarr"
    return str(write_sample_dataset(path, n_times=13, nlat=H, nlon=W))


def _conf(store, time_slice):
    return {
        "data": {
            "path": store,
            "upper_air_variables": UPPER,
            "surface_variables": SURFACE,
            "levels": LEVELS,
            "time_slice": time_slice,
        }
    }


@pytest.mark.parametrize("time_slice", [[0, 11], [1, 4], [2, 4], [0, 13]])
def test_climatology_by_rows_is_the_time_mean_of_the_training_range(sample_store, time_slice):
    ds = xr.open_zarr(sample_store).isel(time=slice(*time_slice))  # integer stop: exclusive
    mean = ds.mean("time")
    want = np.concatenate(
        [mean[v].sel(level=LEVELS).values for v in UPPER] + [mean[v].values[None] for v in SURFACE]
    )
    if ds["latitude"].values[0] < ds["latitude"].values[-1]:
        want = want[:, ::-1]
    conf = _conf(sample_store, time_slice)
    whole = fs.climatology(conf).numpy()
    assert whole.shape == (C, H, W)
    assert np.max(np.abs(whole - want)) <= 1e-4 * np.abs(want).max()  # float32 store, float64 mean
    parts = [fs.climatology(conf, domain_shard=(r, 4)).numpy() for r in range(4)]
    assert [p.shape[1] for p in parts] == [3, 2, 2, 2]
    assert np.array_equal(np.concatenate(parts, axis=1), whole)


def test_climatology_from_a_file_selects_levels_and_rows(sample_store, tmp_path):
    conf = _conf(sample_store, [0, 11])
    computed = fs.climatology(conf)
    mean = xr.open_zarr(sample_store).isel(time=slice(0, 11)).mean("time").compute()
    path = tmp_path / "clim.zarr"
    mean[UPPER + SURFACE].sortby("latitude").to_zarr(path)  # ascending: flipped on read
    read = fs.climatology(conf, path=path, domain_shard=(1, 2))
    a, b = shard_range(H, 2, 1)
    assert np.max(np.abs(read.numpy() - computed[:, a:b].numpy())) <= 1e-3
    with pytest.raises(ValueError, match="has no variable 'V'"):
        fs.climatology({"data": {**conf["data"], "surface_variables": ["V"]}}, path=path)


def test_plot_field_map_reads_the_store(tmp_path):
    lat, lon = np.linspace(90, -90, H), np.arange(W) * 45.0
    shape = (2, STEPS, len(LEVELS), H, W)
    field = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    ds = xr.Dataset(
        {
            "T": (
                ("init_time", "lead_time", "level", "latitude", "longitude"),
                field,
                {"units": "K"},
            ),
            "t2m": (("init_time", "lead_time", "latitude", "longitude"), field[:, :, 0]),
        },
        coords={
            "init_time": np.array(["2020-01-01T00", "2020-01-01T06"], dtype="datetime64[ns]"),
            "lead_time": np.arange(1, STEPS + 1) * np.timedelta64(6, "h"),
            "level": LEVELS,
            "latitude": lat,
            "longitude": lon,
        },
    )
    store = tmp_path / "forecast.zarr"
    ds.to_zarr(store)
    png = fs.plot_field_map(
        store, "T", 2, tmp_path / "map.png", level=850, init_time="2020-01-01T06"
    )
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert fs.plot_field_map(store, "t2m", 3, tmp_path / "m2.png").exists()
    with pytest.raises(ValueError, match="has levels; pass level="):
        fs.plot_field_map(store, "T", 1, tmp_path / "x.png")
    with pytest.raises(ValueError, match="lead 4 outside 1..3"):
        fs.plot_field_map(store, "T", 4, tmp_path / "x.png", level=500)
    with pytest.raises(ValueError, match="'Q' is not in"):
        fs.plot_field_map(store, "Q", 1, tmp_path / "x.png")
