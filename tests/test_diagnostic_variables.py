"""Output-only (diagnostic) variables end to end (``data.diagnostic_variables``, CREDIT's
``diagnostic`` group): the dataset lays them out as CREDIT's gen-2 target does (prognostic then
diagnostic per forecast step, never an input), normalised with their own statistics and read by
rows; the trainer's loss covers them and its rollout feeds back only the prognostic channels, at
domain 2 and dp 2 equal to one process (float64, 1e-10), a CREDIT CrossFormer with
``output_only_channels`` included; the forecast rollout and command write them, denormalised,
equal to a single-process rollout; ``credit_gen2_conf`` maps the group; a model whose outputs
do not count them is refused by name.
"""

from __future__ import annotations

import argparse
import io

import numpy as np
import pytest
import torch
import torch.distributed.tensor  # noqa: F401
import xarray as xr

from credit_parallel.data import ERA5Dataset, write_sample_dataset
from credit_parallel.data.store import default_stats_path
from credit_parallel.domain.rows import shard_range
from credit_parallel.forecast import rollout
from credit_parallel.layout.config import ParallelDims
from credit_parallel.layout.credit_gen2 import credit_gen2_conf
from credit_parallel.layout.run_config import DataConfig, RunConfig
from credit_parallel.models import build_model
from credit_parallel.parallel.composition import parallelize_dims
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.step import advance_state
from miles_credit import import_credit

__all__: list[str] = []

TOL = 1e-10
H, W = 17, 16  # 9 / 8 rows over two domain ranks, both poles


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("diag") / "s.zarr"
    return str(write_sample_dataset(path, n_times=24, nlat=H, nlon=W))


@pytest.fixture(scope="module")
def row_store(tmp_path_factory):
    """One row and one time per chunk, uncompressed: the bytes read are the bytes decoded."""
    path = tmp_path_factory.mktemp("diag_rows") / "s.zarr"
    return str(
        write_sample_dataset(
            path, n_times=8, nlat=H, nlon=W, time_chunk=1, lat_chunk=1, compress=False
        )
    )


# --------------------------------------------------------------------------- the dataset
_DATASET = {
    "upper_air_variables": ["T"],
    "levels": [500, 850],
    "diagnostic_variables": ["t2m", "SP"],
    "dynamic_forcing_variables": ["tsi"],
    "static_variables": ["orography"],
    "history_len": 2,
    "forecast_len": 2,
}


def _normalised(store, name, time, level=None):
    """One field of the store read by xarray, normalised by its statistics (float64)."""
    raw, stats = xr.open_zarr(store), xr.open_zarr(default_stats_path(store))
    field, stat = raw[name], stats[name]
    if time is not None:
        field = field.isel(time=time)
    if level is not None:
        field, stat = field.sel(level=level), stat.sel(level=level)
    mean, std = stat.values
    return (field.values.astype(np.float64) - mean) / std


