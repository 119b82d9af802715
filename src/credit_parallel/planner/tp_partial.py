"""What the plan says about replicated tensors meeting tp-sharded activations.

Runs the tensor-parallel guard's trace (``tensor_parallel_guard``) on the meta model, in one
process: the module outputs whose gradient the run will all-reduce over tp (a note each, with
the parameters they cover), and the replicated tensors it cannot make exact (a violation each:
their gradients would differ across the tp ranks)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..parallel.tensor_parallel import collect_tensor_parallel_targets
from ..parallel.tensor_parallel_guard import find_partial_gradient_modules

__all__ = ["tp_partial_gradient_findings"]


def tp_partial_gradient_findings(
    model: nn.Module, shapes: Sequence[Sequence[int]], tp: int, notes: list, violations: list
) -> None:
    """Append to ``notes`` / ``violations`` what the guard will do for ``model`` (any device,
    meta included; per-sample input ``shapes``) at tp size ``tp``; nothing at tp 1 or when the
    model declares no tensor parallelism.  Run it on the unconverted model."""
    targets = collect_tensor_parallel_targets(model) if tp > 1 else []
    if not targets:
        return
    column = {t.path for t in targets if t.role == "col"}
    row = {t.path for t in targets if t.role == "row"}
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    inputs = [torch.zeros((1, *s), device=device) for s in shapes]
    with torch.no_grad():
        report = find_partial_gradient_modules(model, column, row, *inputs)
    if report.modules:
        notes.append(
            f"tp: {len(report.modules)} replicated module output(s) meet tp-sharded activations "
            f"({', '.join(report.modules)}; {len(report.parameters)} parameters): their "
            "gradient is all-reduced over tp (one all-reduce each per step), so it is exact"
        )
    violations.extend(
        f"tp: replicated {path} would get different gradients on the tp ranks: {why}"
        for path, why in report.unfixable
    )
