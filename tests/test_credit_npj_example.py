"""miles-credit v2026.2.0's ``wxformer_npj_era5_028deg.yml`` (``tests/credit_examples.py``):
its dynamic forcing in netCDF files of their own beside the zarr stores, its netCDF static file,
its resume from a CREDIT checkpoint directory (``load_weights``, ``reload_epoch``, and with
``load_optimizer`` the optimizer and the scheduler's state) and CREDIT's ``cosine-annealing``
scheduler, stepped once per epoch.

The forcing files give the single store's samples bitwise (whole globe, a domain rank's rows, a
tile; one file with its latitude ascending), as CREDIT reads them (by time label, cast to
float32); a time no file holds and a time in two files are refused naming it.  The schedule is
miles-credit's own class, called: its rates equal ``CosineAnnealingLR`` stepped per epoch.  The
config with only its paths, variable names and sizes changed, resuming a checkpoint written by
miles-credit's own model, optimizer, scheduler and ``EMATracker``, maps, plans and trains 2
steps (2 epochs of 1 batch: the rate changes between them) at domain 2 as on one process
(float64, 1e-10).
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
import xarray as xr

from credit_examples import wxformer_npj_era5_028deg
from credit_parallel.data import ERA5Dataset, default_stats_path
from credit_parallel.layout.credit_gen2 import credit_gen2_conf
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit
from test_credit_examples import H, W, _assert_trained_alike, _train
from test_credit_stores import STATIC, SURFACE, UPPER, data  # noqa: F401  (the stores fixture)

# the sample store's times 0..8 and 9..15, the second file's latitude ascending
SOLAR = {"solar_irradiance_2020-01.nc": (0, 9), "solar_irradiance_2020-02.nc": (9, 16)}


@pytest.fixture(scope="module")
def npj(data, tmp_path_factory):  # noqa: F811
    """The netCDF solar files, a netCDF static file and a CREDIT checkpoint directory."""
    root = tmp_path_factory.mktemp("npj")
    raw = data["raw"]
    for index, (name, (a, b)) in enumerate(SOLAR.items()):
        part = raw[["tsi"]].isel(time=slice(a, b))
        part = part.sortby("latitude") if index else part
        part.to_netcdf(root / name, engine="h5netcdf")
    raw[STATIC].sortby("latitude").to_netcdf(root / "static_norm_old.nc", engine="h5netcdf")
    save_loc = root / "run"
    save_loc.mkdir()
    _credit_checkpoint(_conf({**data, "npj": root}, {"data": "none", "tensor": 1, "domain": 1}))
    return {**data, "npj": root}


def _conf(data, parallelism: dict, load_optimizer: bool = True) -> dict:  # noqa: F811
    """The example with only its paths, variable names and sizes changed (and ``load_optimizer``
    on, so that the optimizer and the scheduler's state are resumed too)."""
    conf = wxformer_npj_era5_028deg()
    root = data["npj"]
    conf["save_loc"] = str(root / "run")
    source = conf["data"]["source"]["ERA5"]
    source["levels"] = [500.0, 850.0]
    source["variables"] = {
        "prognostic": {
            "vars_3D": list(UPPER),
            "vars_2D": list(SURFACE),
            "path": str(data["root"] / "all_in_one" / "ERA5_plevel_6h_%Y.zarr"),
        },
        "static": {"vars_2D": list(STATIC), "path": str(root / "static_norm_old.nc")},
        "dynamic_forcing": {"vars_2D": ["tsi"], "path": str(root / "solar_irradiance_%Y-*.nc")},
        "diagnostic": None,
    }
    conf["data"].update(start_datetime="2020-01-01", end_datetime="2020-01-03T18", timestep="6h")
    conf["preblocks"]["norm"]["args"] = {"mean_path": data["mean"], "std_path": data["std"]}
    trainer = conf["trainer"]
    trainer.update(
        parallelism=parallelism,
        thread_workers=0,
        dtype="float64",
        batches_per_epoch=1,
        train_batch_size=2,
        load_optimizer=load_optimizer,
    )
    conf["model"].update(
        image_height=H,
        image_width=W,
        levels=2,
        channels=3,
        surface_channels=2,
        input_only_channels=3,
        dim=[4, 8, 16, 32],
        depth=[1, 1, 1, 1],
        dim_head=4,
        padding_conf={"activate": True, "mode": "earth", "pad_lat": 8, "pad_lon": 16},
        global_window_size=[3, 3, 3, 1],  # windows that tile the padded stages 24 / 12 / 6 / 3
        local_window_size=3,
        cross_embed_kernel_sizes=[[2, 4], [2, 4], [2, 4], [2, 4]],
    )
    conf["model"]["post_conf"]["tracer_fixer"]["tracer_name"] = ["SP"]
    return conf


def _credit_checkpoint(conf: dict) -> None:
    """Epoch 0 of a CREDIT run, written as miles-credit's gen-2 trainer writes it: its model
    (``load_model``), AdamW (betas 0.9, 0.95) one step on, ``load_scheduler``'s cosine-annealing
    stepped after the epoch, its ``EMATracker``, and the training log ``reload_epoch`` looks for."""
    import_credit("credit.models.wxformer.crossformer")
    load_model = import_credit("credit.models").load_model
    load_scheduler = import_credit("credit.scheduler").load_scheduler
    tracker = import_credit("credit.trainers.base_trainer").EMATracker
    block = {k: v for k, v in conf["model"].items() if k != "post_conf"}
    # CREDIT's own parser (credit_main_parser) reads pad_lat: 8 as [8, 8]
    block["padding_conf"] = {**block["padding_conf"], "pad_lat": [8, 8], "pad_lon": [16, 16]}
    torch.manual_seed(7)
    model = load_model({"model": block})
    t = conf["trainer"]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t["learning_rate"], weight_decay=t["weight_decay"], betas=(0.9, 0.95)
    )
    scheduler = load_scheduler(optimizer, {"trainer": dict(t)})
    ema = tracker(model, decay=t["ema_decay"])
    x = torch.randn(1, 3 * 2 + 2 + 3, 1, H, W, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    optimizer.step()
    ema.update(model)
    scheduler.step()  # the epoch's end
    save_loc = conf["save_loc"]
    torch.save(
        {
            "epoch": 0,
            "model_state_dict": model.state_dict(),
            "optimizer_state_dict": optimizer.state_dict(),
            "scheduler_state_dict": scheduler.state_dict(),
            "scaler_state_dict": torch.amp.GradScaler(enabled=False).state_dict(),
        },
        f"{save_loc}/checkpoint.pt",
    )
    torch.save({"epoch": 0, "model_state_dict": ema.state_dict()}, f"{save_loc}/checkpoint_ema.pt")
    with open(f"{save_loc}/training_log.csv", "w", newline="") as f:
        csv.writer(f).writerows([["epoch", "train_loss"], [0, 1.0]])


# --------------------------------------------------------------------------- the forcing files
def test_forcing_files_give_the_single_stores_samples(npj):
    kwargs = dict(levels=[500, 850], dynamic_forcing_variables=["tsi"], cache_limit_bytes=0)
    solar = str(npj["npj"] / "solar_irradiance_[0-9][0-9][0-9][0-9]-*.nc")
    for shard in (None, (1, 2), (3, (2, 2))):
        extra = {"domain_shard": shard} if shard else {}
        single = ERA5Dataset(
            npj["single"], UPPER, SURFACE, static_variables=STATIC, **kwargs, **extra
        )
        files = ERA5Dataset(
            npj["glob"],
            UPPER,
            SURFACE,
            static_variables=STATIC,
            static_path=str(npj["npj"] / "static_norm_old.nc"),
            forcing_path=solar,
            stats_path=str(default_stats_path(npj["single"])),
            **kwargs,
            **extra,
        )
        assert len(files) == len(single) == 15
        for index in (0, 7, 8, 14):  # 8: input in the first file, target in the second
            a, b = single[index], files[index]
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), (shard, index, key)
    assert files.variable_units["tsi"] == single.variable_units["tsi"]
    with pytest.raises(ValueError, match=r"data\.forcing_path: no file holds the time 2020-01-03"):
        ERA5Dataset(
            npj["single"], UPPER, SURFACE, forcing_path=str(npj["npj"] / "*01.nc"), **kwargs
        )
    twice = [str(npj["npj"] / name) for name in SOLAR] + [str(npj["npj"] / "copy.nc")]
    xr.open_dataset(twice[0]).load().to_netcdf(twice[2], engine="h5netcdf")
    with pytest.raises(
        ValueError, match=r"the time 2020-01-01T00.* is in .*copy\.nc' and .*2020-01\.nc'"
    ):
        ERA5Dataset(npj["single"], UPPER, SURFACE, forcing_path=twice, **kwargs)


