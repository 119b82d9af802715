"""The learning-rate schedule of a run: credit-parallel's linear warmup + cosine, or CREDIT's
own scheduler class, called and stepped as CREDIT's gen-2 trainer steps it; and the steps one
job trains (CREDIT's ``num_epoch``).

* :func:`lr_lambda`: a linear warmup over ``warmup_steps`` then a cosine decay to
  ``min_lr_ratio`` over ``schedule_steps`` (default: the run's ``steps``), as a ``LambdaLR``
  factor of the optimizer step;
* ``trainer.credit_scheduler`` (``layout/credit_gen2.py`` maps CREDIT's ``trainer.scheduler``
  block to it): :class:`CreditSchedule` builds CREDIT's class with miles-credit's
  ``credit.scheduler.load_scheduler`` on an AdamW of one parameter made as CREDIT's trainer
  makes its optimizer (its state loaded from a CREDIT checkpoint when the run resumes one), and
  steps it where ``credit/trainers`` does, translated to this run's optimizer steps:

  - ``linear-warmup-cosine``, ``cosine-annealing-restarts`` (``update_on_batch``): once after
    every BATCH; the optimizer steps every ``grad_accum_every`` batches and at an epoch's last
    batch, so optimizer step ``j`` of epoch ``e`` runs at the rate after ``e * batches_per_epoch
    + min((j + 1) * grad_accum_every, batches_per_epoch) - 1`` scheduler steps;
  - ``cosine-annealing`` (``update_on_epoch``): once after every epoch;
  - ``lambda``: once as every epoch starts (``train_one_epoch``) and once after it (``fit``);
  - ``plateau`` (``ReduceLROnPlateau``): after every epoch with the epoch's training loss (the
    mean of its steps' losses: CREDIT's ``train_loss``, its ``training_metric`` with
    ``skip_validation: true``).

  With ``batches_per_epoch: 0`` (CREDIT: the whole loader per epoch) no epoch is counted: the
  per-batch ones take optimizer step ``s`` at batch ``(s + 1) * grad_accum_every - 1`` (an
  epoch's shorter last accumulation is not seen); the per-epoch ones are refused then.
  The rate of each step is the class's own value, bit for bit.  A resumed run replays the
  deterministic ones to its step; ``plateau``'s state (and the epoch's running loss) is saved
  in the checkpoint (:func:`schedule_state`).
* :func:`job_end_step`: ``trainer.job_epochs`` (CREDIT's ``num_epoch``): a job trains the epochs
  from the one it starts in up to ``num_epoch`` of them, then stops; a resumed job goes on.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..layout.credit_gen2 import PER_BATCH, PER_EPOCH

__all__ = [
    "PER_BATCH",
    "PER_EPOCH",
    "CreditSchedule",
    "build_scheduler",
    "credit_scheduler_class",
    "job_end_step",
    "lr_lambda",
    "schedule_state",
    "step_scheduler",
]

TOP = "credit_schedule"  # the checkpoint's top-level key of a plateau schedule's state


def lr_lambda(tc):
    """credit-parallel's schedule as a ``LambdaLR`` factor of the optimizer step."""
    length = tc.schedule_steps or tc.steps

    def fn(step: int) -> float:
        if tc.warmup_steps and step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        span = max(1, length - tc.warmup_steps)
        progress = min(1.0, (step - tc.warmup_steps) / span)
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def credit_scheduler_class(scheduler: dict):
    """miles-credit's ``load_scheduler``, or a ``ValueError`` naming the scheduler type."""
    try:
        from credit.scheduler import load_scheduler
    except ImportError as err:
        raise ValueError(
            f"trainer.scheduler.scheduler_type = {scheduler.get('scheduler_type')!r} is "
            f"miles-credit's own class (credit.scheduler), which cannot be imported ({err})"
        ) from err
    return load_scheduler


