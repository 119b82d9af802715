"""miles-credit's gen-2 example configs train: ``config/gen_2/examples/wxformer_era5_025deg_6hr.yml``
(miles-credit 2026.2) as a dict, its data block in CREDIT's gen-2 schema (``data.source.ERA5``),
its trainer in CREDIT's keys.  A copy rewritten to the sample store (path, the store's variable
names, no diagnostic group, no netCDF statistics, no EMA) and to a tiny model trains 2 steps
through the Trainer at domain 2 with the single-process losses, gradient norms and weights
(float64, 1e-10); the example as written maps whole.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.tensor  # noqa: F401

from credit_examples import DIAGNOSTIC as _DIAGNOSTIC
from credit_examples import E025_MEAN as _MEAN
from credit_examples import E025_STATIC as _STATIC
from credit_examples import E025_STD as _STD
from credit_examples import E025_STORE as _STORE
from credit_examples import wxformer_era5_025deg as _example
from credit_parallel.data import write_sample_dataset
from credit_parallel.layout.credit_gen2 import credit_gen2_conf
from credit_parallel.layout.run_config import RunConfig
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit

TOL = 1e-10
H, W = 32, 64


def _on_sample(store: str, parallelism: dict) -> dict:
    """The example rewritten to the sample store: its path and variable names, no diagnostic
    group and no netCDF statistics (the store's own), no EMA, 2 steps, a tiny model (float64)."""
    conf = _example()
    source = conf["data"]["source"]["ERA5"]
    source["levels"] = [500.0, 850.0]
    source["variables"] = {
        "prognostic": {"vars_3D": ["T", "U", "V"], "vars_2D": ["SP", "t2m"], "path": store},
        "dynamic_forcing": {"vars_2D": ["tsi"], "path": store},
        "static": {"vars_2D": ["orography", "land_sea_mask"], "path": store},
    }
    data = conf["data"]
    data.update(start_datetime="2020-01-01", end_datetime="2020-01-02T18")
    del data["mean_path"], data["std_path"]
    # the validation block reads the same stores (one source object, as YAML anchors give)
    # over the store's last two days; the normaliser preblock's netCDF files go with data's
    valid = conf["validation_data"]
    valid.update(source=data["source"], start_datetime="2020-01-03", end_datetime="2020-01-04T18")
    del valid["mean_path"], valid["std_path"], conf["preblocks"]["per_step"]["norm"]
    trainer = conf["trainer"]
    trainer.update(use_ema=False, thread_workers=0, parallelism=parallelism, dtype="float64")
    trainer["scheduler"].update(warmup_steps=1, total_steps=2)
    conf["model"].update(
        image_height=H,
        image_width=W,
        levels=2,
        channels=3,
        surface_channels=2,
        input_only_channels=3,
        output_only_channels=0,
        dim=[4, 8, 16, 32],
        depth=[1, 1, 1, 1],
        dim_head=4,
        global_window_size=[2, 2, 2, 1],
        local_window_size=2,
        cross_embed_kernel_sizes=[[2, 4], [2, 4], [2, 4], [2, 4]],
        interp=False,
        padding_conf={"activate": False},
    )
    return conf


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    import_credit("credit.trainers.utils")  # miles-credit's inject_flat_var_keys
    import_credit("credit.models.crossformer")
    path = tmp_path_factory.mktemp("data") / "s.zarr"
    return str(write_sample_dataset(path, n_times=16, nlat=H, nlon=W))


def test_the_example_as_written_maps_whole_to_credit_parallel_keys(store):
    """Nothing of the example (v2026.2.0's text) is refused: its ``dataset_type: local``, the
    glob of per-year stores, the static store, the netCDF statistics (data block and
    ``era5_normalizer`` preblock), the diagnostic group, the validation block, the EMA and the
    interpolation are all read (it trains as written, pointed at stores:
    tests/test_credit_stores.py)."""
    with pytest.warns(UserWarning, match=r"bookkeeping"):
        conf = credit_gen2_conf(_example())
    data, trainer = conf["data"], conf["trainer"]
    # ``..._%Y.zarr`` (prognostic) and ``..._%Y*.zarr`` (the other groups): one glob
    assert data["path"] == _STORE and data["static_path"] == _STATIC
    assert (data["mean_path"], data["std_path"]) == (_MEAN, _STD)  # = the normaliser preblock's
    assert data["diagnostic_variables"] == _DIAGNOSTIC
    assert data["time_slice"] == ["1979-01-01", "2018-12-31"]
    assert data["valid_time_slice"] == ["2018-01-01", "2019-12-31"]
    assert trainer["steps"] == 500000
    assert trainer["credit_scheduler"]["scheduler"]["warmup_steps"] == 1000
    for gone in ("save_loc", "inference", "pbs", "preblocks", "validation_data"):
        assert gone not in conf
    assert trainer["use_ema"] is True and trainer["ema_decay"] == 0.9999
    assert conf["model"]["interp"] is True and conf["model"]["padding_conf"]["activate"]


def test_the_rewritten_example_reads_as_credit_parallel_keys(store):
    conf = _on_sample(store, {"data": "none", "tensor": 1, "domain": 2})
    with pytest.warns(UserWarning, match=r"trainer\.use_tensorboard.*bookkeeping"):
        run = RunConfig.from_conf(conf)
    d, t = run.data, run.trainer
    assert d.path == store and d.levels == (500.0, 850.0) and d.level_coord == "level"
    assert d.upper_air_variables == ("T", "U", "V") and d.surface_variables == ("SP", "t2m")
    assert d.dynamic_forcing_variables == ("tsi",)
    assert d.static_variables == ("orography", "land_sea_mask")
    assert d.time_slice == ("2020-01-01", "2020-01-02T18") and d.timestep == "6h"
    assert (d.num_workers, d.prefetch_factor) == (0, 4)
    assert (t.lr, t.batch_size, t.grad_accum, t.seed) == (1e-3, 2, 1, 1000)
    assert (t.steps, t.grad_clip) == (2, 0.0)
    scheduler = {"scheduler_type": "linear-warmup-cosine", "warmup_steps": 1, "total_steps": 2}
    assert t.credit_scheduler == {  # CREDIT's own class, stepped per batch (no epoch counted)
        "scheduler": {**scheduler, "min_lr": 1e-5},
        "steps_per_epoch": None,
        "batches_per_epoch": None,
        "grad_accum": 1,
    }
    assert t.activation_checkpoint and dict(run.parallelism)["domain"] == 2
    # what is not honoured, named: a second source, 3-D static fields, another scheduler
    bad = copy.deepcopy(conf)
    source = bad["data"]["source"]
    source["GFS"] = copy.deepcopy(source["ERA5"])
    source["ERA5"]["variables"]["static"]["vars_3D"] = ["Z"]
    bad["trainer"]["scheduler"]["scheduler_type"] = "cosine-annealing"
    with pytest.raises(ValueError) as refused:
        credit_gen2_conf(bad)
    for key in ("data.source has 2 sources", "static.vars_3D", "scheduler_type"):
        assert key in str(refused.value)


def _train(conf, steps=2, check=None):
    """``steps`` optimizer steps of ``Trainer(conf)``: their records and the final weights
    (whole); ``check(trainer)`` first, when given."""
    from credit_parallel.train.trainer import Trainer

    trainer = Trainer(conf)
    if check is not None:
        check(trainer)
    records = [trainer.train_step() for _ in range(steps)]
    params = {}
    for name, p in trainer.model.named_parameters():
        t = p.detach()
        full = t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t
        params[name] = full.clone()
    trainer.close()
    return records, params


def _assert_trained_alike(
    records, params, ref_records, ref_params, keys=("loss", "grad_norm", "lr")
):
    """A parallel run's 2 steps (records, final weights) equal one process's (``TOL``), and the
    first step changed the weights."""
    assert [r["step"] for r in records] == [1, 2]
    for par, ref in zip(records, ref_records, strict=True):
        for key in keys:
            assert abs(par[key] - ref[key]) <= TOL, (par["step"], key, par[key], ref[key])
    worst = max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params)
    assert params.keys() == ref_params.keys() and worst <= TOL, worst
    assert ref_records[1]["loss"] != ref_records[0]["loss"]  # the first step changed the weights


