"""Attention under latitude sharding, exact without gathering the globe.

* :mod:`.layouts` — pure row layouts (windows, shifted windows, strided groups) and head splits;
* :mod:`.relayout` — :class:`DomainRowGroupAttention`: whole row groups per rank, one exchange in
  and one out (forms "relayout" and "regroup");
* :mod:`.sequence` — :class:`DomainSequenceAttention`: heads split over ranks, all positions per
  head, all-to-all in and out (form "sequence");
* :mod:`.tokens` — :class:`DomainTokenAttention`: ``nn.MultiheadAttention`` /
  ``F.scaled_dot_product_attention`` over flattened H*W tokens, run unmodified under a
  ``TorchFunctionMode`` that makes the attention sequence parallel (form "sequence");
* :mod:`.token_core` / :mod:`.token_mha` — the pieces of token attention (counts, the core
  between two all-to-alls, ``F.multi_head_attention_forward`` over sharded tokens);
* :mod:`.cost` — form, extra communication and memory per rank, for the planner.

Which module of a model gets which of these forms, and the whole-model / whole-block wrappers of
known client classes (timm's and miles-credit's Swin-V2 blocks, FuXi), live in
:mod:`credit_parallel.domain.adapters`.
"""

from .cost import form_cost
from .layouts import head_split, shifted_window_layout, strided_group_layout, window_layout
from .relayout import DomainRowGroupAttention, return_rows
from .sequence import SEQUENCE_CORES, DomainSequenceAttention, all_to_all_parts
from .tokens import DomainTokenAttention, SequenceParallelAttention, sequence_parallel_attention

__all__ = [
    "SEQUENCE_CORES",
    "DomainRowGroupAttention",
    "DomainSequenceAttention",
    "DomainTokenAttention",
    "SequenceParallelAttention",
    "all_to_all_parts",
    "form_cost",
    "head_split",
    "return_rows",
    "sequence_parallel_attention",
    "shifted_window_layout",
    "strided_group_layout",
    "window_layout",
]