def test_the_target_holds_prognostic_then_diagnostic_and_the_input_none(store):
    ds = ERA5Dataset(store, **_DATASET)
    assert (ds.n_diagnostic, ds.channels_per_step, ds.channels_out_per_step) == (2, 2, 4)
    assert ds.output_variable_names == ["T_500", "T_850", "t2m", "SP"]
    assert ds.channel_names_in == ["T_500@t-1", "T_850@t-1", "T_500@t", "T_850@t", "tsi@t"] + [
        "orography"
    ]
    assert ds.channel_names_out == [
        f"{n}@t+{k}" for k in (1, 2) for n in ("T_500", "T_850", "t2m", "SP")
    ]
    assert (ds.channels_in, ds.channels_out) == (6, 8)
    i = 3
    sample = ds[i]
    assert sample["x"].shape == (6, H, W) and sample["y"].shape == (8, H, W)
    want_x = [_normalised(store, "T", t, z) for t in (i, i + 1) for z in (500, 850)]
    want_x += [_normalised(store, "tsi", i + 1), _normalised(store, "orography", None)]
    want_y = [
        f
        for t in (i + 2, i + 3)
        for f in (
            _normalised(store, "T", t, 500),
            _normalised(store, "T", t, 850),
            _normalised(store, "t2m", t),
            _normalised(store, "SP", t),
        )
    ]
    for got, want in ((sample["x"], want_x), (sample["y"], want_y)):
        err = np.abs(got.numpy().astype(np.float64) - np.stack(want)).max()
        assert err <= 1e-6, err  # float64 normalised, rounded once to float32
    assert np.abs(sample["forcing"][0].numpy() - _normalised(store, "tsi", i + 2)).max() <= 1e-6
    # the statistics of the output channels, prognostic then diagnostic, as the store holds them
    stats = xr.open_zarr(default_stats_path(store))
    assert ds.output_mean[2] == float(stats["t2m"].values[0])
    assert ds.output_std[3] == float(stats["SP"].values[1])
    # read_steps: prognostic, diagnostic, forcing per time step; the forcing slice names them
    steps = ds.read_steps(i, i + 1)
    assert steps.shape == (1, 5, H, W) and ds.forcing_channels == slice(4, 5)
    # 5-D samples: the diagnostic channels after the surface ones of y_surface, none in x_surface
    five = ERA5Dataset(store, **_DATASET, as_5d=True)[i]
    assert five["y_upper"].shape == (2, 2, H, W) and five["y_surface"].shape == (4, H, W)
    assert torch.equal(five["y_surface"][2:], sample["y"][6:])
    assert five["x_surface"].shape == (2, H, W)  # tsi + orography


def test_each_rank_reads_only_its_rows_of_the_diagnostic_fields(row_store):
    whole = ERA5Dataset(row_store, **_DATASET, rows=(0, H), cache_limit_bytes=0)
    for rank in (0, 1):
        start, stop = shard_range(H, 2, rank)
        part = ERA5Dataset(row_store, **_DATASET, domain_shard=(rank, 2), cache_limit_bytes=0)
        part.reset_bytes_read()
        sample = part[2]
        window = part.history_len + part.forecast_len
        assert part.read_counter.chunk_bytes["t2m"] == window * (stop - start) * W * 4
        reference = whole[2]
        for key in ("x", "y", "forcing"):  # bitwise the rows of a whole-globe row read
            assert torch.equal(sample[key], reference[key][:, start:stop]), key


def test_diagnostic_variables_are_checked_by_kind(store):
    with pytest.raises(ValueError, match=r"diagnostic variable 'T' has dims"):
        ERA5Dataset(store, upper_air_variables=["U"], levels=[500], diagnostic_variables=["T"])
    with pytest.raises(ValueError, match=r"\['t2m'\] listed as more than one kind"):
        ERA5Dataset(store, surface_variables=["t2m"], diagnostic_variables=["t2m"])
    with pytest.raises(ValueError, match=r"diagnostic variable 'rain' is not in"):
        ERA5Dataset(store, surface_variables=["SP"], diagnostic_variables=["rain"])


# --------------------------------------------------------------------------- the state advance
def test_advance_state_feeds_back_only_the_prognostic_channels():
    g = torch.Generator().manual_seed(1)
    state = torch.randn(2, 2 * 3 + 1 + 1, 5, 4, generator=g)  # history 2 x 3, forcing, static
    out = torch.randn(2, 3 + 2, 5, 4, generator=g)  # 3 prognostic + 2 diagnostic
    forcing = torch.randn(2, 1, 5, 4, generator=g)
    (nxt,) = advance_state((state,), (out,), forcing, n_forcing=1, n_static=1, n_diagnostic=2)
    want = torch.cat([state[:, 3:6], out[:, :3], forcing, state[:, -1:]], dim=1)
    assert torch.equal(nxt, want)
    with pytest.raises(ValueError, match="no prognostic channel"):
        advance_state((state,), (out[:, :2],), forcing, n_forcing=1, n_static=1, n_diagnostic=2)


