"""Fused q|k|v projections and the head count: when a split is exact, and what to tell the user.

A fused projection split per part (``_tp_fused``) gives each tp rank ``width / tp`` of every
part; that is exact only when the declaring module's forward takes its head count from the width
it receives (``heads = width // head_dim``).  A module that splits heads by a stored ``heads``
attribute would read its share as all the heads and mix them, silently: CREDIT's legacy
wxformer ``Attention`` (``credit.models.wxformer.crossformer``), which still carries
``_tp_col = "to_qkv"`` / ``_tp_row = "to_out"``, is refused by name, and the message for an
undeclared fused layer suggests ``_tp_fused`` only under that condition.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["STORED_HEADS_ATTENTION", "check_stored_heads", "undeclared_fused_message"]

# declaring modules whose attention splits heads by a stored count (qualified class name: what)
STORED_HEADS_ATTENTION = {
    "credit.models.wxformer.crossformer.Attention": "CREDIT's legacy wxformer Attention",
}


def undeclared_fused_message(target) -> str:
    """The refusal of a column target named like a fused projection without ``_tp_fused``."""
    name = target.declared_as
    return (
        f"tensor-parallel target {target.describe()} looks like a fused projection (its name "
        "contains 'qkv'/'kv') but the declaring module has no _tp_fused entry for it. "
        f"_tp_fused = {{{name!r}: 3}} (q|k|v) or {{{name!r}: 2}} (k|v) splits it per part and "
        "is exact only when the declaring module's forward takes its head count from the width "
        "it receives (heads = width // head_dim), never from a stored heads attribute (CREDIT's "
        "legacy wxformer Attention does not: for it use nextgen_wxformer or tensor: 1); "
        f"{{{name!r}: 1}} only if the layer is not fused; otherwise leave it out of the "
        "declaration (or use tensor: 1)"
    )


def check_stored_heads(owner: nn.Module, target, is_fused_name: Callable[[str], bool]) -> None:
    """Refuse a fused target (declared, or named like one) of a module in
    :data:`STORED_HEADS_ATTENTION`, naming the target and why no declaration makes it exact."""
    what = STORED_HEADS_ATTENTION.get(f"{type(owner).__module__}.{type(owner).__qualname__}")
    if what is None or not (target.fused_declared or is_fused_name(target.path)):
        return
    raise ValueError(
        f"tensor-parallel target {target.describe()}: {what} splits q|k|v into heads by its "
        "stored self.heads, not by the width each tp rank holds, so a split fused projection "
        "would mix heads (no _tp_fused declaration makes it exact); use nextgen_wxformer "
        "(CREDIT's _tp_plan blocks) for tensor parallelism, or tensor: 1"
    )
