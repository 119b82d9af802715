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
* A GroupNorm, an optional elementwise activation (``norm_halo.ELEMENTWISE_ACTIVATIONS``) and a
  convolution in an ``nn.Sequential`` (or declared by their parent in ``_domain_norm_act_conv``): the norm's statistics travel with the conv's halo
  exchange, one call per direction for both (``norm_halo.NormConvLink``).  Fused only where the
  norm module is used once, no hook sits on the norm or the activation, and the conv is a plain
  (non-transposed, not pad-fused, not shared, no side stream) conv on the same manager.

On lat x lon tiles (``tiles=True``; docs/tiles.md) the pad + conv pairs (the fill agreeing
along longitude too: ``conv_tiles.fused_tile_windows``) and the norm + conv links
(``norm_halo.NormConvLink._norm_forward_tile``) are fused, and sibling 2-D convs with one
longitude rule share one tile exchange (``shared_input.SharedInputExchange.tile_window_for``).

* Opt-in (``halo_chains=``): a run of stencil layers in an ``nn.Sequential`` exchanges ONCE for a
  chain of them, each computing the redundant edge rows the next one reads
  (``layers/halo_chain.py``; 1-D latitude rows, eager).
"""

from __future__ import annotations

from torch import nn

from .exchange.shared_input import share_input_exchange
from .layers.conv import _DomainParallelConvNd
from .layers.halo_chain import chain_role
from .layers.norm import DomainParallelGroupNorm
from .layers.norm_halo import ELEMENTWISE_ACTIVATIONS, NormConvLink
from .layers.padding import DomainParallelPad

__all__ = [
    "apply_fusions",
    "apply_norm_conv",
    "find_fusions",
    "find_halo_chains",
    "find_norm_conv",
    "fuse_exchanges",
]


def _plain_conv(module) -> bool:
    return (
        isinstance(module, _DomainParallelConvNd)
        and not module.geometry.transposed
        and module.fused_pad is None
        and module.shared_input is None
    )


def _fill_agrees(pad: DomainParallelPad, conv: _DomainParallelConvNd, tiles: bool) -> bool:
    """Whether the pad's fill rows and the conv's zero rows are one fill value; on lat x lon
    tiles the columns too (the conv's longitude padding, ``other_mode``, is exchanged there)."""
    geo, i = conv.geometry, conv.spatial_index
    conv_fills = geo.edge_mode == "zeros" and geo.pads[i] != (0, 0)
    if tiles:
        conv_fills = conv_fills or (geo.other_mode == "zeros" and geo.pads[-1] != (0, 0))
    return pad.mode != "constant" or pad.value == 0.0 or not conv_fills


def _pad_conv_pairs(children: list, uses: dict, layer_of, tiles: bool = False) -> list:
    pairs = []
    for first, second in zip(children, children[1:]):
        pad, conv = layer_of(first), layer_of(second)
        if (
            isinstance(pad, DomainParallelPad)
            and pad.fused_into is None
            and uses.get(id(first), 0) == 1
            and _plain_conv(conv)
            and conv.nd == 2
            and conv.spatial_index == 0
            and pad.manager is conv.manager
            and _fill_agrees(pad, conv, tiles)
            and not pad._forward_hooks
            and not pad._forward_pre_hooks
        ):
            pairs.append((first, second))
    return pairs


def _no_hooks(module) -> bool:
    return not module._forward_hooks and not module._forward_pre_hooks


def _linkable(first, act, second, uses: dict, layer_of) -> bool:
    """Whether the modules ``first`` (a norm), ``act`` (None or an activation) and ``second``
    (a conv) may be linked (module docstring)."""
    norm, conv = layer_of(first), layer_of(second)
    return (
        isinstance(norm, DomainParallelGroupNorm)
        and uses.get(id(first), 0) == 1
        and (act is None or (type(act) in ELEMENTWISE_ACTIVATIONS and _no_hooks(act)))
        and _plain_conv(conv)
        and not conv.side_stream
        and conv.options.fused_norm is None
        and norm.options.fused_norm is None
        and conv.manager is norm.manager
        and _no_hooks(first)
    )


def _norm_conv_triples(children: list, uses: dict, layer_of) -> list:
    """``(norm, activation or None, conv)`` modules of one Sequential's children, in order."""
    found = []
    for i, first in enumerate(children):
        act, k = None, i + 1
        if k < len(children) and type(children[k]) in ELEMENTWISE_ACTIVATIONS:
            act, k = children[k], k + 1
        if k < len(children) and _linkable(first, act, children[k], uses, layer_of):
            found.append((first, act, children[k]))
    return found


def _declared_triples(tree: list, uses: dict, layer_of) -> list:
    """The triples a module declares in ``_domain_norm_act_conv`` (names of its children
    ``(norm, activation or None, conv)`` where its forward feeds the conv exactly the activation
    of the norm's output, e.g. ``models.unet.UNetResBlock``)."""
    at, found, seen = dict(tree), [], set()
    for path, module in tree:
        declared = getattr(type(module), "_domain_norm_act_conv", ())
        if not declared or id(module) in seen:
            continue
        seen.add(id(module))
        for names in declared:
            parts = [None if n is None else at.get(f"{path}.{n}" if path else n) for n in names]
            first, act, second = parts
            if first is not None and second is not None:
                if _linkable(first, act, second, uses, layer_of):
                    found.append((first, act, second))
    return found


def _sibling_groups(modules: list, layer_of, tiles: bool = False) -> list[list]:
    groups: dict = {}
    for child in modules:
        m = layer_of(child)
        if not _plain_conv(m) or m.overlap:
            continue
        key = (m.nd, m.shard_dim % (m.nd + 2), m.geometry.edge_mode, id(m.manager))
        key += (m.conv.in_channels,)
        if tiles:  # the longitude rule too, and 2-D convs only (shared_input.tile_window_for)
            if m.nd != 2:
                continue
            key += (m.geometry.other_mode,)
        groups.setdefault(key, []).append(child)
    return [g for g in groups.values() if len(g) >= 2]


def _sequences(tree: list):
    """``(container, children in order, uses)`` of every Sequential / ModuleList of ``tree``
    (the ``(path, module)`` of every module, duplicates included)."""
    at = dict(tree)
    uses: dict[int, int] = {}
    containers: dict[int, tuple] = {}  # first occurrences, in order (as model.modules())
    for path, module in tree:
        uses[id(module)] = uses.get(id(module), 0) + 1
        containers.setdefault(id(module), (path, module))
    for path, module in containers.values():
        if not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        children = {}  # as module.children(): each child once, in order
        for name, child in module._modules.items():
            if child is not None:
                child = at[f"{path}.{name}" if path else name]
                children.setdefault(id(child), child)
        yield module, list(children.values()), uses


def find_fusions(
    model: nn.Module | None, layer_of=None, *, tree=None, tiles: bool = False
) -> tuple[list, list]:
    """``(pad_conv_pairs, sibling_groups)`` of ``model``: pairs ``(pad module, conv module)`` and
    lists of sibling conv modules, as modules of ``model``.  ``layer_of(module)`` gives the
    domain layer that module is or will be replaced by (None: not a domain layer); by default the
    module itself (a converted model).  ``tree``: the ``(path, module)`` of every module,
    duplicates included, to look at instead of ``model``'s (the converter's plan passes the
    converted tree it decided, before anything is replaced: ``convert.plan_conversion``).
    ``tiles``: for lat x lon tiles (the fill agrees along both axes; siblings share the
    longitude rule too)."""
    layer_of = layer_of or (lambda m: m)
    if tree is None:
        tree = list(model.named_modules(remove_duplicate=False))
    pairs, groups = [], []
    for module, children, uses in _sequences(tree):
        if isinstance(module, nn.Sequential):
            pairs += _pad_conv_pairs(children, uses, layer_of, tiles)
        if isinstance(module, nn.ModuleList):
            groups += _sibling_groups(children, layer_of, tiles)
    # a conv that exchanges for its pad does not also share its input; nor does a conv its
    # model declares fed by a norm (``_domain_norm_act_conv``: that is its input's exchange)
    uses: dict[int, int] = {}
    for _, module in tree:
        uses[id(module)] = uses.get(id(module), 0) + 1
    paired = {id(conv) for _, conv in pairs}
    paired |= {id(conv) for _, _, conv in _declared_triples(tree, uses, layer_of)}
    groups = [g for g in ((c for c in g if id(c) not in paired) for g in groups)]
    groups = [g for g in (list(g) for g in groups) if len(g) >= 2]
    return pairs, groups


def find_norm_conv(
    model: nn.Module | None, layer_of=None, *, tree=None, taken=(), tiles: bool = False
) -> list:
    """``(norm, activation or None, conv)`` module triples of ``model`` (or ``tree``, as
    :func:`find_fusions`) whose norm statistics can travel with the conv's exchange; convs in
    ``taken`` (ids: fused with a pad or sharing their input) are left out.  ``tiles``: for lat x
    lon tiles (``norm_halo.py``'s tile form)."""
    layer_of = layer_of or (lambda m: m)
    if tree is None:
        tree = list(model.named_modules(remove_duplicate=False))
    uses: dict[int, int] = {}
    for _, module in tree:
        uses[id(module)] = uses.get(id(module), 0) + 1
    found = []
    for module, children, _ in _sequences(tree):
        if isinstance(module, nn.Sequential):
            found += _norm_conv_triples(children, uses, layer_of)
    found += _declared_triples(tree, uses, layer_of)
    taken, out = set(taken), []
    for triple in found:  # each norm and each conv in one link at most
        if id(triple[0]) not in taken and id(triple[2]) not in taken:
            taken |= {id(triple[0]), id(triple[2])}
            out.append(triple)
    return out


def apply_norm_conv(triples) -> None:
    """Link each ``(norm layer, activation or None, conv layer)`` (domain layers): both get the
    same :class:`~credit_parallel.domain.layers.norm_halo.NormConvLink` as their ``fused_norm``."""
    for norm, act, conv in triples:
        link = NormConvLink(norm, act, conv)
        norm.configure(fused_norm=link)
        conv.configure(fused_norm=link)


def apply_fusions(pairs, groups) -> None:
    """Configure the layers of ``pairs`` ``(pad layer, conv layer)`` and sibling ``groups``
    (domain layers, as :func:`find_fusions` finds them) to share their exchanges: each through
    its ``configure`` method (``options.py``; plain references, not submodules: no new
    state_dict keys, no second parent)."""
    for pad, conv in pairs:
        pad.configure(fused_into=conv)
        conv.configure(fused_pad=pad)
    for group in groups:
        share_input_exchange(*group)


def fuse_exchanges(model: nn.Module) -> dict[str, int]:
    """Fuse the exchanges of ``model``'s domain layers in place (see the module docstring);
    returns how many ``pad_conv`` pairs and ``sibling_convs`` groups were fused."""
    tiles = any(getattr(getattr(m, "manager", None), "is_tiled", False) for m in model.modules())
    pairs, groups = find_fusions(model, tiles=tiles)
    apply_fusions(pairs, groups)
    taken = {id(conv) for _, conv in pairs} | {id(c) for g in groups for c in g}
    triples = find_norm_conv(model, taken=taken, tiles=tiles)
    apply_norm_conv(triples)
    return {"pad_conv": len(pairs), "sibling_convs": len(groups), "norm_conv": len(triples)}


def find_halo_chains(
    model: nn.Module | None, layer_of=None, *, tree=None, taken=(), mode="auto"
) -> list[tuple]:
    """``(sequential, first child index, member modules)`` of every run of halo-chain members
    (``layers/halo_chain.py``: stencils, norms, elementwise activations, starting and ending
    with a stencil, at least two stencils) in the plain ``nn.Sequential`` s of ``model`` (or
    ``tree``, as :func:`find_fusions`).  Members are used once, carry no hooks and are not in
    ``taken`` (ids of modules other fusions hold).  ``mode``: ``"auto"`` or a chain length."""
    layer_of = layer_of or (lambda m: m)
    if tree is None:
        tree = list(model.named_modules(remove_duplicate=False))
    taken = set(taken)
    found = []
    for module, _, uses in _sequences(tree):
        if type(module) is not nn.Sequential:
            continue
        at = dict(tree)
        path = next(p for p, m in tree if m is module)
        children = [
            at[f"{path}.{name}" if path else name] if child is not None else None
            for name, child in module._modules.items()
        ]

        roles = [_chain_member_role(c, taken, uses, layer_of) for c in children]
        i = 0
        while i < len(children):
            if roles[i] is None:
                i += 1
                continue
            j = i
            while j < len(children) and roles[j] is not None:
                j += 1
            stencils = [k for k in range(i, j) if roles[k] == "stencil"]
            if len(stencils) >= 2:
                first, last = stencils[0], stencils[-1]
                found.append((module, first, children[first : last + 1]))
            i = j
    return found


def _chain_member_role(child, taken: set, uses: dict, layer_of):
    """``child``'s ``chain_role`` where it may join a chain (used once, no hooks, not taken)."""
    if child is None or id(child) in taken or uses.get(id(child), 0) != 1:
        return None
    return chain_role(layer_of(child)) if _no_hooks(child) else None
