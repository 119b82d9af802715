"""The typed run configuration: every trainer/data/model key parsed once, errors name key and value."""

from __future__ import annotations

import dataclasses

import pytest

from credit_parallel.layout.run_config import (
    DEFAULT_DIST_TIMEOUT_S,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrainerConfig,
    config_problems,
    trainer_option,
)
from credit_parallel.train.preflight import dist_timeout_s, validate_run

__all__: list[str] = []

PAR = {"data": "none", "tensor": 1, "domain": 1}


def test_defaults_and_types_of_a_minimal_config():
    rc = RunConfig.from_conf({"trainer": {"parallelism": PAR}})
    assert dict(rc.parallelism) == PAR
    assert rc.trainer == TrainerConfig()
    assert rc.trainer.dist_timeout_s == DEFAULT_DIST_TIMEOUT_S and rc.trainer.log_every == 1
    assert rc.data.history_len == 1 and rc.data.as_5d is False and rc.data.normalize is True
    assert rc.model.type is None


def test_values_are_parsed_and_frozen():
    conf = {
        "trainer": {"parallelism": PAR, "steps": 7, "lr": 1, "amp": True, "save_dir": "ck"},
        "data": {"path": "d.zarr", "levels": [500, 850], "history_len": 2, "as_5d": True},
        "model": {"type": "unet", "in_channels": 4},
    }
    rc = RunConfig.from_conf(conf)
    assert rc.trainer.steps == 7 and isinstance(rc.trainer.lr, float) and rc.trainer.amp
    assert rc.data.levels == (500, 850) and rc.data.history_len == 2 and rc.data.as_5d
    assert rc.model.as_dict() == {"type": "unet", "in_channels": 4}
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.trainer.steps = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    "section, key, value, words",
    [
        ("trainer", "steps", 0, ("trainer.steps", "0")),
        ("trainer", "batch_size", 2.5, ("trainer.batch_size", "2.5")),
        ("trainer", "amp", "yes", ("trainer.amp", "'yes'")),
        ("trainer", "nonfinite", "ignore", ("trainer.nonfinite", "'ignore'", "skip")),
        ("trainer", "dist_timeout_s", "10m", ("trainer.dist_timeout_s", "'10m'")),
        ("trainer", "log_every", 0, ("trainer.log_every", "0")),
        ("trainer", "resume", 1, ("trainer.resume", "1")),
        ("trainer", "stpes", 10, ("'stpes'", "trainer", "known keys")),
        ("data", "history_len", 0, ("data.history_len", "0")),
        ("data", "as_5d", "true", ("data.as_5d", "'true'")),
        ("data", "levels", "500", ("data.levels", "'500'")),
        ("data", "histroy_len", 2, ("'histroy_len'", "data")),
        ("model", "type", 3, ("model.type", "3")),
    ],
)
def test_bad_values_name_the_key_and_the_value(section, key, value, words):
    conf = {"trainer": {"parallelism": PAR}, "data": {}, "model": {}}
    conf[section][key] = value
    with pytest.raises(ValueError) as info:
        RunConfig.from_conf(conf)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_every_bad_key_is_reported_at_once():
    conf = {
        "trainer": {"parallelism": PAR, "steps": -1, "amp": 3, "nope": 1},
        "data": {"forecast_len": "2"},
    }
    problems = config_problems(conf)
    text = "\n".join(problems)
    assert len(problems) == 4, problems
    for key in ("trainer.steps", "trainer.amp", "'nope'", "data.forecast_len"):
        assert key in text


def test_single_options_use_the_same_parser_as_the_dataclass():
    conf = {"trainer": {"dist_timeout_s": 30, "amp": True}}
    assert trainer_option(conf, "dist_timeout_s") == 30.0 == dist_timeout_s(conf)
    assert trainer_option(conf, "amp") is True
    assert trainer_option({}, "batch_size") == TrainerConfig().batch_size
    with pytest.raises(ValueError, match="trainer.amp"):
        trainer_option({"trainer": {"amp": "on"}}, "amp")


def test_credit_train_batch_size_is_the_same_key_for_trainer_and_planner():
    # plan accepted trainer.train_batch_size while the trainer rejected it; now both read it
    conf = {"trainer": {"parallelism": PAR, "train_batch_size": 3}}
    assert TrainerConfig.from_conf(conf).batch_size == 3
    assert trainer_option(conf, "batch_size") == 3
    with pytest.raises(ValueError, match="same setting"):
        TrainerConfig.from_conf({"trainer": {"batch_size": 2, "train_batch_size": 3}})


def test_preflight_reports_trainer_and_data_keys_through_the_typed_config():
    conf = {
        "trainer": {"parallelism": PAR, "grad_accum": 0},
        "data": {"as_5d": "no"},
        "model": {"type": "unet", "in_channels": 4, "out_channels": 4, "image_height": 16},
    }
    text = "\n".join(validate_run(conf, 1))
    assert "trainer.grad_accum" in text and "data.as_5d" in text


def test_dataclass_fields_are_exactly_the_parsed_keys():
    from credit_parallel.layout import run_config

    assert [f.name for f in dataclasses.fields(TrainerConfig)] == list(run_config._TRAINER_KEYS)
    assert [f.name for f in dataclasses.fields(DataConfig)] == list(run_config._DATA_KEYS)
    assert {f.name for f in dataclasses.fields(ModelConfig)} == {"type", "options"}
    defaults = {k: d for k, (d, _) in run_config._TRAINER_KEYS.items()}
    assert dataclasses.asdict(TrainerConfig()) == defaults


def test_data_reader_key_defaults_to_auto_and_names_itself_when_wrong():
    assert DataConfig.from_conf({}).reader == "auto"
    for reader in ("auto", "tensorstore", "zarr"):
        assert DataConfig.from_conf({"data": {"reader": reader}}).reader == reader
    with pytest.raises(ValueError, match="data.reader must be"):
        DataConfig.from_conf({"data": {"reader": "fast"}})
