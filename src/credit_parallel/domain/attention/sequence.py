"""Attention over all H*W positions, sequence parallel: a share of the heads per rank.

Queries, keys and values are projected on each rank's own rows (a 1x1 convolution is
row-local); one all-to-all turns "all heads, my rows" into "my heads, all rows"; each rank runs
the module's own attention core for its heads over every position (the same softmax over the
same numbers as one process: no per-shard softmax); a second all-to-all returns "all heads, my
rows", and the output projection runs locally.  Per-rank activation memory of the core falls
as heads/d.  The all-to-all is point-to-point (``batch_isend_irecv``) because parts differ in
size on uneven shards, which gloo's all_to_all refuses.

Recognised cores (by qualified class name, the packages are never imported): miles-credit's
``credit.models.unet_diffusion.Attention`` (softmax attention through its ``Attend`` with
memory key/values) and ``LinearAttention`` (softmax of keys over all positions).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ...layout.launch import wait_all
from ..exchange.ops import EAGER_IMPLS, all_to_all_traced
from ..manager import resolve_manager
from ..rows import shard_range
from ..wrap import DomainWrapper
from .layouts import head_split
from .relayout import copy_tp_declarations

__all__ = ["DomainSequenceAttention", "SEQUENCE_CORES", "all_to_all_parts"]


def _exchange_parts(parts: list, recv_shapes: list, peers: list, rank: int, group):
    ops, recvs = [], []
    for q, (part, shape) in enumerate(zip(parts, recv_shapes)):
        if q == rank:
            recvs.append(part.clone())
            continue
        buf = part.new_empty(shape)
        recvs.append(buf)
        if part.numel():
            ops.append(dist.P2POp(dist.isend, part.contiguous(), peers[q], group))
        if buf.numel():
            ops.append(dist.P2POp(dist.irecv, buf, peers[q], group))
    if ops:
        wait_all(dist.batch_isend_irecv(ops), group)
    return recvs


EAGER_IMPLS["all_to_all"] = _exchange_parts


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv_shapes, peers, rank, group, *parts):
        ctx.send_shapes = [p.shape for p in parts]
        ctx.peers, ctx.rank, ctx.group = peers, rank, group
        return tuple(_exchange_parts(list(parts), recv_shapes, peers, rank, group))

    @staticmethod
    def backward(ctx, *grads):
        back = _exchange_parts(
            [g.contiguous() for g in grads], ctx.send_shapes, ctx.peers, ctx.rank, ctx.group
        )
        return (None, None, None, None, *back)


def all_to_all_parts(parts: list, recv_shapes: list, manager) -> list[torch.Tensor]:
    """Send ``parts[q]`` to domain rank q, receive a tensor of ``recv_shapes[q]`` from each;
    differentiable (the backward is the reverse all-to-all)."""
    if torch.compiler.is_compiling():  # one traced operator (domain/exchange/ops.py)
        return all_to_all_traced(parts, recv_shapes, manager.domain_group)
    return list(
        _AllToAll.apply(
            [torch.Size(s) for s in recv_shapes],
            manager.domain_ranks,
            manager.domain_rank,
            manager.domain_group,
            *parts,
        )
    )


def _with(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def heads_to_positions(t, head_dim, pos_dim, heads, pos_counts, manager):
    """(.., all heads, .., my positions, ..) -> (.., my heads, .., all positions, ..)."""
    n, rank = manager.domain_world_size, manager.domain_rank
    split = head_split(heads, n)
    parts = [t.narrow(head_dim, a, b - a) for a, b in split]
    mine = split[rank][1] - split[rank][0]
    shape = _with(t.shape, head_dim, mine)
    recv = all_to_all_parts(parts, [_with(shape, pos_dim, c) for c in pos_counts], manager)
    return torch.cat(recv, pos_dim)


def positions_to_heads(t, head_dim, pos_dim, heads, pos_counts, manager):
    """Inverse of :func:`heads_to_positions`."""
    n, rank = manager.domain_world_size, manager.domain_rank
    split = head_split(heads, n)
    offsets = [sum(pos_counts[:q]) for q in range(n)]
    parts = [t.narrow(pos_dim, o, c) for o, c in zip(offsets, pos_counts)]
    shape = _with(t.shape, pos_dim, pos_counts[rank])
    recv = all_to_all_parts(parts, [_with(shape, head_dim, b - a) for a, b in split], manager)
    return torch.cat(recv, head_dim)


# ----------------------------------------------------------------------------- cores
def _unet_attention(module, x, manager, height):
    """credit.models.unet_diffusion.Attention, heads split (its forward, line by line, its
    einops patterns written as reshapes)."""
    b, _, h, w = x.shape
    n = manager.domain_world_size
    pos = [(stop - start) * w for start, stop in (shard_range(height, n, r) for r in range(n))]
    qkv = module.to_qkv(module.norm(x)).chunk(3, dim=1)
    heads = module.heads
    # "b (h c) x y -> b h (x y) c"
    q, k, v = (t.reshape(b, heads, -1, h * w).transpose(-1, -2) for t in qkv)
    q, k, v = (heads_to_positions(t, 1, 2, heads, pos, manager) for t in (q, k, v))
    a, z = head_split(heads, n)[manager.domain_rank]
    mk, mv = (t[a:z].unsqueeze(0).expand(b, -1, -1, -1) for t in module.mem_kv)
    k, v = (torch.cat(pair, dim=-2) for pair in ((mk, k), (mv, v)))
    out = module.attend(q, k, v)
    out = positions_to_heads(out, 1, 2, heads, pos, manager)
    out = out.transpose(-1, -2).reshape(b, -1, h, w)  # "b h (x y) d -> b (h d) x y"
    return module.to_out(out)


def _unet_linear_attention(module, x, manager, height):
    """credit.models.unet_diffusion.LinearAttention, heads split."""
    b, _, h, w = x.shape
    n = manager.domain_world_size
    pos = [(stop - start) * w for start, stop in (shard_range(height, n, r) for r in range(n))]
    qkv = module.to_qkv(module.norm(x)).chunk(3, dim=1)
    heads = module.heads
    q, k, v = (t.reshape(b, heads, -1, h * w) for t in qkv)  # "b (h c) x y -> b h c (x y)"
    q, k, v = (heads_to_positions(t, 1, 3, heads, pos, manager) for t in (q, k, v))
    a, z = head_split(heads, n)[manager.domain_rank]
    mk, mv = (t[a:z].unsqueeze(0).expand(b, -1, -1, -1) for t in module.mem_kv)
    k, v = map(partial(torch.cat, dim=-1), ((mk, k), (mv, v)))
    q = q.softmax(dim=-2)
    k = k.softmax(dim=-1)
    q = q * module.scale
    context = torch.einsum("b h d n, b h e n -> b h d e", k, v)
    out = torch.einsum("b h d e, b h d n -> b h e n", context, q)
    out = positions_to_heads(out, 1, 3, heads, pos, manager)
    out = out.reshape(b, -1, h, w)  # "b h c (x y) -> b (h c) x y"
    return module.to_out(out)


SEQUENCE_CORES = {
    "credit.models.unet_diffusion.Attention": _unet_attention,
    "credit.models.unet_diffusion.LinearAttention": _unet_linear_attention,
}


def _qualified(module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


class DomainSequenceAttention(DomainWrapper):
    """Attention over all positions of a B,C,H,W tensor, heads split over the domain ranks.

    ``core(module, x_local, manager, global_height) -> y_local`` computes the module's forward
    from its local rows (see :data:`SEQUENCE_CORES`); by default the core registered for the
    module's qualified class name.  Parameters and ``state_dict`` keys are the module's.
    """

    domain_form = "sequence"

    def __init__(self, module, core=None, shard_dim=-2, *, manager=None):
        super().__init__(module)
        core = core if core is not None else SEQUENCE_CORES.get(_qualified(module))
        if core is None:
            raise ValueError(f"no sequence-parallel core for {_qualified(module)}")
        if shard_dim % 4 != 2:
            raise ValueError("sequence-parallel attention shards B,C,H,W tensors along H (-2)")
        copy_tp_declarations(self, module)
        self.core, self.shard_dim, self.manager = core, shard_dim, manager
        self.heads = int(module.heads)

    def output_height(self, input_height: int) -> int:
        return input_height

    def input_windows(self, input_height: int, n: int):
        return None  # not a window form: every rank reads every position of its heads

    def communication_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """Bytes sent over all ranks per forward: q, k, v and the output, each moving the
        (d-1)/d of its elements that live on other ranks."""
        b, _, h, w = input_shape
        hidden = self.wrapped.to_qkv.out_channels // 3
        return int(4 * b * hidden * h * w * itemsize * (n - 1) / n)

    def activation_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """Bytes of q, k, v the busiest rank holds: its heads on every position."""
        b, _, h, w = input_shape
        hidden = self.wrapped.to_qkv.out_channels // 3
        return 3 * b * h * w * (hidden // self.heads) * max(self.head_share(n)) * itemsize

    def head_share(self, n: int) -> tuple[int, ...]:
        """Heads each rank computes (activation memory of the core scales with these)."""
        return tuple(b - a for a, b in head_split(self.heads, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mgr = resolve_manager(self.manager, type(self.wrapped).__name__)
        if mgr.domain_world_size == 1:
            return self.wrapped(x)
        height = mgr.global_length(self, x.shape[-2])
        return self.core(self.wrapped, x, mgr, height)

    def extra_repr(self) -> str:
        return f"heads={self.heads}"
