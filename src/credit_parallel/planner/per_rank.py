"""What one rank of a plan holds and sends: its memory (parameters, gradients, optimizer state,
activations, the largest FSDP2 unit) and its collectives per training step (pure: no processes).

The figures come from ``cost.py`` (per-layer arithmetic) and the FSDP2 unit rules
(``fsdp_merge.py`` notes when merging small units would pay); :func:`memory_per_rank` also
returns the tensor-parallel targets, the FSDP2 units and the local parameter sizes that
:func:`collectives_per_rank` counts the gradient reductions of.
"""

from __future__ import annotations

import torch

from ..layout.config import DataMode
from ..parallel.fsdp import FSDP2_MIN_UNIT_PARAMS
from .cost import (
    MemoryEstimate,
    activation_parts,
    fsdp_units,
    local_numel,
    predicted_collectives,
    tp_split_dims,
)
from .fsdp_merge import merge_advice

__all__ = ["PARAM_BYTES", "collectives_per_rank", "memory_per_rank"]

PARAM_BYTES = 4  # parameters, gradients and AdamW moments stay fp32 (also under amp)


def collectives_per_rank(layers, data, dp, tp, size, tp_listed, units, local_numels) -> dict:
    """:func:`~credit_parallel.planner.cost.predicted_collectives` of the plan."""
    return predicted_collectives(
        layers,
        data=data,
        dp=max(dp, 1),
        tp=tp,
        domain=size,
        tp_row_layers=sum(1 for t in tp_listed if t.role == "row"),
        tp_col_layers=sum(1 for t in tp_listed if t.role == "col"),
        tp_fused_layers=sum(1 for t in tp_listed if t.role == "col" and t.parts > 1),
        fsdp_units=len(units),
        grad_sizes_bytes=[v * PARAM_BYTES for v in local_numels.values()],
    )


def memory_per_rank(
    model, trace, layers, shapes, levels, *, data, dp, tp, n, batch_size, amp, violations, notes,
    min_unit_params=FSDP2_MIN_UNIT_PARAMS, device="cpu", q=1, tile_layers=None,
):  # fmt: skip
    """(MemoryEstimate, tp targets, FSDP units, local parameter numels) of one rank."""
    split, tp_listed = tp_split_dims(model, tp, violations)
    if tp > 1 and not tp_listed:
        notes.append(
            "tensor > 1 but the model declares no _tp_col/_tp_row layers: every tp rank "
            "repeats the same work"
        )
    # FSDP2 shards over the flattened dp x domain axis (composition.apply_data_parallel)
    fsdp_dp = dp * n * q if data == DataMode.FSDP2 and dp * n * q > 1 else 1
    local_numels, full_numel = {}, 0
    for pname, p in model.named_parameters():
        full_numel += p.numel()
        local_numels[pname] = local_numel(p.shape, split.get(pname), tp, fsdp_dp)
    param_bytes = sum(local_numels.values()) * PARAM_BYTES
    units = fsdp_units(model, min_unit_params) if data == DataMode.FSDP2 else []
    if units:
        item = 2 if amp else PARAM_BYTES
        advice = merge_advice(model, min_unit_params, split=split, tp=tp, item_bytes=item)
        if advice is not None:
            notes.append(advice)
    params = dict(model.named_parameters())
    largest_unit = max(
        (
            sum(local_numel(params[p].shape, split.get(p), tp, 1) for p in names)
            for _, names in units
        ),
        default=0,
    )
    param_dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    act_bytes = 2 if amp else param_dtype.itemsize
    parts = activation_parts(
        trace, layers, shapes, {h for h, _ in levels}, n,
        batch_size=batch_size, act_bytes=act_bytes, data_bytes=param_dtype.itemsize, device=device,
        q=q, tile_layers=tile_layers,
    )  # fmt: skip
    memory = MemoryEstimate(
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=2 * param_bytes,
        param_bytes_unsharded=full_numel * PARAM_BYTES,
        fsdp_largest_unit_bytes=largest_unit * (2 if amp else PARAM_BYTES),
        activation_dtype_bytes=act_bytes,
        **parts,
    )
    return memory, tp_listed, units, local_numels
