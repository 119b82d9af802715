"""CREDIT's schedulers (``credit/scheduler.py``) and ``num_epoch``, against miles-credit's own
classes stepped as its gen-2 trainer steps them.

The reference is CREDIT's loop written out: ``load_scheduler`` builds the class on an AdamW,
``fit`` runs epochs ``start_epoch`` .. ``start_epoch + num_epoch - 1``, ``train_one_epoch``
steps ``lambda`` as the epoch starts, the optimizer steps every ``grad_accum_every`` batches
and at the epoch's last batch, ``update_on_batch`` schedulers step after every batch and
``update_on_epoch`` ones after the epoch (``plateau`` with the epoch's mean training loss).
The rate of every optimizer step equals the run's (bitwise), fresh and resumed at any step.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from credit_parallel.data import write_sample_dataset
from credit_parallel.layout.credit_gen2 import credit_gen2_conf
from credit_parallel.train.schedule import (
    CreditSchedule,
    build_scheduler,
    job_end_step,
    schedule_state,
)
from miles_credit import import_credit
from sample_conf import unet_run_conf

SCHEDULERS = {
    "linear-warmup-cosine": {"warmup_steps": 4, "total_steps": 13, "min_lr": 1e-5},
    "cosine-annealing-restarts": {
        "first_cycle_steps": 5,
        "cycle_mult": 1.5,
        "max_lr": 1e-3,
        "min_lr": 1e-6,
        "warmup_steps": 2,
        "gamma": 0.7,
    },
    "cosine-annealing": {"T_max": 3, "eta_min": 1e-6},
    "lambda": {},
    "plateau": {"mode": "min", "factor": 0.5, "patience": 0, "threshold": 0.0},
}
LR = 1e-3


def _loss(step: int) -> float:
    """The training loss of optimizer step ``step``: falls, then stalls (plateau reduces)."""
    losses = [5.0, 4.0, 3.0, 3.5, 3.2, 4.0, 4.5, 5.0, 5.0, 5.0, 2.0, 2.0, 2.0, 2.1, 2.0]
    return losses[step % 15] if step < 15 else 6.0


def _credit_rates(kind: str, epochs: int, batches: int, accum: int) -> list[float]:
    """The rate of each optimizer step of CREDIT's gen-2 trainer (trainers/base_trainer.py
    ``fit``, trainer_gen2.py ``train_one_epoch``) with CREDIT's own scheduler."""
    load_scheduler = import_credit("credit.scheduler").load_scheduler
    update_on_batch = import_credit("credit.scheduler").update_on_batch
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=LR, betas=(0.9, 0.95))
    block = {"scheduler_type": kind, **SCHEDULERS[kind]}
    conf = {"trainer": {"use_scheduler": True, "scheduler": block}}
    rates, step = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler = load_scheduler(optimizer, conf)
        for _ in range(epochs):
            if kind == "lambda":
                scheduler.step()
            losses = []
            for b in range(batches):
                if (b + 1) % accum == 0 or b == batches - 1:
                    rates.append(optimizer.param_groups[0]["lr"])
                    losses.append(_loss(step))
                    step += 1
                if kind in update_on_batch:
                    scheduler.step()
            if kind == "plateau":
                scheduler.step(sum(losses) / len(losses))
            elif kind not in update_on_batch:
                scheduler.step()
    return rates


