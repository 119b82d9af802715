"""CREDIT's resume keys (``trainer.load_weights`` / ``load_optimizer`` / ``load_scheduler`` /
``load_scaler`` / ``reload_epoch``) read as credit-parallel's ``trainer.credit_resume``.

miles-credit's gen-2 trainer resumes from its ``save_loc`` (``credit/trainers/utils.py``,
``load_model_states_and_optimizer``): with ``load_weights: true`` it reads
``<save_loc>/checkpoint.pt`` (``{"epoch", "model_state_dict", "optimizer_state_dict",
"scheduler_state_dict", "scaler_state_dict"}``, what its ``_save_checkpoint`` writes) into the
model; with any of ``load_optimizer`` / ``load_scaler`` / ``load_scheduler`` also the optimizer
(when ``load_optimizer``), and the scheduler's state when the run does not start at epoch 0;
``reload_epoch: true`` starts at the checkpoint's epoch + 1 (with only ``load_weights``, when
``<save_loc>/training_log.csv`` exists, as CREDIT checks); ``update_learning_rate: true`` sets
the optimizer's rate back to ``learning_rate`` afterwards; an EMA run reads
``checkpoint_ema.pt`` beside it.  :func:`credit_resume_keys` does that arithmetic before any
rank starts (it reads the checkpoint's ``epoch`` only, memory-mapped) and names a missing
checkpoint by its key; ``train/credit_resume.py`` loads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["RESUME_KEYS", "credit_resume_keys"]

RESUME_KEYS = ("load_weights", "load_optimizer", "load_scaler", "load_scheduler", "reload_epoch")


def _epoch(path: Path) -> int:
    import torch

    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return int(payload["epoch"])


def credit_resume_keys(conf: Mapping, t: dict, out: dict, problems: list[str]) -> None:
    """Pop CREDIT's resume keys from the trainer block ``t``; with ``load_weights: true`` set
    ``out["credit_resume"]`` and ``t["start_epoch"]`` (``reload_epoch``) as CREDIT's trainer
    does; every problem named by its key into ``problems``."""
    flags = {key: bool(t.pop(key, False)) for key in RESUME_KEYS}
    if not flags["load_weights"]:
        return  # CREDIT reads none of the other flags without it
    update_lr = bool(t.pop("update_learning_rate", False))
    save_loc = conf.get("save_loc")
    if not isinstance(save_loc, str):
        problems.append("trainer.load_weights: true resumes from save_loc, which is not given")
        return
    directory = Path(os.path.expandvars(save_loc))
    checkpoint = directory / "checkpoint.pt"
    if not checkpoint.is_file():
        problems.append(
            f"trainer.load_weights: true reads {str(checkpoint)!r} (save_loc), which does not "
            "exist; set it to false to start afresh"
        )
        return
    if flags["load_scaler"] and t.get("amp"):
        problems.append(
            "trainer.load_scaler: true with amp: credit-parallel keeps no GradScaler state "
            "(bf16 autocast); set it to false"
        )
    more = flags["load_optimizer"] or flags["load_scaler"] or flags["load_scheduler"]
    start = int(t.get("start_epoch") or 0)
    if flags["reload_epoch"] and (more or (directory / "training_log.csv").exists()):
        start = _epoch(checkpoint) + 1
    t["start_epoch"] = start
    out["credit_resume"] = {
        "checkpoint": str(checkpoint),
        "load_optimizer": flags["load_optimizer"],
        # CREDIT loads the scheduler's state whenever it loads more than the weights and the
        # run does not start at epoch 0 (load_scheduler or not)
        "load_scheduler": more and start > 0,
        "update_learning_rate": update_lr,
        "start_epoch": start,
    }
