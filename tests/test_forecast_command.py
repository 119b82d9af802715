"""``credit-parallel forecast``: the store written at 4 ranks equals the one written at 1 rank and
opens with xarray with the SPEC §7 dims and coordinates; no two ranks write one chunk; resume
after a killed rank; miles-credit checkpoints (keys renamed by CREDIT's own domain conversion);
every bad input stops with one line, a non-zero exit and no store."""

from __future__ import annotations

import argparse
import io
import os
import time

import numpy as np
import pytest
import torch
import xarray as xr
import yaml
import zarr

from credit_parallel import cli
from credit_parallel.data import write_sample_dataset
from credit_parallel.forecast.chunks import row_chunk_length
from credit_parallel.forecast.command import FAIL_ENV, build_arguments, run_forecast
from credit_parallel.models import build_model
from credit_parallel.testing import RankFailure, fake_process_group, run_on_ranks
from credit_parallel.train.checkpoint import save_checkpoint

__all__: list[str] = []

H, W = 17, 16  # 9 / 8 rows over two domain ranks
INITS = ["2020-01-02T00", "2020-01-03T00", "2020-01-03T06"]
STEPS = 4


def _model_conf(in_channels=8):
    return {
        "type": "unet",
        "in_channels": in_channels,
        "out_channels": 6,
        "image_height": H,
        "image_width": W,
        "base_channels": 4,
        "channel_mults": [1, 2],
        "norm_groups": 2,
    }


def _conf(store, *, forcing=True, parallelism=None):
    data = {
        "path": str(store),
        "upper_air_variables": ["T", "U"],
        "surface_variables": ["t2m", "SP"],
        "levels": [500, 850],
        "time_slice": [0, 30],
        "num_workers": 0,
    }
    if forcing:
        data.update(dynamic_forcing_variables=["tsi"], static_variables=["orography"])
    return {
        "model": _model_conf(8 if forcing else 6),
        "data": data,
        "trainer": {
            "parallelism": parallelism or {"data": "none", "tensor": 1, "domain": 1},
            "seed": 3,
            "dist_timeout_s": 20,
        },
    }


def _checkpoint(directory, model_conf, seed=3):
    torch.manual_seed(seed)
    model = build_model(model_conf)
    return save_checkpoint(directory, 1, model), model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("forecast")
    store = write_sample_dataset(root / "s.zarr", n_times=40, nlat=H, nlon=W)
    ckpt, _ = _checkpoint(root / "ckpt", _model_conf(8))
    plain, _ = _checkpoint(root / "ckpt_plain", _model_conf(6))
    conf_path = root / "conf.yaml"
    conf_path.write_text(yaml.safe_dump(_conf(store)))
    plain_path = root / "plain.yaml"
    plain_path.write_text(yaml.safe_dump(_conf(store, forcing=False)))
    one = root / "one"
    result = run_forecast(_conf(store), _args(conf_path, ckpt, one), stream=io.StringIO())
    return {
        "root": root,
        "store": store,
        "ckpt": ckpt,
        "plain": plain,
        "conf": conf_path,
        "plain_conf": plain_path,
        "one": one,
        "one_result": result,
    }


def _args(conf_path, checkpoint, output, *extra, inits=INITS, steps=STEPS):
    ap = argparse.ArgumentParser()
    build_arguments(ap)
    args = ap.parse_args(
        [
            "--config",
            str(conf_path),
            "--checkpoint",
            str(checkpoint),
            "--steps",
            str(steps),
            "--output",
            str(output),
            "--init-times",
            *inits,
            *extra,
        ]
    )
    args.progress = False
    return args


def _worker(rank, world, conf, args, fail_at=None):
    if fail_at is not None:
        os.environ[FAIL_ENV] = fail_at
    result = run_forecast(conf, args, stream=io.StringIO())
    return {k: result[k] for k in ("written_chunks", "scores", "computed", "skipped")}


def _assert_same_store(a, b, rel=1e-5):
    one, other = xr.open_zarr(a), xr.open_zarr(b)
    for name in ("T", "U", "t2m", "SP"):
        x, y = one[name].values, other[name].values
        assert not np.isnan(x).any() and not np.isnan(y).any(), name
        scale = np.abs(x).max()
        assert np.abs(x - y).max() <= rel * scale, name


