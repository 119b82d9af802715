"""miles-credit v2026.2.0's local-data gen-2 examples (``config/gen_2/examples/``), transcribed
as dicts (CI has no network): ``example-v2026.2.yml`` and ``example-end-to-end.yml``.

What maps: ``dataset_type: local``, ``trainer.type: gen2``, CREDIT's ``%Y*`` path templates (one
glob of per-year stores), the static store, the validation block (same stores, its date range),
``concat`` / ``reconstruct`` / ``to_device`` blocks, ``batches_per_epoch`` x epochs as optimizer
steps, and the bookkeeping sections (save_loc, metrics, inference, pbs) dropped with one warning.
As written each is refused only for the files it names on CREDIT's cluster (the bridgescaler
JSON, the latitude store); its ``bridgescaler_transform`` / ``log_transform`` / ``exp_transform``
blocks and ``loss.type: base`` are read (tests/test_credit_bridgescaler.py trains them).  With
those blocks replaced by CREDIT's ``era5_normalizer`` preblock and the flat MSE loss keys (the
netCDF rewrite), each maps whole; ``example-v2026.2.yml`` plans at domain 2 through
``credit-parallel plan`` and, pointed at per-year stores written from the sample store (its
``%Y*`` template kept), trains 2 steps at domain 2 as on one process (float64, 1e-10).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import yaml

from credit_examples import DIAGNOSTIC as _DIAGNOSTIC
from credit_examples import V2026_BASE as _BASE
from credit_examples import V2026_LEVELS as _LEVELS
from credit_examples import V2026_STATIC as _STATIC
from credit_examples import example_end_to_end as _end_to_end
from credit_examples import example_v2026 as _v2026
from credit_parallel.layout.credit_gen2 import credit_gen2_conf
from credit_parallel.layout.credit_gen2_blocks import epoch_steps
from credit_parallel.layout.run_config import RunConfig
from credit_parallel.testing import run_on_ranks
from test_credit_examples import H, W, _assert_trained_alike, _train
from test_credit_stores import data  # noqa: F401  (the per-year stores fixture)

# as written, only the files on CREDIT's cluster are missing: the scaler and the latitudes
_ABSENT = [
    "preblocks.per_step.scaler.args.scaler_path",
    "postblocks.per_step.scaler.args.scaler_path",
    "loss.args.scaler_path",
    "loss.args.latitude_weights",
]
_REFUSED_BLOCKS = {"v2026": _ABSENT, "end_to_end": _ABSENT}
_EXAMPLES = {"v2026": _v2026, "end_to_end": _end_to_end}


def _with_normaliser(conf: dict, mean: str, std: str) -> dict:
    """The one rewrite: CREDIT's ``era5_normalizer`` preblock (netCDF mean / std) for the
    BridgeScaler blocks, the flat latitude-weighted MSE loss keys for ``loss.type: base``."""
    conf["preblocks"] = {
        "per_step": {
            "norm": {"type": "era5_normalizer", "args": {"mean_path": mean, "std_path": std}},
            "concat": {"type": "concat"},
        }
    }
    conf["postblocks"] = {"per_step": {"reconstruct": {"type": "reconstruct"}}}
    latitude_weights = conf["loss"]["args"]["latitude_weights"]
    conf["loss"] = {
        "training_loss": "mse",
        "use_latitude_weights": True,
        "latitude_weights": latitude_weights,
    }
    return conf


@pytest.mark.parametrize("name", sorted(_EXAMPLES))
def test_each_local_example_is_refused_only_for_its_absent_files(name):
    """Its bridgescaler blocks and ``loss.type: base`` are read (tests/test_credit_bridgescaler.py);
    the scaler file and the latitude store it names are not on this machine."""
    from miles_credit import import_credit

    import_credit("credit.trainers.utils")
    with pytest.raises(ValueError) as refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        credit_gen2_conf(_EXAMPLES[name]())
    lines = [line for line in str(refused.value).splitlines() if line.startswith("  - ")]
    assert [line[4:].split(" = ")[0].split(":")[0] for line in lines] == _REFUSED_BLOCKS[name]
    assert "does not exist" in lines[0] and "bridgescaler_pre.json" in lines[0]
    assert f"{len(lines)} key(s) cannot be honoured" in str(refused.value)


@pytest.mark.parametrize("name", sorted(_EXAMPLES))
def test_each_local_example_maps_whole_with_the_era5_normaliser(name):
    from miles_credit import import_credit

    import_credit("credit.trainers.utils")
    conf = _with_normaliser(_EXAMPLES[name](), "/m.nc", "/s.nc")
    with pytest.warns(UserWarning, match=r"save_loc.*inference.*pbs.*bookkeeping"):
        mapped = credit_gen2_conf(conf)
    d, trainer = mapped["data"], mapped["trainer"]
    assert d["path"] == _BASE + "/all_in_one/ERA5_mlevel_1deg_6h_subset_[0-9][0-9][0-9][0-9]*"
    assert d["static_path"] == _STATIC and d["levels"] == _LEVELS
    assert (d["mean_path"], d["std_path"]) == ("/m.nc", "/s.nc")
    assert d["diagnostic_variables"] == _DIAGNOSTIC
    assert d["upper_air_variables"][0] == "u_component_of_wind"
    assert d["valid_time_slice"] == ["2019-01-01", "2020-12-31"]
    assert trainer["steps"] == {"v2026": 350, "end_to_end": 10}[name]
    assert trainer["schedule_steps"] == 500000 and trainer["use_ema"] is True
    assert not {"metrics", "inference", "pbs", "save_loc", "preblocks"} & set(mapped)


def test_epochs_count_optimizer_steps_as_credits_trainer():
    """``trainer_gen2.py``: a run trains epochs start_epoch .. epochs (num_epoch of them per
    job, then a requeue), each batches_per_epoch batches, an optimizer step every
    grad_accum_every batches and at the epoch's last batch."""
    trainer = _v2026()["trainer"]  # 5 batches, 70 epochs (num_epoch 1 per job)
    assert epoch_steps(trainer) == 350
    assert epoch_steps(trainer, per_epoch=True) == 5
    assert epoch_steps({**trainer, "num_epoch": 3, "grad_accum_every": 2}) == 70 * 3
    assert epoch_steps({**trainer, "start_epoch": 65}) == 25  # a requeued run's rest
    assert epoch_steps(_end_to_end()["trainer"]) == 10  # 2 epochs of 5
    assert epoch_steps({**trainer, "batches_per_epoch": 0}) is None  # the whole dataset
    conf = _with_normaliser(_v2026(), "/m.nc", "/s.nc")
    del conf["trainer"]["scheduler"]["total_steps"]
    conf["trainer"]["grad_accum_every"] = 2
    with pytest.warns(UserWarning):
        assert credit_gen2_conf(conf)["trainer"]["steps"] == 70 * 3  # ceil(5 / 2) per epoch


