"""The pieces of sequence-parallel token attention shared by its SDPA and MHA forms.

Token counts of every rank (one tiny all_gather), the core run "my units, all tokens" between two
all-to-alls, and ``F.scaled_dot_product_attention`` over tokens sharded in rank order.  See
:mod:`.tokens` for why this is exact.

One domain, P x Q tiles (rows: P x 1).  The tokens of a rank are its tile flattened, H
outermost (``x.flatten(2)``).  Softmax attention without a mask does not depend on the order of
the key tokens, and each query's output depends on that query alone: gathered in domain-rank
order (tile by tile; on rows that IS the global row-major order) the keys give the
single-process output.  Two things depend on the global layout:

* the check that the tokens are whole tiles (the counts of the P x Q ranks are
  ``rows[lat] * cols[lon]`` of the balanced tiles of some H x W: :func:`tile_grids`; at Q = 1,
  whole rows of the balanced latitude layout);
* on Q > 1 tiles, the key order of the attention WEIGHTS ``nn.MultiheadAttention`` returns by
  default: the weights over the gathered keys are put in global row-major order
  (:func:`global_key_order`) when the counts determine the grid; where several grids give the
  same counts (e.g. every tile equal) the order is unknown and ``need_weights=True`` raises,
  naming the module.
"""

from __future__ import annotations

import math
import weakref
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..rows import shard_range, shard_sizes
from .layouts import head_split
from .sequence import heads_to_positions, positions_to_heads

__all__ = [
    "checked_counts",
    "core_over_all_tokens",
    "global_key_order",
    "mask_refused",
    "sequence_parallel_sdpa",
    "tile_grids",
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
    shape = tuple(manager.domain_shape)
    if not tile_grids(tuple(q_counts), shape):  # whole tiles (at Q = 1: whole rows)
        raise ValueError(
            f"{name}: token counts {q_counts} across the domain ranks are not whole balanced "
            f"tiles of one grid ({shape[0]} x {shape[1]}; rows at Q = 1): the tokens must be "
            "exactly the local tile flattened with H outermost (no per-rank extra tokens such "
            "as a class token)"
        )
    return q_counts, [c[1] for c in counts]


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


# ----------------------------------------------------------------------------- tiles
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@lru_cache(maxsize=256)
def tile_grids(counts: tuple[int, ...], shape: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Every global ``(H, W)`` whose balanced ``shape`` = (P, Q) tiles hold ``counts`` tokens
    (domain rank ``lat * Q + lon``); empty when none does (the tokens are not whole tiles)."""
    p, q = shape
    grid = [counts[lat * q : (lat + 1) * q] for lat in range(p)]
    if not any(counts):
        return ((0, 0),)
    first = math.gcd(*grid[0])
    found = []
    for rows0 in _divisors(first) if first else ():
        cols = [c // rows0 for c in grid[0]]
        if not cols[0] or tuple(cols) != shard_sizes(sum(cols), q):
            continue
        if any(row[0] % cols[0] for row in grid):
            continue
        rows = [row[0] // cols[0] for row in grid]
        if tuple(rows) != shard_sizes(sum(rows), p):
            continue
        if all(grid[a][b] == rows[a] * cols[b] for a in range(p) for b in range(q)):
            found.append((sum(rows), sum(cols)))
    return tuple(found)


@lru_cache(maxsize=64)
def _order(height: int, width: int, shape: tuple[int, int]) -> tuple[int, ...]:
    p, q = shape
    offsets, at = {}, 0
    for lat in range(p):
        for lon in range(q):
            (r0, r1), (c0, c1) = shard_range(height, p, lat), shard_range(width, q, lon)
            offsets[lat, lon] = (at, r0, c0, c1 - c0)
            at += (r1 - r0) * (c1 - c0)
    rows_of = [next(a for a in range(p) if shard_range(height, p, a)[1] > r) for r in range(height)]
    cols_of = [next(b for b in range(q) if shard_range(width, q, b)[1] > c) for c in range(width)]
    out = []
    for r in range(height):
        for c in range(width):
            start, r0, c0, w = offsets[rows_of[r], cols_of[c]]
            out.append(start + (r - r0) * w + (c - c0))
    return tuple(out)


def global_key_order(counts: list[int], shape, name: str, device) -> torch.Tensor:
    """Positions, among the keys gathered in domain-rank order (tile after tile, each tile
    row-major), of the global tokens in row-major order; ``ValueError`` naming ``name`` when
    the counts do not determine the grid."""
    grids = tile_grids(tuple(counts), tuple(shape))
    if len(grids) != 1:
        raise ValueError(
            f"{name}: nn.MultiheadAttention with need_weights=True on lat x lon tiles: the key "
            f"order of its attention weights is the global token order, which the tile token "
            f"counts {list(counts)} do not determine (grids {list(grids)}); call it with "
            "need_weights=False, or use an int (latitude-only) domain"
        )
    return torch.tensor(_order(*grids[0], tuple(shape)), dtype=torch.long, device=device)