def _spec(kind: str, batches: int, accum: int) -> dict:
    per_epoch = -(-batches // accum)
    block = {"scheduler_type": kind, **SCHEDULERS[kind]}
    return {
        "scheduler": block,
        "steps_per_epoch": per_epoch,
        "batches_per_epoch": batches,
        "grad_accum": accum,
    }


def _ours(spec: dict, steps: int, start: int = 0, state=None) -> tuple[list[float], object]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    schedule = CreditSchedule(optimizer, spec, lr=LR)
    if start:
        schedule.seek(start, state)
    rates = []
    for step in range(start, steps):
        rates.append(optimizer.param_groups[0]["lr"])
        schedule.step(_loss(step))
    return rates, schedule


# grad_accum 2 on 5 batches: the epoch's last optimizer step has one batch (plateau reads the
# epoch's mean step loss, which the test's per-step losses give with grad_accum 1)
CASES = [
    (kind, accum) for kind in SCHEDULERS for accum in (1, 2) if (kind, accum) != ("plateau", 2)
]


@pytest.mark.parametrize("kind,accum", CASES)
def test_every_credit_scheduler_gives_credits_rates_and_resumes_at_any_step(kind, accum):
    batches, epochs = 5, 4  # 5 batches: with grad_accum 2 the epoch's last step has one
    theirs = _credit_rates(kind, epochs, batches, accum)
    spec = _spec(kind, batches, accum)
    ours, _ = _ours(spec, len(theirs))
    assert ours == theirs  # bitwise, every optimizer step
    assert len(set(theirs)) > 1  # the rate moves within the steps compared
    for start in range(1, len(theirs)):  # resumed at every step (plateau: from its state)
        _, before = _ours(spec, start)
        state = schedule_state(before).get("credit_schedule", {}).get("state")
        resumed, _ = _ours(spec, len(theirs), start, state)
        assert resumed == theirs[start:], start


def test_plateau_resumed_without_its_state_is_refused_by_name():
    spec = _spec("plateau", 5, 1)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    with pytest.raises(ValueError, match=r"'plateau'.*no 'credit_schedule' state"):
        build_scheduler(optimizer, _tc(spec), step=3)


def _tc(spec, job_epochs=None, steps=20):
    class TC:  # the TrainerConfig fields build_scheduler / job_end_step read
        credit_scheduler = spec
        lr, weight_decay = LR, 0.0

    TC.job_epochs, TC.steps = job_epochs, steps
    return TC


def test_num_epoch_is_the_epochs_one_job_runs_from_where_it_starts():
    tc = _tc(None, {"num_epoch": 2, "steps_per_epoch": 3}, steps=20)
    assert job_end_step(tc, 0) == 6  # epochs 0, 1
    assert job_end_step(tc, 6) == 12  # the resumed job: epochs 2, 3
    assert job_end_step(tc, 7) == 12  # resumed inside epoch 2: it ends with epoch 3
    assert job_end_step(tc, 18) == 20  # the run's last epoch is cut at trainer.steps
    assert job_end_step(_tc(None, None, steps=20), 5) == 20


# --------------------------------------------------------------------------- the mapping
def _gen2(kind: str, **trainer) -> dict:
    from test_credit_examples_v2026 import _v2026, _with_normaliser

    conf = _with_normaliser(_v2026(), "/m.nc", "/s.nc")
    conf["trainer"]["scheduler"] = {"scheduler_type": kind, **SCHEDULERS[kind]}
    conf["trainer"].update(trainer)
    return conf


@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_a_gen2_config_maps_each_scheduler_to_credits_class(kind):
    extra = {"skip_validation": True} if kind == "plateau" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = credit_gen2_conf(_gen2(kind, grad_accum_every=2, **extra))["trainer"]
    assert t["credit_scheduler"] == {
        "scheduler": {"scheduler_type": kind, **SCHEDULERS[kind]},
        "steps_per_epoch": 3,  # the template's 5 batches, an optimizer step every 2
        "batches_per_epoch": 5,
        "grad_accum": 2,
    }
    assert t["job_epochs"] == {"num_epoch": 1, "steps_per_epoch": 3}  # the template's num_epoch
    assert t["steps"] == 70 * 3


def test_what_cannot_be_stepped_as_credit_steps_it_is_named():
    with pytest.raises(ValueError) as refused:
        credit_gen2_conf(_gen2("plateau"))
    assert "'plateau' steps on CREDIT's training_metric ('valid_loss'" in str(refused.value)
    assert "trainer.skip_validation: true" in str(refused.value)
    conf = _gen2("lambda", batches_per_epoch=0)
    conf["trainer"]["scheduler"]["total_steps"] = 10
    with pytest.raises(ValueError, match=r"'lambda' steps once per epoch: it needs"):
        credit_gen2_conf(conf)
    conf = _gen2("lambda")
    conf["trainer"]["scheduler"]["scheduler_type"] = "step-lr"
    with pytest.raises(ValueError, match=r"'step-lr': CREDIT's schedulers are"):
        credit_gen2_conf(conf)


# --------------------------------------------------------------------------- a run
H, W = 9, 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("sched") / "s.zarr"
    return str(write_sample_dataset(path, n_times=16, nlat=H, nlon=W))


# reduces when an epoch's loss does not rise above the best (patience 0): a falling loss
RUN_PLATEAU = {"scheduler_type": "plateau", "mode": "max", "factor": 0.5, "patience": 0}


def _run_conf(store, save_dir, job_epochs=None) -> dict:
    spec = {**_spec("plateau", 2, 1), "scheduler": dict(RUN_PLATEAU)}  # 2 steps per epoch
    trainer = {"steps": 6, "batch_size": 1, "lr": LR, "seed": 5, "dtype": "float64"}
    trainer.update(credit_scheduler=spec, save_dir=str(save_dir), grad_clip=0.0)
    if job_epochs:
        trainer["job_epochs"] = {"num_epoch": job_epochs, "steps_per_epoch": 2}
    conf = unet_run_conf(store, H, W, time_slice=[0, 14], **trainer)
    conf["data"]["num_workers"] = 0
    return conf


def test_num_epoch_stops_the_job_and_the_resumed_job_continues_the_run_exactly(store, tmp_path):
    """A plateau schedule over 3 epochs of 2 steps, ``num_epoch: 2``: the first job trains 4
    steps and stops with a checkpoint (the plateau's state in it), ``--resume auto`` trains the
    last epoch; the losses and rates are those of one uninterrupted job (float64, bitwise)."""
    from credit_parallel.train.main import run_training

    whole = run_training(
        _run_conf(store, tmp_path / "w"), tmp_path / "w", progress=False, stream=io.StringIO()
    )
    stream = io.StringIO()
    first = run_training(
        _run_conf(store, tmp_path / "j", 2), tmp_path / "j1", stream=stream, resume="auto"
    )
    assert first["steps"] == 4
    assert "this job stops at step 4 of 6" in stream.getvalue()
    second = run_training(
        _run_conf(store, tmp_path / "j", 2),
        tmp_path / "j2",
        progress=False,
        stream=io.StringIO(),
        resume="auto",
    )
    assert second["steps"] == 6
    jobs = first["history"] + second["history"]
    keep = ("step", "loss", "lr")
    assert [{k: r[k] for k in keep} for r in jobs] == [
        {k: r[k] for k in keep} for r in whole["history"]
    ]
    rates = [r["lr"] for r in whole["history"]]
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(  # CREDIT's class, its epoch losses
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR),
        **{k: v for k, v in RUN_PLATEAU.items() if k != "scheduler_type"},
    )
    expected = []
    for epoch in range(3):
        expected += [reference.optimizer.param_groups[0]["lr"]] * 2
        losses = [r["loss"] for r in whole["history"][2 * epoch : 2 * epoch + 2]]
        reference.step(sum(losses) / 2)
    assert rates == expected
    assert len(set(rates)) > 1, rates  # the plateau reduced the rate inside the run
