"""The graph breaks ``trainer.compile`` would meet, per block (``credit-parallel plan --compile``).

Without processes the planner cannot convert the model, so this looks at what ``compile_blocks``
compiles on one process: the model of the config, built on the meta device, run once to record
each block's inputs, then ``torch._dynamo.explain`` on every block (meta tensors: nothing is
computed).  A converted block adds the library's communication, which is traced as operators
(``domain/exchange/ops.py``) for every domain form (:data:`TRACED_FORMS`, which the report states), so
a block without breaks here has none at domain > 1 either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.compile import compile_targets
from .trace import build_meta_model, model_input_shapes

__all__ = ["TRACED_FORMS", "BlockBreaks", "compile_breaks", "format_compile_breaks"]

# the domain layers whose communication a compiled block traces as operators (domain/exchange/ops.py);
# none is left that breaks the graph
TRACED_FORMS = (
    "halo exchanges (every exchange_rows caller: convolutions, padding, resampling, ...)",
    "GroupNorm statistics",
    "sequence-parallel attention (heads and tokens: all-to-alls, token counts noted eagerly)",
    "row-group / Swin window re-layouts",
    "the nonlocal gather policy (rows gathered and kept)",
)


@dataclass(frozen=True)
class BlockBreaks:
    """One compiled block: its name, graph count, graph breaks and their reasons."""

    name: str
    block_type: str
    graphs: int
    breaks: int
    reasons: tuple[str, ...]


def compile_breaks(conf: dict, batch_size: int = 1, model: nn.Module | None = None):
    """``[BlockBreaks]`` for every block ``compile_blocks`` compiles in the model of ``conf``
    (or ``model``), traced with meta inputs of the config's shapes."""
    if model is None:
        model, _ = build_meta_model(conf)
    shapes = model_input_shapes(model)
    inputs = [torch.empty((batch_size, *s), device="meta") for s in shapes]
    targets = compile_targets(model)
    seen: dict = {}
    hooks = [
        block.register_forward_pre_hook(
            lambda m, args, kwargs, name=name: seen.setdefault(name, (args, kwargs)),
            with_kwargs=True,
        )
        for name, block in targets
    ]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for name, block in targets:
        if name not in seen:
            continue  # not called by the forward
        args, kwargs = seen[name]
        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(*args, **kwargs)
        reasons = tuple(str(r.reason).splitlines()[0] for r in explained.break_reasons)
        out.append(
            BlockBreaks(
                name or "(model)",
                type(block).__name__,
                explained.graph_count,
                explained.graph_break_count,
                reasons,
            )
        )
    return out


def format_compile_breaks(blocks) -> str:
    """The report section ``credit-parallel plan --compile`` prints."""
    total = sum(b.breaks for b in blocks)
    lines = [
        f"torch.compile per block ({len(blocks)} blocks, {total} graph breaks; fullgraph "
        "compilation needs 0 per block):"
    ]
    for b in blocks:
        lines.append(f"  {b.name} ({b.block_type}): {b.graphs} graph(s), {b.breaks} break(s)")
        lines.extend(f"    - {r}" for r in b.reasons)
    lines.append("  domain communication traced as operators: " + "; ".join(TRACED_FORMS))
    return "\n".join(lines)
