"""``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` calls) over tokens sharded
in rank order, computed from the same weights as torch's function and exact.

Input projections (packed ``in_proj_weight`` or separate q/k/v weights, biases) run on the local
tokens; the (batch x head) units go to the ranks by :func:`~.token_core.core_over_all_tokens`;
``bias_k`` / ``bias_v`` and ``add_zero_attn`` append their key tokens after the gathered keys (the
order torch uses: real keys, bias token, zero token); a ``key_padding_mask`` is gathered along the
tokens in rank order (small: batch x tokens); attention weights (``need_weights=True``) are those
of each rank's own queries over every key in rank order (on lat x lon tiles put in the global
key order, ``token_core.py``), returned with the output by the same all-to-all; the output
projection runs locally.  ``attn_mask``, ``is_causal`` and
``static_k`` / ``static_v`` are refused (they refer to global positions or unsharded keys).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .sequence import all_to_all_parts
from .token_core import (
    checked_counts,
    core_over_all_tokens,
    global_key_order,
    mask_refused,
    unit_range,
)

__all__ = ["sequence_parallel_mha"]

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def _projections(a: dict, query, key, value):
    if a["use_separate_proj_weight"]:
        weights = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
    else:
        weights = a["in_proj_weight"].chunk(3)
    bias = a["in_proj_bias"]
    biases = bias.chunk(3) if bias is not None else (None, None, None)
    return tuple(F.linear(t, w, b) for t, w, b in zip((query, key, value), weights, biases))


def _gathered_key_mask(mask, k_counts, manager, dtype):
    """(B, S_mine) key_padding_mask -> additive float (B, S_all), keys in rank order."""
    if mask.dtype == torch.bool:  # torch's _canonical_mask: True = ignore this key
        mask = torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    else:
        mask = mask.to(dtype)
    n = manager.domain_world_size
    parts = all_to_all_parts([mask] * n, [(mask.shape[0], c) for c in k_counts], manager)
    return torch.cat(parts, 1)


def _extra_keys(a: dict, k, v, batch: int, heads: int, units: tuple[int, int]):
    """Append bias_k / bias_v and the zero key of add_zero_attn for this rank's units."""
    start, stop = units
    if a["bias_k"] is not None and a["bias_v"] is not None:
        per_unit = [
            b.reshape(heads, 1, -1).repeat(batch, 1, 1)[start:stop]
            for b in (a["bias_k"], a["bias_v"])
        ]
        k, v = torch.cat([k, per_unit[0]], 1), torch.cat([v, per_unit[1]], 1)
    elif a["bias_k"] is not None or a["bias_v"] is not None:
        raise ValueError("multi_head_attention_forward: bias_k and bias_v go together")
    if a["add_zero_attn"]:
        k = torch.cat([k, k.new_zeros(k.shape[0], 1, k.shape[2])], 1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], 1)
    return k, v


def _core(a: dict, key_mask, batch: int, heads: int, units: tuple[int, int]):
    """The attention of this rank's units over every key, as torch computes it."""
    dropout = a["dropout_p"] if a["training"] else 0.0
    start, stop = units

    def core(q, k, v):
        k, v = _extra_keys(a, k, v, batch, heads, units)
        mask = None
        if key_mask is not None:
            mask = F.pad(key_mask, (0, k.shape[1] - key_mask.shape[1]))
            mask = mask.reshape(batch, 1, 1, -1).expand(-1, heads, -1, -1)
            mask = mask.reshape(batch * heads, 1, -1)[start:stop]
        if q.shape[0] == 0:  # no unit here: stay in the graph of both all-to-alls
            linked = (q.sum() + k.sum() + v.sum()) * 0
            out = q.new_zeros(0, q.shape[1], v.shape[2]) + linked
            weights = q.new_zeros(0, q.shape[1], k.shape[1]) + linked
            return (out, weights) if a["need_weights"] else out
        if not a["need_weights"]:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        scores = torch.bmm(q * (1.0 / q.shape[-1]) ** 0.5, k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        return torch.bmm(weights, v), weights

    return core


def _refuse_unsupported(name: str, a: dict) -> None:
    if a["attn_mask"] is not None or a["is_causal"]:
        raise mask_refused(name, "nn.MultiheadAttention")
    if a["static_k"] is not None or a["static_v"] is not None:
        raise ValueError(
            f"{name}: multi_head_attention_forward with static_k / static_v (keys not computed "
            "from the sharded tokens) is not sequence parallel; use nonlocal_policy='gather'"
        )


def sequence_parallel_mha(manager, name: str, args: tuple, kwargs: dict, owner=None):
    """``F.multi_head_attention_forward(*args, **kwargs)`` with token dim 0 of query, key and
    value sharded over the domain ranks in rank order; returns ``(output, weights or None)``."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    _refuse_unsupported(name, a)
    query, key, value, kpm = a["query"], a["key"], a["value"], a["key_padding_mask"]
    batched = query.dim() == 3
    if not batched:  # (L, E): torch runs it as a batch of one
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        kpm = kpm.unsqueeze(0) if kpm is not None else None
    length, batch, embed = query.shape
    heads = a["num_heads"]
    q, k, v = _projections(a, query, key, value)
    # torch's layout: (L, B, E) -> (B * heads, L, head_dim), unit = b * heads + h
    q, k, v = (t.reshape(t.shape[0], batch * heads, -1).transpose(0, 1) for t in (q, k, v))
    q_counts, k_counts = checked_counts(manager, name, length, key.shape[0], batch * heads, owner)
    order = None  # the weights' keys in global order on lat x lon tiles (token_core.py):
    if a["need_weights"] and getattr(manager, "is_tiled", False):  # refused before any all-to-all
        order = global_key_order(k_counts, manager.domain_shape, name, q.device)
    key_mask = None if kpm is None else _gathered_key_mask(kpm, k_counts, manager, q.dtype)
    units = unit_range(batch * heads, manager)
    outs = core_over_all_tokens(
        _core(a, key_mask, batch, heads, units), q, k, v, q_counts, k_counts, manager
    )
    out = outs[0].transpose(0, 1).reshape(length * batch, embed)
    out = F.linear(out, a["out_proj_weight"], a["out_proj_bias"]).view(length, batch, -1)
    weights = None
    if a["need_weights"]:
        weights = outs[1].reshape(batch, heads, length, -1)
        if order is not None:
            extra = weights[..., sum(k_counts) :]  # bias_k, add_zero_attn: last, as torch's
            weights = torch.cat([weights.index_select(-1, order), extra], -1)
        if a["average_attn_weights"]:
            weights = weights.mean(dim=1)
        if not batched:
            weights = weights.squeeze(0)
    if not batched:
        out = out.squeeze(1)
    return out, weights
