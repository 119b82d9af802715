"""The ``credit-parallel`` command line: help, one-line errors, plan, sample-data, and two
end-to-end runs through torchrun (``train --nproc 2`` and ``verify --nproc 2``).

Most cases call ``cli.main`` in this process (fast); the two launches run the console entry as
a subprocess, since torchrun starts its own worker processes either way.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest
import yaml

import credit_parallel
from credit_parallel import cli
from credit_parallel.data import ERA5Dataset, write_sample_dataset
from sample_conf import tiny_unet_conf

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(credit_parallel.__file__)))

__all__: list[str] = []

COMMANDS = ["train", "forecast", "verify", "plan", "sample-data", "bench", "mesh-demo"]
H, W = 17, 32


def _tiny_conf(store, parallelism):
    trainer = {
        "parallelism": parallelism,
        "steps": 5,
        "batch_size": 2,
        "lr": 0.01,
        "dist_timeout_s": 60,
    }
    return tiny_unet_conf(store, H, W, time_slice=[0, 20], trainer=trainer)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    store = write_sample_dataset(root / "s.zarr", n_times=24, nlat=H, nlon=W)
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(_tiny_conf(store, {"data": "none", "tensor": 1, "domain": 2})))
    return path


def _error_line(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, f"expected ONE line on stderr, got:\n{err}"
    return err


def _subprocess(args, cwd):
    # the subprocess imports the credit_parallel under test, whatever PYTHONPATH says
    path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-m", "credit_parallel.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


# --------------------------------------------------------------------------- help
@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_exits_zero(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: credit-parallel" in out
    if command is None:
        assert all(c in out for c in COMMANDS)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("command", ["train", "verify", "plan"])
def test_missing_config_file_exits_nonzero_naming_the_path(command, tmp_path, capsys):
    missing = str(tmp_path / "nowhere.yaml")
    extra = ["--world-size", "2"] if command == "plan" else []
    assert cli.main([command, "--config", missing, *extra]) != 0
    err = _error_line(capsys)
    assert "not found" in err and missing in err


@pytest.mark.parametrize("command", ["train", "verify", "plan"])
def test_invalid_yaml_exits_nonzero_naming_file_and_line(command, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  type: unet\n  channel_mults: [1, 2\ntrainer: {}\n")
    extra = ["--world-size", "2"] if command == "plan" else []
    assert cli.main([command, "--config", str(bad), *extra]) != 0
    err = _error_line(capsys)
    assert "invalid YAML" in err and str(bad) in err and "line" in err


@pytest.mark.parametrize("command", ["train", "verify"])
def test_layout_that_does_not_fit_nproc_exits_nonzero_naming_the_keys(
    command, tiny_config, tmp_path, capsys
):
    conf = yaml.safe_load(tiny_config.read_text())
    conf["trainer"]["parallelism"] = {"data": "none", "tensor": 2, "domain": 1}
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(conf))
    assert cli.main([command, "--config", str(path), "--nproc", "3"]) != 0
    err = _error_line(capsys)
    assert "3" in err and "trainer.parallelism.tensor" in err and "not divisible" in err


def test_train_with_missing_data_store_names_data_path(tiny_config, tmp_path, capsys):
    conf = yaml.safe_load(tiny_config.read_text())
    conf["data"]["path"] = str(tmp_path / "absent.zarr")
    path = tmp_path / "nodata.yaml"
    path.write_text(yaml.safe_dump(conf))
    assert cli.main(["train", "--config", str(path), "--nproc", "2"]) != 0
    err = _error_line(capsys)
    assert "data.path" in err and "absent.zarr" in err and "sample-data" in err
    for many in (str(tmp_path / "absent_*.zarr"), [str(tmp_path / "absent.zarr")]):
        conf["data"]["path"] = many  # a glob or a list: no demo data to offer
        path.write_text(yaml.safe_dump(conf))
        assert cli.main(["train", "--config", str(path), "--nproc", "2"]) != 0
        err = _error_line(capsys)
        assert "absent" in err and "sample-data" not in err


# --------------------------------------------------------------------------- plan, sample-data
def test_plan_demo_world_size_8_prints_every_rank(capsys):
    assert cli.main(["plan", "--config", "demo", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(
        i for i, line in enumerate(lines) if line.split()[:4] == ["rank", "dp", "tp", "domain"]
    )
    rows = [line.split() for line in lines[header + 1 : header + 9]]
    # the demo layout {fsdp2, tensor 2, domain 2}: rank g has domain g % 2, tp g // 2 % 2, dp g // 4
    assert [r[:4] for r in rows] == [
        [str(g), str(g // 4), str(g // 2 % 2), str(g % 2)] for g in range(8)
    ]
    assert "world size 8" in out


def test_sample_data_writes_a_readable_store(tmp_path, capsys):
    out = tmp_path / "sample.zarr"
    argv = ["sample-data", "--output", str(out), "--times", "6", "--nlat", "9", "--nlon", "8"]
    assert cli.main(argv) == 0
    assert "wrote sample dataset" in capsys.readouterr().out
    ds = ERA5Dataset(out, upper_air_variables=["T"], surface_variables=["SP"])
    assert ds.grid_shape == (9, 8) and len(ds) == 5
    assert ds[0]["x"].shape == (ds.channels_in, 9, 8)


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow  # 25 s alone, 58 s in the whole suite on the loaded 2-core machine
def test_train_nproc_2_domain_2_writes_metrics_and_loss_curve(tiny_config, tmp_path):
    out = tmp_path / "run"
    result = _subprocess(
        ["train", "--config", str(tiny_config), "--nproc", "2", "--output", str(out)], tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["step"] for r in metrics["train"]] == [1, 2, 3, 4, 5]
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "over 5 steps" in result.stdout


def test_verify_nproc_2_prints_a_passing_table(tiny_config, tmp_path):
    result = _subprocess(["verify", "--config", str(tiny_config), "--nproc", "2"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout
    assert "verify: layout" in table and "'domain': 2" in table
    # the default table: output, input gradient, ONE row for every parameter gradient
    quantities = [
        line for line in table.splitlines() if line.startswith(("output", "input grad", "grad"))
    ]
    assert [q.split()[0] for q in quantities] == ["output", "input", "grad:"]
    assert all(line.rstrip().endswith("PASS") for line in quantities)
    (grads,) = [q for q in quantities if q.startswith("grad:")]
    n = int(grads.split()[1])  # "grad: N parameters, worst NAME ..."
    assert n > 10 and f"{n + 2} passed, 0 failed" in table and "--all lists every row" in table
    assert "FAIL" not in table


def test_verify_all_hands_the_flag_to_the_ranks(tiny_config, monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "_run_worker", lambda module, n, extra, conf: seen.append(extra) or 0)
    monkeypatch.setattr(cli, "_choose_device", lambda args, n: "cpu")
    assert cli.main(["verify", "--config", str(tiny_config), "--nproc", "2", "--all"]) == 0
    assert cli.main(["verify", "--config", str(tiny_config), "--nproc", "2"]) == 0
    assert "--all" in seen[0] and "--all" not in seen[1]