def test_the_template_trains_credits_count_and_says_so_in_one_line():
    """``example-v2026.2.yml``: CREDIT trains 70 epochs x 5 batches = 350 optimizer steps;
    ``scheduler.total_steps: 500000`` is only the learning-rate schedule's length (its cosine
    runs over 500000 steps, of which the run trains 350)."""
    from credit_parallel.train.schedule import build_scheduler

    conf = _with_normaliser(_v2026(), "/m.nc", "/s.nc")
    with pytest.warns(UserWarning) as caught:
        trainer = credit_gen2_conf(conf)["trainer"]
    assert (trainer["steps"], trainer["schedule_steps"]) == (350, 500000)
    lines = [str(w.message) for w in caught if "only the learning-rate" in str(w.message)]
    assert lines == [
        "CREDIT gen-2 config: trains 350 optimizer steps as CREDIT counts them ((epochs - "
        "start_epoch) x batches_per_epoch / grad_accum_every); trainer.scheduler.total_steps = "
        "500000 is only the learning-rate schedule's length"
    ]
    with pytest.warns(UserWarning):
        tc = RunConfig.from_conf(conf).trainer
    # CREDIT's LinearWarmupCosineScheduler, stepped per batch: warmup 1000 then the cosine
    # over 500000 steps, not over 350 (5 batches per epoch, an optimizer step each)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=tc.lr)
    schedule = build_scheduler(optimizer, tc, step=999)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(tc.lr * 999 / 1000, rel=1e-15)
    schedule.seek(1000 + 249500)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * (1e-3 + 1e-5), rel=1e-12)
    assert tc.steps == 350 and tc.schedule_steps == 500000


def test_another_dataset_type_and_a_differing_validation_block_are_named():
    conf = _with_normaliser(_v2026(), "/m.nc", "/s.nc")
    variables = conf["validation_data"]["source"]["ERA5"]["variables"]
    variables["prognostic"]["path"] = _BASE + "/all_in_one/ERA5_mlevel_1deg_6h_subset_%Y"
    with pytest.warns(UserWarning):  # %Y and %Y*: the same glob, the same stores
        assert credit_gen2_conf(copy.deepcopy(conf))["data"]["valid_time_slice"][0] == "2019-01-01"
    conf["data"]["source"]["ERA5"]["dataset_type"] = "weatherbench2_era5"
    conf["validation_data"]["source"]["ERA5"]["variables"]["static"]["path"] = "/other.zarr"
    conf["validation_data"]["history_len"] = 2
    conf["postblocks"]["per_step"]["reconstruct"]["args"] = {"detach": True}
    with pytest.raises(ValueError) as refused:
        credit_gen2_conf(conf)
    text = str(refused.value)
    assert "data.source.ERA5.dataset_type = 'weatherbench2_era5'" in text
    assert "validation_data.source.ERA5 differs from data.source.ERA5" in text
    assert "validation_data.history_len = 2 differs from data.history_len = 1" in text
    assert "postblocks.per_step.reconstruct.args.detach: true" in text


