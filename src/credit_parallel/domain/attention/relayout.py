"""Attention that mixes rows only inside known groups, made exact by re-laying rows out.

:class:`DomainRowGroupAttention` wraps an unmodified module (CREDIT's ``Attention`` with
``attn_type="short"`` or ``"long"``, or any module declaring the same structure) and runs it on
whole groups: one exchange brings every rank the rows of its groups (a no-op when the shard
boundaries already fall on group boundaries), the module runs, and one exchange returns every
output row to its owner in the balanced layout.  Both exchanges are ``exchange/halo.py``'s: the way
in is :func:`exchange_rows`; the way back is the gradient-return half of the same plan (the
layout is a permutation, so "accumulate the rows back to their owners" IS the inverse exchange),
and its backward is the way in again.
"""

from __future__ import annotations

import torch
from torch import nn

from ..exchange.halo import exchange_rows
from ..exchange.ops import return_rows_traced
from ..exchange.p2p import post_gradient_return, post_rows
from ..exchange.windows import assemble_window
from ..manager import resolve_manager
from ..rows import plan_exchange, shard_range
from ..wrap import DomainWrapper
from .layouts import (
    check_permutation,
    shifted_window_layout,
    strided_group_layout,
    window_layout,
)

__all__ = ["DomainRowGroupAttention", "copy_tp_declarations", "return_rows"]

_TP_DECLARATIONS = ("_tp_col", "_tp_row", "_tp_fused", "_tp_head_dim")


def copy_tp_declarations(wrapper: nn.Module, module: nn.Module) -> None:
    """The wrapper takes the module's place in the tree, so tensor parallelism (applied after
    domain conversion) must find the module's ``_tp_*`` plan on it; the paths resolve through
    the shared child dict to the same layers."""
    for attr in _TP_DECLARATIONS:
        if hasattr(module, attr):
            wrapper.__dict__[attr] = getattr(module, attr)  # a declaration, never a child


class _ReturnRows(torch.autograd.Function):
    """Send the rows of a layout back to their owners (forward) / fetch them again (backward)."""

    @staticmethod
    def forward(ctx, y, plan, dim, peers, group, owned_shape):
        ctx.plan, ctx.dim, ctx.peers, ctx.group = plan, dim, peers, group
        return post_gradient_return(
            y, plan, dim, peers, group, owned_shape, overlapped=False
        ).wait()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        recv = post_rows(grad, ctx.plan, ctx.dim, ctx.peers, ctx.group, overlapped=False).wait()
        window = assemble_window(grad, recv, ctx.plan, ctx.dim)
        return window.clone(), None, None, None, None, None


def return_rows(y: torch.Tensor, layout: tuple, height: int, dim: int, manager) -> torch.Tensor:
    """Inverse of ``exchange_rows(x, layout, height, dim, manager)`` for a permutation layout:
    this rank's rows of ``y`` (held in the order of ``layout[rank]``) go back to their owners;
    returns this rank's balanced shard.  Differentiable."""
    n, rank = manager.domain_world_size, manager.domain_rank
    dim = dim % y.dim()
    plan = plan_exchange(height, n, layout)[rank]
    start, stop = shard_range(height, n, rank)
    if torch.compiler.is_compiling():  # one traced operator (domain/exchange/ops.py)
        return return_rows_traced(y, plan, dim, stop - start, manager.domain_group)
    owned = list(y.shape)
    owned[dim] = stop - start
    return _ReturnRows.apply(
        y, plan, dim, manager.domain_ranks, manager.domain_group, torch.Size(owned)
    )