def test_advance_state_of_a_5d_model_drops_the_diagnostics_of_its_surface_output():
    g = torch.Generator().manual_seed(2)
    upper, surface = (
        torch.randn(1, 3, 2, 5, 4, generator=g),
        torch.randn(1, 2 + 1, 5, 4, generator=g),
    )
    out_upper, out_surface = (
        torch.randn(1, 3, 2, 5, 4, generator=g),
        torch.randn(1, 2 + 1, 5, 4, generator=g),
    )
    nxt = advance_state((upper, surface), (out_upper, out_surface), n_static=1, n_diagnostic=1)
    assert torch.equal(nxt[0], out_upper)  # history 1: the prediction itself
    assert torch.equal(nxt[1], torch.cat([out_surface[:, :2], surface[:, 2:]], dim=1))


# --------------------------------------------------------------------------- training
def _unet_conf(store, parallelism, **trainer):
    return {
        "model": {
            "type": "unet",
            "in_channels": 2 * 5 + 1 + 1,  # history 2 x (T, U at 2 levels + SP), tsi, orography
            "out_channels": 5 + 1,  # + the diagnostic t2m
            "image_height": H,
            "image_width": W,
            "base_channels": 4,
            "channel_mults": [1, 2],
            "norm_groups": 2,
        },
        "data": {
            "path": store,
            "upper_air_variables": ["T", "U"],
            "surface_variables": ["SP"],
            "diagnostic_variables": ["t2m"],
            "levels": [500, 850],
            "history_len": 2,
            "forecast_len": 2,
            "dynamic_forcing_variables": ["tsi"],
            "static_variables": ["orography"],
            "time_slice": [0, 20],
            "num_workers": 0,
        },
        "trainer": {
            "parallelism": parallelism,
            "steps": 3,
            "batch_size": 2,
            "lr": 0.01,
            "seed": 5,
            "dtype": "float64",
            "dist_timeout_s": 60,
            **trainer,
        },
    }


def _params(trainer) -> dict:
    out = {}
    for name, p in trainer.model.named_parameters():
        t = p.detach()
        out[name] = (
            t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t
        ).clone()
    return out


def _train(conf, steps):
    from credit_parallel.train.trainer import Trainer

    trainer = Trainer(conf)
    records = [trainer.train_step() for _ in range(steps)]
    result = (records, _params(trainer), trainer.step_fn.n_diagnostic)
    trainer.close()
    return result


def _train_worker(rank, world, conf, steps):
    return _train(conf, steps)


