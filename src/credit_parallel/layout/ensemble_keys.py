"""The ensemble's config keys and pure arithmetic, below every layer that reads them: the CRPS
losses a ``loss`` section may name (``train/crps.py`` computes them) and what their pairwise term
sends and holds per step (``plan`` states it: ``planner/ensemble_notes.py``)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["ALMOST_FAIR", "CRPS_LOSSES", "KCRPS", "RING", "crps_comm_per_step", "requested_crps"]

KCRPS = "KCRPS"
ALMOST_FAIR = "almost-fair-crps"
RING = "ring-crps"
CRPS_LOSSES = (KCRPS, ALMOST_FAIR, RING)


def requested_crps(loss_conf) -> str | None:
    """The CRPS loss a ``loss`` section names, or None."""
    if not isinstance(loss_conf, Mapping):
        return None
    if loss_conf.get("type") == "base":
        name = (loss_conf.get("args") or {}).get("training_loss")
    else:
        name = loss_conf.get("training_loss")
    return name if name in CRPS_LOSSES else None


def crps_comm_per_step(members: int, ensemble: int, local_field_elements: int, itemsize: int):
    """(bytes each rank sends per loss call, peak bytes of member fields it holds) for K =
    ``members`` over E = ``ensemble`` ranks and fields of ``local_field_elements`` (its rows of
    one member of one sample, all channels) — the figures ``plan`` states."""
    local = members // ensemble
    block = local * local_field_elements * itemsize
    sent = (ensemble - 1) * block
    held = (3 if ensemble > 1 else 1) * block + block  # own, received, in flight; accumulator
    return sent, held
