"""The forecast of a run normalised by CREDIT's pre- and postblocks, against miles-credit's own
block classes.

A run's ``data.bridgescaler`` chain here: ``log_transform`` on the dynamic forcing (inputs only),
``sqrt_transform`` on ``t2m``, a standard ``bridgescaler_transform`` fitted by miles-credit's own
preblock on the store; postblocks: the bridgescaler inverse, ``square_transform``.  The store
``credit-parallel forecast`` writes (one process, and domain 2 on 13 uneven rows) holds, at each
lead, CREDIT's postblocks (``credit.postblock.scaler.BridgeScalerTransform``, ``SquareTransform``)
applied to the model's output, where the model's input is CREDIT's preblocks
(``credit.preblock.log.LogTransform``, ``sqrt.SqrtTransform``, ``scaler.BridgeScalerTransform``)
applied to the raw initial state and, at lead 2, to the raw forcing.  The training climatology
of ``Trainer.use_training_climatology`` is CREDIT's target preblocks on the raw time mean.
"""

from __future__ import annotations

import argparse
import io
import warnings

import numpy as np
import pytest
import torch
import xarray as xr
import yaml

from credit_parallel.data import ERA5Dataset, write_sample_dataset
from credit_parallel.data.bridgescaler_blocks import SampleLayout
from credit_parallel.forecast.command import build_arguments, run_forecast
from credit_parallel.models import build_model
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.checkpoint import save_checkpoint
from miles_credit import import_credit

H, W = 13, 16  # 7 / 6 rows over two domain ranks
UPPER, SURFACE, LEVELS = ["T", "U"], ["SP", "t2m"], [500, 850]
FORCING, STATIC = ["tsi"], ["orography"]
INIT, STEPS = "2020-01-02T00", 2
TSI, T2M = "ERA5/dynamic_forcing/2d/tsi", "ERA5/prognostic/2d/t2m"
PROGNOSTIC = ["ERA5/prognostic"]


def _model_conf():
    return {
        "type": "unet",
        "in_channels": 8,  # T, U at 2 levels, SP, t2m, tsi, orography
        "out_channels": 6,
        "image_height": H,
        "image_width": W,
        "base_channels": 4,
        "channel_mults": [1, 2],
        "norm_groups": 2,
    }


def _spec(scaler: str) -> dict:
    return {
        "source": "ERA5",
        "pre": [
            {"type": "log_transform", "variables": [TSI], "data_types": ["input"]},
            {"type": "sqrt_transform", "variables": [T2M]},
            {
                "type": "bridgescaler_transform",
                "scaler_path": scaler,
                "method": "transform",
                "variables": PROGNOSTIC,
                "spatial_variables": [],
            },
        ],
        "post": [
            {
                "type": "bridgescaler_transform",
                "scaler_path": scaler,
                "method": "inverse_transform",
                "variables": PROGNOSTIC,
                "spatial_variables": [],
                "key": "y_processed",
            },
            {"type": "square_transform", "variables": [T2M], "key": "y_processed"},
        ],
    }


def _raw(store) -> ERA5Dataset:
    return ERA5Dataset(
        store,
        UPPER,
        SURFACE,
        levels=LEVELS,
        dynamic_forcing_variables=FORCING,
        static_variables=STATIC,
        normalize=False,
    )


def _nested(flat: torch.Tensor, slots) -> dict:
    """CREDIT's ``{source: {key: (B, levels, 1, H, W)}}`` of a flat ``(B, C, H, W)`` tensor."""
    return {"ERA5": {s.key: flat[:, s.start : s.start + s.width, None] for s in slots}}


def _flat(nested: dict, slots) -> torch.Tensor:
    return torch.cat([nested["ERA5"][s.key][:, :, 0] for s in slots], dim=1)


