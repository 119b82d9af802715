"""When merging small FSDP2 units would pay, and what it costs (``credit-parallel plan``).

SPEC §4: every ``_fsdp2_shard = True`` block is its own FSDP2 unit unless the user sets
``trainer.fsdp2_min_unit_params: N``, which merges opted-in blocks of fewer than N parameters of
their own into their parent's unit (``fsdp.fsdp2_units``).  This module prices that choice with
the planner's own cost model, so the plan can say it:

* collectives: ``cost.predicted_collectives`` counts ``2 u - 1`` all-gathers (forward, and
  backward for every unit but the root, which FSDP2 does not reshard after forward) and ``u``
  reduce-scatters for ``u`` units; merging k units saves ``2 k`` all-gathers and ``k``
  reduce-scatters per step, each with a fixed price a small unit does not hide: NCCL latency of
  10-30 us plus FSDP2's Python hooks and copy-in/out of 50-200 us (docs/performance.md, "One
  rank at torch's level");
* memory: the parameters gathered at once, modelled as the root's unit (gathered for the whole
  step) plus the largest other unit (the one in use), unsharded, in the compute dtype; merging
  moves a small block's parameters into its parent's gathered unit.

A unit under :data:`MERGE_HINT_PARAMS` parameters is "small": 1M float32 parameters are 4 MB,
~13 us at 300 GB/s, below the fixed price of its three collectives.  Pure: no processes.
"""

from __future__ import annotations

from torch import nn

from .cost import fsdp_units, local_numel

__all__ = ["MERGE_HINT_PARAMS", "gathered_parameter_bytes", "merge_advice"]

MERGE_HINT_PARAMS = 1_000_000
_FIXED_US = (60, 230)  # per collective: NCCL latency 10-30 us + FSDP2 hooks / copies 50-200 us
_NAMES_SHOWN = 6


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def gathered_parameter_bytes(units, params, split, tp: int, item_bytes: int) -> int:
    """Bytes of parameters gathered at once under ``units`` (``cost.fsdp_units``): the root's unit
    (``""``, not resharded after forward) plus the largest other unit, unsharded over dp but
    split over tp (``split``: ``{parameter name: dim}``), ``item_bytes`` per element."""

    def size(names) -> int:
        return sum(local_numel(params[p].shape, split.get(p), tp, 1) for p in names)

    root = sum(size(names) for name, names in units if name == "")
    other = max((size(names) for name, names in units if name != ""), default=0)
    return (root + other) * item_bytes


def merge_advice(
    model: nn.Module,
    min_unit_params: int,
    *,
    split: dict,
    tp: int,
    item_bytes: int,
    threshold: int = MERGE_HINT_PARAMS,
) -> str | None:
    """One line for the plan's notes when opted-in blocks under ``threshold`` parameters are
    FSDP2 units of their own at ``min_unit_params`` (the run's setting): how many, what setting
    would merge them, the collectives it saves per step and the gathered-parameter memory it
    adds.  None when merging would change nothing."""
    if min_unit_params >= threshold:
        return None
    current = fsdp_units(model, min_unit_params)
    merged = fsdp_units(model, threshold)
    kept = {name for name, _ in merged}
    small = [name for name, _ in current if name and name not in kept]
    if not small:
        return None
    k = len(current) - len(merged)  # units that disappear (one per merged block)
    params = dict(model.named_parameters())
    before = gathered_parameter_bytes(current, params, split, tp, item_bytes)
    after = gathered_parameter_bytes(merged, params, split, tp, item_bytes)
    shown = ", ".join(small[:_NAMES_SHOWN]) + (
        f", ... ({len(small) - _NAMES_SHOWN} more)" if len(small) > _NAMES_SHOWN else ""
    )
    lo, hi = (3 * k * us / 1000 for us in _FIXED_US)
    return (
        f"FSDP2: {len(small)} opted-in blocks under {threshold:,} parameters are units of their "
        f"own ({shown}): trainer.fsdp2_min_unit_params: {threshold} would merge them into their "
        f"parents' units, saving {2 * k} all-gathers and {k} reduce-scatters per step (each "
        f"with a fixed price of ~{_FIXED_US[0]}-{_FIXED_US[1]} us: {lo:.1f}-{hi:.1f} ms per "
        f"step), costing {_human(max(0, after - before))} more peak (parameters gathered at "
        f"once: root unit + largest other unit, {_human(before)} -> {_human(after)}); the "
        "default keeps every _fsdp2_shard block its own unit (SPEC §4)"
    )
