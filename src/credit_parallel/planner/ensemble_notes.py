"""What ``plan`` says about an ensemble run: the CRPS loss's communication and memory per step,
and the cost of the layout-independent random draws (``train/crps.py``,
``domain/random_draws.py``, docs/ensembles.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = ["ensemble_coords", "ensemble_notes"]

_MIB = 1024 * 1024


def ensemble_coords(dims, layout, rank: int) -> tuple:
    """(ensemble coordinate, ensemble group) of ``rank`` for the plan's rank table; empty when
    the layout has no ensemble axis."""
    if dims.ensemble == 1:
        return ()
    return dims.ensemble_coord(rank), tuple(layout.ranks_along_dim("ensemble", rank))


def _output_shape(model: nn.Module, shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """One sample's first output shape (batch dim dropped), from a meta forward; the first
    input's shape when the model cannot run on the meta device."""
    try:
        with torch.no_grad():
            out = model(*[torch.empty((1, *s), device="meta") for s in shapes])
        out = out[0] if isinstance(out, (tuple, list)) else out
        return tuple(out.shape[1:])
    except Exception:  # noqa: BLE001 - an estimate: the input's shape will do
        return tuple(shapes[0])


def ensemble_notes(
    conf: Mapping,
    dims,
    model: nn.Module,
    shapes: Sequence[Sequence[int]],
    batch_size: int,
    dtype_bytes: int,
) -> list[str]:
    """The plan's lines on the ensemble (none for a deterministic run)."""
    from ..domain.random_draws import random_drawing_modules
    from ..layout.ensemble_keys import crps_comm_per_step, requested_crps

    trainer = conf.get("trainer") or {}
    members = trainer.get("ensemble_size", 1)
    kind = requested_crps(conf.get("loss"))
    if dims is None or kind is None or not isinstance(members, int) or members < 2:
        return []
    ens = dims.ensemble
    if members % ens:
        return []  # refused by preflight, named there
    p, q = dims.domain_shape
    shape = _output_shape(model, shapes)
    rows, cols = math.ceil(shape[-2] / p), math.ceil(shape[-1] / q)
    field = math.prod(shape[:-2]) * rows * cols * batch_size
    sent, held = crps_comm_per_step(members, ens, field, dtype_bytes)
    notes = [
        f"ensemble: {kind} over trainer.ensemble_size = {members} members, "
        f"{members // ens} per rank on trainer.parallelism.ensemble = {ens}: per forecast step "
        f"each rank sends {sent / _MIB:.2f} MiB ({ens - 1} ring shift(s) of its members' rows) "
        f"and holds {held / _MIB:.2f} MiB of member fields for the pairwise term; no rank "
        "gathers the members"
    ]
    if random_drawing_modules(model) and (ens > 1 or dims.domain > 1):
        draw = field * (members // ens) * ens * dims.domain * dtype_bytes
        notes.append(
            "random draws: drawn for the global field and the K members, then sliced "
            f"(layout-independent): a field draw holds up to {draw / _MIB:.2f} MiB while it runs"
        )
    return notes
