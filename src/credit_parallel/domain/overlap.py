"""Halo/compute overlap for domain-parallel convolutions: the split convolution.

Only the boundary output rows of a rank read halo rows.  With overlap on, the forward posts the
exchange, convolves the INTERIOR output rows (those whose input rows all lie in the local shard)
straight from the shard while the rows are in flight, waits, then convolves the boundary rows
from small strips of the window (``conv_geometry.overlap_split`` says which rows are which).  The
backward computes the window's input gradient in one call, posts the return of the halo
gradients, computes the weight and bias gradients while they are in flight, then waits.  The
backward calls see exactly the plain path's operands and accumulate the gradient rows in the same
order; the forward pieces compute every output row from the same input rows.  Where the CPU
convolution kernels give an output row the same bits whichever other rows a call computes (and
whichever gradients one backward call computes), the results are bitwise those of the plain
path; that is a property of the kernels, not of every CPU (float64 im2col + MKL GEMM on an AMD EPYC
differs in the last bits), so ``tests/test_overlap.py`` asserts equality to rounding.

Overlap is an option of each layer (``overlap=`` on the layer, :func:`set_model_overlap` for all
layers of a model), not a process-wide switch.  ``None`` (the default) means off: on the 2-core
benchmark machine the split convolution costs more than the halo time it hides
(docs/performance.md), and on CUDA cuDNN may pick another algorithm for a few boundary rows than
for the whole window.  The overlapped backward is once-differentiable: a double backward
(gradient penalties) needs overlap off.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .exchange import assemble_window, post_gradient_return, post_rows

__all__ = ["OverlappedConv", "check_overlap", "overlap_enabled", "set_model_overlap"]


def check_overlap(enabled):
    """``enabled`` if it is True, False or None (the default, off); else ``TypeError``."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"halo overlap must be True, False or None (default), got {enabled!r}")
    return enabled


def overlap_enabled(setting: bool | None) -> bool:
    """Whether a layer with this ``overlap`` setting overlaps (None: the default, off)."""
    return bool(setting)


def set_model_overlap(model: nn.Module, enabled: bool | None) -> int:
    """Set ``overlap`` on every domain-parallel layer of ``model`` that has the option (through
    any FSDP/DDP wrapper); returns how many layers were set.  Read at each forward."""
    check_overlap(enabled)
    count = 0
    for module in model.modules():
        if getattr(module, "_domain_parallel", False) and hasattr(module, "overlap"):
            module.overlap = enabled
            count += 1
    return count


class OverlappedConv(torch.autograd.Function):
    """A conv over this rank's window with the exchange hidden behind computation (see module
    docstring).  Inputs: the local shard ``x``, weight, bias; saves ``x``, the received halo
    rows, weight and bias (no copy of the assembled window)."""

    @staticmethod
    def forward(ctx, x, weight, bias, op, plan, dim, split, peers, group):
        pending = post_rows(x, plan, dim, peers, group)
        interior = op(
            x.narrow(dim, split.interior_start, split.interior_stop - split.interior_start),
            weight,
            bias,
        )
        recv_bufs = pending.wait()
        parts = []
        if split.top_rows:
            parts.append(
                op(assemble_window(x, recv_bufs, plan, dim, 0.0, 0, split.top_stop), weight, bias)
            )
        parts.append(interior)
        if split.bottom_rows:
            bottom = assemble_window(x, recv_bufs, plan, dim, 0.0, split.bottom_start)
            parts.append(op(bottom, weight, bias))
        ctx.op, ctx.plan, ctx.dim, ctx.peers, ctx.group = op, plan, dim, peers, group
        ctx.save_for_backward(x, weight, bias, *recv_bufs)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, bias, *recv_bufs = ctx.saved_tensors
        op, plan, dim = ctx.op, ctx.plan, ctx.dim
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        window = assemble_window(x, recv_bufs, plan, dim, 0.0)
        del recv_bufs
        args = (
            None if bias is None else [bias.shape[0]],
            list(op.stride),
            list(op.padding),
            list(op.dilation),
            False,
            [0] * op.nd,
            op.groups,
        )
        with torch.enable_grad():
            leaf = window.detach().requires_grad_(need_x and op.pad_flat is not None)
            inp = op.input_of(leaf)
        pending = None
        if need_x:
            grad_inp, _, _ = torch.ops.aten.convolution_backward(
                grad_y, inp.detach(), weight, *args, [True, False, False]
            )
            if op.pad_flat is not None:
                # the padding's own backward, exactly as autograd runs it on the plain path
                (grad_inp,) = torch.autograd.grad(inp, leaf, grad_inp)
            pending = post_gradient_return(grad_inp, plan, dim, ctx.peers, ctx.group, x.shape)
            del grad_inp
        grad_w = grad_b = None
        if need_w or need_b:
            # computed while the halo gradients travel
            _, grad_w, grad_b = torch.ops.aten.convolution_backward(
                grad_y, inp.detach(), weight, *args, [False, need_w, need_b]
            )
        del inp, leaf, window
        grad_x = pending.wait() if pending is not None else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None
