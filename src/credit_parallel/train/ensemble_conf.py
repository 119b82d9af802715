"""The ensemble keys of a run, checked before any rank starts (SPEC §6).

``trainer.ensemble_size: K`` members of each sample, trained on a CRPS loss
(``loss.training_loss`` or ``loss.args.training_loss`` of ``type: base``:
``train/crps.py``), spread over ``trainer.parallelism.ensemble: E`` ranks.  Every problem is
one message naming the key: a CRPS loss with K = 1, members without a CRPS loss, K not a
multiple of E, E > 1 without members, and members asked of a model that draws no random numbers
(its K members would be the same forecast: nothing perturbs them).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..layout.ensemble_keys import CRPS_LOSSES, requested_crps
from .crps import EnsembleLoss, ensemble_loss_of

__all__ = ["ensemble_problems", "requested_crps"]


def ensemble_problems(
    conf: Mapping, members: int, ensemble: int, model: nn.Module | None = None
) -> list[str]:
    """Every problem of the ensemble keys: ``members`` = ``trainer.ensemble_size``,
    ``ensemble`` = ``trainer.parallelism.ensemble``; ``model`` (a meta model is enough) is
    checked for random draws when members > 1."""
    problems = []
    crps = requested_crps(conf.get("loss"))
    if crps is not None:
        try:
            ensemble_loss_of(conf["loss"], members)
        except ValueError as err:
            problems.append(str(err))
    elif members > 1:
        problems.append(
            f"trainer.ensemble_size = {members} trains members on a CRPS loss: set "
            f"loss.training_loss to one of {list(CRPS_LOSSES)}"
        )
    if ensemble > 1 and members < 2:
        problems.append(
            f"trainer.parallelism.ensemble = {ensemble} spreads the members of each sample: set "
            f"trainer.ensemble_size to a multiple of {ensemble} (and a CRPS loss)"
        )
    elif members % ensemble:
        problems.append(
            f"trainer.ensemble_size = {members} is not a multiple of "
            f"trainer.parallelism.ensemble = {ensemble}"
        )
    if members > 1 and model is not None:
        from ..domain.random_draws import random_drawing_modules

        if not random_drawing_modules(model):
            problems.append(
                f"trainer.ensemble_size = {members}: the model ({type(model).__name__}) draws no "
                "random numbers (no noise, no dropout with p > 0), so its members would be the "
                "same forecast; use a stochastic model (e.g. crossformer-ensemble) or dropout"
            )
    return problems


def crps_loss(conf: Mapping, members: int) -> EnsembleLoss | None:
    """The run's :class:`EnsembleLoss` (None: a deterministic loss)."""
    return ensemble_loss_of(conf.get("loss"), members)
