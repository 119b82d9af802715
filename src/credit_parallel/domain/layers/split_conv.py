"""The split convolution: a domain conv that never assembles its window, and halo overlap.

Only the boundary output rows of a rank read halo rows.  :class:`SplitConv` (the default path
of the non-transposed domain convolutions, except, by default, those whose other dims are padded
explicitly: ``_DomainParallelConvNd._splits`` in ``conv.py``) posts the exchange, convolves straight from the local
shard, then convolves the boundary rows from small strips of the window (a few rows each;
``conv_geometry.overlap_split`` says which rows are which).  Two forms of the shard's call:

* ``full`` (stride 1, symmetric padding, output rows = shard rows, e.g. every 3x3 "same" conv,
  periodic ones included: their other dims are padded as on one process): ONE call of the conv with its own zero padding over the whole
  shard gives every owned row, the boundary rows with the halo read as zeros; those few rows
  are then overwritten by the strip convs (strip-sized copies); a strip that would read only
  fill rows beyond the globe is left out (``conv._without_fill_strips``: the zero padding gave
  those rows already).  Backward: one
  ``convolution_backward`` of the whole output gradient against the shard gives the shard's
  input gradient and the weight and bias gradients, the halo positions of the strips add the
  missing terms (input gradient of the halo rows, weight gradient from the halo values).
* otherwise (strides, asymmetric padding): the interior output rows
  from the interior shard rows, concatenated with the strips; backward per piece.

The backward first posts the receives of the gradients the peers return for this rank's rows,
computes the strips' gradients, posts the halo-row gradients back to their owners, then runs
the shard's call while they travel.  No copy of the whole shard is made in
either direction (the window path, the option ``split_halo=False``, is kept as the reference).

Results equal the window path to rounding, not bitwise: the CPU kernels' bits depend on how rows
are split over calls (``tests/test_overlap.py`` probes it).  ``overlap`` only moves the forward's
wait for the halo rows after the shard's call (``late``); the arithmetic is the same either
way, so overlap on and off give bitwise the same results.  Overlap is an option of each layer
(``overlap=`` on the layer, :func:`set_model_overlap` for a whole model, ``configure`` on one
built layer); ``None`` (the default)
follows :func:`overlap_enabled`'s measured rule (docs/performance.md).  The split backward is
once-differentiable: a double backward (gradient penalties) needs the option ``split_halo=False``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..exchange.p2p import post_halo_gradients, post_rows, receive_halo_gradients
from ..exchange.windows import assemble_window, halo_gradient_buffers, scatter_window_grad
from ..options import check_overlap

__all__ = ["SplitConv", "check_overlap", "overlap_enabled", "set_model_overlap"]


def overlap_enabled(setting: bool | None, device: torch.device | None = None) -> bool:
    """Whether a layer with this ``overlap`` setting waits for its halo rows late, for an input
    on ``device``.  None (the default): on for CUDA, where the transfer runs beside the kernels;
    off on CPU, where gloo's transfer threads compete with the convolution for the same cores
    (measured slower at every size on the 2-core benchmark machine, docs/performance.md)."""
    if setting is not None:
        return setting
    return device is not None and device.type == "cuda"


def set_model_overlap(model: nn.Module, enabled: bool | None) -> int:
    """Set the ``overlap`` option of every domain-parallel layer of ``model`` that has it
    (through any FSDP/DDP wrapper), each through its ``configure`` method (``options.py``);
    returns how many layers were set.  Read at each forward."""
    check_overlap(enabled)
    count = 0
    for module in model.modules():
        if getattr(module, "_domain_parallel", False) and hasattr(module, "overlap"):
            module.configure(overlap=enabled)
            count += 1
    return count


def _conv_backward(op, grad, rows, weight, bias, mask):
    """``(input, weight, bias)`` gradients of ``op(rows, weight, bias)`` for ``grad`` (those not
    in ``mask`` are None), with the op's explicit padding of the other dims differentiated as
    autograd does on the plain path."""
    if not any(mask):
        return None, None, None
    args = (
        None if bias is None else [bias.shape[0]],
        list(op.stride),
        list(op.padding),
        list(op.dilation),
        False,
        [0] * op.nd,
        op.groups,
    )
    if op.pad_flat is None:
        return torch.ops.aten.convolution_backward(grad, rows, weight, *args, list(mask))
    with torch.enable_grad():
        leaf = rows.detach().requires_grad_(mask[0])
        inp = op.input_of(leaf)
    g_in, g_w, g_b = torch.ops.aten.convolution_backward(
        grad, inp.detach(), weight, *args, list(mask)
    )
    if mask[0]:
        (g_in,) = torch.autograd.grad(inp, leaf, g_in)
    return g_in, g_w, g_b


def _add(total, part):
    return part if total is None else (total if part is None else total.add_(part))


class SplitConv(torch.autograd.Function):
    """A conv over this rank's window that never assembles the window (see module docstring).
    Inputs: the local shard ``x``, weight, bias; ``late``: wait for the halo rows after the
    shard's own computation (overlap); ``full``: None, or ``(op, skip)`` when one call of ``op``
    (the conv with its own zero padding along the sharded dim) gives every owned output row
    from the shard alone, ``skip`` being the window positions of the shard.  Saves ``x``, the
    received halo rows, weight and bias."""

    @staticmethod
    def forward(ctx, x, weight, bias, op, plan, dim, split, peers, group, late, full):
        pending = post_rows(x, plan, dim, peers, group, overlapped=late)
        if not late:
            pending.wait()
        if full is not None:
            # every owned row, the halo read as zeros; the boundary rows are redone below
            main = full[0](x, weight, bias)
        else:
            rows = split.interior_stop - split.interior_start
            main = op(x.narrow(dim, split.interior_start, rows), weight, bias)
        recv_bufs = pending.wait()
        top = bottom = None
        if split.top_rows:
            top = op(assemble_window(x, recv_bufs, plan, dim, 0.0, 0, split.top_stop), weight, bias)
        if split.bottom_rows:
            bottom = op(
                assemble_window(x, recv_bufs, plan, dim, 0.0, split.bottom_start), weight, bias
            )
        if full is not None:
            # strip-sized copies into the output instead of a shard-sized window
            if top is not None:
                main.narrow(dim, 0, split.top_rows).copy_(top)
            if bottom is not None:
                main.narrow(dim, main.shape[dim] - split.bottom_rows, split.bottom_rows).copy_(
                    bottom
                )
            y = main
        else:
            parts = [t for t in (top, main, bottom) if t is not None]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        ctx.op, ctx.plan, ctx.dim, ctx.split = op, plan, dim, split
        ctx.peers, ctx.group, ctx.late, ctx.full = peers, group, late, full
        ctx.save_for_backward(x, weight, bias, *recv_bufs)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, bias, *recv_bufs = ctx.saved_tensors
        op, plan, dim, split, full = ctx.op, ctx.plan, ctx.dim, ctx.split, ctx.full
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # with ``full`` the main call covers every own window position and the bias
        skip = full[1] if full is not None else (0, 0)
        out_rows = grad_y.shape[dim]
        strips = []
        if split.top_rows:
            strips.append((0, split.top_stop, 0, split.top_rows))
        if split.bottom_rows:
            strips.append(
                (
                    split.bottom_start,
                    plan.window_rows,
                    out_rows - split.bottom_rows,
                    split.bottom_rows,
                )
            )
        # what the peers return for the rows this rank sent: received while this rank computes
        received = None
        if need_x:
            received = receive_halo_gradients(plan, dim, ctx.peers, ctx.group, x)
        # the boundary strips first: their halo gradients travel while the shard's are computed
        grad_recv = halo_gradient_buffers(x, plan, dim) if need_x else None
        strip_grads, grad_w, grad_b = [], None, None
        for start, stop, first, rows in strips:
            piece = assemble_window(x, recv_bufs, plan, dim, 0.0, start, stop, skip)
            mask = (need_x, need_w, need_b and full is None)
            g_in, g_w, g_b = _conv_backward(
                op, grad_y.narrow(dim, first, rows), piece, weight, bias, mask
            )
            grad_w, grad_b = _add(grad_w, g_w), _add(grad_b, g_b)
            if need_x:
                scatter_window_grad(g_in, start, plan, dim, None, grad_recv, skip)
                strip_grads.append((start, g_in))
        del recv_bufs
        pending = None
        if need_x:
            pending = post_halo_gradients(
                grad_recv,
                plan,
                dim,
                ctx.peers,
                ctx.group,
                x,
                overlapped=ctx.late,
                received=received,
            )
        mask = (need_x, need_w, need_b)
        if full is not None:
            g_in, g_w, g_b = _conv_backward(full[0], grad_y, x, weight, bias, mask)
        else:
            rows = split.interior_stop - split.interior_start
            g_in, g_w, g_b = _conv_backward(
                op,
                grad_y.narrow(dim, split.top_rows, split.interior_rows),
                x.narrow(dim, split.interior_start, rows),
                weight,
                bias,
                mask,
            )
            if need_x and rows != x.shape[dim]:
                grad_x = x.new_zeros(x.shape)
                grad_x.narrow(dim, split.interior_start, rows).add_(g_in)
                g_in = grad_x
        grad_w, grad_b = _add(g_w, grad_w), _add(g_b, grad_b)
        grad_x = None
        if need_x:
            grad_x = g_in
            for start, g in strip_grads:
                scatter_window_grad(g, start, plan, dim, grad_x, None, skip)
            grad_x = pending.wait()(grad_x)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None