def _no_rows(held: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """A rank holding no whole group (fewer groups than ranks) does not run the module (a conv
    refuses an empty input) but still joins both exchanges; its parameters get zero, not
    missing, gradients so that every rank reduces the same gradient set."""
    zero = sum((p.sum() * 0 for p in module.parameters() if p.requires_grad), held.new_zeros(()))
    return held + zero


_LAYOUTS = {"windows": "relayout", "shifted_windows": "relayout", "strided": "regroup"}


class DomainRowGroupAttention(DomainWrapper):
    """Run ``module`` on whole row groups; exact forward and backward, state_dict unchanged.

    ``form``: ``"windows"`` (windows of ``rows`` rows tile H), ``"shifted_windows"`` (the same
    after a cyclic roll of ``-shift`` rows; the module must then compute on the rolled rows, see
    docs of ``_domain_attention``) or ``"strided"`` (groups ``j, j + H/rows, ...`` as CREDIT's
    long-distance attention lays them out).  ``entry``: the name of a method called as
    ``entry(x_held, global_rows)`` instead of the module's forward (required for shifted
    windows: it computes on rows already rolled, with masks from their global indices).  The module's output height must equal its input
    height.
    """

    # the geometry's windows are the way in; the output rows go back to their owners by the
    # same plan inverted (``return_rows``): the planner counts both (``planner/cost.py``)
    returns_rows = True

    def __init__(
        self,
        module: nn.Module,
        form: str,
        rows: int,
        shift: int = 0,
        shard_dim=-2,
        *,
        manager=None,
        entry: str | None = None,
    ):
        super().__init__(module)
        if form not in _LAYOUTS:
            raise ValueError(
                f"row-group attention form must be one of {sorted(_LAYOUTS)}, got {form!r}"
            )
        if form == "shifted_windows" and not callable(getattr(module, str(entry), None)):
            raise ValueError(
                f"{type(module).__name__}: shifted windows need an entry method "
                "(``_domain_attention['entry']``) computing on rows already rolled, called as "
                "entry(x, global_rows); the module's own forward would roll a shard again"
            )
        self.entry = entry
        self._layouts: dict = {}
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"row-group attention needs rows >= 1, got {rows!r}")
        copy_tp_declarations(self, module)
        self.form, self.rows, self.shift = form, rows, int(shift)
        self.domain_form = _LAYOUTS[form]
        self.shard_dim = shard_dim
        self.manager = manager

    def layout(self, height: int, n: int) -> tuple[tuple[int, ...], ...]:
        """Per rank, the global rows it holds while the module runs (checked once per size)."""
        key = (height, n)
        if key not in self._layouts:
            self._layouts[key] = self._make_layout(height, n)
        return self._layouts[key]

    def _make_layout(self, height: int, n: int) -> tuple[tuple[int, ...], ...]:
        if self.form == "windows":
            out = window_layout(height, n, self.rows)
        elif self.form == "shifted_windows":
            out = shifted_window_layout(height, n, self.rows, self.shift)
        else:
            out = strided_group_layout(height, n, self.rows)
        check_permutation(out, height)
        return out

    # ---- geometry protocol (see domain/geometry.py)
    def output_height(self, input_height: int) -> int:
        return input_height

    def input_windows(self, input_height: int, n: int):
        """The global rows each rank's module run reads (its whole groups)."""
        return self.layout(input_height, n)

    def communication_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """Bytes this layer sends over all ranks per forward (the same again in backward):
        every row held away from its owner travels in and its output row travels back."""
        height = input_shape[self.shard_dim]
        row_bytes = itemsize
        for i, s in enumerate(input_shape):
            if i != len(input_shape) + self.shard_dim:
                row_bytes *= s
        moved = 0
        for r, rows in enumerate(self.layout(height, n)):
            start, stop = shard_range(height, n, r)
            moved += sum(1 for g in rows if not start <= g < stop)
        return 2 * moved * row_bytes

    def activation_rows(self, input_height: int, n: int) -> tuple[int, ...]:
        """Rows each rank runs the module on (its activation memory scales with these)."""
        return tuple(len(rows) for rows in self.layout(input_height, n))

    def activation_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """Bytes of input the busiest rank runs the module on."""
        height = input_shape[self.shard_dim]
        numel = 1
        for s in input_shape:
            numel *= s
        return max(self.activation_rows(height, n)) * (numel // height) * itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mgr = resolve_manager(self.manager, type(self.wrapped).__name__)
        if mgr.domain_world_size == 1:
            return self.wrapped(x)
        dim = self.shard_dim % x.dim()
        height = mgr.global_length(self, x.shape[dim])
        layout = self.layout(height, mgr.domain_world_size)
        held = exchange_rows(x, layout, height, dim, mgr)
        if held.shape[dim] == 0:
            y = _no_rows(held, self.wrapped)
        elif self.entry is not None:
            rows = torch.tensor(layout[mgr.domain_rank], dtype=torch.long, device=held.device)
            y = getattr(self.wrapped, self.entry)(held, rows)
        else:
            y = self.wrapped(held)
        if y.shape[dim] != held.shape[dim]:
            raise ValueError(
                f"{getattr(self, 'module_path', None) or type(self.wrapped).__name__}: row-group attention "
                f"changed the height ({held.shape[dim]} -> {y.shape[dim]} rows)"
            )
        return return_rows(y, layout, height, dim, mgr)

    def extra_repr(self) -> str:
        shift = f", shift={self.shift}" if self.form == "shifted_windows" else ""
        return f"form={self.form!r}, rows={self.rows}{shift}"
