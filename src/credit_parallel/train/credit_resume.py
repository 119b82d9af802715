"""A run resumed from a CREDIT checkpoint directory (``trainer.credit_resume``: CREDIT's
``load_weights`` / ``load_optimizer`` / ``load_scheduler`` / ``reload_epoch``, mapped by
``layout/credit_resume.py``), as miles-credit's ``load_model_states_and_optimizer`` does it.

* the model: ``checkpoint.pt``'s ``model_state_dict`` (full tensors) distributed onto this
  rank's shards (``forecast/weights.set_credit_weights``: keys mapped, shapes checked);
* ``load_optimizer``: its ``optimizer_state_dict`` (AdamW's, keyed by the position of each
  parameter among the model's parameters, as ``torch.optim`` saves it) turned into the state
  keyed by parameter name and distributed onto this rank's shards
  (``set_optimizer_state_dict(full_state_dict=True)``): the moments, the step counts and the
  hyperparameters CREDIT's optimizer had (its betas (0.9, 0.95) among them); a parameter that
  never had a gradient has no state there, as in ``torch.optim`` (not strict);
* the scheduler's state and the optimizer's hyperparameters go to the schedule
  (``schedule.build_scheduler``);
* ``trainer.use_ema``: ``checkpoint_ema.pt`` beside it, when it exists (as CREDIT's trainer),
  into miles-credit's ``EMATracker`` (which reshards it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from ..forecast.weights import credit_state, map_credit_keys, set_credit_weights
from .checkpoint import CheckpointError

__all__ = ["credit_optimizer_state", "load_credit_resume", "restore_credit_ema"]


def _read(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported in one line
        raise CheckpointError(
            f"trainer.load_weights: {str(path)!r} could not be read ({type(exc).__name__}: {exc})"
        ) from None


def credit_optimizer_state(saved: dict, names: list[str]) -> dict:
    """CREDIT's ``optimizer.state_dict()`` (parameters by position) keyed by parameter name:
    ``names`` are the model's parameter names in CREDIT's order (its ``model.parameters()``)."""
    groups = saved["param_groups"]
    count = sum(len(g["params"]) for g in groups)
    if count != len(names):
        raise CheckpointError(
            f"trainer.load_optimizer: the checkpoint's optimizer holds {count} parameters, the "
            f"model {len(names)}"
        )
    by_index = {}
    for group in groups:
        for index in group["params"]:
            by_index[index] = names[len(by_index)]
    return {
        "state": {by_index[i]: dict(s) for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]} for g in groups],
    }


def load_credit_resume(model: torch.nn.Module, optimizer, tc) -> dict:
    """Load ``tc.credit_resume`` into ``model`` and ``optimizer`` (every rank calls it); what
    the schedule needs back: ``{"optimizer_group", "scheduler_state", "update_learning_rate"}``
    (``{}`` without a CREDIT resume)."""
    spec = tc.credit_resume
    if not spec:
        return {}
    path = Path(spec["checkpoint"])
    payload = _read(path)
    state, _ = credit_state(payload)
    set_credit_weights(model, state, path)
    out = {"update_learning_rate": bool(spec.get("update_learning_rate"))}
    if spec.get("load_optimizer"):
        own = {name for name, _ in model.named_parameters()}
        names = [k for k in map_credit_keys(state, own) if k in own]  # CREDIT's order
        saved = credit_optimizer_state(payload["optimizer_state_dict"], names)
        known = set(optimizer.param_groups[0])  # initial_lr: the schedule's (build_scheduler)
        saved["param_groups"] = [
            {k: v for k, v in g.items() if k in known} for g in saved["param_groups"]
        ]
        set_optimizer_state_dict(
            model, optimizer, saved, options=StateDictOptions(full_state_dict=True, strict=False)
        )
        for group in optimizer.param_groups:  # the tuple torch.optim makes (a load gives a list)
            if isinstance(group.get("betas"), list):
                group["betas"] = tuple(group["betas"])
        out["optimizer_group"] = {
            k: v for k, v in payload["optimizer_state_dict"]["param_groups"][0].items()
        }
    if spec.get("load_scheduler"):
        out["scheduler_state"] = payload.get("scheduler_state_dict")
    return out


def restore_credit_ema(ema, model: torch.nn.Module, tc) -> bool:
    """``checkpoint_ema.pt`` beside the resumed checkpoint into the ``EMATracker`` ``ema``
    (its keys mapped onto the model's); False when there is none (the average starts at the
    loaded weights)."""
    spec = tc.credit_resume
    if ema is None or not spec:
        return False
    path = Path(spec["checkpoint"]).with_name("checkpoint_ema.pt")
    if not path.is_file():
        return False
    saved = _read(path)["model_state_dict"]
    saved = {**saved, "shadow": map_credit_keys(saved["shadow"], ema.shadow)}
    ema.load_state_dict(saved)
    return True
