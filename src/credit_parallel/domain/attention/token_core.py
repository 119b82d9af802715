"""The pieces of sequence-parallel token attention shared by its SDPA and MHA forms.

Token counts of every rank (one tiny all_gather), the core run "my units, all tokens" between two
all-to-alls, and ``F.scaled_dot_product_attention`` over tokens sharded in rank order.  See
:mod:`.tokens` for why this is exact.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..rows import shard_sizes
from .layouts import head_split
from .sequence import heads_to_positions, positions_to_heads
from .token_tiles import tile_grids

__all__ = [
    "checked_counts",
    "core_over_all_tokens",
    "mask_refused",
    "sequence_parallel_sdpa",
    "token_counts",
    "unit_range",
]


def mask_refused(name: str, call: str) -> ValueError:
    return ValueError(
        f"{name}: {call} with attn_mask or is_causal=True refers to global token positions, "
        "which sequence-parallel attention does not see; run this module on the whole globe "
        "with nonlocal_policy='gather' (or drop the mask)"
    )


def token_counts(manager, *lengths: int, owner=None) -> list[tuple[int, ...]]:
    """Per domain rank, its local token counts ``lengths`` (one tiny all_gather, on the
    device the group communicates on).

    The counts are a function of the input shapes alone, so an eager call notes them for
    ``owner`` (the attention wrapper) in the manager, under its forward token, as layers note
    their global heights; under ``torch.compile`` they are read back from there (a compiled
    graph cannot read a gathered tensor on the host): no communication, no graph break.  A
    whole-model compile with no eager call first has none noted and stops, naming the module
    and ``compile_blocks``.
    """
    if torch.compiler.is_compiling():
        return _noted_counts(manager, owner, lengths)
    mine = torch.tensor(lengths, dtype=torch.int64, device=manager.device)
    out = [torch.empty_like(mine) for _ in range(manager.domain_world_size)]
    dist.all_gather(out, mine, group=manager.domain_group)
    counts = [tuple(int(v) for v in t.tolist()) for t in out]
    if owner is not None:
        noted = _noted_for(manager, owner)
        key = (manager._token, tuple(lengths))
        noted[key] = counts if noted.get(key, counts) == counts else None  # None: ambiguous
    return counts


def _noted_for(manager, owner) -> dict:
    """The counts noted for ``owner``, kept by the manager (``id(owner)``, dropped with the
    owner): the library writes nothing on the modules it wraps."""
    table = manager.token_counts_noted
    noted = table.get(id(owner))
    if noted is None:
        noted = table[id(owner)] = {}
        weakref.finalize(owner, table.pop, id(owner), None)
    return noted


def _noted_counts(manager, owner, lengths) -> list[tuple[int, ...]]:
    return _counts_at_trace(manager, id(owner), type(owner).__name__, manager._token, lengths)


@torch._dynamo.assume_constant_result
def _counts_at_trace(manager, owner_id: int, name: str, token, lengths) -> list:
    counts = manager.token_counts_noted.get(owner_id, {}).get((token, tuple(lengths)))
    if counts is None:
        raise RuntimeError(
            f"{name}: no token counts of the domain ranks known for local lengths "
            f"{tuple(lengths)} of this input shape under torch.compile: sequence-parallel token "
            "attention learns them eagerly; compile the model with "
            "credit_parallel.compile_blocks (its first call per input shape runs eagerly and "
            "notes them)"
        )
    return counts


def checked_counts(manager, name: str, q_len: int, k_len: int, units: int, owner=None):
    """Per-rank query and key token counts (one tiny all_gather, or the counts noted on
    ``owner`` under ``torch.compile``: see :func:`token_counts`); every rank must hold the same
    (batch x head) units, else the dim taken for tokens is not the sharded one."""
    counts = token_counts(manager, q_len, k_len, units, owner=owner)
    if len({c[2] for c in counts}) != 1:
        raise ValueError(
            f"{name}: sequence-parallel attention found different batch x head sizes on the "
            f"domain ranks ({[c[2] for c in counts]}): its token dim is not the latitude-sharded "
            "one (check batch_first, and flatten H outermost: x.flatten(2))"
        )
    q_counts = [c[0] for c in counts]
    if getattr(manager, "is_tiled", False):  # lat x lon tiles: whole tiles (token_tiles.py)
        if not tile_grids(tuple(q_counts), tuple(manager.domain_shape)):
            raise ValueError(
                f"{name}: token counts {q_counts} across the lat x lon tiles are not whole "
                "balanced tiles of one grid: the tokens must be exactly the local tile "
                "flattened (no per-rank extra tokens such as a class token)"
            )
        return q_counts, [c[1] for c in counts]
    if not _balanced_multiple(q_counts):
        raise ValueError(
            f"{name}: token counts {q_counts} across the domain ranks are not whole rows of the "
            "balanced latitude layout: the tokens must be exactly the local rows flattened with "
            "H outermost (no per-rank extra tokens such as a class token)"
        )
    return q_counts, [c[1] for c in counts]


def _balanced_multiple(counts: list[int]) -> bool:
    """True when ``counts[r] = rows[r] * W`` for the balanced row shards of some height and
    some row length W (equal counts always pass: nothing to tell them apart)."""
    if len(set(counts)) == 1:
        return True
    width = max(counts) - min(counts)  # balanced row counts differ by exactly one row
    if any(c % width for c in counts):
        return False
    rows = [c // width for c in counts]
    return tuple(rows) == shard_sizes(sum(rows), len(rows))


def unit_range(units: int, manager) -> tuple[int, int]:
    return head_split(units, manager.domain_world_size)[manager.domain_rank]


def core_over_all_tokens(core, q, k, v, q_counts, k_counts, manager):
    """(U, L_mine, D) q, k, v -> ``core(q, k, v)`` for this rank's share of the U units on every
    token -> (U, L_mine, Dv).  ``core`` returns the output (and optionally more per-unit
    tensors of shape (u, L_all, ...), returned to the query owners the same way)."""
    units = q.shape[0]
    q = heads_to_positions(q, 0, 1, units, q_counts, manager)
    k = heads_to_positions(k, 0, 1, units, k_counts, manager)
    v = heads_to_positions(v, 0, 1, units, k_counts, manager)
    outs = core(q, k, v)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return tuple(positions_to_heads(o, 0, 1, units, q_counts, manager) for o in outs)


def _sdpa_core(dropout_p, scale):
    def core(q, k, v):
        if q.shape[0] == 0:  # no unit on this rank: still part of both all-to-alls' graphs
            linked = (q.sum() + k.sum() + v.sum()) * 0
            return q.new_zeros(0, q.shape[1], v.shape[-1]) + linked
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)

    return core


def sequence_parallel_sdpa(
    manager,
    name: str,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale=None,
    enable_gqa: bool = False,
    *,
    owner=None,
):
    """``F.scaled_dot_product_attention`` on (..., L_local, D) tensors whose token dim -2 is
    sharded in rank order: the same function as one process on the concatenated tokens."""
    if attn_mask is not None or is_causal:
        raise mask_refused(name, "scaled_dot_product_attention")
    lead = query.shape[:-2]
    if key.shape[:-2] != lead or value.shape[:-2] != lead:
        raise ValueError(
            f"{name}: sequence-parallel scaled_dot_product_attention needs q, k and v with the "
            f"same leading (batch, head) dims, got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)} (grouped-query / broadcast heads are not split)"
        )
    units = math.prod(lead)
    q_counts, k_counts = checked_counts(manager, name, query.shape[-2], key.shape[-2], units, owner)
    q, k, v = (t.reshape(units, t.shape[-2], t.shape[-1]) for t in (query, key, value))
    (out,) = core_over_all_tokens(
        _sdpa_core(dropout_p, scale), q, k, v, q_counts, k_counts, manager
    )
    return out.reshape(*lead, query.shape[-2], value.shape[-1])