def _assert_same_run(got, want):
    (records, params, n_diag), (ref_records, ref_params, _) = got, want
    assert n_diag == 1
    for r, ref in zip(records, ref_records, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(r[key] - ref[key]) <= TOL, (r["step"], key, r[key], ref[key])
    assert params.keys() == ref_params.keys()
    worst = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
    assert worst <= TOL, worst


def test_training_with_diagnostics_at_domain_2_equals_one_process(store):
    one = {"data": "none", "tensor": 1, "domain": 1}
    want = _train(_unet_conf(store, one), 3)
    assert want[0][1]["loss"] != want[0][0]["loss"]  # the weights moved
    got = run_on_ranks(
        _train_worker,
        2,
        _unet_conf(store, {"data": "none", "tensor": 1, "domain": 2}),
        3,
        timeout=240,
    )
    for result in got:
        _assert_same_run(result, want)


def test_training_with_diagnostics_at_dp_2_equals_one_process(store):
    """FSDP2 over 2 dp ranks, 1 sample per micro-batch x 2: the global batch of 4."""
    one = {"data": "none", "tensor": 1, "domain": 1}
    want = _train(_unet_conf(store, one, batch_size=4), 2)
    conf = _unet_conf(
        store, {"data": "fsdp2", "tensor": 1, "domain": 1}, batch_size=1, grad_accum=2
    )
    for result in run_on_ranks(_train_worker, 2, conf, 2, timeout=240):
        _assert_same_run(result, want)


def test_the_loss_covers_the_diagnostic_channels(store):
    """Changing only a diagnostic target changes the loss: it is in the loss."""
    from credit_parallel.train.trainer import Trainer

    trainer = Trainer(_unet_conf(store, {"data": "none", "tensor": 1, "domain": 1}))
    batch = {k: v.double() for k, v in next(iter(trainer.loader)).items() if k != "time_index"}
    assert batch["y"].shape[1] == 2 * 6
    base, _ = trainer.step_fn.forward_backward(batch)
    batch["y"][:, 5] += 1.0  # the diagnostic channel of forecast step 1
    shifted, _ = trainer.step_fn.forward_backward(batch)
    assert float(shifted - base) > 1e-3
    # validation names every output channel, the diagnostic one included, at both leads; the
    # climatology of its ACC holds the diagnostic channel too (normalised by its statistics)
    climatology = trainer.use_training_climatology()
    assert climatology.shape == (6, H, W)
    metrics = trainer.evaluate()
    names = ["T_500", "T_850", "U_500", "U_850", "SP", "t2m"]
    assert sorted(metrics) == sorted(
        f"{score}{lead}/{n}" for score in ("rmse", "acc") for lead in ("", "@t+2") for n in names
    )
    raw, stats = xr.open_zarr(store)["t2m"], xr.open_zarr(default_stats_path(store))["t2m"]
    mean, std = stats.values
    want = (raw.isel(time=slice(0, 20)).values.astype(np.float64).mean(axis=0) - mean) / std
    assert np.abs(climatology[5].numpy() - want).max() <= 1e-5
    trainer.close()


def test_a_model_that_does_not_output_the_diagnostics_is_refused_by_name(store):
    from credit_parallel.train.preflight import validate_run

    conf = _unet_conf(store, {"data": "none", "tensor": 1, "domain": 1})
    conf["model"]["out_channels"] = 5
    problems = " ".join(validate_run(conf, 1))
    assert "output per sample (5, 17, 16) does not match" in problems, problems
    assert "(5 prognostic + 1 diagnostic: data.diagnostic_variables)" in problems, problems
    assert "set model.out_channels: 6" in problems, problems


def _pangu_conf(store, parallelism, output_only=1):
    """A 5-D run: Pangu3D on T, U (2 levels) and SP, t2m predicted after SP in y_surface."""
    return {
        "model": {
            "type": "pangu",
            "upper_channels": 2,
            "surface_channels": 1,
            "output_only_channels": output_only,
            "levels": 2,
            "image_height": 16,
            "image_width": 16,
            "dim": 8,
        },
        "data": {
            "path": store,
            "upper_air_variables": ["T", "U"],
            "surface_variables": ["SP"],
            "diagnostic_variables": ["t2m"],
            "levels": [500, 850],
            "forecast_len": 2,
            "as_5d": True,
            "time_slice": [0, 12],
            "num_workers": 0,
        },
        "trainer": {
            "parallelism": parallelism,
            "steps": 2,
            "batch_size": 2,
            "lr": 0.01,
            "seed": 5,
            "dtype": "float64",
            "dist_timeout_s": 60,
        },
    }


@pytest.fixture(scope="module")
def store16(tmp_path_factory):
    path = tmp_path_factory.mktemp("diag16") / "s.zarr"
    return str(write_sample_dataset(path, n_times=12, nlat=16, nlon=16))


def test_a_5d_model_with_diagnostics_trains_at_domain_2_as_on_one_process(store16):
    """Pangu3D's ``output_only_channels``: the surface output carries the diagnostic t2m, the
    two-step rollout feeds back only T, U and SP."""
    from credit_parallel.train.preflight import validate_run

    want = _train(_pangu_conf(store16, {"data": "none", "tensor": 1, "domain": 1}), 2)
    conf = _pangu_conf(store16, {"data": "none", "tensor": 1, "domain": 2})
    for result in run_on_ranks(_train_worker, 2, conf, 2, timeout=240):
        _assert_same_run(result, want)
    bad = _pangu_conf(store16, {"data": "none", "tensor": 1, "domain": 1}, output_only=0)
    problems = " ".join(validate_run(bad, 1))
    assert "target (2, 16, 16) (1 prognostic + 1 diagnostic" in problems, problems
    assert "set model.output_only_channels: 1" in problems, problems


# --------------------------------------------------------------------------- CREDIT's gen-2 schema
def _credit_conf(store, parallelism, *, diagnostic=("t2m",), output_only=1) -> dict:
    """A miles-credit gen-2 config (the 0.25-degree example's schema) on the sample store, its
    CrossFormer tiny: prognostic T, U (2 levels) and SP, diagnostic t2m, forcing, static."""
    groups = {
        "prognostic": {"vars_3D": ["T", "U"], "vars_2D": ["SP"], "path": store},
        "dynamic_forcing": {"vars_2D": ["tsi"], "path": store},
        "static": {"vars_2D": ["orography"], "path": store},
    }
    if diagnostic:
        groups["diagnostic"] = {"vars_2D": list(diagnostic), "path": store}
    return {
        "seed": 7,
        "data": {
            "source": {
                "ERA5": {"level_coord": "level", "levels": [500.0, 850.0], "variables": groups}
            },
            "start_datetime": "2020-01-01",
            "end_datetime": "2020-01-03T18",
            "timestep": "6h",
            "history_len": 1,
            "forecast_len": 1,
            "scaler_type": "std_new",
        },
        "trainer": {
            "learning_rate": 1e-3,
            "train_batch_size": 2,
            "grad_max_norm": 1.0,
            "thread_workers": 0,
            "use_scheduler": False,
            "steps": 2,
            "dtype": "float64",
            "parallelism": parallelism,
        },
        "model": {
            "type": "crossformer",
            "frames": 1,
            "image_height": 32,
            "image_width": 32,
            "levels": 2,
            "channels": 2,
            "surface_channels": 1,
            "input_only_channels": 2,
            "output_only_channels": output_only,
            "patch_width": 1,
            "patch_height": 1,
            "frame_patch_size": 1,
            "dim": [4, 8, 16, 32],
            "depth": [1, 1, 1, 1],
            "dim_head": 4,
            "global_window_size": [2, 2, 2, 1],
            "local_window_size": 2,
            "cross_embed_kernel_sizes": [[2, 4], [2, 4], [2, 4], [2, 4]],
            "cross_embed_strides": [2, 2, 2, 2],
            "interp": False,
            "padding_conf": {"activate": False},
        },
        "loss": {"training_loss": "mse", "use_latitude_weights": True},
    }


@pytest.fixture(scope="module")
def credit_store(tmp_path_factory):
    import_credit("credit.trainers.utils")  # miles-credit's inject_flat_var_keys
    import_credit("credit.models.crossformer")
    path = tmp_path_factory.mktemp("diag_credit") / "s.zarr"
    return str(write_sample_dataset(path, n_times=16, nlat=32, nlon=32))


def test_credit_gen2_conf_maps_the_diagnostic_group(credit_store):
    one = {"data": "none", "tensor": 1, "domain": 1}
    conf = _credit_conf(credit_store, one, diagnostic=("t2m", "SP"))
    conf["data"]["source"]["ERA5"]["variables"]["prognostic"]["vars_2D"] = []
    mapped = credit_gen2_conf(conf)
    assert mapped["data"]["diagnostic_variables"] == ["t2m", "SP"]
    run = RunConfig.from_conf(conf)
    assert run.data.diagnostic_variables == ("t2m", "SP")
    assert run.data.surface_variables == () and run.data.upper_air_variables == ("T", "U")
    # no group: no diagnostic variables
    assert (
        credit_gen2_conf(_credit_conf(credit_store, one, diagnostic=()))["data"][
            "diagnostic_variables"
        ]
        == []
    )
    # 3-D diagnostics are named, not dropped
    bad = _credit_conf(credit_store, one)
    bad["data"]["source"]["ERA5"]["variables"]["diagnostic"]["vars_3D"] = ["V"]
    with pytest.raises(ValueError, match=r"diagnostic\.vars_3D \['V'\]: only 2-D diagnostic"):
        credit_gen2_conf(bad)
    # the one parser names a bad value of the key
    with pytest.raises(ValueError, match=r"data\.diagnostic_variables must be a list of names"):
        DataConfig.from_conf({"data": {"diagnostic_variables": "t2m"}})


def test_credit_model_without_output_only_channels_is_refused_by_name(credit_store):
    from credit_parallel.train.preflight import validate_run

    conf = _credit_conf(credit_store, {"data": "none", "tensor": 1, "domain": 1}, output_only=0)
    problems = " ".join(validate_run(conf, 1))
    assert "set model.output_only_channels: 1 (the diagnostic channels)" in problems, problems
    assert "5 prognostic + 1 diagnostic" in problems, problems


def _credit_worker(rank, world, conf):
    return _train(conf, 2)


@pytest.mark.slow  # 21-51 s on the shared 2-core machine (CREDIT's model built whole per rank)
def test_credit_crossformer_with_diagnostics_trains_at_domain_2_as_on_one_process(credit_store):
    want = _train(_credit_conf(credit_store, {"data": "none", "tensor": 1, "domain": 1}), 2)
    assert want[0][1]["loss"] != want[0][0]["loss"]
    conf = _credit_conf(credit_store, {"data": "none", "tensor": 1, "domain": 2})
    for result in run_on_ranks(_credit_worker, 2, conf, timeout=300):
        _assert_same_run(result, want)


# --------------------------------------------------------------------------- forecasts
PROG, DIAG, STEPS = 3, 2, 3
C_IN = PROG + 1 + 1  # history 1 x prognostic, forcing, static
_FORECAST_UNET = {
    "type": "unet",
    "in_channels": C_IN,
    "out_channels": PROG + DIAG,
    "image_height": H,
    "image_width": W,
    "base_channels": 4,
    "channel_mults": [1, 2],
    "norm_groups": 2,
}


def _forecast_inputs():
    g = torch.Generator().manual_seed(4)
    state = torch.randn(2, C_IN, H, W, generator=g, dtype=torch.float64)
    forcing = [torch.randn(2, 1, H, W, generator=g, dtype=torch.float64) for _ in range(STEPS)]
    return state, forcing


def _forecast_model():
    torch.manual_seed(0)
    return build_model(_FORECAST_UNET).double()


def _forecast_reference():
    """The rollout written out on one process: only the prognostic channels fed back."""
    model = _forecast_model().eval()
    x, forcing = _forecast_inputs()
    outs = []
    with torch.no_grad():
        for k in range(STEPS):
            y = model(x)
            outs.append(y)
            x = torch.cat([y[:, :PROG], forcing[min(k + 1, STEPS - 1)], x[:, -1:]], dim=1)
    return outs


def _rollout_worker(rank, world):
    dims = ParallelDims.from_conf({"trainer": {"parallelism": {"domain": 2}}})
    model = parallelize_dims(_forecast_model(), dims)
    start, stop = shard_range(H, 2, rank)
    x, forcing = _forecast_inputs()
    outs = rollout(
        model,
        x[:, :, start:stop],
        STEPS,
        forcing=lambda k: forcing[k][:, :, start:stop],
        n_static=1,
        n_diagnostic=DIAG,
    )
    return (start, stop), [o[0].clone() for o in outs]


def test_rollout_with_diagnostics_at_domain_2_equals_one_process():
    reference = _forecast_reference()
    assert reference[0].shape[1] == PROG + DIAG
    assert (reference[2][:, PROG:] - reference[1][:, PROG:]).abs().max() > 1e-3
    for (start, stop), outs in run_on_ranks(_rollout_worker, 2, timeout=240):
        for k, out in enumerate(outs):
            err = (out - reference[k][:, :, start:stop]).abs().max().item()
            assert err <= TOL, (k, start, err)


def _command_conf(store, parallelism) -> dict:
    return {
        # T (2 levels) + SP prognostic, tsi, orography in; + the diagnostic t2m out
        "model": {**_FORECAST_UNET, "in_channels": 3 + 1 + 1, "out_channels": 3 + 1},
        "data": {
            "path": store,
            "upper_air_variables": ["T"],
            "surface_variables": ["SP"],
            "diagnostic_variables": ["t2m"],
            "levels": [500, 850],
            "history_len": 1,
            "dynamic_forcing_variables": ["tsi"],
            "static_variables": ["orography"],
            "time_slice": [0, 16],
            "num_workers": 0,
        },
        "trainer": {"parallelism": parallelism, "seed": 3, "dtype": "float64"},
    }


def _command_args(checkpoint, output):
    from credit_parallel.forecast.command import build_arguments

    ap = argparse.ArgumentParser()
    build_arguments(ap)
    args = ap.parse_args(
        [
            "--config", "unused.yaml", "--checkpoint", str(checkpoint), "--steps", str(STEPS),
            "--output", str(output), "--init-times", "2020-01-02T00", "2020-01-03T06",
        ]
    )  # fmt: skip
    args.progress = False
    return args


def _command_worker(rank, world, conf, args):
    from credit_parallel.forecast.command import run_forecast

    return run_forecast(conf, args, stream=io.StringIO())["scores"]


def _by_hand(store, conf, checkpoint_model, init_position: int) -> list[np.ndarray]:
    """The diagnostic t2m of each lead, physical units: one process, the whole globe, written
    out (input, prognostic feedback, forcing of each lead, denormalisation)."""
    data = {k: v for k, v in conf["data"].items() if k not in ("time_slice", "num_workers")}
    path = data.pop("path")
    ds = ERA5Dataset(path, **data)
    steps = ds.read_steps(init_position, init_position + 1)
    x = ds.compose_input(steps)["x"].double().unsqueeze(0)
    mean, std = ds.output_mean, ds.output_std
    fields = []
    with torch.no_grad():
        for k in range(1, STEPS + 1):
            y = checkpoint_model(x)
            fields.append(y[0, ds.channels_per_step].numpy() * std[3] + mean[3])
            forcing = ds.read_steps(init_position + k, init_position + k + 1)[
                0, ds.forcing_channels
            ]
            forcing = torch.from_numpy(forcing).double().unsqueeze(0)
            x = torch.cat([y[:, : ds.channels_per_step], forcing, x[:, -1:]], dim=1)
    return fields


def test_forecast_writes_the_diagnostic_fields_equal_to_one_process(store, tmp_path):
    from credit_parallel.forecast.command import run_forecast
    from credit_parallel.train.checkpoint import save_checkpoint

    conf = _command_conf(store, {"data": "none", "tensor": 1, "domain": 1})
    torch.manual_seed(3)
    model = build_model(conf["model"])
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model)
    one = run_forecast(conf, _command_args(checkpoint, tmp_path / "one"), stream=io.StringIO())
    conf2 = _command_conf(store, {"data": "none", "tensor": 1, "domain": 2})
    two = run_on_ranks(
        _command_worker, 2, conf2, _command_args(checkpoint, tmp_path / "two"), timeout=300
    )
    a = xr.open_zarr(tmp_path / "one" / "forecast.zarr")
    b = xr.open_zarr(tmp_path / "two" / "forecast.zarr")
    assert a["t2m"].dims == ("init_time", "lead_time", "latitude", "longitude")
    assert set(a.data_vars) >= {"T", "SP", "t2m"}
    for name in ("T", "SP", "t2m"):
        x, y = a[name].values, b[name].values
        assert not np.isnan(x).any()
        assert np.abs(x - y).max() <= 1e-6 * np.abs(x).max(), name
    # the stored diagnostic is the denormalised prediction of a rollout written out by hand
    hand = _by_hand(store, conf, model.double().eval(), 4)  # 2020-01-02T00 is position 4
    for k, field in enumerate(hand):
        stored = a["t2m"].values[0, k].astype(np.float64)
        assert np.abs(stored - field).max() <= 1e-5 * np.abs(field).max(), k
    assert 150 < float(a["t2m"].min()) and float(a["t2m"].max()) < 350  # kelvin, not z-scores
    # scored like a surface variable, the same at 2 ranks
    rows = [r for r in one["scores"] if r["variable"] == "t2m"]
    assert len(rows) == STEPS and all(r["level"] is None for r in rows)
    for got in two:
        for r, w in zip(got, one["scores"], strict=True):
            assert r["variable"] == w["variable"] and abs(r["rmse"] - w["rmse"]) <= 1e-8 * w["rmse"]
