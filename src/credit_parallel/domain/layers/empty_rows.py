"""Row-local convolutions on a rank that owns no row (SPEC §3: levels with fewer rows than ranks).

The converter leaves a conv that is row-local along the sharded dim (kernel 1, stride 1, no
padding there: a CREDIT FeedForward's 1x1 convs) as it is: every output row is its own input
row, no exchange is needed.  But PyTorch refuses a conv on an input with a zero-size spatial
dim ("Kernel size can't be greater than actual input size"), so a rank that owns 0 rows of a
deep level crashed there while the others waited in the next collective.

:func:`guard_row_local_convs` makes such a conv exact on an empty shard: its ``_conv_forward``
(the one place ``nn.Conv2d`` / ``nn.Conv3d`` call the kernel) runs, when a dim it is local along
has size 0, on one zero row there and keeps 0 rows of the result.  The output has the right
width, dtype and channels; it is attached to the graph of the input, the weight and the bias,
so every parameter gets a (zero) gradient on this rank as on the others and every rank reduces
the same gradient set.  Other inputs go to the module's own ``_conv_forward`` unchanged.  The
module's type, parameters, state_dict and forward stay as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from .conv_geometry import ConvGeometry

__all__ = ["guard_row_local_convs"]

_GUARDED = (nn.Conv2d, nn.Conv3d)


def _local_dims(conv: nn.Module) -> tuple[int, ...]:
    """The spatial dims (as dims of the input, batch first) along which ``conv`` is local."""
    geo = ConvGeometry.of(conv)
    nd = len(geo.kernel)
    return tuple(i + 2 for i in range(nd) if geo.is_row_local(i))


class _EmptySafeConvForward:
    """``conv._conv_forward`` of a guarded conv: the class's own, except when a dim the conv is
    local along has size 0 (then on one zero row there, 0 rows of the result kept).  A plain
    object (not a closure) so that a guarded model deep-copies and pickles."""

    def __init__(self, conv: nn.Module, local_dims: tuple[int, ...]):
        self.conv = conv
        self.local_dims = local_dims

    def __call__(self, input, weight, bias):
        conv = self.conv
        original = type(conv)._conv_forward
        empty = [d for d in self.local_dims if input.shape[d] == 0]
        if not empty:
            return original(conv, input, weight, bias)
        x = input
        for d in empty:  # one zero row along each empty local dim, dropped from the result
            shape = list(x.shape)
            shape[d] = 1
            x = torch.cat([x, x.new_zeros(shape)], dim=d)
        y = original(conv, x, weight, bias)
        for d in empty:
            y = y.narrow(d, 0, 0)
        return y


def guard_row_local_convs(model: nn.Module) -> int:
    """Make every ``nn.Conv2d`` / ``nn.Conv3d`` of ``model`` outside a domain-parallel layer
    exact on inputs with 0 rows along a dim it is local along (see the module docstring).
    Returns how many convs were guarded; guarding twice is a no-op."""
    count = 0

    def visit(module: nn.Module) -> None:
        nonlocal count
        if getattr(module, "_domain_parallel", False):
            return  # its conv runs through the layer, which handles empty windows itself
        if isinstance(module, _GUARDED) and "_conv_forward" not in vars(module):
            dims = _local_dims(module)
            if dims:
                vars(module)["_conv_forward"] = _EmptySafeConvForward(module, dims)
                count += 1
        for child in module.children():
            visit(child)

    visit(model)
    return count
