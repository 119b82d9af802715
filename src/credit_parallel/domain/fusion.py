"""Exchange fusion: fewer halo exchanges for the same result, applied by the converter.

* A padding layer over H followed by a convolution in an ``nn.Sequential``: the two row maps
  compose (``exchange.compose_windows``), so the conv exchanges the PAD's input once with the
  composed windows and applies the pad's width padding itself; the pad passes its input through.
  Fused only where the result is the same: the pad's fill rows and the conv's zero rows must
  have one fill value (a zero or reflect/replicate/circular pad, or a conv without zero padding
  over H), the pad's input is 4-D, and the pad module is used once in the model.
* Sibling convolutions in one ``nn.ModuleList`` with the same input channels (CREDIT's
  CrossEmbed: several kernels applied to the same tensor) share ONE exchange of the union of
  their windows (``shared_input.share_input_exchange``).  Sharing never changes results: a layer
  called on another tensor exchanges again, and a group seen used as a stack (each layer on a
  new tensor) stops sharing after its first call.
"""

from __future__ import annotations

from torch import nn

from .conv import _DomainParallelConvNd
from .padding import DomainParallelPad
from .shared_input import share_input_exchange

__all__ = ["fuse_exchanges"]


def _plain_conv(module) -> bool:
    return (
        isinstance(module, _DomainParallelConvNd)
        and not module.geometry.transposed
        and module.fused_pad is None
        and module.shared_input is None
    )


def _fill_agrees(pad: DomainParallelPad, conv: _DomainParallelConvNd) -> bool:
    geo, i = conv.geometry, conv.spatial_index
    conv_fills = geo.edge_mode == "zeros" and geo.pads[i] != (0, 0)
    return pad.mode != "constant" or pad.value == 0.0 or not conv_fills


def _fuse_pad_conv(seq: nn.Sequential, uses: dict) -> int:
    fused = 0
    children = list(seq.children())
    for pad, conv in zip(children, children[1:]):
        if (
            isinstance(pad, DomainParallelPad)
            and pad.fused_into is None
            and uses.get(id(pad), 0) == 1
            and _plain_conv(conv)
            and conv.nd == 2
            and conv.spatial_index == 0
            and pad.manager is conv.manager
            and _fill_agrees(pad, conv)
            and not pad._forward_hooks
            and not pad._forward_pre_hooks
        ):
            # plain attributes, not submodules: no new state_dict keys, no second parent
            object.__setattr__(pad, "fused_into", conv)
            object.__setattr__(conv, "fused_pad", pad)
            fused += 1
    return fused


def _sibling_groups(modules: nn.ModuleList) -> list[list]:
    groups: dict = {}
    for m in modules:
        if not _plain_conv(m) or m.overlap:
            continue
        conv = m.conv
        key = (m.nd, m.shard_dim % (m.nd + 2), m.geometry.edge_mode, id(m.manager))
        key += (conv.in_channels,)
        groups.setdefault(key, []).append(m)
    return [g for g in groups.values() if len(g) >= 2]


def fuse_exchanges(model: nn.Module) -> dict[str, int]:
    """Fuse the exchanges of ``model``'s domain layers in place (see the module docstring);
    returns how many ``pad_conv`` pairs and ``sibling_convs`` groups were fused."""
    uses: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        uses[id(module)] = uses.get(id(module), 0) + 1
    counts = {"pad_conv": 0, "sibling_convs": 0}
    for module in model.modules():
        if isinstance(module, nn.Sequential):
            counts["pad_conv"] += _fuse_pad_conv(module, uses)
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for group in _sibling_groups(module):
                share_input_exchange(*group)
                counts["sibling_convs"] += 1
    return counts
