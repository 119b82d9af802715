"""Attention under latitude sharding, exact without gathering the globe.

* :mod:`.layouts` — pure row layouts (windows, shifted windows, strided groups) and head splits;
* :mod:`.relayout` — :class:`DomainRowGroupAttention`: whole row groups per rank, one exchange in
  and one out (forms "relayout" and "regroup");
* :mod:`.sequence` — :class:`DomainSequenceAttention`: heads split over ranks, all positions per
  head, all-to-all in and out (form "sequence");
* :mod:`.tokens` — :class:`DomainTokenAttention`: ``nn.MultiheadAttention`` /
  ``F.scaled_dot_product_attention`` over flattened H*W tokens, run unmodified under a
  ``TorchFunctionMode`` that makes the attention sequence parallel (form "sequence");
* :mod:`.swin_blocks` — :class:`DomainSwinBlock`: timm's and miles-credit's Swin-V2 blocks on
  (B, H, W, C) shards, the cyclic shift over H as a row exchange (form "relayout"), and
  :class:`DomainSwinPatchMerging` for their patch merging;
* :mod:`.recognise` — which modules get which form (qualified class names, ``_domain_attention``);
* :mod:`.cost` — form, extra communication and memory per rank, for the planner.
"""

from .cost import form_cost
from .layouts import head_split, shifted_window_layout, strided_group_layout, window_layout
from .recognise import (
    attention_replacement,
    convert_known_attention,
    qualified_name,
    recognised_attention_form,
)
from .relayout import DomainRowGroupAttention, return_rows
from .sequence import SEQUENCE_CORES, DomainSequenceAttention, all_to_all_parts
from .swin_blocks import (
    SWIN_BLOCKS,
    SWIN_PATCH_MERGING,
    DomainSwinBlock,
    DomainSwinPatchMerging,
    swin_unshardable_reason,
)
from .tokens import DomainTokenAttention, SequenceParallelAttention, sequence_parallel_attention

__all__ = [
    "SEQUENCE_CORES",
    "SWIN_BLOCKS",
    "SWIN_PATCH_MERGING",
    "DomainRowGroupAttention",
    "DomainSequenceAttention",
    "DomainTokenAttention",
    "SequenceParallelAttention",
    "DomainSwinBlock",
    "DomainSwinPatchMerging",
    "all_to_all_parts",
    "attention_replacement",
    "convert_known_attention",
    "form_cost",
    "head_split",
    "qualified_name",
    "recognised_attention_form",
    "return_rows",
    "sequence_parallel_attention",
    "shifted_window_layout",
    "strided_group_layout",
    "swin_unshardable_reason",
    "window_layout",
]
