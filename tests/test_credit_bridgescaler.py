"""CREDIT's bridgescaler pre/postblocks and ``loss.type: base``, against miles-credit's own classes.

A scaler is fitted by miles-credit's own preblock (``BridgeScalerTransform.fit_scaler_batch``,
bridgescaler's ``DStandardScalerTensor`` / ``DQuantileScalerTensor``) on the per-year sample
stores and saved with bridgescaler's ``save_scaler_dict``.  Then:

* the dataset's samples (whole globe, a rank's rows, a lat x lon tile) equal CREDIT's preblock
  chain (``log_transform`` + ``bridgescaler_transform``, a spatial variable included) on the
  raw batch, bitwise;
* the base loss (and its gradient) equals CREDIT's postblocks (``bridgescaler_transform``
  inverse, ``exp_transform``) + ``BaseLoss`` on one process for every ``var_weighting``;
* ``example-v2026.2.yml`` and ``example-end-to-end.yml``, only paths, names and sizes changed,
  train 2 steps at domain 2 as on one process (float64, 1e-10), and the template from the CLI;
* learnable weights train exactly at 2 x 2 tiles, dp 2 x domain 2, tp 2 x domain 2 and resume
  from a checkpoint;
* a missing ``scaler_path`` and a zero variance are refused naming the key / the variable.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import yaml

from credit_parallel.data import ERA5Dataset
from credit_parallel.data.bridgescaler_blocks import SampleLayout
from credit_parallel.layout.credit_gen2 import credit_gen2_conf
from credit_parallel.testing import run_on_ranks
from test_credit_examples import TOL, _train
from test_credit_examples_v2026 import _end_to_end, _on_stores, _v2026
from test_credit_stores import STATIC as _STORE_STATIC
from test_credit_stores import (
    YEARS,
    _write,
    data,  # noqa: F401  (the per-year stores fixture)
)

UPPER, SURFACE, DIAG, FORCING = ["T", "U", "V"], ["SP"], ["t2m"], ["tsi"]
STATIC = ["orography", "land_sea_mask"]
# the template's variable names -> the sample store's (None: left out)
_NAMES = {
    "u_component_of_wind": "U",
    "v_component_of_wind": "V",
    "temperature": "T",
    "SP": "SP",
    "toa_incident_solar_radiation": "tsi",
    "total_precipitation": "t2m",
}
ONE = {"data": "none", "tensor": 1, "domain": 1}
DOMAIN2 = {"data": "none", "tensor": 1, "domain": 2}


def _dataset(data, **kw):  # noqa: F811
    base = dict(levels=[500, 850], dynamic_forcing_variables=FORCING, static_variables=STATIC)
    base.update(diagnostic_variables=DIAG, static_path=data["static"])
    return ERA5Dataset(data["glob"], UPPER, SURFACE, **{**base, **kw})


def _credit_batch(layout: SampleLayout, sample: dict) -> dict:
    """CREDIT's ``{data_type: {source: {key: (B, levels, T, H, W)}}}`` of a batched flat sample
    (a variable's time steps stacked on T)."""
    out = {}
    for name, data_type, slots in (
        ("x", "input", layout.input_slots),
        ("y", "target", layout.target_slots),
    ):
        t, steps = sample[name], {}
        for s in slots:
            steps.setdefault(s.key, []).append(t[:, s.start : s.start + s.width, None])
        out[data_type] = {"ERA5": {k: torch.cat(v, dim=2) for k, v in steps.items()}}
    return out


def _flat(nested: dict, slots) -> torch.Tensor:
    """The flat channels of CREDIT's nested tensors, in the order of ``slots``."""
    seen: dict = {}
    parts = []
    for s in slots:
        step = seen[s.key] = seen.get(s.key, -1) + 1
        parts.append(nested["ERA5"][s.key][:, :, step])
    return torch.cat(parts, dim=1)


def _fit(data, path, kind: str, spatial=(), samples=None):  # noqa: F811
    """A scaler fitted by miles-credit's own preblock on the stores' samples (the first
    ``samples``, default all)."""
    from bridgescaler import save_scaler_dict
    from credit.preblock.scaler import BridgeScalerTransform

    raw = _dataset(data, normalize=False)
    layout = SampleLayout(raw, "ERA5")
    params = {"channels_last": False}
    if kind == "quantile":
        params["distribution"] = "normal"
    block = BridgeScalerTransform(
        str(path), [], scaler_type=kind, scaler_params=params, spatial_variables=list(spatial)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        count = len(raw) if samples is None else samples
        for start in range(0, count, 4):
            chunk = [raw[i] for i in range(start, min(start + 4, count))]
            batch = {k: torch.stack([s[k] for s in chunk]) for k in ("x", "y")}
            block.fit_scaler_batch(_credit_batch(layout, batch))
    save_scaler_dict(block.scaler, str(path))
    return str(path)


@pytest.fixture(scope="module")
def stores(data, tmp_path_factory):  # noqa: F811
    """The per-year stores with the pole rows of SP varying in time (the sample store holds
    it constant: a per-grid-point scaler would have a zero variance there, refused below)."""
    root = tmp_path_factory.mktemp("bridgescaler_stores")
    ds = data["raw"].drop_vars(_STORE_STATIC).copy(deep=True)
    ramp = 10.0 * np.arange(1, ds.sizes["time"] + 1, dtype=np.float32)[:, None]
    for pole in (0, -1):
        ds["SP"][:, pole, :] = ds["SP"][:, pole, :] + ramp
    (root / "all_in_one").mkdir()
    for name, (a, b) in YEARS.items():
        _write(ds.isel(time=slice(a, b)), root / "all_in_one" / name)
    return {**data, "root": root, "glob": str(root / "all_in_one" / "ERA5_plevel_6h_*.zarr")}


@pytest.fixture(scope="module")
def scalers(stores, tmp_path_factory):
    root = tmp_path_factory.mktemp("scalers")
    return {
        "standard": _fit(stores, root / "standard.json", "standard"),
        "quantile": _fit(stores, root / "quantile.json", "quantile", samples=4),
        "spatial": _fit(stores, root / "spatial.json", "standard", ["ERA5/prognostic/2d/SP"]),
    }


# --------------------------------------------------------------------------- the preblocks
_SELECTED = ["ERA5/prognostic", "ERA5/diagnostic/2d/t2m", "ERA5/dynamic_forcing/2d/tsi"]


def _pre_spec(path, spatial=(), log=False):
    steps = []
    if log:
        steps.append({"type": "log_transform", "variables": ["ERA5/diagnostic/2d/t2m"]})
    steps.append(
        {
            "type": "bridgescaler_transform",
            "scaler_path": path,
            "method": "transform",
            "variables": list(_SELECTED),
            "spatial_variables": list(spatial),
        }
    )
    return {"source": "ERA5", "pre": steps, "post": []}


@pytest.mark.parametrize(
    "kind,spatial,log",
    [
        ("standard", (), False),
        ("quantile", (), False),
        ("spatial", ("ERA5/prognostic/2d/SP",), True),
    ],
)
def test_the_dataset_samples_are_credits_preblocks_on_the_raw_batch(
    stores, scalers, kind, spatial, log
):
    from credit.preblock.log import LogTransform
    from credit.preblock.scaler import BridgeScalerTransform

    # CREDIT scales a spatial variable of one time step only (its T dim must be 1)
    steps = (
        {"history_len": 1, "forecast_len": 1} if spatial else {"history_len": 2, "forecast_len": 2}
    )
    raw = _dataset(stores, normalize=False, **steps)
    layout = SampleLayout(raw, "ERA5")
    batch = _credit_batch(layout, {k: raw[3][k][None] for k in ("x", "y")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if log:
            batch = LogTransform(["ERA5/diagnostic/2d/t2m"])(batch)
        batch = BridgeScalerTransform(
            scalers[kind], list(_SELECTED), spatial_variables=list(spatial)
        )(batch)
    want_x, want_y = (
        _flat(batch["input"], layout.input_slots)[0],
        _flat(batch["target"], layout.target_slots)[0],
    )
    assert not torch.equal(want_x, raw[3]["x"])
    spec = _pre_spec(scalers[kind], spatial, log)
    for shard in (None, (1, 2), (3, (2, 2))):
        extra = {} if shard is None else {"domain_shard": shard}
        ours = _dataset(stores, bridgescaler=spec, **steps, **extra)[3]
        (a, b), (c, d) = _rows(raw, shard)
        assert torch.equal(ours["x"], want_x[:, a:b, c:d]), str(
            [
                (i, float((ours["x"][i] - want_x[i, a:b, c:d]).abs().max()))
                for i in range(want_x.shape[0])
            ]
        )
        assert torch.equal(ours["y"], want_y[:, a:b, c:d]), (kind, shard)
        if spatial:
            continue
        # the forcing of the 2nd step's input: the input scaler, as CREDIT scales an input
        tsi = next(s for s in layout.input_slots if s.key.endswith("tsi")).start
        forcing = {
            "input": {
                "ERA5": {"ERA5/dynamic_forcing/2d/tsi": raw[4]["x"][None, tsi : tsi + 1, None]}
            }
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            forcing = BridgeScalerTransform(scalers[kind], list(_SELECTED))(forcing)
        want_f = forcing["input"]["ERA5"]["ERA5/dynamic_forcing/2d/tsi"][0, :, 0]
        assert torch.equal(ours["forcing"], want_f[:, a:b, c:d]), (kind, shard)


def _rows(raw, shard):
    from credit_parallel.data.selection import tile_window

    if shard is None:
        return (0, raw.grid_shape[0]), (0, raw.grid_shape[1])
    rows, columns = tile_window(None, shard, raw.grid_shape)
    return rows, columns or (0, raw.grid_shape[1])


# --------------------------------------------------------------------------- the loss
_MODES = [
    {"var_weighting": "inverse_variance", "use_latitude_weights": True, "validation_loss": "mae"},
    {
        "var_weighting": "manual",
        "variable_weights": {"ERA5/prognostic/3d/T": 2.0, "ERA5/diagnostic/2d/t2m": 0.5},
        "base_loss_overrides": {"ERA5/diagnostic/2d/t2m": {"loss": "mae", "parameters": {}}},
        "normalize_weights": False,
    },
    {"var_weighting": "learnable", "training_loss": "huber", "use_latitude_weights": True},
    {"var_weighting": "none", "training_loss": "mae"},
]


@pytest.mark.parametrize("mode", range(len(_MODES)))
def test_the_base_loss_is_credits_postblocks_and_base_loss(stores, scalers, mode):
    """One process, float32: CREDIT's postblocks (inverse bridgescaler, exp) on the prediction
    and the target twin, then its ``BaseLoss``; the same loss and gradient here."""
    from credit.losses.base import BaseLoss
    from credit.postblock.exp import ExpTransform
    from credit.postblock.scaler import BridgeScalerTransform

    from credit_parallel.data.bridgescaler_blocks import ScalerBlocks
    from credit_parallel.train.credit_loss import CreditBaseLoss, credit_lat_weights

    path = scalers["spatial"]
    spec = _pre_spec(path, ("ERA5/prognostic/2d/SP",), log=True)
    spec["post"] = [
        {
            "type": "bridgescaler_transform",
            "scaler_path": path,
            "method": "inverse_transform",
            "variables": [],
            "spatial_variables": ["ERA5/prognostic/2d/SP"],
        },
        {"type": "exp_transform", "variables": ["ERA5/diagnostic/2d/t2m"]},
    ]
    ds = _dataset(stores, bridgescaler=spec)
    layout = SampleLayout(ds, "ERA5")
    y = torch.stack([ds[i]["y"] for i in range(2)])
    torch.manual_seed(mode)
    pred = (y + 0.3 * torch.randn_like(y)).requires_grad_()
    args = {"training_loss": "mse", "scaler_path": path, **_MODES[mode]}
    if args.get("use_latitude_weights"):
        args["latitude_weights"] = stores["static"]
    keys = [s.key for s in layout.output_slots]

    def credit_loss(p, validation=False):
        from credit_parallel.train.credit_loss import _Schema

        state = {}
        for key, flat in (("y_processed", p), ("y_target_processed", y)):
            nested = {
                "ERA5": {
                    s.key: flat[:, s.start : s.start + s.width, None] for s in layout.output_slots
                }
            }
            state[key] = nested
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for key in ("y_processed", "y_target_processed"):
                state = BridgeScalerTransform(
                    path, [], key=key, spatial_variables=["ERA5/prognostic/2d/SP"]
                )(state)
                state = ExpTransform(["ERA5/diagnostic/2d/t2m"], key=key)(state)
        schema = _Schema(keys) if args["var_weighting"] == "learnable" else None
        crit = BaseLoss(**args, channel_schema=schema, validation=validation)
        return crit(state), crit

    want, crit = credit_loss(pred)
    (want_grad,) = torch.autograd.grad(want, pred)
    lat = None
    if args.get("use_latitude_weights"):
        lat = credit_lat_weights(stores["static"], ds.latitude)
    ours = CreditBaseLoss(args, ScalerBlocks(spec), layout, lat, *ds.grid_shape, 1, False)
    got = ours((pred,), (y,))
    (grad,) = torch.autograd.grad(got, pred)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float((grad - want_grad).abs().max()) <= 1e-4 * float(want_grad.abs().max())
    for key, value in crit.last_var_losses.items():
        assert ours.last_var_losses[key] == pytest.approx(value, rel=1e-5), key
    if args["var_weighting"] == "learnable":
        assert torch.equal(ours.learnable.log_variance.detach(), crit.log_variance.detach())
    # validation: CREDIT's `validation_loss` when given (mae here, in mode 0)
    valid = CreditBaseLoss(args, ScalerBlocks(spec), layout, lat, *ds.grid_shape, 1, True)
    with torch.no_grad():
        want_valid = float(credit_loss(pred, validation=True)[0])
        assert float(valid((pred,), (y,))) == pytest.approx(want_valid, rel=1e-5)
    assert (want_valid != pytest.approx(float(want), rel=1e-3)) == ("validation_loss" in args)


# --------------------------------------------------------------------------- the examples
def _as_template(conf: dict, example: dict, scaler: str, static: str) -> dict:
    """``conf`` (the example pointed at the stores, ``_on_stores``) with the example's own
    pre/postblocks and loss back, only their paths and variable names changed."""

    def rename(value):
        if isinstance(value, str) and value.startswith("ERA5/"):
            *head, name = value.split("/")
            new = _NAMES.get(name)
            return None if new is None else "/".join([*head, new])
        if isinstance(value, list):
            return [v for v in (rename(v) for v in value) if v is not None]
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                key = rename(k) if isinstance(k, str) and k.startswith("ERA5/") else k
                if key is not None:
                    out[key] = (
                        scaler
                        if k == "scaler_path"
                        else static
                        if k == "latitude_weights"
                        else rename(v)
                    )
            return out
        return value

    for section in ("preblocks", "postblocks", "loss"):
        conf[section] = rename(copy.deepcopy(example[section]))
    return conf


def _example_on_stores(data, scalers, name, parallelism):  # noqa: F811
    conf = _on_stores(data, parallelism)
    example = {"v2026": _v2026, "end_to_end": _end_to_end}[name]()
    scaler = scalers["spatial" if name == "end_to_end" else "standard"]
    # clipped: with the template's `grad_max_norm: dynamic` (none) the physical-unit loss's
    # gradients (norm ~4e5) make Adam turn the round-off of a gradient that is zero in exact
    # arithmetic (a bias before a norm, ~1e-15) into a 6e-10 step (sign / eps)
    conf["trainer"]["grad_max_norm"] = 1.0
    return _as_template(conf, example, scaler, data["static"])


def _examples_worker(rank, world, data, scalers):  # noqa: F811
    return [_train(_example_on_stores(data, scalers, n, DOMAIN2)) for n in ("v2026", "end_to_end")]


def _close(records, params, ref_records, ref_params):
    assert [r["step"] for r in records] == [1, 2]
    for par, ref in zip(records, ref_records, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(par[key] - ref[key]) <= TOL * max(1.0, abs(ref[key])), (key, par, ref)
    worst = max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params)
    assert params.keys() == ref_params.keys() and worst <= TOL, worst


@pytest.mark.slow
def test_the_local_examples_train_at_domain_2_as_on_one_process(stores, scalers):  # noqa: F811
    with pytest.warns(UserWarning, match="bookkeeping"):
        mapped = credit_gen2_conf(_example_on_stores(stores, scalers, "end_to_end", ONE))
    steps = [s["type"] for s in mapped["data"]["bridgescaler"]["pre"]]
    assert steps == ["log_transform", "bridgescaler_transform"]
    assert mapped["loss"]["args"]["var_weighting"] == "inverse_variance"
    refs = [_train(_example_on_stores(stores, scalers, n, ONE)) for n in ("v2026", "end_to_end")]
    got = run_on_ranks(_examples_worker, 2, stores, scalers, timeout=300)[0]
    for (records, params), (ref_records, ref_params) in zip(got, refs, strict=True):
        _close(records, params, ref_records, ref_params)
        assert ref_records[1]["loss"] != ref_records[0]["loss"]


def test_the_template_trains_from_the_cli(stores, scalers, tmp_path):  # noqa: F811
    from credit_parallel import cli

    conf = _example_on_stores(stores, scalers, "v2026", ONE)
    path = tmp_path / "example-v2026.2.yml"
    path.write_text(yaml.safe_dump(conf))
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["train", "--config", str(path), "--output", str(out)]) == 0
    lines = (out / "metrics.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("step")


# --------------------------------------------------------------------------- learnable weights
def _learnable(data, scalers, parallelism, batch=2):  # noqa: F811
    conf = _example_on_stores(data, scalers, "v2026", parallelism)
    conf["loss"]["args"]["var_weighting"] = "learnable"
    conf["trainer"]["train_batch_size"] = batch
    conf["model"] = {
        "type": "unet",
        "in_channels": 10,
        "out_channels": 8,
        "image_height": conf["model"]["image_height"],
        "image_width": conf["model"]["image_width"],
        "base_channels": 4,
        "channel_mults": [1, 2],
        "norm_groups": 2,
    }
    return conf


def _train_learnable(conf, steps=2):
    from credit_parallel.train.trainer import Trainer

    trainer = Trainer(conf)
    records = [trainer.train_step() for _ in range(steps)]
    records.append(trainer.evaluate())  # CREDIT's validation loss, exact over the layout
    log_var = trainer.credit_loss.learnable.log_variance.detach().clone()
    trainer.close()
    return records, log_var


_LAYOUTS = [
    ("tiles", {"data": "none", "tensor": 1, "domain": {"lat": 2, "lon": 2}}, 2),
    ("dp2_domain2", {"data": "ddp", "tensor": 1, "domain": 2}, 1),
    ("tp2_domain2", {"data": "none", "tensor": 2, "domain": 2}, 2),
]


def _learnable_worker(rank, world, data, scalers):  # noqa: F811
    return {
        name: _train_learnable(_learnable(data, scalers, layout, batch))
        for name, layout, batch in _LAYOUTS
    }


@pytest.mark.slow
def test_learnable_weights_train_exactly_under_tiles_dp_and_tp(stores, scalers):  # noqa: F811
    ref_records, ref_log_var = _train_learnable(_learnable(stores, scalers, ONE))
    assert float((ref_log_var - ref_log_var.new_tensor(0)).abs().max()) > 0
    for out in run_on_ranks(_learnable_worker, 4, stores, scalers, timeout=600):
        for name, (records, log_var) in out.items():
            for par, ref in zip(records, ref_records, strict=True):
                assert abs(par["loss"] - ref["loss"]) <= TOL * max(1.0, abs(ref["loss"])), name
            assert float((log_var - ref_log_var).abs().max()) <= TOL, name


def test_learnable_weights_are_checkpointed_and_resume(stores, scalers, tmp_path):
    """2 steps, save, a new trainer loads and steps once: the third step's loss and the weights
    of the uninterrupted run (CREDIT re-initialises them on resume, its issue #473)."""
    from credit_parallel.train.trainer import Trainer

    conf = _learnable(stores, scalers, ONE)
    whole = Trainer(conf)
    want = [whole.train_step()["loss"] for _ in range(3)]
    first = Trainer(conf)
    for _ in range(2):
        first.train_step()
    path = first.save(tmp_path)
    again = Trainer(conf)
    again.load(path)
    assert again.train_step()["loss"] == want[2]
    got, ref = (t.credit_loss.learnable.log_variance.detach() for t in (again, whole))
    assert torch.equal(got, ref)
    # trained away from CREDIT's initial value (the validation BaseLoss keeps it)
    assert not torch.equal(ref, first.credit_valid_loss.credit.log_variance.detach().to(ref))
    for t in (whole, first, again):
        t.close()


# --------------------------------------------------------------------------- refusals
def test_a_missing_scaler_path_and_a_zero_variance_are_refused_by_name(
    stores, scalers, tmp_path, capsys
):  # noqa: F811
    from bridgescaler import load_scaler_dict, save_scaler_dict

    from credit_parallel import cli

    conf = _example_on_stores(stores, scalers, "v2026", ONE)
    missing = copy.deepcopy(conf)
    missing["trainer"]["parallelism"] = DOMAIN2
    missing["preblocks"]["per_step"]["scaler"]["args"]["scaler_path"] = str(tmp_path / "none.json")
    key = r"preblocks\.per_step\.scaler\.args\.scaler_path = .*none\.json' does not exist"
    with pytest.raises(ValueError, match=key):
        credit_gen2_conf(missing)
    path = tmp_path / "missing.yml"  # `train --nproc 2` stops before any rank starts
    path.write_text(yaml.safe_dump(missing))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["train", "--config", str(path), "--nproc", "2"]) != 0
    err = capsys.readouterr().err
    assert "preblocks.per_step.scaler.args.scaler_path" in err and "does not exist" in err
    scaler = load_scaler_dict(scalers["standard"])
    scaler["target"]["ERA5"]["ERA5/prognostic/3d/T"].var_x_[1] = 0.0
    zero = tmp_path / "zero.json"
    save_scaler_dict(scaler, str(zero))
    conf = _as_template(conf, _v2026(), str(zero), stores["static"])
    with pytest.raises(ValueError) as refused:
        credit_gen2_conf(conf)
    text = str(refused.value)
    assert "variance is zero for ERA5/prognostic/3d/T" in text
    assert "preblocks.per_step.scaler.args.scaler_path" in text and "loss.args.scaler_path" in text
