"""``benchmarks/forecast.py`` refuses an existing ``--store`` of another grid, times, levels or
variables than asked (it once reused one silently and failed inside the forecast)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from credit_parallel.data import write_sample_dataset

__all__: list[str] = []

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "forecast.py"


def _bench():
    spec = importlib.util.spec_from_file_location("forecast_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "s.zarr"
    return write_sample_dataset(path, n_times=6, nlat=9, nlon=8, levels=(500, 850))


def test_the_store_asked_for_is_accepted_and_every_difference_is_named(store):
    bench = _bench()
    bench.check_store(store, 6, [500, 850], [9, 8], 10)  # the same: used as it is
    bench.check_store(store.parent / "absent.zarr", 6, [500, 850], [9, 8], 10)  # written later
    cases = {
        "grid (9, 8) (asked (721, 1440))": (6, [500, 850], [721, 1440], 10),
        "times 6 (asked 8)": (8, [500, 850], [9, 8], 10),
        "levels [500.0, 850.0] (asked [50.0,": (6, bench.LEVELS_71, [9, 8], 71),
    }
    for message, (times, levels, grid, channels) in cases.items():
        with pytest.raises(SystemExit, match="holds another store") as info:
            bench.check_store(store, times, levels, grid, channels)
        assert message in str(info.value), str(info.value)


def test_main_refuses_before_writing_or_launching_anything(store, tmp_path):
    bench = _bench()
    argv = ["--store", str(store), "--out", str(tmp_path / "runs"), "--times", "8"]
    with pytest.raises(SystemExit, match="times 6 \\(asked 8\\)"):
        bench.main([*argv, "--grid", "9", "8", "--steps", "2", "--inits", "1"])
    assert not (tmp_path / "runs").exists()
    args = bench.parse_args(["--channels", "71", "--times", "2", "--steps", "6", "--inits", "1"])
    assert len(args.levels) == 17 and args.store.endswith("era5_71ch.zarr")
    assert bench._config(args, 1)["model"]["out_channels"] == 71