def _shrunk(conf: dict, parallelism: dict) -> dict:
    conf["trainer"].update(parallelism=parallelism, thread_workers=0)
    conf["model"].update(dim=[8, 16, 32, 64], depth=[1, 1, 1, 1], dim_head=8)
    return conf


def test_example_v2026_plans_at_domain_2_through_the_cli(tmp_path, capsys):
    """``credit-parallel plan --config example-v2026.2.yml --world-size 2``: its grid (181 x
    360, earth padding 37/38 x 12, interpolation) at domain 2, its model at a smaller width."""
    from credit_parallel import cli
    from miles_credit import import_credit

    import_credit("credit.trainers.utils")
    import_credit("credit.models.crossformer")
    conf = _with_normaliser(_v2026(), "/m.nc", "/s.nc")
    path = tmp_path / "example-v2026.2.yml"
    path.write_text(yaml.safe_dump(_shrunk(conf, {"data": "none", "tensor": 1, "domain": 2})))
    assert cli.main(["plan", "--config", str(path), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "model wxformer (CrossFormer" in out and "dp=1 x tp=1 x domain=2" in out
    assert "[0:91) of 181" in out and "[91:181) of 181" in out
    assert "== Constraints (0 violated) ==" in out


def _on_stores(data, parallelism: dict) -> dict:  # noqa: F811
    """``example-v2026.2.yml`` (normaliser rewrite) pointed at per-year stores written from the
    sample store, its ``%Y*`` template kept: the sample store's names, its last two days as the
    validation range, 2 batches of one epoch (no total_steps: the epoch count gives the steps),
    a tiny model in float64."""
    conf = _with_normaliser(_v2026(), data["mean"], data["std"])
    source = conf["data"]["source"]["ERA5"]
    source["levels"] = [500.0, 850.0]
    per_year = str(data["root"] / "all_in_one" / "ERA5_plevel_6h_%Y*")
    source["variables"] = {
        "prognostic": {"vars_3D": ["T", "U", "V"], "vars_2D": ["SP"], "path": per_year},
        "diagnostic": {"vars_2D": ["t2m"], "path": per_year},
        "dynamic_forcing": {"vars_2D": ["tsi"], "path": per_year},
        "static": {"vars_2D": ["orography", "land_sea_mask"], "path": data["static"]},
    }
    conf["data"].update(start_datetime="2020-01-01", end_datetime="2020-01-02T18")
    valid = conf["validation_data"]
    valid.update(start_datetime="2020-01-03", end_datetime="2020-01-04T18")
    valid["source"] = copy.deepcopy(conf["data"]["source"])
    trainer = conf["trainer"]
    trainer.update(batches_per_epoch=2, epochs=1, train_batch_size=2, dtype="float64")
    del trainer["scheduler"]["total_steps"]
    trainer["scheduler"]["warmup_steps"] = 1
    _shrunk(conf, parallelism)
    conf["model"].update(
        image_height=H,
        image_width=W,
        levels=2,
        channels=3,
        surface_channels=1,
        input_only_channels=3,
        output_only_channels=1,
        dim=[4, 8, 16, 32],
        dim_head=4,
        padding_conf={"activate": True, "mode": "earth", "pad_lat": [8, 8], "pad_lon": [16, 16]},
        global_window_size=[3, 3, 3, 1],  # windows that tile the padded stages 24 / 12 / 6 / 3
        local_window_size=3,
        cross_embed_kernel_sizes=[[2, 4], [2, 4], [2, 4], [2, 4]],
    )
    return conf


def _domain2_worker(rank, world, data):  # noqa: F811
    return _train(_on_stores(data, {"data": "none", "tensor": 1, "domain": 2}))


def test_example_v2026_on_per_year_stores_trains_at_domain_2_as_on_one_process(data):  # noqa: F811
    one = {"data": "none", "tensor": 1, "domain": 1}
    with pytest.warns(UserWarning, match="bookkeeping"):
        run = RunConfig.from_conf(_on_stores(data, one))
    assert run.data.path == data["glob"][: -len("*.zarr")] + "[0-9][0-9][0-9][0-9]*"
    assert run.trainer.steps == 2
    assert run.data.static_path == data["static"] and run.data.diagnostic_variables == ("t2m",)
    assert run.data.valid_time_slice == ("2020-01-03", "2020-01-04T18")
    ref_records, ref_params = _train(_on_stores(data, one))
    records, params = run_on_ranks(_domain2_worker, 2, data, timeout=300)[0]
    _assert_trained_alike(records, params, ref_records, ref_params)
