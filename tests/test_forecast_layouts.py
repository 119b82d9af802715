"""The forecast store's layouts and the command's 2-D domain flag: ``--layout weatherbench2``
(WeatherBench 2's dims, ERA5's long names, levels in hPa) read as WeatherBench 2's evaluation
reads a forecast, with the same values and scores as the default layout; ``--parallelism
domain=PxQ`` (and ``lat=P,lon=Q``) on 4 CLI ranks equal to one rank; the map's three panels."""

from __future__ import annotations

import io

import numpy as np
import pytest
import xarray as xr
import yaml
import zarr

from credit_parallel import cli
from credit_parallel.data import write_sample_dataset
from credit_parallel.forecast.command import run_forecast
from credit_parallel.forecast.inputs import parse_parallelism_flag
from credit_parallel.forecast.maps import map_figure, map_stride
from credit_parallel.forecast.store_layout import (
    era5_long_name,
    layout_for_dataset,
    pressure_levels_hpa,
)
from test_forecast_command import INITS, _args, _assert_same_store, _checkpoint, _conf, _model_conf

__all__: list[str] = []


def _png_width(path) -> int:
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG"
    return int.from_bytes(data[16:20], "big")  # IHDR


THREE_PANELS = round(3 * 6.2 * 110)  # map_figure's width of three panels at the command's dpi

H, W = 17, 16
LONG = {"T": "temperature", "U": "u_component_of_wind", "t2m": "2m_temperature"}
LONG["SP"] = "surface_pressure"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    store = write_sample_dataset(root / "s.zarr", n_times=40, nlat=H, nlon=W)
    ckpt, _ = _checkpoint(root / "ckpt", _model_conf(8))
    conf_path = root / "conf.yaml"
    conf_path.write_text(yaml.safe_dump(_conf(store)))
    return {"root": root, "store": store, "ckpt": ckpt, "conf": conf_path}


