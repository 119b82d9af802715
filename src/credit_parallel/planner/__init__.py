"""The layout planner and cost model behind ``credit-parallel plan`` (pure: no processes).

``trace.py`` builds the model on the meta device and records every domain-layer call;
``cost.py`` asks each layer for its geometry and estimates halo bytes, collectives and memory;
``make.py`` puts the rank layout, the levels and the constraints together (:func:`make_plan`)
from ``layer_calls.py`` (the traced layer calls: plans, fused exchanges, levels, tiles, splits)
and ``per_rank.py`` (one rank's memory and collectives);
``report.py`` prints it (:func:`format_plan`); ``fsdp_merge.py`` prices merging small FSDP2
units (a note of the plan); ``tiles.py`` plans the exchanges of lat x lon tiles per rank and
``split.py`` projects every P x Q split of the domain ranks (the plan's note on the best one).
"""

from __future__ import annotations

from .cost import (
    DomainLayerPlan,
    MemoryEstimate,
    predicted_collectives,
    predicted_halo_bytes,
)
from .make import Plan, RankEntry, make_plan
from .report import format_plan
from .trace import build_meta_model, model_input_shapes

__all__ = [
    "DomainLayerPlan",
    "MemoryEstimate",
    "Plan",
    "RankEntry",
    "build_meta_model",
    "format_plan",
    "make_plan",
    "model_input_shapes",
    "predicted_collectives",
    "predicted_halo_bytes",
]
