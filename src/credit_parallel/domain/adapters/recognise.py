"""Which attention modules the converter makes exact, and how: recognised by qualified class
name (miles-credit's and timm's, without importing them) or declared by the user's module.

Declaring the structure on your own module (class attribute or property)::

    class MyWindowAttention(nn.Module):
        _domain_attention = {"form": "windows", "rows": 8}      # windows of 8 rows tile H

    # other forms: {"form": "strided", "rows": k}  rows j, j+H/k, ... form a group of k rows,
    #              laid out "(k h)" as CREDIT's long-distance attention does;
    #              {"form": "shifted_windows", "rows": w, "shift": s, "entry": "forward_rows"}:
    #              windows of w rows of the tensor rolled by -s over H; the wrapper performs
    #              the roll as part of its row exchange and calls
    #              module.forward_rows(x_held, global_rows) (masks from global positions; see
    #              credit_parallel.models.swin.ShiftedWindowAttention);
    #              {"form": "tokens"}: the forward flattens its own rows to tokens with H
    #              outermost (x.flatten(2)) and attends over all of them with
    #              nn.MultiheadAttention or F.scaled_dot_product_attention, no mask: run
    #              unmodified, sequence parallel (DomainTokenAttention).  nn.MultiheadAttention
    #              itself is recognised by type.

``"rows"`` may also name an attribute of the module (``{"form": "windows", "rows":
"window_size"}``).  A ready wrapper for ``custom_converters`` is
:class:`~credit_parallel.domain.attention.DomainRowGroupAttention` (row groups) or
:class:`~credit_parallel.domain.attention.DomainSequenceAttention` with your own ``core``.
"""

from __future__ import annotations

from torch import nn

from ..attention.relayout import DomainRowGroupAttention
from ..attention.sequence import SEQUENCE_CORES, DomainSequenceAttention
from ..attention.tokens import DomainTokenAttention
from ..wrap import replace_outermost
from .nextgen import nextgen_part_replacement
from .swin import (
    DomainSwinBlock,
    DomainSwinPatchMerging,
    is_swin_patch_merging,
    swin_family,
    swin_unshardable_reason,
)

__all__ = [
    "attention_replacement",
    "convert_known_attention",
    "known_attention_decision",
    "qualified_name",
    "recognised_attention_form",
]

# miles-credit 2026.2.0 classes that cut rows "(h s1)" (short) or "(l1 h)" (long) and mix
# nothing else over H
_CREDIT_WINDOW_ATTENTION = (
    "credit.models.crossformer.Attention",
    "credit.models.camulator.Attention",
    "credit.models.wxformer.crossformer.Attention",
    "credit.models.wxformer.crossformer_downscaling.Attention",
    "credit.models.wxformer.wxformer_next.Attention",
)


def qualified_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _declared(module: nn.Module):
    spec = getattr(module, "_domain_attention", None)
    if spec is None:
        return None
    if isinstance(spec, dict) and spec.get("form") == "tokens":
        return "tokens", 0, 0, None  # attention over all tokens: nothing about rows to say
    if not isinstance(spec, dict) or "form" not in spec or "rows" not in spec:
        raise ValueError(
            f"{type(module).__name__}._domain_attention must be a dict with 'form' and 'rows' "
            f"(or {{'form': 'tokens'}}), got {spec!r}"
        )
    rows = spec["rows"]
    if isinstance(rows, str):
        rows = getattr(module, rows)
    return spec["form"], int(rows), int(spec.get("shift", 0)), spec.get("entry")


def attention_replacement(module: nn.Module, manager, shard_dim: int = -2):
    """The exact domain-parallel form of ``module``, or None when its structure is unknown."""
    name = qualified_name(module)
    declared = _declared(module)
    if (declared is not None and declared[0] == "tokens") or isinstance(
        module, nn.MultiheadAttention
    ):
        return DomainTokenAttention(module, shard_dim, manager=manager)
    if declared is not None:
        form, rows, shift, entry = declared
        return DomainRowGroupAttention(
            module, form, rows, shift, shard_dim, manager=manager, entry=entry
        )
    if name in _CREDIT_WINDOW_ATTENTION:
        form = {"short": "windows", "long": "strided"}.get(getattr(module, "attn_type", None))
        if form is not None:
            return DomainRowGroupAttention(
                module, form, int(module.window_size), 0, shard_dim, manager=manager
            )
    if name in SEQUENCE_CORES:
        return DomainSequenceAttention(module, shard_dim=shard_dim, manager=manager)
    nextgen = nextgen_part_replacement(module, manager)  # ColumnAttention, SpectralGNNBottleneck
    if nextgen is not None:
        return nextgen
    if swin_family(module) is not None and swin_unshardable_reason(module) is None:
        # (B, H, W, C) blocks: H is their dim 1 whatever the model's shard_dim
        return DomainSwinBlock(module, manager=manager)
    if is_swin_patch_merging(module):
        return DomainSwinPatchMerging(module, manager=manager)
    return None


def known_attention_decision(module: nn.Module, path: str, manager, shard_dim: int, skip_types=()):
    """The attention step of the converter for ``module`` at ``path`` ("" or "<root>" for the
    model), outermost first: None (not attention: look at its children), ``module`` itself
    (keep it, children not visited: already domain-parallel, a caller's custom type, or
    declared row-local) or its exact replacement (children not visited), built with its
    module path."""
    if getattr(module, "_domain_parallel", False) or isinstance(module, tuple(skip_types)):
        return module
    if getattr(module, "_domain_local", None) is True:
        # declared row-local: an nn.MultiheadAttention inside attends within rows it holds
        # (per row, per window), not over the sharded tokens; the walker skips it too
        return module
    replacement = attention_replacement(module, manager, shard_dim)
    if replacement is not None:
        replacement.configure(module_path=path or "<root>")
    return replacement


def convert_known_attention(model: nn.Module, manager, shard_dim: int = -2, skip_types=()):
    """Replace, in place, every recognised or declared attention module (outermost first, not
    descending into a replaced one) by its exact form; modules of ``skip_types`` (the caller's
    custom converters, which take precedence) are left to the caller.  Returns the model (the
    root itself may be replaced)."""

    def replacement_for(module: nn.Module, path: str):
        return known_attention_decision(module, path, manager, shard_dim, skip_types)

    return replace_outermost(model, replacement_for)


def recognised_attention_form(module: nn.Module) -> str | None:
    """The form the converter gives ``module`` ("relayout", "regroup", "sequence"; "halo" for a
    Swin patch merging), or None."""
    declared = _declared(module)
    if (declared is not None and declared[0] == "tokens") or isinstance(
        module, nn.MultiheadAttention
    ):
        return "sequence"
    if declared is not None:
        return "regroup" if declared[0] == "strided" else "relayout"
    name = qualified_name(module)
    if name in _CREDIT_WINDOW_ATTENTION:
        return {"short": "relayout", "long": "regroup"}.get(getattr(module, "attn_type", None))
    if name in SEQUENCE_CORES:
        return "sequence"
    if swin_family(module) is not None and swin_unshardable_reason(module) is None:
        return "relayout"
    if is_swin_patch_merging(module):
        return "halo"
    return None