@pytest.fixture(scope="module")
def one_process(store):
    """The rewritten example's 2 steps on one process: the reference of the domain 2 and 3
    runs below (trained once; the trainer is seeded, so it is the same run either way)."""
    return _train(_on_sample(store, {"data": "none", "tensor": 1, "domain": 1}))


def _domain2_worker(rank, world, store):
    return _train(_on_sample(store, {"data": "none", "tensor": 1, "domain": 2}))


def test_the_rewritten_example_trains_at_domain_2_as_on_one_process(store, one_process):
    ref_records, ref_params = one_process
    records, params = run_on_ranks(_domain2_worker, 2, store, timeout=300)[0]
    _assert_trained_alike(records, params, ref_records, ref_params)
    # CREDIT's LinearWarmupCosineScheduler (warmup_steps 1, stepped per batch): its warmup
    # starts at 0 (step / warmup_steps), then the cosine from learning_rate
    assert ref_records[0]["loss"] > 0 and ref_records[0]["lr"] == 0.0
    assert ref_records[1]["lr"] == pytest.approx(1e-3, rel=1e-15)


def _domain3_worker(rank, world, store):
    return _train(_on_sample(store, {"data": "none", "tensor": 1, "domain": 3}))


def test_the_rewritten_example_trains_at_domain_3_where_a_rank_owns_no_deep_row(store, one_process):
    """H=32 at domain 3: the deepest stage has 2 rows, rank 2 owns none of them; its
    FeedForward's 1x1 convs (left alone, row-local) run on 0 rows (``layers/empty_rows.py``)."""
    ref_records, ref_params = one_process
    records, params = run_on_ranks(_domain3_worker, 3, store, timeout=300)[0]
    _assert_trained_alike(records, params, ref_records, ref_params, keys=("loss", "grad_norm"))


