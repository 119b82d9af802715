"""``trainer.use_ema``: miles-credit's own EMATracker in the trainer, exact under every layout.

The reference is a single-process run of the plain trainer with miles-credit's ``EMATracker``
updated by hand after each step (what CREDIT's trainer does); the parallel runs (domain 2 on 17
uneven rows, FSDP2 over dp 2, tensor 2 x domain 2 (4 ranks)) build the tracker through
``trainer.use_ema``.  Everything in float64 (the shadow is CREDIT's float32), compared at
1e-10.  A run resumed from a checkpoint (under another layout too) continues the uninterrupted
run's EMA; validation runs on the EMA weights and leaves the training weights bit for bit; the
forecast loads the EMA weights on request.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (imported once here so forked workers inherit it)

from credit_parallel.data import write_sample_dataset
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.trainer import Trainer
from miles_credit import import_credit
from sample_conf import unet_run_conf

__all__: list[str] = []

TOL = 1e-10
H, W = 17, 32
DECAY = 0.2  # the adaptive decay (1 + s) / (10 + s) is below it at step 1, above from step 2
# one sample per dp rank: the global batch of 2 the single-process reference takes
FSDP2_DP2 = {"data": "fsdp2", "tensor": 1, "domain": 1}
EMATracker = import_credit("credit.trainers.base_trainer").EMATracker


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(
        write_sample_dataset(tmp_path_factory.mktemp("data") / "s.zarr", n_times=40, nlat=H, nlon=W)
    )


def _conf(store, parallelism=None, *, ema=True, **trainer):
    base = {"steps": 10, "batch_size": 2, "lr": 0.01, "seed": 3, "dtype": "float64"}
    base.update(use_ema=ema, ema_decay=DECAY, val_batches=1)
    data = {"valid_time_slice": [33, 40]}
    return unet_run_conf(
        store, H, W, time_slice=[0, 33], parallelism=parallelism, data=data, **{**base, **trainer}
    )


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _params(trainer):
    return {k: _full(v) for k, v in trainer.model.state_dict().items()}


def _shadow(trainer):
    """The full shadow (CREDIT's ``state_dict`` gathers DTensor shards: every rank calls it)."""
    state = trainer.ema.state_dict()
    return {k: v.clone() for k, v in state["shadow"].items()}, state["step"]


def _reference(store, steps):
    """The plain single-process trainer with CREDIT's tracker updated after each step."""
    trainer = Trainer(_conf(store, ema=False))
    tracker = EMATracker(trainer.model, decay=DECAY)
    for _ in range(steps):
        trainer.train_step()
        tracker.update(trainer.model)
    return trainer, tracker


def _worker(rank, world, store, path):
    out = {}
    for name, layout in (
        ("domain2", {"data": "none", "tensor": 1, "domain": 2}),
        ("fsdp2_dp2", FSDP2_DP2),
    ):
        trainer = Trainer(_conf(store, layout, batch_size=1 if layout is FSDP2_DP2 else 2))
        for _ in range(3):
            trainer.train_step()
        out[name] = _shadow(trainer)
    # resume under domain 2: 2 steps, save, a new trainer loads and runs 2 more
    domain2 = {"data": "none", "tensor": 1, "domain": 2}
    first = Trainer(_conf(store, domain2))
    for _ in range(2):
        first.train_step()
    first.save(f"{path}/domain2")
    resumed = Trainer(_conf(store, domain2))
    resumed.resume_latest(f"{path}/domain2")
    for _ in range(2):
        resumed.train_step()
    out["resumed_domain2"] = (_shadow(resumed), _params(resumed))
    # FSDP2 over dp 2 writes a checkpoint the test process resumes in one process
    fsdp = Trainer(_conf(store, FSDP2_DP2, batch_size=1))
    for _ in range(2):
        fsdp.train_step()
    fsdp.save(f"{path}/fsdp2")
    # under FSDP2 the EMA weights go into the shards the next all-gather reads, and back
    from credit_parallel.train.ema import ema_weights

    before = _params(fsdp)
    with ema_weights(fsdp.ema, fsdp.model):
        inside = _params(fsdp)
    out["fsdp2_swap"] = (before, inside, _params(fsdp), _shadow(fsdp)[0])
    # validation on the EMA weights, the training weights back bit for bit afterwards
    before = _params(resumed)
    out["evaluate"] = resumed.evaluate()
    after = _params(resumed)
    out["restored"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


@pytest.fixture(scope="module")
def parallel(store, tmp_path_factory):
    path = tmp_path_factory.mktemp("ema")
    return path, run_on_ranks(_worker, 2, store, str(path), timeout=240)


def _four_rank_worker(rank, world, store):
    out = {}
    for name, layout, batch in (
        ("tp2_domain2", {"data": "none", "tensor": 2, "domain": 2}, 2),
        ("ddp2_domain2", {"data": "ddp", "tensor": 1, "domain": 2}, 1),
    ):
        trainer = Trainer(_conf(store, layout, batch_size=batch))
        for _ in range(3):
            trainer.train_step()
        out[name] = _shadow(trainer)
    return out


def test_ema_under_tensor2_x_domain2_and_ddp2_x_domain2_equals_the_single_process_one(store):
    _, tracker = _reference(store, 3)
    for out in run_on_ranks(_four_rank_worker, 4, store, timeout=300):
        for layout in ("tp2_domain2", "ddp2_domain2"):
            shadow, step = out[layout]
            assert step == 3 and _max_err(shadow, tracker.shadow) <= TOL, layout


def _max_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("layout", ["domain2", "fsdp2_dp2"])
def test_ema_after_three_steps_equals_a_single_process_ema_tracker(store, parallel, layout):
    _, tracker = _reference(store, 3)
    reference = dict(tracker.shadow)
    assert tracker.step == 3
    for out in parallel[1]:
        shadow, step = out[layout]
        assert step == 3
        assert _max_err(shadow, reference) <= TOL
    # the shadow is not the weights (the average is real) nor the initial weights
    trainer = _reference(store, 0)[0]
    start = {k: v.float() for k, v in _params(trainer).items()}
    assert _max_err(reference, start) > 1e-4


def test_resumed_run_continues_the_uninterrupted_ema_and_weights(store, parallel):
    ref, tracker = _reference(store, 4)
    for out in parallel[1]:
        shadow, step = out["resumed_domain2"][0]
        assert step == 4 and _max_err(shadow, tracker.shadow) <= TOL
        assert _max_err(out["resumed_domain2"][1], _params(ref)) <= TOL
    # a checkpoint of FSDP2 over dp 2 resumed in one process: the same EMA at step 4
    one = Trainer(_conf(store))
    one.resume_latest(parallel[0] / "fsdp2")
    assert one.ema.step == 2
    for _ in range(2):
        one.train_step()
    assert one.ema.step == 4 and _max_err(dict(one.ema.shadow), tracker.shadow) <= TOL
    assert _max_err(_params(one), _params(ref)) <= TOL


def test_validation_runs_on_the_ema_weights_and_restores_the_training_weights(store, parallel):
    ref, tracker = _reference(store, 4)
    trained = ref.evaluate()  # the training weights
    tracker.swap(ref.model)  # CREDIT's own swap: the EMA weights in the model
    on_ema = ref.evaluate()
    assert trained.keys() == on_ema.keys()
    assert max(abs(trained[k] - on_ema[k]) for k in trained) > 1e-6
    for out in parallel[1]:
        assert out["restored"]
        assert out["evaluate"].keys() == on_ema.keys()
        assert max(abs(out["evaluate"][k] - on_ema[k]) for k in on_ema) <= TOL


def test_fsdp2_shards_hold_the_ema_weights_inside_the_block_and_the_training_weights_after(
    parallel,
):
    for out in parallel[1]:
        before, inside, after, shadow = out["fsdp2_swap"]
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(torch.equal(inside[k], shadow[k].double()) for k in shadow)
        assert any(not torch.equal(inside[k], before[k]) for k in shadow)


def test_a_checkpoint_without_ema_starts_the_average_at_the_loaded_weights(store, tmp_path):
    plain = Trainer(_conf(store, ema=False))
    plain.train_step()
    plain.save(tmp_path)
    resumed = Trainer(_conf(store))
    resumed.resume_latest(tmp_path)
    assert resumed.ema.step == 0
    weights = {k: v.float() for k, v in _params(resumed).items()}
    assert _max_err(dict(resumed.ema.shadow), weights) == 0.0


def test_forecast_loads_the_ema_weights_of_a_checkpoint(store, parallel):
    from credit_parallel.forecast.weights import load_forecast_weights
    from credit_parallel.train.checkpoint import CheckpointError

    _, tracker = _reference(store, 2)
    model = Trainer(_conf(store, ema=False)).model
    load_forecast_weights(model, parallel[0] / "fsdp2", ema=True)
    got = {k: v.float() for k, v in _params_of(model).items()}
    assert _max_err(got, tracker.shadow) <= TOL
    # a checkpoint without EMA weights is refused by name
    plain = Trainer(_conf(store, ema=False))
    plain.train_step()
    path = plain.save(parallel[0] / "plain")
    with pytest.raises(CheckpointError, match="no EMA weights"):
        load_forecast_weights(model, path, ema=True)


def test_forecast_reads_a_miles_credit_checkpoint_ema_file_and_takes_the_ema_flag(store, tmp_path):
    import argparse

    from credit_parallel.forecast.command import build_arguments
    from credit_parallel.forecast.weights import load_forecast_weights

    ref, tracker = _reference(store, 2)
    path = tmp_path / "checkpoint_ema.pt"  # what CREDIT's trainer writes beside checkpoint.pt
    torch.save({"epoch": 0, "model_state_dict": tracker.state_dict()}, path)
    model = Trainer(_conf(store, ema=False)).model
    load_forecast_weights(model, path)
    got = {k: v.float() for k, v in _params_of(model).items()}
    assert _max_err(got, tracker.shadow) <= TOL
    ap = argparse.ArgumentParser()
    build_arguments(ap)
    argv = ["--config", "c", "--checkpoint", "k", "--steps", "1", "--output", "o"]
    argv += ["--init-times", "2020-01-01"]
    assert ap.parse_args([*argv, "--ema"]).ema and not ap.parse_args(argv).ema


def _params_of(model):
    return {k: _full(v) for k, v in model.state_dict().items()}


def test_ema_keys_are_parsed_and_a_credit_gen2_use_ema_is_accepted():
    from credit_parallel.layout.credit_gen2 import _trainer_section
    from credit_parallel.layout.run_config import TrainerConfig

    tc = TrainerConfig.from_conf({"trainer": {"use_ema": True, "ema_decay": 0.999}})
    assert tc.use_ema and tc.ema_decay == 0.999
    assert not TrainerConfig().use_ema and TrainerConfig().ema_decay == 0.9999
    for bad in (1.5, -0.1, "0.9", True):
        with pytest.raises(ValueError, match="trainer.ema_decay must be a number in"):
            TrainerConfig.from_conf({"trainer": {"ema_decay": bad}})
    problems, dropped = [], []
    out = _trainer_section({"trainer": {"use_ema": True, "ema_decay": 0.99}}, {}, problems, dropped)
    assert not problems and not dropped
    assert out["use_ema"] is True and out["ema_decay"] == 0.99


def test_preflight_names_an_ema_tracker_that_cannot_be_imported(store, monkeypatch):
    import sys

    from credit_parallel.train.preflight import validate_run

    assert validate_run(_conf(store), 1) == []
    # what a miles-credit without cftime gives: its base_trainer's import chain fails
    monkeypatch.setitem(sys.modules, "credit.trainers.base_trainer", None)
    (problem,) = validate_run(_conf(store), 1)
    for words in ("trainer.use_ema", "EMATracker", "cftime", "trainer.use_ema: false"):
        assert words in problem, (words, problem)
    assert validate_run(_conf(store, ema=False), 1) == []


def test_check_weights_and_ema_flag_read_miles_credit_files_as_credit_writes_them(store, tmp_path):
    """``checkpoint_ema.pt`` ({"model_state_dict": {"shadow", "decay", "step"}}) passes the
    CLI's pre-check; ``--ema`` with ``checkpoint.pt`` reads the ``checkpoint_ema.pt`` beside it
    (the training weights otherwise), and is refused by name without one."""
    from credit_parallel.forecast.weights import check_weights, load_forecast_weights
    from credit_parallel.train.checkpoint import CheckpointError

    ref, tracker = _reference(store, 2)
    conf = _conf(store, ema=False)
    trained = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    ema_path, plain_path = tmp_path / "checkpoint_ema.pt", tmp_path / "checkpoint.pt"
    torch.save({"epoch": 0, "model_state_dict": tracker.state_dict()}, ema_path)
    torch.save({"epoch": 0, "model_state_dict": trained}, plain_path)
    check_weights(conf["model"], ema_path)
    check_weights(conf["model"], ema_path, ema=True)
    check_weights(conf["model"], plain_path, ema=True)
    model = Trainer(conf).model
    manifest = load_forecast_weights(model, plain_path, ema=True)
    assert manifest["ema"] and manifest["checkpoint"] == str(ema_path)
    got = {k: v.float() for k, v in _params_of(model).items()}
    assert _max_err(got, tracker.shadow) <= TOL
    assert _max_err(_params_of(model), trained) > 1e-6
    manifest = load_forecast_weights(model, plain_path)
    assert not manifest["ema"] and manifest["checkpoint"] == str(plain_path)
    assert _max_err(_params_of(model), trained) == 0.0
    ema_path.unlink()
    for call in (
        lambda: load_forecast_weights(model, plain_path, ema=True),
        lambda: check_weights(conf["model"], plain_path, ema=True),
    ):
        with pytest.raises(CheckpointError, match="checkpoint.pt.*pass checkpoint_ema.pt"):
            call()