def _fit(raw: ERA5Dataset, path) -> str:
    """A standard scaler fitted by miles-credit's own preblock on the raw samples."""
    from bridgescaler import save_scaler_dict

    scaler = import_credit("credit.preblock.scaler").BridgeScalerTransform
    layout = SampleLayout(raw, "ERA5")
    block = scaler(str(path), [], scaler_type="standard", scaler_params={"channels_last": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(0, 8, 4):
            x = torch.stack([raw[j]["x"] for j in range(i, i + 4)])
            y = torch.stack([raw[j]["y"] for j in range(i, i + 4)])
            batch = {
                "input": _nested(x, layout.input_slots),
                "target": _nested(y, layout.output_slots),
            }
            block.fit_scaler_batch(batch)
    save_scaler_dict(block.scaler, str(path))
    return str(path)


def _conf(store, scaler, parallelism=None) -> dict:
    return {
        "model": _model_conf(),
        "data": {
            "path": str(store),
            "upper_air_variables": UPPER,
            "surface_variables": SURFACE,
            "levels": LEVELS,
            "dynamic_forcing_variables": FORCING,
            "static_variables": STATIC,
            "time_slice": [0, 12],
            "num_workers": 0,
            "bridgescaler": _spec(scaler),
        },
        "trainer": {
            "parallelism": parallelism or {"data": "none", "tensor": 1, "domain": 1},
            "seed": 3,
            "dtype": "float64",
            "dist_timeout_s": 30,
        },
    }


def _args(conf_path, checkpoint, output):
    ap = argparse.ArgumentParser()
    build_arguments(ap)
    argv = ["--config", str(conf_path), "--checkpoint", str(checkpoint), "--steps", str(STEPS)]
    args = ap.parse_args([*argv, "--output", str(output), "--init-times", INIT])
    args.progress = False
    return args


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("forecast_bridgescaler")
    store = str(write_sample_dataset(root / "s.zarr", n_times=16, nlat=H, nlon=W))
    raw = _raw(store)
    scaler = _fit(raw, root / "scaler.json")
    torch.manual_seed(3)
    model = build_model(_model_conf()).to(torch.float64)
    checkpoint = save_checkpoint(root / "ckpt", 1, model)
    conf = _conf(store, scaler)
    conf_path = root / "conf.yaml"
    conf_path.write_text(yaml.safe_dump(conf))
    run_forecast(conf, _args(conf_path, checkpoint, root / "one"), stream=io.StringIO())
    return {
        "root": root,
        "store": store,
        "raw": raw,
        "scaler": scaler,
        "model": model.eval(),
        "conf": conf,
        "conf_path": conf_path,
        "checkpoint": checkpoint,
    }


def _credit_reference(setup) -> list[dict]:
    """Each lead's physical fields by miles-credit's own pre- and postblocks around the model
    (whole globe, one process): ``{variable: (levels, H, W)}``."""
    log = import_credit("credit.preblock.log").LogTransform
    sqrt = import_credit("credit.preblock.sqrt").SqrtTransform
    pre_scaler = import_credit("credit.preblock.scaler").BridgeScalerTransform
    post_scaler = import_credit("credit.postblock.scaler").BridgeScalerTransform
    square = import_credit("credit.postblock.square").SquareTransform
    raw, path = setup["raw"], setup["scaler"]
    layout = SampleLayout(raw, "ERA5")
    position = int(np.flatnonzero(raw.times == np.datetime64(INIT))[0])
    pre = [log([TSI], data_types=["input"]), sqrt([T2M]), pre_scaler(path, list(PROGNOSTIC))]
    post = [post_scaler(path, list(PROGNOSTIC)), square([T2M])]

    def model_units(x):
        batch = {"input": _nested(x, layout.input_slots)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for block in pre:
                batch = block(batch)
        return _flat(batch["input"], layout.input_slots)

    x = model_units(raw.compose_input(raw.read_steps(position, position + 1))["x"][None])
    leads = []
    with torch.no_grad():
        for k in range(STEPS):
            out = setup["model"](x.double())
            state = {"y_processed": _nested(out, layout.output_slots)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for block in post:
                    state = block(state)
            names = UPPER + SURFACE
            leads.append(
                {
                    n: state["y_processed"]["ERA5"][s.key][0, :, 0]
                    for n, s in zip(names, layout.output_slots)
                }
            )
            # the next input: the prediction, the forcing of its valid time, the static field
            after = raw.compose_input(raw.read_steps(position + k + 1, position + k + 2))["x"]
            following = model_units(after[None])
            x = torch.cat([out, following[:, out.shape[1] :].double()], dim=1)
    return leads


def _stored(path) -> list[dict]:
    ds = xr.open_zarr(path / "forecast.zarr")
    return [
        {n: np.asarray(ds[n].isel(init_time=0, lead_time=k).values) for n in UPPER + SURFACE}
        for k in range(STEPS)
    ]


def _assert_store_is(stored, reference):
    for k, (got, want) in enumerate(zip(stored, reference)):
        for name, values in want.items():
            expected = values.numpy().reshape(got[name].shape).astype(np.float32)
            scale = float(np.abs(expected).max())
            err = float(np.abs(got[name] - expected).max())
            assert err <= 2.0**-22 * scale, (k + 1, name, err, scale)  # float32 rounding


def _worker(rank, world, conf, args):
    run_forecast(conf, args, stream=io.StringIO())
    return rank


@pytest.mark.slow  # ~35 s on the 2-core machine with the setup: two forecasts, one at domain 2
def test_the_forecast_store_is_credits_postblocks_of_the_model_output(setup):
    reference = _credit_reference(setup)
    one = _stored(setup["root"] / "one")
    _assert_store_is(one, reference)
    # the postblocks matter: t2m is the square of its inverse-scaled output (the scaler was
    # fitted on raw t2m, about 280 K: squared, about 8e4), SP the inverse-scaled output itself
    assert float(np.median(one[0]["t2m"])) > 5e4
    assert 5e4 < float(np.median(one[0]["SP"])) < 2e5
    # domain 2 (7 / 6 rows): each rank its rows of the same store
    conf2 = _conf(setup["store"], setup["scaler"], {"data": "none", "tensor": 1, "domain": 2})
    args = _args(setup["conf_path"], setup["checkpoint"], setup["root"] / "two")
    args.parallelism = "domain=2"
    run_on_ranks(_worker, 2, conf2, args, timeout=300)
    _assert_store_is(_stored(setup["root"] / "two"), reference)


def test_the_training_climatology_is_credits_target_preblocks_of_the_raw_mean(setup):
    from credit_parallel.forecast.scores import climatology
    from credit_parallel.train.trainer import Trainer

    sqrt = import_credit("credit.preblock.sqrt").SqrtTransform
    pre_scaler = import_credit("credit.preblock.scaler").BridgeScalerTransform
    trainer = Trainer(setup["conf"])
    ours = trainer.use_training_climatology()
    trainer.close()
    raw = climatology(setup["conf"], domain_shard=(0, 1))  # the time mean, physical units
    layout = SampleLayout(setup["raw"], "ERA5")
    batch = {"target": _nested(raw[None].float(), layout.output_slots)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = pre_scaler(setup["scaler"], list(PROGNOSTIC))(sqrt([T2M])(batch))
    want = _flat(batch["target"], layout.output_slots)[0].double()
    assert torch.equal(ours.cpu(), want)
    assert float((want - raw).abs().max()) > 1.0  # in the model's units, not physical


def test_sqrt_and_square_blocks_are_read_from_a_gen2_config():
    """CREDIT's ``sqrt_transform`` preblock and ``square_transform`` postblock (HRRR's
    emulator config uses them) join ``data.bridgescaler``'s chains; unknown args are named."""
    from credit_parallel.layout.credit_gen2_blocks import block_sections

    conf = {
        "data": {"source": {"ERA5": {}}},
        "preblocks": {"sqrt": {"type": "sqrt_transform", "args": {"variables": [T2M]}}},
        "postblocks": {
            "square": {"type": "square_transform", "args": {"variables": [T2M], "base": 2}}
        },
    }
    data, problems = {"surface_variables": ["t2m"]}, []
    block_sections(conf, data, problems)
    assert problems == [
        "postblocks.square.args.base is not read by credit-parallel (square_transform)"
    ]
    chains = data["bridgescaler"]
    assert chains["pre"] == [
        {"type": "sqrt_transform", "where": "preblocks.sqrt", "variables": [T2M]}
    ]
    assert chains["post"] == [
        {
            "type": "square_transform",
            "where": "postblocks.square",
            "variables": [T2M],
            "key": "y_processed",
        }
    ]


def _gen2(setup) -> dict:
    """The same run as a CREDIT gen-2 config: its blocks as ``preblocks`` / ``postblocks``."""
    store, scaler = setup["store"], setup["scaler"]
    variables = {
        "prognostic": {"vars_3D": UPPER, "vars_2D": SURFACE, "path": store},
        "dynamic_forcing": {"vars_2D": FORCING, "path": store},
        "static": {"vars_2D": STATIC, "path": store},
    }
    source = {"ERA5": {"level_coord": "level", "levels": LEVELS, "variables": variables}}
    bridge = {"scaler_path": scaler, "variables": PROGNOSTIC}
    return {
        "seed": 3,
        "data": {"source": source, "start_datetime": "2020-01-01", "end_datetime": "2020-01-03T18"},
        "preblocks": {
            "log": {"type": "log_transform", "args": {"variables": [TSI], "data_types": ["input"]}},
            "sqrt": {"type": "sqrt_transform", "args": {"variables": [T2M]}},
            "scaler": {"type": "bridgescaler_transform", "args": bridge},
        },
        "postblocks": {
            "scaler": {"type": "bridgescaler_transform", "args": bridge},
            "square": {"type": "square_transform", "args": {"variables": [T2M]}},
        },
        "trainer": {
            "parallelism": {"data": "none", "tensor": 1, "domain": 1},
            "dtype": "float64",
            "thread_workers": 0,
        },
        "model": _model_conf(),
    }


def test_a_credit_gen2_config_forecasts_through_its_own_blocks(setup):
    """``credit-parallel forecast --config`` of the gen-2 config: its blocks are read as
    ``data.bridgescaler`` and the store is the one above, value for value."""
    from credit_parallel.forecast.command import apply_overrides, preflight

    args = _args(setup["conf_path"], setup["checkpoint"], setup["root"] / "gen2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bookkeeping keys dropped
        conf = apply_overrides(_gen2(setup), args)
    chains = conf["data"]["bridgescaler"]
    assert [s["type"] for s in chains["pre"]] == [s["type"] for s in _spec("").get("pre")]
    assert [s["type"] for s in chains["post"]] == [s["type"] for s in _spec("").get("post")]
    preflight(conf, args)
    run_forecast(conf, args, stream=io.StringIO())
    for got, want in zip(_stored(setup["root"] / "gen2"), _stored(setup["root"] / "one")):
        for name in want:
            assert np.array_equal(got[name], want[name]), name
