"""Attention over flattened H*W tokens, sequence parallel (Ulysses-style) and exact.

A module that flattens its B,C,H,W input to tokens (``x.flatten(2)``: H is the outer factor, so
every rank holds one contiguous block of the global token sequence) and attends over them with
``nn.MultiheadAttention`` or ``F.scaled_dot_product_attention`` runs UNMODIFIED under
:func:`sequence_parallel_attention`, a ``TorchFunctionMode`` that replaces those two calls:
projections stay local, one all-to-all turns "all heads, my tokens" into "my heads, all tokens",
the attention core runs over every key of those heads, and a second all-to-all brings each
rank's queries back.  Softmax attention without a mask does not depend on the order of the key
tokens and each query's output depends only on that query, so the result is the single-process
one whatever the local token order is, as long as q, k and v are all token-sharded over the same
ranks.  Masks and ``is_causal`` refer to global token positions: refused (``ValueError`` naming
the module).  The work unit split over ranks is (batch x heads), balanced by ``head_split``.

:class:`DomainTokenAttention` wraps such a module (``nn.MultiheadAttention`` itself, or a module
declaring ``_domain_attention = {"form": "tokens"}``) and runs its forward under the mode.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..manager import resolve_manager
from ..wrap import DomainWrapper
from .layouts import head_split
from .relayout import copy_tp_declarations
from .token_core import sequence_parallel_sdpa
from .token_mha import sequence_parallel_mha

__all__ = ["DomainTokenAttention", "SequenceParallelAttention", "sequence_parallel_attention"]


class SequenceParallelAttention(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` and ``F.multi_head_attention_forward``
    (what ``nn.MultiheadAttention`` calls; its fused eval fast path is skipped while a
    ``TorchFunctionMode`` is active) compute over the tokens of every domain rank."""

    def __init__(self, manager, name: str = "attention", owner=None):
        super().__init__()
        self.manager, self.name, self.owner = manager, name, owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return sequence_parallel_sdpa(
                self.manager, self.name, *args, owner=self.owner, **kwargs
            )
        if func is F.multi_head_attention_forward:
            return sequence_parallel_mha(self.manager, self.name, args, kwargs, self.owner)
        return func(*args, **kwargs)


def sequence_parallel_attention(name: str = "attention", *, manager) -> SequenceParallelAttention:
    """The mode: ``with sequence_parallel_attention("blocks.3.attn", manager=mgr): y = module(x)``;
    ``name`` (the module's path) appears in its errors."""
    return SequenceParallelAttention(manager, name)


def _heads(module: nn.Module) -> int:
    """Heads, for the planner's memory estimate: ``nn.MultiheadAttention.num_heads``, the
    declaration's ``"heads"`` (a number or an attribute name), a ``heads`` attribute, or 1."""
    spec = getattr(module, "_domain_attention", None)
    heads = spec.get("heads") if isinstance(spec, dict) else None
    if isinstance(heads, str):
        heads = getattr(module, heads)
    if heads is None:
        heads = getattr(module, "num_heads", getattr(module, "heads", 1))
    return int(heads)


class DomainTokenAttention(DomainWrapper):
    """Run ``module``'s unmodified forward under :func:`sequence_parallel_attention`.

    For ``nn.MultiheadAttention`` and modules declaring ``_domain_attention = {"form":
    "tokens"}`` (attention over all tokens of their own rows, flattened with H outermost).
    Parameters and ``state_dict`` keys are the module's; its submodules are still converted
    (``_domain_convert_children``: a 3x3 conv inside gets its halo exchange as anywhere else).
    """

    domain_form = "sequence"
    _domain_convert_children = True

    def __init__(self, module: nn.Module, shard_dim=-2, *, manager=None):
        super().__init__(module)
        copy_tp_declarations(self, module)
        self.shard_dim, self.manager = shard_dim, manager
        self.heads = _heads(module)

    @property
    def tile_exact(self) -> bool:
        """A bare ``nn.MultiheadAttention`` runs on lat x lon tiles as it is: its input is the
        tokens of the tile (``token_core.py``); a declared module flattens a tile itself and
        runs on latitude strips (``tiles_relayout.py``)."""
        return isinstance(self.wrapped, nn.MultiheadAttention)

    def _name(self) -> str:
        return getattr(self, "module_path", None) or type(self.wrapped).__name__

    def forward(self, *args, **kwargs):
        mgr = resolve_manager(self.manager, type(self.wrapped).__name__)
        # .train() / .eval() on the parent reach this wrapper and the shared children only
        self.wrapped.training = self.training
        if mgr.domain_world_size == 1:
            return self.wrapped(*args, **kwargs)
        with SequenceParallelAttention(mgr, self._name(), self):
            return self.wrapped(*args, **kwargs)

    # ---- geometry protocol and planner costs
    def output_height(self, input_height: int) -> int:
        return input_height

    def input_windows(self, input_height: int, n: int):
        return None  # not a window form: every rank reads every token of its units

    def _tokens(self, input_shape) -> tuple[int, int, int]:
        """(batch, tokens, channels) of the module's global input."""
        if isinstance(self.wrapped, nn.MultiheadAttention):
            if len(input_shape) == 2:
                return 1, input_shape[0], input_shape[1]
            if self.wrapped.batch_first:
                return tuple(input_shape)
            return input_shape[1], input_shape[0], input_shape[2]
        b, c = input_shape[0], input_shape[1]
        return b, math.prod(input_shape[2:]), c

    def communication_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """Bytes sent over all ranks per forward: q, k, v and the output, each moving the
        (d-1)/d of its elements that live elsewhere (a declared module's q, k, v are taken to
        have its input's channel count); ``nn.MultiheadAttention`` adds the attention weights
        it returns by default (``need_weights=True``): batch x heads x tokens^2."""
        b, tokens, channels = self._tokens(input_shape)
        moved = 4 * b * tokens * channels
        if isinstance(self.wrapped, nn.MultiheadAttention):
            moved += b * self.heads * tokens * tokens
        return int(moved * itemsize * (n - 1) / n)

    def activation_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """Bytes of q, k, v the busiest rank holds: its (batch x head) units on every token."""
        b, tokens, channels = self._tokens(input_shape)
        units = b * self.heads
        busiest = max(stop - start for start, stop in head_split(units, n))
        return 3 * busiest * tokens * (channels // self.heads) * itemsize

    def extra_repr(self) -> str:
        return f"tokens, heads={self.heads}"
