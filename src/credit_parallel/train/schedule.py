"""The learning-rate schedule of a run: credit-parallel's linear warmup + cosine, or CREDIT's own
epoch-level scheduler class, called.

* :func:`lr_lambda`: a linear warmup over ``warmup_steps`` then a cosine decay to
  ``min_lr_ratio`` over ``schedule_steps`` (default: the run's ``steps``; CREDIT's
  ``scheduler.total_steps``), as a ``LambdaLR`` factor of the optimizer step;
* ``trainer.credit_scheduler`` (``{"scheduler": CREDIT's trainer.scheduler block,
  "steps_per_epoch"}``; ``cosine-annealing`` from a CREDIT config): miles-credit's
  ``credit.scheduler.load_scheduler`` builds CREDIT's class (``CosineAnnealingLR`` with its
  ``T_max``, ...) on an AdamW of one parameter made as CREDIT's trainer makes its optimizer,
  its state loaded from a CREDIT checkpoint when the run resumes one (``credit_resume``), and
  stepped once per epoch, as CREDIT's ``fit`` steps it after each epoch: :func:`credit_epoch_lrs`
  is the rate of each epoch, :class:`EpochTable` sets it for every optimizer step of that
  epoch (``steps_per_epoch`` of them).  The rates are the class's own values, bit for bit.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

__all__ = ["EpochTable", "build_scheduler", "credit_epoch_lrs", "lr_lambda"]


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


def credit_epoch_lrs(
    scheduler: dict,
    epochs: int,
    *,
    lr: float,
    weight_decay: float = 0.0,
    optimizer_group: dict | None = None,
    scheduler_state: dict | None = None,
    update_learning_rate: bool = False,
) -> list[float]:
    """The learning rate of each of ``epochs`` epochs under CREDIT's scheduler ``scheduler``
    (its ``trainer.scheduler`` block), as CREDIT's trainer sets it up: an AdamW with
    ``learning_rate`` / ``weight_decay`` / betas (0.9, 0.95) (``optimizer_group``: the
    hyperparameters a loaded optimizer brings), ``load_scheduler``, the checkpoint's
    ``scheduler_state`` loaded, ``update_learning_rate``, then one ``step()`` per epoch."""
    try:
        from credit.scheduler import load_scheduler
    except ImportError as err:
        raise ValueError(
            f"trainer.scheduler.scheduler_type = {scheduler.get('scheduler_type')!r} is "
            f"miles-credit's own class (credit.scheduler), which cannot be imported ({err})"
        ) from err
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    if optimizer_group is not None:
        group = {k: v for k, v in optimizer_group.items() if k != "params"}
        optimizer.load_state_dict({"state": {}, "param_groups": [{**group, "params": [0]}]})
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        sched = load_scheduler(
            optimizer, {"trainer": {"use_scheduler": True, "scheduler": scheduler}}
        )
        if scheduler_state is not None:
            sched.load_state_dict(scheduler_state)
        if update_learning_rate:
            optimizer.param_groups[0]["lr"] = lr
        for _ in range(epochs):
            lrs.append(optimizer.param_groups[0]["lr"])
            sched.step()
    return lrs


class EpochTable(LRScheduler):
    """Sets the rate of epoch ``step // steps_per_epoch`` of ``lrs`` for optimizer step
    ``step`` (the last one beyond the table)."""

    def __init__(self, optimizer, lrs: list[float], steps_per_epoch: int, last_epoch: int = -1):
        self.lrs, self.steps_per_epoch = list(lrs), max(int(steps_per_epoch), 1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        epoch = min(max(self.last_epoch, 0) // self.steps_per_epoch, len(self.lrs) - 1)
        return [self.lrs[epoch] for _ in self.optimizer.param_groups]


def build_scheduler(optimizer, tc, step: int = 0, resumed: dict | None = None):
    """The run's scheduler at optimizer step ``step`` (0: a fresh run; a DCP resume passes its
    step); ``resumed``: what a CREDIT checkpoint brought (``credit_resume.load_credit_resume``:
    the optimizer's hyperparameters and the scheduler's state)."""
    if tc.credit_scheduler is not None:
        per_epoch = int(tc.credit_scheduler["steps_per_epoch"])
        resumed = resumed or {}
        lrs = credit_epoch_lrs(
            dict(tc.credit_scheduler["scheduler"]),
            max(math.ceil(tc.steps / per_epoch), 1),
            lr=tc.lr,
            weight_decay=tc.weight_decay,
            optimizer_group=resumed.get("optimizer_group"),
            scheduler_state=resumed.get("scheduler_state"),
            update_learning_rate=bool(resumed.get("update_learning_rate")),
        )
        table = EpochTable(optimizer, lrs, per_epoch)
        if step:
            table.last_epoch = step - 1
            table.step()
        return table
    fn = lr_lambda(tc)
    scheduler = LambdaLR(optimizer, fn, last_epoch=-1)
    if step:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * fn(step)
        scheduler.last_epoch = step
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return scheduler