def test_timestep_and_level_coord_are_honoured_by_the_dataset(store):
    from credit_parallel.data import ERA5Dataset

    kwargs = {"upper_air_variables": ["T"], "surface_variables": ["SP"], "normalize": False}
    every = ERA5Dataset(store, **kwargs, timestep="6h", level_coord="level")
    twelve = ERA5Dataset(store, **kwargs, timestep="12h")
    assert list(twelve.times) == list(every.times[::2]) and len(every.times) == 16
    assert torch.equal(twelve[1]["x"], every[2]["x"]) and torch.equal(twelve[1]["y"], every[3]["y"])
    with pytest.raises(ValueError, match=r"timestep '5h' is not a multiple of .* 0 days 06:00"):
        ERA5Dataset(store, **kwargs, timestep="5h")
    with pytest.raises(ValueError, match=r"level_coord 'plev' is not a dimension"):
        ERA5Dataset(store, **kwargs, level_coord="plev")


def test_the_examples_interpolation_and_padding_pass_preflight_at_domain_2(store):
    """The example's interpolation to the global size and its earth padding (CREDIT's
    TensorPadding in the model's forward) are exact at domain > 1
    (``credit_interp.DomainInterpModel``, tests/test_credit_interp.py): no longer refused."""
    from credit_parallel.train.preflight import check_run

    conf = _on_sample(store, {"data": "none", "tensor": 1, "domain": 2})
    conf["model"].update(
        interp=True,
        padding_conf={"activate": True, "mode": "earth", "pad_lat": [8, 8], "pad_lon": [16, 16]},
        global_window_size=[3, 3, 3, 1],  # windows that tile the padded stages 24 / 12 / 6 / 3
        local_window_size=3,
    )
    with pytest.warns(UserWarning):
        run, dims = check_run(conf, 2)
    assert dims.domain == 2 and run.trainer.steps == 2