# --------------------------------------------------------------------------- the schedule
def test_cosine_annealing_is_credits_own_class_stepped_per_epoch():
    from credit_parallel.train.schedule import CreditSchedule

    block = {"scheduler_type": "cosine-annealing", "T_max": 3, "last_epoch": -1}
    spec = {"scheduler": block, "steps_per_epoch": 2}

    def rates(epochs, **kw):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        schedule = CreditSchedule(optimizer, spec, lr=1e-3, **kw)
        seen = []
        for _ in range(2 * epochs):
            seen.append(optimizer.param_groups[0]["lr"])
            schedule.step()
        return seen

    param = torch.nn.Parameter(torch.zeros(1))
    theirs = torch.optim.AdamW([param], lr=1e-3)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=3)
    expected = []
    for _ in range(5):
        expected += [theirs.param_groups[0]["lr"]] * 2  # each epoch's 2 optimizer steps
        theirs.step()
        reference.step()
    assert rates(5) == expected  # bitwise
    assert expected[2] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 3)), rel=1e-12)
    # a loaded state continues where the checkpoint's scheduler stopped, CosineAnnealingLR's
    # recursive step from the optimizer's current rate (here a fresh optimizer's 1e-3, as in
    # CREDIT's trainer when the scheduler is loaded and the optimizer is not)
    state = {**reference.state_dict(), "last_epoch": 1}
    continued = rates(2, resumed={"scheduler_state": state})
    ratio = (1 + math.cos(2 * math.pi / 3)) / (1 + math.cos(math.pi / 3))
    assert continued[::2] == [1e-3, pytest.approx(1e-3 * ratio, rel=1e-12)]