def test_parallelism_flag_takes_a_two_dimensional_domain():
    assert parse_parallelism_flag("data=none,tensor=1,domain=2x2") == {
        "data": "none",
        "tensor": 1,
        "domain": {"lat": 2, "lon": 2},
    }
    assert parse_parallelism_flag("lat=2,lon=4") == {"domain": {"lat": 2, "lon": 4}}
    assert parse_parallelism_flag("domain=4") == {"domain": 4}
    for bad, message in [
        ("domain=2x", "must be PxQ"),
        ("domain=0x2", "must be PxQ"),
        ("lat=2", "lat=P needs lon=Q"),
        ("domain=2,lat=2,lon=1", "not two of them"),
        ("domain=2x2,domain=4", "given twice"),
        ("rows=2", "expected data=MODE"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_parallelism_flag(bad)


def test_era5_long_names_and_levels_in_hpa():
    assert [era5_long_name(n) for n in ("T", "U", "V", "Q", "Z", "t2m", "SP", "MSL")] == [
        "temperature",
        "u_component_of_wind",
        "v_component_of_wind",
        "specific_humidity",
        "geopotential",
        "2m_temperature",
        "surface_pressure",
        "mean_sea_level_pressure",
    ]
    # 10 m winds are not the wind at 10 hPa; a single-level field at a pressure gets the suffix
    assert era5_long_name("U10") == "10m_u_component_of_wind"
    assert era5_long_name("VAR_10V") == "10m_v_component_of_wind"
    assert era5_long_name("Z500") == "geopotential_500"
    assert era5_long_name("T850") == "temperature_850"
    assert era5_long_name("my_index") == "my_index" and era5_long_name("T5000") == "T5000"
    hpa = pressure_levels_hpa([50000.0, 85000.0], "plev", "Pa")
    assert hpa.dtype == np.int64 and hpa.tolist() == [500, 850]
    assert pressure_levels_hpa([500.0, 850.0], "level", "millibars").tolist() == [500, 850]
    assert pressure_levels_hpa([1.5, 850.0], "pressure_level", "").tolist() == [1.5, 850.0]
    with pytest.raises(ValueError, match="'level' .* is not pressure"):
        pressure_levels_hpa([10.0, 137.0], "level", "")  # CREDIT's model levels
    with pytest.raises(ValueError, match="'t2m' and 'VAR_2T' both become '2m_temperature'"):
        layout_for_dataset("weatherbench2", ["t2m", "VAR_2T"])
    layout = layout_for_dataset("weatherbench2", ["T", "Z500"], [500.0], ("level", "hPa"))
    assert layout.lead_dims(2) == ("time", "number", "prediction_timedelta")
    assert layout.store_name("Z500") == "geopotential_500" and layout.levels.tolist() == [500]


def _as_weatherbench2_opens_it(path, truth_store) -> tuple[xr.Dataset, xr.Dataset]:
    """The forecast and the truth as WeatherBench 2's ``open_source_files`` /
    ``apply_time_conventions(by_init=True)`` leave them: latitude increasing, the forecast's
    ``time`` / ``prediction_timedelta`` renamed to ``init_time`` / ``lead_time``, ``valid_time``
    their sum; the truth named as ERA5 (WeatherBench 2's ERA5 stores)."""
    forecast = xr.open_zarr(path).sortby("latitude")
    truth = xr.open_zarr(truth_store).rename(LONG).sortby("latitude")
    np.testing.assert_allclose(forecast["latitude"], truth["latitude"], atol=1e-3)
    np.testing.assert_allclose(forecast["longitude"], truth["longitude"], atol=1e-3)
    forecast = forecast.rename({"prediction_timedelta": "lead_time", "time": "init_time"})
    forecast.coords["valid_time"] = forecast["init_time"] + forecast["lead_time"]
    return forecast, truth


def test_weatherbench2_layout_reads_as_weatherbench2_does_and_scores_equal_default(setup, tmp_path):
    conf, inits = _conf(setup["store"]), INITS[:2]
    stores = {}
    results = {}
    for layout in ("default", "weatherbench2"):
        out = tmp_path / layout
        args = _args(
            setup["conf"], setup["ckpt"], out, "--members", "2", "--layout", layout,
            inits=inits, steps=2,
        )  # fmt: skip
        results[layout] = run_forecast(conf, args, stream=io.StringIO())
        stores[layout] = out / "forecast.zarr"
    wb2 = xr.open_zarr(stores["weatherbench2"])
    default = xr.open_zarr(stores["default"])
    dims = ("time", "number", "prediction_timedelta")
    assert wb2["temperature"].dims == (*dims, "level", "latitude", "longitude")
    assert wb2["2m_temperature"].dims == (*dims, "latitude", "longitude")
    assert sorted(wb2.data_vars) == sorted([*LONG.values(), "complete"])
    assert wb2["time"].dtype == np.dtype("datetime64[ns]")
    assert wb2["prediction_timedelta"].dtype == np.dtype("timedelta64[ns]")
    assert wb2["level"].dtype == np.int64 and wb2["level"].values.tolist() == [500, 850]
    assert wb2["number"].values.tolist() == [0, 1] and wb2.attrs["layout"] == "weatherbench2"
    assert wb2["temperature"].attrs["units"] == "K"
    # the same numbers as the default layout's store, renamed
    for short, long in LONG.items():
        renamed = default[short].rename(
            {"init_time": "time", "member": "number", "lead_time": "prediction_timedelta"}
        )
        assert np.array_equal(wb2[long].values, renamed.values), long
    # WeatherBench 2's reading: the truth at each valid time; its RMSE is the scores' rmse
    forecast, truth = _as_weatherbench2_opens_it(stores["weatherbench2"], setup["store"])
    weights = np.cos(np.deg2rad(forecast["latitude"]))
    weights = weights / weights.mean()
    rows = {
        (r["variable"], r["level"], r["lead_time_hours"]): r for r in results["default"]["scores"]
    }
    for short, long in LONG.items():
        mean = forecast[long].mean("number")
        for k in range(2):
            f = mean.isel(lead_time=k)
            y = truth[long].sel(time=f["valid_time"])
            levels = f["level"].values.tolist() if "level" in f.dims else [None]
            for level in levels:
                fl, yl = (f, y) if level is None else (f.sel(level=level), y.sel(level=level))
                mse = (((fl - yl) ** 2) * weights).mean(("latitude", "longitude")).mean("init_time")
                row = rows[(short, None if level is None else float(level), 6.0 * (k + 1))]
                assert abs(float(np.sqrt(mse)) - row["rmse"]) <= 1e-4 * row["rmse"], (long, level)
    for a, b in zip(results["weatherbench2"]["scores"], results["default"]["scores"]):
        assert a == b
    # the map, named as the store names the variable: forecast, truth and error
    assert _png_width(tmp_path / "weatherbench2" / "map_temperature.png") == THREE_PANELS
    # --resume continues only a store of the same layout; resumed, it scores from the store
    args = _args(
        setup["conf"], setup["ckpt"], tmp_path / "weatherbench2", "--members", "2", "--resume",
        inits=inits, steps=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="has the weatherbench2 layout"):
        run_forecast(conf, args, stream=io.StringIO())
    args.layout = "weatherbench2"
    resumed = run_forecast(conf, args, stream=io.StringIO())
    assert resumed["skipped"] == 2 and not resumed["computed"]
    for a, b in zip(resumed["scores"], results["default"]["scores"]):
        assert abs(a["rmse"] - b["rmse"]) <= 1e-5 * b["rmse"], (a, b)


def test_weatherbench2_layout_refuses_model_levels_before_any_output(setup, tmp_path, capsys):
    store = write_sample_dataset(tmp_path / "m.zarr", n_times=8, nlat=H, nlon=W)
    group = zarr.open_group(store, mode="r+")
    group["level"].attrs.update({"units": "", "long_name": "model level"})  # not pressures
    zarr.consolidate_metadata(store)
    conf = tmp_path / "conf.yaml"
    conf.write_text(yaml.safe_dump(_conf(store)))
    argv = ["forecast", "--config", str(conf), "--checkpoint", str(setup["ckpt"]), "--steps", "1"]
    argv += ["--output", str(tmp_path / "o"), "--init-times", "2020-01-01T06", "--device", "cpu"]
    capsys.readouterr()  # what writing the store printed (zarr's consolidation notice)
    code = cli.main([*argv, "--layout", "weatherbench2"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "is not pressure in hPa or Pa" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # four ranks started by the CLI's launcher (a process each)
def test_domain_2x2_on_four_cli_ranks_equals_one_rank_with_a_three_panel_map(
    setup, tmp_path, capsys
):
    argv = ["forecast", "--config", str(setup["conf"]), "--checkpoint", str(setup["ckpt"])]
    argv += ["--steps", "2", "--init-times", INITS[0], "--device", "cpu"]
    one, four = tmp_path / "one", tmp_path / "four"
    assert cli.main([*argv, "--output", str(one)]) == 0
    parallelism = ["--parallelism", "data=none,tensor=1,domain=2x2", "--nproc", "4"]
    assert cli.main([*argv, "--output", str(four), *parallelism]) == 0, capsys.readouterr().err
    _assert_same_store(one / "forecast.zarr", four / "forecast.zarr")
    chunks = zarr.open_group(four / "forecast.zarr", mode="r")["T"].chunks
    assert chunks[-1] == W // 2  # a chunk lies inside one 2 x 2 tile
    assert (four / "scores.csv").read_text().splitlines()[0].startswith("variable,level")
    assert _png_width(four / "map_T.png") == THREE_PANELS


def test_map_figure_draws_forecast_truth_and_error_side_by_side():
    lat, lon = np.linspace(90, -90, 5), np.arange(8) * 45.0
    forecast = np.arange(40, dtype=np.float64).reshape(5, 8)
    truth = forecast[::-1].copy()
    fig, panels = map_figure(forecast, truth, latitude=lat, longitude=lon, title="T 500", units="K")
    assert [ax.get_title() for ax in panels] == ["forecast", "truth", "error (forecast - truth)"]
    assert len(fig.axes) == 6  # three maps, each with its colour bar
    drawn = [np.asarray(ax.images[0].get_array()) for ax in panels]
    assert np.array_equal(drawn[2], forecast - truth) and np.array_equal(drawn[1], truth)
    assert panels[0].images[0].get_clim() == panels[1].images[0].get_clim() == (0, 39)
    assert panels[0].images[0].origin == "upper"  # north (row 0) at the top
    lo, hi = panels[2].images[0].get_clim()
    assert lo == -hi == -np.abs(forecast - truth).max()  # diverging, centred on zero
    fig, panels = map_figure(forecast, latitude=lat, longitude=lon)  # no truth: the forecast
    assert len(panels) == 1 and panels[0].get_title() == "forecast"
    with pytest.raises(ValueError, match="the truth's shape"):
        map_figure(forecast, truth[:2], latitude=lat, longitude=lon)
    # a 0.1-degree field is drawn from every 3rd point, a 0.25-degree one from all of them
    assert (map_stride(1801, 3600), map_stride(721, 1440), map_stride(17, 16)) == (3, 1, 1)