def _proxy(spec: dict, lr: float, weight_decay: float, resumed: dict):
    """CREDIT's scheduler on an AdamW of one parameter made as CREDIT's trainer makes its
    optimizer (betas (0.9, 0.95); ``resumed``: a CREDIT checkpoint's optimizer
    hyperparameters and scheduler state, and ``update_learning_rate``)."""
    block = dict(spec["scheduler"])
    load_scheduler = credit_scheduler_class(block)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    group = resumed.get("optimizer_group")
    if group is not None:
        group = {k: v for k, v in group.items() if k != "params"}
        optimizer.load_state_dict({"state": {}, "param_groups": [{**group, "params": [0]}]})
    sched = load_scheduler(optimizer, {"trainer": {"use_scheduler": True, "scheduler": block}})
    if resumed.get("scheduler_state") is not None:
        sched.load_state_dict(resumed["scheduler_state"])
    if resumed.get("update_learning_rate"):
        optimizer.param_groups[0]["lr"] = lr
    return optimizer, sched


class CreditSchedule:
    """CREDIT's scheduler driven by this run's optimizer steps (see the module docstring): the
    rate of step ``step_count`` is on ``optimizer`` before that step runs.

    ``spec``: ``trainer.credit_scheduler``: ``{"scheduler": CREDIT's trainer.scheduler block,
    "steps_per_epoch": optimizer steps per epoch (None: no epochs counted, per-batch kinds
    only), "batches_per_epoch", "grad_accum"}``."""

    def __init__(self, optimizer, spec, *, lr, weight_decay=0.0, resumed=None):
        self.optimizer = optimizer
        self.kind = spec["scheduler"]["scheduler_type"]
        self.steps_per_epoch = spec.get("steps_per_epoch")
        self.batches_per_epoch = spec.get("batches_per_epoch")
        self.grad_accum = max(int(spec.get("grad_accum") or 1), 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
            self._optimizer, self._sched = _proxy(spec, lr, weight_decay, resumed or {})
        self.step_count = 0
        self._batches = 0  # per-batch: the CREDIT scheduler's steps taken
        self._epochs = 0  # per-epoch: the epochs ended
        self._loss = [0.0, 0]  # plateau: the running epoch's loss sum and step count
        if self.kind == "lambda":
            self._credit_step()  # CREDIT's train_one_epoch steps it as epoch 0 starts
        self._apply()

    # ------------------------------------------------------------------ CREDIT's steps
    def _credit_step(self, *args) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._sched.step(*args)

    def _batch_count(self, step: int) -> int:
        """The scheduler steps before optimizer step ``step`` (per-batch kinds)."""
        if not self.batches_per_epoch:
            return (step + 1) * self.grad_accum - 1
        epoch, j = divmod(step, self.steps_per_epoch)
        within = min((j + 1) * self.grad_accum, self.batches_per_epoch) - 1
        return epoch * self.batches_per_epoch + within

    def _end_epoch(self) -> None:
        if self.kind == "plateau":
            total, count = self._loss
            self._credit_step(total / max(count, 1))  # CREDIT's train_loss of the epoch
            self._loss = [0.0, 0]
        else:
            self._credit_step()
        self._epochs += 1
        if self.kind == "lambda":
            self._credit_step()  # and again as the next epoch starts

    def _apply(self) -> None:
        """Bring CREDIT's scheduler to ``step_count`` and set its rate on the optimizer."""
        if self.kind in PER_BATCH:
            target = self._batch_count(self.step_count)
            while self._batches < target:
                self._credit_step()
                self._batches += 1
        else:
            while self._epochs < self.step_count // self.steps_per_epoch:
                self._end_epoch()
        rate = self._optimizer.param_groups[0]["lr"]
        for group in self.optimizer.param_groups:
            group["lr"] = rate

    def step(self, loss: float | None = None) -> None:
        """After optimizer step ``step_count``: ``loss`` is its (global) loss, for ``plateau``."""
        if self.kind == "plateau":
            if loss is None:
                raise ValueError("CreditSchedule.step: 'plateau' steps on the epoch's loss")
            self._loss = [self._loss[0] + float(loss), self._loss[1] + 1]
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ resume
    def seek(self, step: int, state: torch.Tensor | None = None) -> None:
        """Continue at optimizer step ``step`` of the run (a resumed run); ``state``: what
        :func:`schedule_state` saved (required for ``plateau`` past its first epoch's start)."""
        if self.kind == "plateau" and step > 0:
            if state is None:
                raise ValueError(
                    "trainer.scheduler.scheduler_type = 'plateau': the checkpoint holds no "
                    f"'{TOP}' state (the plateau's best loss and its epoch's running loss); "
                    "resume from a checkpoint written with this schedule"
                )
            self._restore(state)
        self.step_count = int(step)
        self._apply()

    def state_tensor(self) -> torch.Tensor:
        """``plateau``'s state as a float64 tensor (for the DCP checkpoint)."""
        s = self._sched
        return torch.tensor(
            [
                float(s.best),
                float(s.num_bad_epochs),
                float(s.cooldown_counter),
                float(s.last_epoch),
                float(self._optimizer.param_groups[0]["lr"]),
                self._loss[0],
                float(self._loss[1]),
                float(self._epochs),
            ],
            dtype=torch.float64,
        )

    def _restore(self, state: torch.Tensor) -> None:
        values = [float(v) for v in state.tolist()]
        s = self._sched
        s.best, s.num_bad_epochs, s.cooldown_counter = values[0], int(values[1]), int(values[2])
        s.last_epoch = int(values[3])
        self._optimizer.param_groups[0]["lr"] = values[4]
        s._last_lr = [values[4]]
        self._loss = [values[5], int(values[6])]
        self._epochs = int(values[7])


def step_scheduler(scheduler, loss: float) -> None:
    """One optimizer step done: a :class:`CreditSchedule` is told its loss (``plateau``)."""
    if isinstance(scheduler, CreditSchedule):
        scheduler.step(loss)
    elif scheduler is not None:
        scheduler.step()


def schedule_state(scheduler, template: bool = False) -> dict:
    """``{TOP: {"state": tensor}}`` for ``save_checkpoint(extra=)`` when ``scheduler`` is a
    ``plateau`` :class:`CreditSchedule` (``template``: zeros a load fills), else ``{}``."""
    if not isinstance(scheduler, CreditSchedule) or scheduler.kind != "plateau":
        return {}
    state = scheduler.state_tensor()
    return {TOP: {"state": torch.zeros_like(state) if template else state}}


def build_scheduler(optimizer, tc, step: int = 0, resumed: dict | None = None, state=None):
    """The run's scheduler at optimizer step ``step`` (0: a fresh run; a DCP resume passes its
    step and ``state``, :func:`schedule_state`'s tensor); ``resumed``: what a CREDIT checkpoint
    brought (``credit_resume.load_credit_resume``: the optimizer's hyperparameters and the
    scheduler's state)."""
    if tc.credit_scheduler is not None:
        schedule = CreditSchedule(
            optimizer,
            dict(tc.credit_scheduler),
            lr=tc.lr,
            weight_decay=tc.weight_decay,
            resumed=resumed,
        )
        if step:
            schedule.seek(step, state)
        return schedule
    fn = lr_lambda(tc)
    scheduler = LambdaLR(optimizer, fn, last_epoch=-1)
    if step:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * fn(step)
        scheduler.last_epoch = step
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return scheduler


def job_end_step(tc, start: int) -> int:
    """The optimizer step a job that starts at ``start`` stops at: ``trainer.steps``, or with
    ``trainer.job_epochs`` (CREDIT's ``num_epoch``: ``{"num_epoch", "steps_per_epoch"}``) the
    end of the ``num_epoch``-th epoch counted from the one ``start`` lies in, as CREDIT's
    ``fit`` runs epochs ``start_epoch`` .. ``start_epoch + num_epoch - 1`` per job."""
    spec = tc.job_epochs
    if not spec:
        return tc.steps
    per = max(int(spec["steps_per_epoch"]), 1)
    return min(tc.steps, (start // per + int(spec["num_epoch"])) * per)