@pytest.mark.parametrize(
    "parallelism",
    [
        {"data": "fsdp2", "tensor": 1, "domain": 2},  # 2 dp groups: 3 initial times, a stand-in
        {"data": "none", "tensor": 2, "domain": 2},  # tp peers hold the same rows: one writes
        {"data": "none", "tensor": 1, "domain": {"lat": 2, "lon": 2}},  # tiles: rows x columns
    ],
    ids=["dp2_domain2", "tp2_domain2", "tiles_2x2"],
)
def test_store_at_4_ranks_equals_1_rank_and_opens_with_xarray(setup, parallelism):
    conf = _conf(setup["store"], parallelism=parallelism)
    q = parallelism["domain"]["lon"] if isinstance(parallelism["domain"], dict) else 1
    out = setup["root"] / f"four_{parallelism['data']}_{parallelism['tensor']}_{q}"
    results = run_on_ranks(_worker, 4, conf, _args(setup["conf"], setup["ckpt"], out), timeout=300)
    _assert_same_store(setup["one"] / "forecast.zarr", out / "forecast.zarr")
    ds = xr.open_zarr(out / "forecast.zarr")
    assert ds["T"].dims == ("init_time", "lead_time", "level", "latitude", "longitude")
    assert ds["t2m"].dims == ("init_time", "lead_time", "latitude", "longitude")
    assert ds["init_time"].dtype.kind == "M" and ds["lead_time"].dtype.kind == "m"
    assert list(ds["lead_time"].values) == [np.timedelta64(6 * k, "h") for k in range(1, 5)]
    assert [str(t)[:13] for t in ds["init_time"].values] == INITS
    assert ds["latitude"].values[0] == 90.0 and ds["latitude"].values[-1] == -90.0
    assert list(ds["level"].values) == [500.0, 850.0]
    assert ds["T"].attrs["units"] == "K" and ds["T"].attrs["standard_name"] == "air_temperature"
    assert ds["SP"].attrs["units"] == "Pa" and ds.attrs["Conventions"].startswith("CF")
    assert "tsi" in ds.attrs["config"] and ds.attrs["checkpoint"].endswith("step_00000001")
    assert ds.attrs["ema"] is False  # the training weights, not their moving average
    assert ds["complete"].values.tolist() == [1, 1, 1]
    # physical units: temperatures in kelvin, surface pressure in pascal
    assert 150 < float(ds["T"].min()) and float(ds["T"].max()) < 350
    assert 8e4 < float(ds["SP"].mean()) < 1.2e5
    # no two ranks wrote one chunk; tp/dp peers wrote nothing twice; every chunk was written
    owners: dict = {}
    for rank, result in enumerate(results):
        for chunk in result["written_chunks"]:
            owners.setdefault(tuple(chunk), set()).add(rank)
    assert all(len(ranks) == 1 for ranks in owners.values())
    # 9 / 8 rows in chunks of 5 (a quarter globe at most: 5 + 5 + 5 + 2, row 9 goes to rank 0);
    # on 2 x 2 tiles, 8 columns per chunk
    per_variable = len(INITS) * STEPS * 4 * q
    assert row_chunk_length(H, 2) == 5
    assert zarr.open_group(out / "forecast.zarr", mode="r")["T"].chunks[-2:] == (5, W // q)
    assert sum(1 for name, _ in owners if name == "T") == per_variable
    # scores: every rank of every layout has the same rows, equal to the one-process scores
    one = setup["one_result"]["scores"]
    for result in results:
        assert len(result["scores"]) == len(one) == 6 * STEPS
        for a, b in zip(result["scores"], one):
            assert (a["variable"], a["level"], a["lead_time_hours"]) == (
                b["variable"],
                b["level"],
                b["lead_time_hours"],
            )
            assert abs(a["rmse"] - b["rmse"]) <= 1e-5 * b["rmse"]
            assert abs(a["acc"] - b["acc"]) <= 1e-5


def test_uneven_rows_straddling_chunks_go_to_their_one_owner(setup):
    """17 rows over 4 ranks (5/4/4/4) in chunks of 5 (5 + 5 + 5 + 2): row 9 of rank 2 and rows
    13, 14 of rank 3 are written by the rank owning their chunk (a neighbour exchange)."""
    conf = _conf(setup["store"], parallelism={"data": "none", "tensor": 1, "domain": 4})
    out = setup["root"] / "straddle"
    args = _args(setup["conf"], setup["ckpt"], out, inits=INITS[:1], steps=2)
    results = run_on_ranks(_worker, 4, conf, args, timeout=300)
    group = zarr.open_group(out / "forecast.zarr", mode="r")
    assert group["T"].chunks[-2:] == (5, W) and group["SP"].chunks[-2:] == (5, W)
    rows = {r: {c[-2] for _, c in result["written_chunks"]} for r, result in enumerate(results)}
    assert rows == {0: {0}, 1: {1}, 2: {2}, 3: {3}}
    one = xr.open_zarr(setup["one"] / "forecast.zarr").isel(init_time=[0], lead_time=[0, 1])
    four = xr.open_zarr(out / "forecast.zarr")
    for name in ("T", "U", "t2m", "SP"):
        x, y = one[name].values, four[name].values
        assert not np.isnan(y).any(), name
        assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max(), name
    # the files on disk: one per chunk, none for a row of its own
    files = sorted(
        p.relative_to(out / "forecast.zarr" / "T")
        for p in (out / "forecast.zarr" / "T" / "c").rglob("*")
        if p.is_file()
    )
    assert len(files) == 2 * 4, files  # 2 leads x 4 row chunks


def test_resume_after_a_killed_rank_finishes_the_store(setup):
    conf = _conf(setup["store"], parallelism={"data": "none", "tensor": 1, "domain": 2})
    out = setup["root"] / "killed"
    args = _args(setup["conf"], setup["ckpt"], out)
    started = time.perf_counter()
    # rank 1 dies at the start of round 2: round 0 was marked complete while round 1 computed
    with pytest.raises(RankFailure, match="stops at round 2"):
        run_on_ranks(_worker, 2, conf, args, "1:2", timeout=120, pg_timeout=5)
    assert time.perf_counter() - started < 60  # the survivor stopped at its timeout, no hang
    ds = xr.open_zarr(out / "forecast.zarr")
    assert ds["complete"].values.tolist() == [1, 0, 0]  # what was complete stays intact
    first = ds["T"].isel(init_time=0).values
    args = _args(setup["conf"], setup["ckpt"], out, "--resume")
    results = run_on_ranks(_worker, 2, conf, args, timeout=300)
    assert results[0]["skipped"] == 1 and len(results[0]["computed"]) == 2
    _assert_same_store(setup["one"] / "forecast.zarr", out / "forecast.zarr")
    assert np.array_equal(xr.open_zarr(out / "forecast.zarr")["T"].isel(init_time=0).values, first)
    assert xr.open_zarr(out / "forecast.zarr")["complete"].values.tolist() == [1, 1, 1]
    # the scores cover every initial time: the skipped one is scored from the store
    one = setup["one_result"]["scores"]
    assert len(results[0]["scores"]) == len(one)
    for a, b in zip(results[0]["scores"], one):
        assert abs(a["rmse"] - b["rmse"]) <= 1e-5 * b["rmse"], (a, b)
        assert abs(a["acc"] - b["acc"]) <= 1e-5, (a, b)


def test_miles_credit_checkpoint_with_credit_domain_renames(setup):
    from miles_credit import import_credit

    convert = import_credit("credit.domain_parallel.convert")
    manager = import_credit("credit.domain_parallel.manager")
    torch.manual_seed(3)
    model = build_model(_model_conf(8))
    with fake_process_group(0, 2):
        converted = convert.convert_to_domain_parallel(model, manager.DomainParallelManager(2, 2))
    state = converted.state_dict()
    assert "stem.conv.conv.weight" in state  # CREDIT renamed the wrapped convs
    path = setup["root"] / "credit.pt"
    torch.save({"epoch": 1, "model_state_dict": state}, path)
    out = setup["root"] / "credit"
    run_forecast(_conf(setup["store"]), _args(setup["conf"], path, out), stream=io.StringIO())
    _assert_same_store(setup["one"] / "forecast.zarr", out / "forecast.zarr", rel=0.0)


def _cli(*argv, capsys):
    code = cli.main(["forecast", *map(str, argv), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    return code, err


BAD = {
    "not a time": (["--init-times", "2020-05-01T00"], "not a time of the dataset"),
    "history": (["--init-times", "2020-01-01T00"], "has no history"),
    "forcing": (["--init-times", "2020-01-10T12"], "no dynamic forcing for lead"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_initial_times_stop_with_one_line_and_no_store(setup, case, tmp_path, capsys):
    flags, message = BAD[case]
    conf = setup["root"] / "history2.yaml"
    data = _conf(setup["store"])
    data["data"]["history_len"] = 2
    conf.write_text(yaml.safe_dump(data))
    code, err = _cli(
        "--config", conf, "--checkpoint", setup["ckpt"], "--steps", 4, "--output", tmp_path / "o",
        *flags, capsys=capsys,
    )  # fmt: skip
    assert code != 0 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o" / "forecast.zarr").exists()


def test_checkpoint_of_another_model_names_the_keys(setup, tmp_path, capsys):
    code, err = _cli(
        "--config", setup["plain_conf"], "--checkpoint", setup["ckpt"], "--steps", 2,
        "--output", tmp_path / "o", "--init-times", INITS[0],
        "--parallelism", "data=none,tensor=1,domain=2", "--nproc", 2, capsys=capsys,
    )  # fmt: skip
    # found before any rank starts (the model on the meta device against the checkpoint's keys)
    assert code != 0 and "does not match the model" in err and "stem.conv.weight" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o" / "forecast.zarr").exists()


def test_existing_store_needs_resume_or_overwrite(setup, tmp_path, capsys):
    args = ["--config", setup["conf"], "--checkpoint", setup["ckpt"], "--steps", 2]
    args += ["--output", tmp_path / "o", "--init-times", INITS[0]]
    assert _cli(*args, capsys=capsys)[0] == 0
    before = xr.open_zarr(tmp_path / "o" / "forecast.zarr")["T"].values
    code, err = _cli(*args, capsys=capsys)
    assert code != 0 and "pass --resume to continue it or --overwrite" in err, err
    assert np.array_equal(xr.open_zarr(tmp_path / "o" / "forecast.zarr")["T"].values, before)
    assert _cli(*args, "--overwrite", capsys=capsys)[0] == 0
    code, err = _cli(*args[:-1], INITS[1], "--resume", capsys=capsys)
    assert code != 0 and "holds other initial times" in err, err


def test_layout_that_does_not_divide_the_world(setup, tmp_path, capsys):
    code, err = _cli(
        "--config", setup["conf"], "--checkpoint", setup["ckpt"], "--steps", 2,
        "--output", tmp_path / "o", "--init-times", INITS[0],
        "--parallelism", "data=none,tensor=1,domain=3", "--nproc", 4, capsys=capsys,
    )  # fmt: skip
    assert code != 0 and "domain" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_scores_beyond_the_data_score_what_exists_and_say_so(setup, tmp_path, capsys):
    # the store ends at 2020-01-10T18; from 2020-01-10T06 the truth covers leads 1 and 2 of 4
    code = cli.main(
        [
            "forecast", "--config", str(setup["plain_conf"]), "--checkpoint", str(setup["plain"]),
            "--steps", "4", "--output", str(tmp_path / "o"), "--init-times", "2020-01-10T06",
            "--device", "cpu",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "truth up to lead 2 of 4" in out, out
    rows = (tmp_path / "o" / "scores.csv").read_text().splitlines()
    assert rows[0].startswith("variable,level,lead_time_hours,rmse,acc")
    assert {r.split(",")[2] for r in rows[1:]} == {"6", "12"} or {
        float(r.split(",")[2]) for r in rows[1:]
    } == {6.0, 12.0}
    ds = xr.open_zarr(tmp_path / "o" / "forecast.zarr")
    assert not np.isnan(ds["T"].values).any()  # every lead is still forecast and written


@pytest.mark.parametrize("final", [True, False])
def test_training_writes_its_final_checkpoint_unless_turned_off(setup, tmp_path, final):
    from credit_parallel.train.main import run_training

    conf = _conf(setup["store"])
    conf["trainer"].update(steps=2, batch_size=2, checkpoint_every=0, validate_every=0)
    if not final:
        conf["trainer"]["final_checkpoint"] = False
    run_training(conf, tmp_path / "run", progress=False, stream=io.StringIO())
    found = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert found == (["step_00000002"] if final else [])


def test_members_spread_over_dp_groups_equal_one_process(setup, tmp_path):
    inits = INITS[:2]
    one = tmp_path / "one"
    single = run_forecast(
        _conf(setup["store"]),
        _args(setup["conf"], setup["ckpt"], one, "--members", "2", inits=inits, steps=2),
        stream=io.StringIO(),
    )
    conf = _conf(setup["store"], parallelism={"data": "ddp", "tensor": 1, "domain": 2})
    four = tmp_path / "four"
    args = _args(setup["conf"], setup["ckpt"], four, "--members", "2", inits=inits, steps=2)
    results = run_on_ranks(_worker, 4, conf, args, timeout=300)
    _assert_same_store(one / "forecast.zarr", four / "forecast.zarr")
    ds = xr.open_zarr(four / "forecast.zarr")
    assert ds["T"].dims == ("init_time", "member", "lead_time", "level", "latitude", "longitude")
    assert float(np.abs(ds["T"].isel(member=1) - ds["T"].isel(member=0)).max()) > 1e-3
    # each dp group ran one member: the two members of a row came from two ranks
    groups: dict = {}  # member -> the dp groups (rank // 2: dp outermost) that wrote it
    for rank, result in enumerate(results):
        for _, chunk in result["written_chunks"]:
            groups.setdefault(chunk[1], set()).add(rank // 2)
    assert groups == {0: {0}, 1: {1}}
    for result in results:
        for a, b in zip(result["scores"], single["scores"]):
            for key in ("rmse", "acc", "crps", "spread"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a, b)


def test_members_on_1x3_tiles_uneven_columns_equal_one_process(setup, tmp_path):
    inits = INITS[:2]
    one = tmp_path / "one"
    single = run_forecast(
        _conf(setup["store"]),
        _args(setup["conf"], setup["ckpt"], one, "--members", "2", inits=inits, steps=2),
        stream=io.StringIO(),
    )
    tiles = {"data": "none", "tensor": 1, "domain": {"lat": 1, "lon": 3}}  # 6 / 5 / 5 columns
    out = tmp_path / "tiles"
    args = _args(setup["conf"], setup["ckpt"], out, "--members", "2", inits=inits, steps=2)
    results = run_on_ranks(_worker, 3, _conf(setup["store"], parallelism=tiles), args, timeout=300)
    _assert_same_store(one / "forecast.zarr", out / "forecast.zarr")
    # 6 / 5 / 5 columns in chunks of 6 (6 + 6 + 4): column 11 of rank 2 goes to rank 1
    assert zarr.open_group(out / "forecast.zarr", mode="r")["T"].chunks[-2:] == (5, 6)
    columns: dict = {}  # rank -> the longitude chunks it wrote
    for rank, result in enumerate(results):
        for _, chunk in result["written_chunks"]:
            columns.setdefault(rank, set()).add(chunk[-1])
    assert columns == {0: {0}, 1: {1}, 2: {2}}
    # --resume of the complete store: every initial time scored from the tiles the store holds
    args = _args(
        setup["conf"], setup["ckpt"], out, "--members", "2", "--resume", inits=inits, steps=2
    )
    resumed = run_on_ranks(_worker, 3, _conf(setup["store"], parallelism=tiles), args, timeout=300)
    assert all(r["skipped"] == 2 and not r["computed"] for r in resumed)
    # scored from the float32 store: SP (~1e5 Pa, float32 steps of ~0.008 Pa) has a member
    # spread of ~0.5 Pa, so the spread and the CRPS of stored values agree to ~1e-3 of it only
    for result, rel in [(r, 1e-5) for r in results] + [(r, 1e-3) for r in resumed]:
        assert len(result["scores"]) == len(single["scores"])
        for a, b in zip(result["scores"], single["scores"]):
            assert abs(a["rmse"] - b["rmse"]) <= 1e-5 * b["rmse"], (a, b)
            assert abs(a["acc"] - b["acc"]) <= 1e-5, (a, b)
            for key in ("crps", "spread"):
                assert abs(a[key] - b[key]) <= rel * max(1.0, abs(b[key])), (key, a, b)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_plain_lines_in_batch_jobs_and_a_bar_on_a_terminal(setup, tmp_path):
    import re

    args = _args(setup["conf"], setup["ckpt"], tmp_path / "plain", inits=INITS[:1], steps=2)
    args.progress = True
    stream = io.StringIO()
    run_forecast(_conf(setup["store"]), args, stream=stream)
    number = r"[\d.e+-]+"
    line = rf"forecast init 2020-01-02T00:00 step (\d)/2 steps/s {number} writer_lag \d+ steps "
    line += rf"{number} s"
    assert [m.group(1) for m in re.finditer(line, stream.getvalue())] == ["1", "2"]
    lines = stream.getvalue().splitlines()
    # the first line: the writer's steps in flight, their host memory and the chunks; the last:
    # the write share of the loop and the writer's throughput
    assert re.fullmatch(
        r"forecast writer: 2 steps in flight, host buffers 2 x [\d.]+ MB \+ tensorstore's copies: "
        r"<= [\d.]+ MB per rank; chunks 5 rows x 16 columns, one writer each",
        lines[0],
    ), lines[0]
    assert re.search(r"writes on the critical path [\d.]+% \(writer \d+ MB/s\)", lines[-1])
    args = _args(setup["conf"], setup["ckpt"], tmp_path / "bar", inits=INITS[:1], steps=2)
    args.progress = True
    terminal = _Terminal()
    run_forecast(_conf(setup["store"]), args, stream=terminal)
    text = terminal.getvalue()
    assert "forecast:" in text and "2/2" in text and not re.search(line, text)


def test_parallelism_flag_overrides_the_config_before_the_world_is_checked(setup, tmp_path):
    conf = _conf(setup["store"], parallelism={"data": "fsdp2", "tensor": 2, "domain": 2})
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump(conf))
    argv = ["forecast", "--config", str(path), "--checkpoint", str(setup["ckpt"]), "--steps", "2"]
    argv += ["--output", str(tmp_path / "o"), "--init-times", INITS[0], "--device", "cpu"]
    assert cli.main([*argv, "--parallelism", "data=none,tensor=1,domain=1", "--nproc", "1"]) == 0
    assert xr.open_zarr(tmp_path / "o" / "forecast.zarr")["complete"].values.tolist() == [1]


_FREED_PROBE = """
import sys
import numpy as np
from credit_parallel.forecast.command import fix_mmap_threshold

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024

fixed = fix_mmap_threshold() if sys.argv[1] == "fixed" else None
np.ones(2**22, dtype=np.float32)  # 16 MiB mapped, freed: glibc's default threshold rises to it
before = rss_mib()
np.ones(2**22 - 1024, dtype=np.float32)  # a field a little smaller, touched, freed
print(fixed, rss_mib() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_fixed_mmap_threshold_returns_a_freed_field_to_the_system():
    import platform
    import subprocess
    import sys

    from credit_parallel.forecast.command import MMAP_THRESHOLD, fix_mmap_threshold

    assert fix_mmap_threshold(environ={"MALLOC_MMAP_THRESHOLD_": "65536"}) is None
    assert fix_mmap_threshold(environ={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}) is None
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    kept = {}
    for mode in ("default", "fixed"):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
        out = subprocess.run(
            [sys.executable, "-c", _FREED_PROBE, mode], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        threshold, grown = out.stdout.split()
        kept[mode] = float(grown)
        assert threshold == (str(MMAP_THRESHOLD) if mode == "fixed" else "None")
    # glibc's default keeps the freed 16 MiB in the heap; the fixed threshold unmaps it
    assert kept["default"] > 12 and kept["fixed"] < 2, kept