# --------------------------------------------------------------------------- the example
def test_the_example_as_written_is_refused_only_for_its_missing_checkpoint():
    import_credit("credit.trainers.utils")
    with pytest.raises(ValueError) as refused:
        credit_gen2_conf(wxformer_npj_era5_028deg())
    lines = [line for line in str(refused.value).splitlines() if line.startswith("  - ")]
    assert len(lines) == 1 and "trainer.load_weights: true reads" in lines[0]
    assert "CREDIT_runs/wxformer_npj_1h/checkpoint.pt' (save_loc), which does not exist" in lines[0]


def test_the_example_maps_with_its_forcing_files_resume_and_schedule(npj):
    one = {"data": "none", "tensor": 1, "domain": 1}
    with pytest.warns(UserWarning, match="bookkeeping"):
        mapped = credit_gen2_conf(_conf(npj, one))
    d, t = mapped["data"], mapped["trainer"]
    assert d["forcing_path"] == str(npj["npj"] / "solar_irradiance_[0-9][0-9][0-9][0-9]-*.nc")
    assert d["path"].endswith("ERA5_plevel_6h_[0-9][0-9][0-9][0-9].zarr")
    assert d["static_path"] == str(npj["npj"] / "static_norm_old.nc")
    assert t["credit_resume"] == {
        "checkpoint": str(npj["npj"] / "run" / "checkpoint.pt"),
        "load_optimizer": True,
        "load_scheduler": True,  # CREDIT loads it with the optimizer once start_epoch > 0
        "update_learning_rate": False,
        "start_epoch": 1,  # reload_epoch: the checkpoint's epoch 0 + 1
    }
    assert t["steps"] == 2  # epochs 3 - start_epoch 1, 1 batch each
    assert t["credit_scheduler"] == {
        "scheduler": {"scheduler_type": "cosine-annealing", "T_max": 3, "last_epoch": -1},
        "steps_per_epoch": 1,
        "batches_per_epoch": 1,
        "grad_accum": 1,
    }
    # weights only, no training log: CREDIT starts at start_epoch 0 (3 epochs), no scheduler
    conf = _conf(npj, one, load_optimizer=False)
    (npj["npj"] / "run" / "training_log.csv").rename(npj["npj"] / "log.csv")
    try:
        with pytest.warns(UserWarning):
            t = credit_gen2_conf(conf)["trainer"]
    finally:
        (npj["npj"] / "log.csv").rename(npj["npj"] / "run" / "training_log.csv")
    assert t["steps"] == 3 and t["credit_resume"]["start_epoch"] == 0
    assert not t["credit_resume"]["load_scheduler"]


def test_the_example_plans_at_domain_2(npj):
    from credit_parallel.planner import make_plan

    with pytest.warns(UserWarning):
        plan = make_plan(_conf(npj, {"data": "none", "tensor": 1, "domain": 2}), 2)
    assert plan.domain == 2 and not plan.violations, plan.violations


def _domain2_worker(rank, world, npj):
    return _train(_conf(npj, {"data": "none", "tensor": 1, "domain": 2}))


@pytest.mark.slow  # a trainer and 2 ranks: ~110 s on the loaded 2-core machine
def test_the_example_resumed_trains_at_domain_2_as_on_one_process(npj):
    saved = torch.load(npj["npj"] / "run" / "checkpoint.pt", weights_only=True)

    def resumed(trainer):
        weights = dict(trainer.model.named_parameters())
        for key, value in saved["model_state_dict"].items():
            if key in weights:  # the CREDIT model's weights, loaded (float64 of them)
                assert torch.equal(weights[key].detach(), value.double()), key
        state = trainer.optimizer.state_dict()
        assert all(int(s["step"]) == 1 for s in state["state"].values())
        assert state["param_groups"][0]["betas"] == (0.9, 0.95)  # CREDIT's optimizer's
        assert trainer.ema.step == 1  # checkpoint_ema.pt's EMATracker

    with pytest.warns(UserWarning):
        ref_records, ref_params = _train(
            _conf(npj, {"data": "none", "tensor": 1, "domain": 1}), check=resumed
        )
    # epochs 1 and 2 of cosine annealing over T_max 3, continued from the checkpoint's state
    lr = 1e-6 * 0.5 * (1 + math.cos(math.pi / 3))
    assert ref_records[0]["lr"] == pytest.approx(lr, rel=1e-12)
    assert ref_records[1]["lr"] == pytest.approx(lr * (1 + math.cos(2 * math.pi / 3))
                                                 / (1 + math.cos(math.pi / 3)), rel=1e-12)  # fmt: skip
    records, params = run_on_ranks(_domain2_worker, 2, npj, timeout=300)[0]
    _assert_trained_alike(records, params, ref_records, ref_params)
    assert np.isfinite(ref_records[1]["grad_norm"])
